"""The measuring side of `twinflash bench ring` (`compare/bench/ring_bench.py` plans, launches and reports).

  run_torch(plan)  under torchrun, one process per GPU (NCCL): our one-GPU kernel on the full sequence, our torch
                   sequence parallelism in each scheme (`torch_impl.ulysses.sequence_parallel_attention`: the ring in
                   both variants, Ulysses, the hybrid), and the peer, PyTorch's own context parallelism
                   (`torch.distributed.tensor.experimental.context_parallel`) on cuDNN SDPA, plus cuDNN SDPA on one
                   GPU. The peer is measured as the project's anchor script (cp_cudnn.py) measured it: [B, H, S, D]
                   buffers sharded by `context_parallel`, `set_rotate_method("allgather" | "alltoall")`, fwd + `.backward`.
  run_jax(plan)    one process over the plan's GPUs: our JAX flash kernel on one GPU and
                   `jax_impl.ulysses.sequence_parallel_attention` in each scheme in `jax.shard_map` over the GPUs'
                   mesh (its sp axis split in two, `sequence_parallel_mesh`).

Every measurement is fwd+bwd, causal, random bf16 inputs; timed like the anchors: warm-up calls, then a timed run of
back-to-back calls between two device synchronisations, wall clock (time.perf_counter). With several GPUs each
decision (iterations, time) is the maximum over ranks, so all ranks run the same calls and the slowest one counts.
Long points run fewer iterations (`budget_s` per measurement); the row records how many.

For our schemes each row also gives (JAX: busy time from a jax.profiler trace of one call, bytes from the
shapes):
  compute_only_ms    the same calls with every transfer replaced by a local copy of the same size (both rings'
                     `local_copies=True`): the run minus its communication.
  exposed_comm_ms    ms - compute_only_ms: the communication the overlap failed to hide.
  comm_busy_ms       from CUDA events on the comm streams of one extra call: time with a transfer in flight
                     (including waits for a slower peer), the slowest rank's.
  bytes_sent_per_rank, wire_GBps = bytes / comm_busy_ms: achieved bandwidth, a lower bound.

Output protocol: rank 0 (or the JAX process) appends JSON lines to plan["rows_path"]: {"meta": {...}} once, then
{"started": task id} before each task and {"row": {...}} after it, so the parent can tell a task that crashed or
hung (started, no row) from one never reached, and relaunch for the rest. A task that raises gets a row with its
error; the sweep goes on.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import platform
import time

from weights.sequence_parallel import scheme_degrees, sequence_parallel_bytes_sent


def _append(path: str, record: dict) -> None:
    with open(path, "a") as handle:
        handle.write(json.dumps(record) + "\n")


def _error_text(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"[:400]


def _timed(step, plan: dict, synchronize, slowest) -> tuple[float, int]:
    """(ms per call, timed calls). `synchronize()` waits for the device(s); `slowest(x)` is the max over ranks."""
    warm = spent = 0.0
    for done in range(plan["warmup"]):
        if done >= 2 and spent > plan["budget_s"]:  # first call compiles; a second one is warm
            break
        start = time.perf_counter()
        step()
        synchronize()
        warm = slowest(time.perf_counter() - start)
        spent += warm
    iters = max(1, min(plan["iters"], int(plan["budget_s"] / max(warm, 1e-9))))
    start = time.perf_counter()
    for _ in range(iters):
        step()
    synchronize()
    return slowest(time.perf_counter() - start) / iters * 1e3, iters


# ---------------------------------------------------------------------------------------------------------------
# torch (torchrun, NCCL)
# ---------------------------------------------------------------------------------------------------------------

def run_torch(plan: dict) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    import triton

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=plan["collective_timeout_s"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    def synchronize():
        torch.cuda.synchronize(device)

    def slowest(value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    if rank == 0:
        _append(plan["rows_path"], {"meta": {
            "gpu": torch.cuda.get_device_name(device), "gpus": world, "python": platform.python_version(),
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())), "cudnn": torch.backends.cudnn.version()}})
    measures = {"flash-1gpu": _flash_one_gpu, "ring": _torch_scheme, "ulysses": _torch_scheme,
                "hybrid": _torch_scheme, "cudnn-1gpu": _cudnn_one_gpu, "cp-cudnn": _context_parallel}
    timing = dict(synchronize=synchronize, slowest=slowest)
    for task in plan["tasks"]:
        if rank == 0:
            _append(plan["rows_path"], {"started": task["id"]})
        try:
            fields = measures[task["kind"]](task, plan, device, world, timing)
        except Exception as err:  # recorded in the row (an OOM is the expected case); the sweep goes on
            fields = {"error": _error_text(err)}
        errors = [None] * world
        dist.all_gather_object(errors, fields.get("error"))
        if rank == 0:
            first_error = next((e for e in errors if e), None)
            _append(plan["rows_path"], {"row": {**task, **fields, "error": first_error}})
        gc.collect()
        torch.cuda.empty_cache()
    dist.destroy_process_group()


def _random(shape, device, seed):
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen)


def _flash_one_gpu(task, plan, device, world, timing):
    """Our flash kernel (pair forward + backward) on the full sequence, every rank on its own GPU."""
    from torch_impl.kernels.flash_attention import flash_attention_backward, flash_attention_forward

    b, s, h, hkv, d = task["batch"], task["seq_len"], task["heads"], task["kv_heads"], task["head_dim"]
    q, dout = _random((b, s, h, d), device, 1), _random((b, s, h, d), device, 2)
    k, v = _random((b, s, hkv, d), device, 3), _random((b, s, hkv, d), device, 4)
    scale = d ** -0.5

    def step():
        out, lse = flash_attention_forward(q, k, v, causal=True, softmax_scale=scale)
        flash_attention_backward(dout, q, k, v, out, lse, causal=True, softmax_scale=scale)

    ms, iters = _timed(step, plan, **timing)
    return {"ms": ms, "iters": iters}


@functools.cache
def _scheme_groups(scheme: str, ulysses_degree: int | None):
    """The process groups of a scheme over the world, made once (every rank runs the plan's tasks in order)."""
    from torch_impl.ulysses import sequence_parallel_groups

    return sequence_parallel_groups(scheme, ulysses_degree)


def _torch_scheme(task, plan, device, world, timing):
    import torch

    from torch_impl.ring_comm import CommLog
    from torch_impl.ulysses import sequence_parallel_attention

    b, local, h, hkv, d = task["batch"], task["seq_len"] // world, task["heads"], task["kv_heads"], task["head_dim"]
    rank = torch.distributed.get_rank()
    q, dout = (_random((b, local, h, d), device, 10 * rank + i) for i in (1, 2))
    k, v = (_random((b, local, hkv, d), device, 10 * rank + i) for i in (3, 4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    groups = _scheme_groups(task.get("scheme", "ring"), task.get("ulysses_degree"))
    attend = functools.partial(sequence_parallel_attention, groups=groups, causal=True, layout=task["layout"],
                               variant=task["variant"] or "ring")

    def step(**instruments):
        torch.autograd.grad(attend(q, k, v, **instruments), (q, k, v), dout)

    ms, iters = _timed(step, plan, **timing)
    log = CommLog()
    step(comm_log=log)
    timing["synchronize"]()
    busy_ms = timing["slowest"](log.busy_ms())
    compute_ms, _ = _timed(functools.partial(step, local_copies=True), plan, **timing)
    return {"ms": ms, "iters": iters, "compute_only_ms": compute_ms, "exposed_comm_ms": ms - compute_ms,
            "comm_busy_ms": busy_ms, "bytes_sent_per_rank": log.bytes_sent(),
            "wire_GBps": log.bytes_sent() / busy_ms / 1e6 if busy_ms > 0 else None}


def _sdpa_inputs(task, device, gqa_native: bool):
    """Full-sequence [B, H, S, D] q, k, v, dout as the anchor builds them; k/v repeated to H heads unless SDPA's
    native GQA (`enable_gqa`) is used."""
    b, s, h, hkv, d = task["batch"], task["seq_len"], task["heads"], task["kv_heads"], task["head_dim"]
    q, dout = _random((b, h, s, d), device, 1), _random((b, h, s, d), device, 2)
    k, v = _random((b, hkv, s, d), device, 3), _random((b, hkv, s, d), device, 4)
    if not gqa_native and hkv != h:
        k, v = (x.repeat_interleave(h // hkv, dim=1) for x in (k, v))
    return q, k, v, dout


def _with_gqa_fallback(measure):
    """Runs `measure(gqa_native)` with SDPA's native GQA first; if that raises (a backend without it), again with
    K/V repeated to all heads, noting it in the row."""
    def run(task, plan, device, world, timing):
        if task["kv_heads"] == task["heads"]:
            return measure(task, plan, device, world, timing, gqa_native=False)
        try:
            return measure(task, plan, device, world, timing, gqa_native=True)
        except Exception as err:
            fields = measure(task, plan, device, world, timing, gqa_native=False)
            return {**fields, "note": f"K/V repeated to {task['heads']} heads (enable_gqa: {_error_text(err)[:120]})"}
    return run


@_with_gqa_fallback
def _cudnn_one_gpu(task, plan, device, world, timing, *, gqa_native):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, dout = _sdpa_inputs(task, device, gqa_native)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    extra = {"enable_gqa": True} if gqa_native else {}

    def step():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True, **extra).backward(dout)

    ms, iters = _timed(step, plan, **timing)
    return {"ms": ms, "iters": iters}


@functools.cache
def _world_mesh(world: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cuda", (world,))


@_with_gqa_fallback
def _context_parallel(task, plan, device, world, timing, *, gqa_native):
    import torch.nn.functional as F
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = _world_mesh(world)
    set_rotate_method(task["variant"])
    q, k, v, dout = _sdpa_inputs(task, device, gqa_native)
    extra = {"enable_gqa": True} if gqa_native else {}
    with context_parallel(mesh, buffers=[q, k, v, dout], buffer_seq_dims=[2, 2, 2, 2]):
        q_local, k_local, v_local = (x.detach().requires_grad_() for x in (q, k, v))

        def step():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                F.scaled_dot_product_attention(q_local, k_local, v_local, is_causal=True, **extra).backward(dout)

        ms, iters = _timed(step, plan, **timing)
    return {"ms": ms, "iters": iters}


# ---------------------------------------------------------------------------------------------------------------
# JAX (one process, all the ring's devices)
# ---------------------------------------------------------------------------------------------------------------

def run_jax(plan: dict) -> None:
    import jax
    import jaxlib
    import numpy as np
    from jax.sharding import Mesh

    devices = jax.devices()[:plan["gpus"]]
    mesh = Mesh(np.array(devices), ("sp",))
    _append(plan["rows_path"], {"meta": {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
                                         "gpu": devices[0].device_kind, "jax_devices": [str(d) for d in devices]}})
    for task in plan["tasks"]:
        _append(plan["rows_path"], {"started": task["id"]})
        try:
            fields = jax_measure(task, plan, devices, mesh)
        except Exception as err:  # recorded in the row; the sweep goes on
            fields = {"error": _error_text(err)}
        _append(plan["rows_path"], {"row": {**task, **fields}})
        jax.clear_caches()
        gc.collect()


def jax_measure(task, plan, devices, mesh):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from jax_impl.kernels.flash_attention import flash_attention
    from jax_impl.ulysses import scheme_axes, sequence_parallel_attention, sequence_parallel_mesh

    b, s, h, hkv, d = task["batch"], task["seq_len"], task["heads"], task["kv_heads"], task["head_dim"]
    keys = jax.random.split(jax.random.key(0), 4)
    shapes = [(b, s, h, d), (b, s, hkv, d), (b, s, hkv, d), (b, s, h, d)]
    ring_axis, ulysses_axis = scheme_axes("sp")
    split = sequence_parallel_mesh(mesh, _task_degrees(task, len(devices)))
    tokens = PartitionSpec(None, (ring_axis, ulysses_axis), None, None)

    def attention(local_copies: bool):
        if task["kind"] == "jax-flash-1gpu":
            return functools.partial(flash_attention, causal=True)
        return jax.shard_map(functools.partial(sequence_parallel_attention, ulysses_axis=ulysses_axis,
                                               ring_axis=ring_axis, causal=True, layout=task["layout"],
                                               variant=task["variant"] or "ring", local_copies=local_copies),
                             mesh=split, in_specs=(tokens,) * 3, out_specs=tokens)

    placement = devices[0] if task["kind"] == "jax-flash-1gpu" else NamedSharding(split, tokens)
    q, k, v, dout = (jax.device_put(jax.random.normal(key, shape, jnp.bfloat16), placement)
                     for key, shape in zip(keys, shapes))

    def timed_fwd_bwd(local_copies: bool = False) -> tuple[float, int]:
        """(ms, iters) of fwd+bwd, with every collective a local copy when `local_copies`."""
        attend = attention(local_copies)
        fwd_bwd = jax.jit(lambda q, k, v, dout: jax.vjp(attend, q, k, v)[1](dout))
        results = []  # dispatch is asynchronous; the calls run in order, so the last result marks the end

        def step():
            results[:] = [fwd_bwd(q, k, v, dout)]
            return results

        timing = _timed(step, plan, synchronize=lambda: jax.block_until_ready(results), slowest=lambda x: x)
        timed_fwd_bwd.step = step
        return timing

    # wall seconds of each phase (compilation included), so a slow part of the bench can be named
    began = time.perf_counter()
    ms, iters = timed_fwd_bwd()
    phase_s = {"compile_and_time": time.perf_counter() - began}
    if task["kind"] == "jax-flash-1gpu":
        return {"ms": ms, "iters": iters, "phase_s": phase_s}
    began = time.perf_counter()
    busy_s = _jax_comm_busy_s(timed_fwd_bwd.step)
    phase_s["comm_trace"] = time.perf_counter() - began
    began = time.perf_counter()
    compute_ms, _ = timed_fwd_bwd(local_copies=True)
    phase_s["compile_and_time_local_copies"] = time.perf_counter() - began
    sent = jax_ring_bytes_per_rank(task, len(devices))
    return {"ms": ms, "iters": iters, "compute_only_ms": compute_ms, "exposed_comm_ms": ms - compute_ms,
            "comm_busy_ms": busy_s * 1e3, "bytes_sent_per_rank": sent,
            "wire_GBps": sent / busy_s / 1e9 if busy_s else None, "phase_s": phase_s}


def _jax_comm_busy_s(step) -> float:
    """Seconds device 0 was communicating during one `step()`, from a jax.profiler trace (NCCL kernels on GPU 0,
    the collectives' events on the CPU devices' threads)."""
    import tempfile

    import jax

    from compare.harness.jobs import union_seconds
    from compare.harness.worker_jax import activity_intervals

    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir):
            jax.block_until_ready(step())
        communication, _compute = activity_intervals(log_dir, jax.default_backend())
        return union_seconds(communication)


def _task_degrees(task, world: int):
    return scheme_degrees(task.get("scheme", "ring"), world, task.get("ulysses_degree"))


def jax_ring_bytes_per_rank(task, world: int) -> int:
    """Bytes one rank sends in one bf16 fwd+bwd of the task's scheme in JAX, from the shapes (the model of
    `weights.sequence_parallel`, the ring's `weights.attention.ring_bytes_sent` inside it)."""
    return sequence_parallel_bytes_sent(_task_degrees(task, world), batch=task["batch"],
                                        local_tokens=task["seq_len"] // world, heads=task["heads"],
                                        kv_heads=task["kv_heads"], head_dim=task["head_dim"], compute_bytes=2,
                                        variant=task["variant"] or "ring", backward=True)
