"""The communication under the PyTorch ring attention: neighbour exchange, all-gather and reduce-scatter over a
torch.distributed process group, issued on side CUDA streams so that it overlaps the attention compute.
`torch_impl/ring_attention.py` and `torch_impl/ulysses.py` (its `all_to_all`) are the users. Twin of
`jax_impl/ring_comm.py` (the same `Ring` with `exchange`, `all_gather`, `reduce_scatter`, `all_to_all` and
`local_copies`; there XLA schedules `jax.lax.ppermute` / `all_gather` / `psum_scatter` / `all_to_all`, so each
returns its result instead of a `Pending`).

Every operation is split into issue (`Ring.exchange`, `Ring.all_gather`, `Ring.reduce_scatter`) and `Pending.wait()`,
so a caller can issue the next step's transfer, compute the current step, and only then wait.

Stream discipline on CUDA (NCCL): each operation gets a side (comm) stream (two per `Ring`, taken in turn, as
the ring backward has two transfers in flight), which first waits for everything already queued on the issuing
(compute) stream, because the tensors to send were written there and the fresh receive buffers were allocated there
(the caching allocator may hand out memory that earlier compute-stream work still reads). The ops are launched with
that comm stream current, so NCCL orders its own stream after it. `wait()` makes the comm stream wait for NCCL's
completion, then makes the compute stream wait for the comm stream. Sent and received tensors are
`record_stream`-ed on the comm stream and kept referenced until `wait()`, so the allocator cannot reuse their
memory while a transfer may still touch it. On CPU (gloo) the same calls run without streams; `wait()` blocks.
`Ring.draining()` waits for what is still in flight when a ring step raises.

Instrumentation for the ring benchmark, passed as arguments of a `Ring` (and of `ring_attention`), no hidden state:
  log=CommLog()        collects bytes sent per rank and, on CUDA, start/end events on the comm streams for every
                       operation the ring issues (`CommLog.busy_ms`).
  local_copies=True    the same calls, but each transfer becomes a local copy of the same size: the ring then does
                       the compute (and copies) of a real run with no communication, which is how the benchmark
                       measures exposed communication.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

# torch 2.13 deprecates the *_into_tensor / *_tensor names for *_single ones; older torch has only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclasses.dataclass
class CommRecord:
    """One issued operation: its kind, the bytes this rank puts on the wire (ring-algorithm volume: an exchange
    sends its tensors once; an all-gather or reduce-scatter over P ranks sends (P-1)/P of the gathered size), and on
    CUDA its comm-stream events (start: when the stream got past the compute it waits for; end: when NCCL was done,
    as far as the stream could tell: the wait is queued at `Pending.wait()`, normally long before that)."""

    kind: str
    bytes_sent: int
    start: torch.cuda.Event | None = None
    end: torch.cuda.Event | None = None


@dataclasses.dataclass
class CommLog:
    """The operations a ring issued (one log may be shared by several rings: a forward and its backward)."""

    records: list[CommRecord] = dataclasses.field(default_factory=list)

    def bytes_sent(self) -> int:
        return sum(r.bytes_sent for r in self.records)

    def busy_ms(self) -> float:
        """Time during which at least one operation was in flight (the union of the records' intervals, so
        overlapping transfers count once); includes waiting for a slower peer. CUDA only, after a synchronize."""
        if any(r.start is None for r in self.records):
            raise ValueError("transfer times are only recorded for CUDA communication")
        if not self.records:
            return 0.0
        origin = self.records[0].start
        intervals = sorted((origin.elapsed_time(r.start), origin.elapsed_time(r.end)) for r in self.records)
        busy, reach = 0.0, -float("inf")
        for begin, end in intervals:
            busy += max(0.0, end - max(begin, reach))
            reach = max(reach, end)
        return busy


_RELEASE_POLL_S = 1e-4
_RELEASE_TIMEOUT_S = 10.0  # a reference still held after this is the caller's own, not a worker's in passing


def all_reduce_in_place(tensors: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Each tensor summed over `group`'s ranks, in place. Returns once the collectives are done and, for CPU
    tensors (gloo), once gloo's worker threads hold no reference to them any more. Why the second wait: a gloo
    worker drops its reference to a finished collective just after `wait()` returns; when that drop is the last
    one, the worker frees the tensors, which takes the GIL, and if the caller has meanwhile reached interpreter
    exit the worker thread is ended inside a destructor and the process aborts ("terminate called without an
    active exception", pytorch/pytorch#179291; 1 run in 10 of torch_impl/README.md's example on a loaded 2-core
    CPU). Waiting for the use counts to fall back makes the caller's reference the last one."""
    on_cpu = [(t, t._use_count()) for t in tensors if t.device.type == "cpu"]
    works = [dist.all_reduce(t, group=group, async_op=True) for t in tensors]
    while works:
        works.pop().wait()  # the popped handle is dropped here: the tensors are then the worker's and ours
    deadline = time.monotonic() + _RELEASE_TIMEOUT_S
    while any(t._use_count() > count for t, count in on_cpu) and time.monotonic() < deadline:
        time.sleep(_RELEASE_POLL_S)  # releases the GIL, which the worker may be waiting for


