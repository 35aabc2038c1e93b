"""Ulysses (all-to-all) and hybrid Ulysses x ring sequence parallelism for PyTorch, with `sequence_parallel_attention`,
the one entry of the three schemes (ring, ulysses, hybrid) over a torch.distributed group. Twin of
`jax_impl/ulysses.py` (mesh axes there, process groups here). The schemes, their degrees and checks, the KV heads each
device receives, the token order after the all-to-all and the bytes each scheme sends are
`weights/sequence_parallel.py`'s; the ring inside the hybrid is `torch_impl/ring_attention.py`'s, unchanged.

Public API:

  sequence_parallel_groups(scheme="ring", ulysses_degree=None, group=None) -> SequenceParallelGroups
      The process groups of a scheme over the ranks of `group` (default: the world; a single rank without an
      initialised torch.distributed): rank s of `group` is device (r, u) = divmod(s, U), its Ulysses group the U
      adjacent ranks of one r, its ring the R ranks of one u. Every rank of `group` calls it (the hybrid creates its
      two subgroups, with `use_local_synchronization`: only their members take part, so the sp groups of an
      fsdp x sp mesh make theirs side by side); ring and ulysses use `group` itself.
  sequence_parallel_attention(q, k, v, *, groups=None, causal=True, layout="zigzag", variant="ring",
                              return_lse=False, softmax_scale=None, backend="triton", check_ranks=True,
                              compile_merge=False, local_copies=False, comm_log=None, segment_ids=None)
      q [B, S_local, H, D], k/v [B, S_local, Hkv, D]: this rank's tokens in `layout` order over all U x R ranks, as
      for `ring_attention` (which the ring scheme is: `groups=None` is the ring over the world). Returns out
      [B, S_local, H, D] in q's dtype, or (out, lse [B, H, S_local] float32, not differentiable) with `return_lse`.
      Differentiable; with its keywords bound by `functools.partial`, the model's `AttentionFn`. `variant`,
      `compile_merge` are the hybrid's ring's; `check_ranks` compares every rank's shapes, dtypes and choices over
      all U x R ranks first (one all-gather of a few integers: one clear line on every rank, not a collective left
      waiting). `local_copies` /
      `comm_log` are the benchmark's instruments, as the ring's: every transfer a same-sized local copy, and the
      bytes each all-to-all and ring transfer sends. `segment_ids` [B, S_local]: packed documents
      (`weights/documents.py`), this rank's tokens' ids in `layout` order like q, as for `ring_attention`.

Ulysses and hybrid, on each rank: K/V heads put in the all-to-all's slots (`kv_head_slots`: repeated only where
U > Hkv); q, k, v through one all-to-all each over the Ulysses group (`Ring.all_to_all`), from this rank's tokens of
all heads to the group's tokens of H / U heads, put in increasing position order (`gathered_chunk_order`); then our
flash kernel on the whole sequence of those heads (ulysses, `flash_attention` with `backend`) or the ring over the
R groups (hybrid, `ring_attention` on the group's tokens, which are the ring layout's over R); out (and lse, when
asked) back through the inverse all-to-all. Autograd runs the same all-to-alls backwards for dout and dq/dk/dv (in
the inputs' dtype; the copies of a repeated KV head are summed by the backward of the slot gather). The all-to-alls
are issued and waited for in turn: nothing overlaps them yet.

Packed documents (`segment_ids`): the local ids go through the same all-to-all as the heads (int32, one head slot
per Ulysses rank: B L U ids sent, no gradient), so each rank holds the group's ids in increasing position order;
then the flash kernel on the whole sequence with them (ulysses) or the ring over R with them (hybrid, on key spans).
Balance: Ulysses computes every token of its H / U heads on each device, so no document lengths can unbalance it.
The hybrid's ring runs in the layout over R that the U x R layout gives the groups (zigzag over P is zigzag over R,
contiguous contiguous), whose work per device follows the documents' lengths as a zigzag (or contiguous) ring's
does. zigzag_stripes is refused whenever U > 1 with `weights.sequence_parallel.check_gathered_layout`'s one
ValueError line (JAX's too): a group's stripes over P are not the stripes of a ring over R, and
`gathered_chunk_order` knows zigzag's two chunks per device, not one per stripe. Packed training runs Ulysses and
the hybrid in zigzag (`weights.parallel.scheme_layout`).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist

from torch_impl.documents import checked_segment_ids
from torch_impl.kernels.flash_attention import flash_attention
from torch_impl.ring_attention import agreement_fields, check_agreement, ring_attention
from torch_impl.ring_comm import CommLog, Ring
from weights.attention import check_ring_choices, check_ring_shapes
from weights.sequence_parallel import (SchemeDegrees, check_gathered_layout, check_heads, gathered_chunk_order,
                                       kv_head_slots, scheme_degrees)


@dataclasses.dataclass(frozen=True)
class SequenceParallelGroups:
    """A scheme's degrees and this rank's groups: `ulysses`, the U ranks of its all-to-all (None when U = 1),
    `ring`, the R ranks of its ring (None when R = 1, or on a single rank without torch.distributed), and `every`,
    all U x R ranks (where `check_ranks` compares the arguments: a rank that differs must stop them all)."""

    degrees: SchemeDegrees
    ulysses: dist.ProcessGroup | None
    ring: dist.ProcessGroup | None
    every: dist.ProcessGroup | None = None


def sequence_parallel_groups(scheme: str = "ring", ulysses_degree: int | None = None,
                             group: dist.ProcessGroup | None = None) -> SequenceParallelGroups:
    """The groups of `scheme` over the ranks of `group` (module docstring); ValueError for degrees the scheme
    cannot take (`weights.sequence_parallel.scheme_degrees`)."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return SequenceParallelGroups(scheme_degrees(scheme, 1, ulysses_degree), None, None)
    group = group if group is not None else dist.group.WORLD
    degrees = scheme_degrees(scheme, dist.get_world_size(group), ulysses_degree)
    if degrees.ulysses == 1:
        return SequenceParallelGroups(degrees, None, group)
    if degrees.ring == 1:
        return SequenceParallelGroups(degrees, group, None, group)
    ranks = [dist.get_global_rank(group, s) for s in range(degrees.sp)]
    r, u = divmod(dist.get_rank(group), degrees.ulysses)
    ulysses = dist.new_group(ranks[r * degrees.ulysses:(r + 1) * degrees.ulysses], use_local_synchronization=True)
    ring = dist.new_group(ranks[u::degrees.ulysses], use_local_synchronization=True)
    return SequenceParallelGroups(degrees, ulysses, ring, group)


# ---------------------------------------------------------------------------------------------------------------
# The all-to-all between sequence shards and head shards
# ---------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _HeadExchange:
    """The Ulysses group's all-to-all, both ways, with the reordering of the group's chunks around it."""

    ring: Ring
    order: tuple[int, ...]  # `gathered_chunk_order`: chunk i of position order is gathered chunk order[i]

    def to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, L, U n, ...] this rank's tokens of every rank's heads -> [B, U L, n, ...] the group's tokens of this
        rank's heads, in increasing position order."""
        parts = x.unflatten(2, (self.ring.world, -1)).movedim(2, 0)  # [U, B, L, n, ...]: part j goes to rank j
        received = self.ring.all_to_all(parts).wait()  # [U, B, L, n, ...]: row i came from rank i
        return self._reordered(received.movedim(0, 1).flatten(1, 2), self.order)

    def to_sequence(self, y: torch.Tensor) -> torch.Tensor:
        """Inverse of `to_heads`: [B, U L, n, ...] in position order -> [B, L, U n, ...]."""
        inverse = tuple(sorted(range(len(self.order)), key=self.order.__getitem__))
        gathered = self._reordered(y, inverse)  # device order: rank j's tokens are the j-th part
        received = self.ring.all_to_all(gathered.unflatten(1, (self.ring.world, -1)).movedim(1, 0)).wait()
        return received.movedim(0, 2).flatten(2, 3)  # row i holds rank i's heads: they go i-th

    @staticmethod
    def _reordered(x: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
        chunks = x.chunk(len(order), dim=1)
        return torch.cat([chunks[i] for i in order], dim=1)


class _AllToAll(torch.autograd.Function):
    """`_HeadExchange.to_heads` (or `to_sequence`), differentiable: the backward moves the gradient the other way."""

    @staticmethod
    def forward(ctx, x, exchange: _HeadExchange, to_heads: bool):
        ctx.exchange, ctx.to_heads = exchange, to_heads
        return exchange.to_heads(x) if to_heads else exchange.to_sequence(x)

    @staticmethod
    def backward(ctx, grad):
        exchange = ctx.exchange
        return exchange.to_sequence(grad) if ctx.to_heads else exchange.to_heads(grad), None, None


@functools.lru_cache(maxsize=32)
def _kv_slot_index(heads: int, kv_heads: int, ulysses_degree: int, device: torch.device) -> torch.Tensor:
    """`kv_head_slots` on `device`, made once (a host-to-device copy per layer would stall the host's queueing)."""
    return torch.from_numpy(kv_head_slots(heads, kv_heads, ulysses_degree)).to(device)


def _group_segment_ids(segment_ids, q: torch.Tensor, exchange: _HeadExchange, check_values: bool) -> torch.Tensor:
    """int32 [B, U L]: the Ulysses group's segment ids in increasing position order, from this rank's [B, L] (checked
    with `check_values`: non-decreasing in their local order, a host copy), through the heads' all-to-all: each
    rank receives the ids once (one head slot per rank)."""
    if check_values:
        ids = checked_segment_ids(segment_ids, q.shape[0], q.shape[1], q.device)
    elif not isinstance(segment_ids, torch.Tensor) or tuple(segment_ids.shape) != tuple(q.shape[:2]):
        raise ValueError(f"segment_ids must be a tensor [B, S_local] = {tuple(q.shape[:2])}")
    else:
        ids = segment_ids.to(device=q.device, dtype=torch.int32)
    slots = ids.unsqueeze(-1).expand(-1, -1, exchange.ring.world)  # [B, L, U]: one copy for each rank
    return exchange.to_heads(slots).squeeze(-1).contiguous()


# ---------------------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------------------

def sequence_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                                groups: SequenceParallelGroups | None = None, causal: bool = True,
                                layout: str = "zigzag", variant: str = "ring", return_lse: bool = False,
                                softmax_scale: float | None = None, backend: str = "triton", check_ranks: bool = True,
                                compile_merge: bool = False, local_copies: bool = False,
                                comm_log: CommLog | None = None, segment_ids: torch.Tensor | None = None):
    """Attention over a sequence sharded across the ranks of `groups`' scheme; see the module docstring.

    Raises ValueError for bad arguments (heads the Ulysses degree cannot split: one line naming the degrees that
    work), LayoutError (a ValueError) when the local length does not split in `layout`, and for the zigzag_stripes
    layout with U > 1 (module docstring).
    """
    groups = groups if groups is not None else sequence_parallel_groups()
    ring_keywords = dict(causal=causal, layout=layout, variant=variant, return_lse=True, softmax_scale=softmax_scale,
                         backend=backend, check_ranks=check_ranks, compile_merge=compile_merge,
                         local_copies=local_copies, comm_log=comm_log)
    degrees = groups.degrees
    if degrees.ulysses == 1:
        out, lse = ring_attention(q, k, v, group=groups.ring, segment_ids=segment_ids, **ring_keywords)
        return (out, lse) if return_lse else out
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if check_ranks:  # over all U x R ranks at once: a rank raising alone would leave the others in a collective
        check_agreement(Ring(groups.every, q.device), agreement_fields(q, k, v, causal, layout, variant,
                                                                        softmax_scale, segment_ids),
                        caller="sequence_parallel_attention")
        ring_keywords["check_ranks"] = False  # the hybrid's ring: its ranks agreed just now
    check_ring_choices(layout, variant)
    check_gathered_layout(layout)
    check_ring_shapes(q.shape, k.shape, v.shape, degrees.sp, layout)
    heads, kv_heads = q.shape[2], k.shape[2]
    check_heads(degrees.ulysses, heads, kv_heads)
    exchange = _HeadExchange(Ring(groups.ulysses, q.device, local_copies=local_copies, log=comm_log),
                             gathered_chunk_order(degrees.ulysses, layout))
    if degrees.ulysses > kv_heads:  # each KV head once per device of its query heads
        slots = _kv_slot_index(heads, kv_heads, degrees.ulysses, k.device)
        k, v = (x.index_select(2, slots) for x in (k, v))
    ids = None if segment_ids is None else _group_segment_ids(segment_ids, q, exchange, check_ranks)
    q, k, v = (_AllToAll.apply(x, exchange, True) for x in (q, k, v))
    if degrees.ring == 1:
        out, lse = flash_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=True,
                                   backend=backend, segment_ids=ids)
    else:
        out, lse = ring_attention(q, k, v, group=groups.ring, segment_ids=ids, **ring_keywords)
    out = _AllToAll.apply(out, exchange, False)
    if not return_lse:
        return out
    # lse [B, n, U L] -> [B, U L, n] for the exchange -> [B, L, H] -> [B, H, L]
    return out, exchange.to_sequence(lse.detach().transpose(1, 2)).transpose(1, 2)