_COMM_STREAMS_PER_DEVICE = 2  # the ring backward has two transfers in flight (K/V and dK/dV)


class Pending:
    """An issued operation; `wait()` returns its result tensor(s) once they are safe to use on the compute stream."""

    def __init__(self, result, works: list, compute_stream, comm_stream, keep_alive: list[torch.Tensor],
                 record: CommRecord | None, in_flight: list[Pending]):
        self._result, self._works, self._record = result, works, record
        self._compute_stream, self._comm_stream, self._keep_alive = compute_stream, comm_stream, keep_alive
        self._in_flight = in_flight
        in_flight.append(self)

    def wait(self):
        self._in_flight.remove(self)
        if self._comm_stream is None:
            for work in self._works:
                work.wait()
        else:
            with torch.cuda.stream(self._comm_stream):
                for work in self._works:
                    work.wait()  # makes the current (comm) stream wait for NCCL
                if self._record is not None:
                    self._record.end.record(self._comm_stream)
            self._compute_stream.wait_stream(self._comm_stream)
        self._keep_alive = []
        return self._result


class Ring:
    """The ranks of `group` (default: the world; a single rank when torch.distributed is not initialised) seen
    as a ring: rank r sends to r+1 and receives from r-1 (mod P)."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device, *, local_copies: bool = False,
                 log: CommLog | None = None):
        if group is None and not (dist.is_available() and dist.is_initialized()):
            self.group, self.rank, self.world = None, 0, 1
        else:
            self.group = group if group is not None else dist.group.WORLD
            self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.device = device
        if self.world > 1:
            self.next_peer = dist.get_global_rank(self.group, (self.rank + 1) % self.world)
            self.previous_peer = dist.get_global_rank(self.group, (self.rank - 1) % self.world)
        self.local_copies, self.log = local_copies, log
        # Each in-flight transfer gets its own side stream, so one transfer's wait for NCCL is not queued behind
        # another's wait for compute (which would also stretch its end event). torch.cuda.Stream() hands out
        # CUDA's pooled streams in turn (nothing is created per ring).
        self._comm_streams = ([torch.cuda.Stream(device=device) for _ in range(_COMM_STREAMS_PER_DEVICE)]
                              if device.type == "cuda" else [])
        self._issued = 0
        self._in_flight: list[Pending] = []

    @contextlib.contextmanager
    def draining(self) -> Iterator[None]:
        """On an exception inside the block, waits for the transfers still in flight before re-raising: when
        every rank fails at the same step (a kernel refusing a shape, say), their issued transfers still match
        and complete, and the group stays usable for the next call."""
        try:
            yield
        except BaseException:
            for pending in list(self._in_flight):
                pending.wait()
            raise

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's `values` (same length on all ranks), in rank order; synchronous (a host round trip)."""
        local = torch.tensor(values, dtype=torch.int64, device=self.device)
        if self.world == 1:
            return [values]
        gathered = torch.empty(self.world * local.numel(), dtype=torch.int64, device=self.device)
        _all_gather_single(gathered, local, group=self.group)
        return gathered.view(self.world, -1).tolist()

    def exchange(self, tensors: list[torch.Tensor]) -> Pending:
        """Sends `tensors` to the next rank, receives same-shaped ones from the previous rank."""
        sends = [t.contiguous() for t in tensors]
        recvs = [torch.empty_like(t) for t in sends]

        def launch():
            if self.local_copies:
                for recv, send in zip(recvs, sends):
                    recv.copy_(send)
                return []
            ops = [dist.P2POp(dist.isend, t, self.next_peer, self.group) for t in sends]
            ops += [dist.P2POp(dist.irecv, t, self.previous_peer, self.group) for t in recvs]
            return dist.batch_isend_irecv(ops)

        return self._issue("exchange", sum(t.nbytes for t in sends), launch, sends + recvs, recvs)

    def all_gather(self, local: torch.Tensor) -> Pending:
        """Result [P, *local.shape]: every rank's `local`, in rank order."""
        local = local.contiguous()
        flat = torch.empty(self.world * local.numel(), dtype=local.dtype, device=local.device)  # gloo wants 1-D
        gathered = flat.view(self.world, *local.shape)

        def launch():
            if self.local_copies:
                gathered.copy_(local.expand_as(gathered))
                return []
            return [_all_gather_single(flat, local.view(-1), group=self.group, async_op=True)]

        return self._issue("all_gather", (self.world - 1) * local.nbytes, launch, [local, flat], gathered)

    def reduce_scatter(self, full: torch.Tensor) -> Pending:
        """`full` is [P, ...]; the result is this rank's slice, full[rank], summed over all ranks."""
        full = full.contiguous()
        mine = torch.empty(full.shape[1:], dtype=full.dtype, device=full.device)

        def launch():
            if self.local_copies:
                mine.copy_(full[self.rank])
                return []
            return [_reduce_scatter_single(mine.view(-1), full.view(-1), group=self.group, async_op=True)]

        return self._issue("reduce_scatter", (self.world - 1) * mine.nbytes, launch, [full, mine], mine)

    def all_to_all(self, parts: torch.Tensor) -> Pending:
        """`parts` is [P, ...]: part j goes to rank j; the result [P, ...] holds in row i the part rank i sent here
        (the Ulysses schemes' exchange, `torch_impl/ulysses.py`)."""
        parts = parts.contiguous()
        received = torch.empty_like(parts)

        def launch():
            if self.local_copies:
                received.copy_(parts)
                return []
            return [dist.all_to_all_single(received.view(-1), parts.view(-1), group=self.group, async_op=True)]

        return self._issue("all_to_all", (self.world - 1) * parts[0].nbytes, launch, [parts, received], received)

    def _issue(self, kind: str, nbytes: int, launch: Callable[[], list], tensors: list[torch.Tensor],
               result) -> Pending:
        record = None
        if self.log is not None:
            record = CommRecord(kind, 0 if self.local_copies else nbytes)
            self.log.records.append(record)
        if not self._comm_streams:
            return Pending(result, launch(), None, None, tensors, record, self._in_flight)
        compute = torch.cuda.current_stream(self.device)
        self._issued += 1
        stream = self._comm_streams[self._issued % _COMM_STREAMS_PER_DEVICE]
        stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            if record is not None:
                record.start = torch.cuda.Event(enable_timing=True)
                record.end = torch.cuda.Event(enable_timing=True)
                record.start.record(stream)
            works = launch()
        for tensor in tensors:
            tensor.record_stream(stream)
        return Pending(result, works, compute, stream, tensors, record, self._in_flight)
