"""Sequence-parallel (ring) attention for PyTorch: every rank of a torch.distributed group holds a slice of the
sequence's tokens; K/V blocks go around the ring (or are all-gathered) and each rank merges its queries' partial
results by log-sum-exp. Twin of `jax_impl/ring_attention.py` (same names; JAX collectives there). The transfers
and their CUDA-stream handling live in `torch_impl/ring_comm.py`.

Public API:

  ring_attention(q, k, v, *, group=None, causal=True, layout="zigzag", variant="ring", return_lse=False,
                 softmax_scale=None, backend="triton", check_ranks=True, compile_merge=False, local_copies=False,
                 comm_log=None)
      q [B, S_local, H, D], k/v [B, S_local, Hkv, D]: this rank's tokens in the layout's order
      (`weights.layout.rank_positions`: increasing positions). Returns out [B, S_local, H, D] in q's dtype, or
      (out, lse [B, H, S_local] float32) with `return_lse`; lse is not differentiable (gradients flow through out).
      `group` defaults to the world; without an initialised torch.distributed it is the single-device path.
      With its keywords bound by `functools.partial`, it is the model's `AttentionFn` (`fn(q, k, v) -> out`).
      `local_copies` / `comm_log` are the benchmark's instruments (`torch_impl/ring_comm.py`): every transfer a
      same-sized local copy (results wrong by design), and a `CommLog` of what the call and its backward send.
  shard_for_ring(x, group, layout, dim=1)      this rank's positions of a full sequence (no communication).
  gather_from_ring(x_local, group, layout, dim=1)  all ranks' parts back in position order.

Per-pair work goes to `torch_impl.kernels.flash_attention` (`backend="triton"` kernels or `"reference"` plain math).

Variant "ring": at step s rank r holds the K/V block of rank j = (r - s) mod P; the transfer for step s+1 is
issued before step s's compute and waited for after it. The causal work of each step is the table of
`weights.attention.ring_block` (shared with the JAX twin). Partial results are merged in float32 math, into a
float32 accumulator, or one in q's dtype where no row merges twice and the backend's partials are in q's dtype
(`_ring_forward`); `compile_merge` runs the merge under torch.compile (the training step on GPUs). A row that saw no
key keeps lse -inf and output 0, without NaN. Backward: K/V go around again with float32 dK/dV accumulators
travelling with their block (sent after each step's compute, so they overlap the next step), arriving back at
their owner after P hops; dq accumulates locally in float32; the pair backward gets the GLOBAL merged out and lse.

Variant "allgather" (Llama-3's context parallelism): K/V are all-gathered once and put in position order; each run
of consecutive positions among the local queries (one for contiguous, two for zigzag) then attends, in one kernel
call, to the key prefix that ends at its last position, with the bottom-right-aligned causal mask; no merge is
needed. Its backward gathers K/V again (instead of keeping P copies alive) and reduce-scatters float32 dK/dV.

Packed documents (`segment_ids`, `weights/documents.py`), and the zigzag_stripes layout with or without them: every
step is the whole K/V block on its key spans (`_step_pair`), which come from the segment ids of the local tokens and
of the block (they travel with it, or are all-gathered with K/V) at both ranks' positions; the allgather variant
makes one call per rank on the spans of the whole sequence.

Only the Hkv K/V heads travel (GQA is never expanded on the wire). With `check_ranks` (the default) every call
first all-gathers a few integers describing each rank's arguments (shapes, dtypes, causal, layout, variant, scale),
so a rank whose input differs makes every rank raise the same ValueError instead of hanging in a transfer; this
costs one tiny collective and a host round trip per call, which stalls the host's queueing of the step at every
layer. The training step turns it off (`torch_impl/parallel.py`): there every rank's arguments are the same by
construction.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import struct

import numpy as np
import torch
import torch.distributed as dist

from torch_impl.documents import Spans, checked_segment_ids, key_spans
from torch_impl.kernels.flash_attention import exact_output_dtype, flash_attention_backward, flash_attention_forward
from torch_impl.remat import keep_for_backward
from torch_impl.ring_comm import CommLog, Ring
from weights.attention import (ALL, BLOCK_LAYOUTS, VARIANTS, RingBlock, check_ring_choices, check_ring_shapes,
                               ring_block, source_of)
from weights.layout import LAYOUTS, check_split, inverse_order, layout_order, position_runs, rank_positions

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_MAX_DIMS = 6  # dimensions encoded per tensor in the cross-rank agreement check


@dataclasses.dataclass(frozen=True)
class _RingConfig:
    causal: bool
    layout: str
    variant: str
    softmax_scale: float
    backend: str
    compile_merge: bool
    documents: bool  # every step on key spans (`_step_pair`): segment ids given, or the zigzag_stripes layout


@functools.lru_cache(maxsize=32)
def _layout_positions(seq_len: int, world: int, layout: str, device: torch.device) -> torch.Tensor:
    """int32 [P, S_local]: every rank's positions (`weights.layout.rank_positions`), where the spans look keys up."""
    table = np.stack([rank_positions(seq_len, world, rank, layout) for rank in range(world)])
    return torch.from_numpy(table.astype(np.int32)).to(device)


def _step_pair(ring: Ring, cfg: _RingConfig, step: int, local_len: int, ids=None, block_ids=None
               ) -> tuple[RingBlock, Spans | None] | None:
    """The work of ring step `step`, whose K/V block is rank (rank - step) mod P's: the local rows x block columns
    and causal flag of `weights.attention.ring_block`, or with documents the whole block with the step's key spans
    (segment ids `ids` of the local tokens and `block_ids` of the block's, looked up at both ranks' positions); None
    when the mask hides all of it."""
    source = (ring.rank - step) % ring.world
    if cfg.documents:
        positions = _layout_positions(local_len * ring.world, ring.world, cfg.layout, ids.device)
        spans = key_spans(ids, positions[ring.rank], block_ids, positions[source], causal=cfg.causal)
        return RingBlock(ALL, ALL, False), spans
    block = ring_block(cfg.causal, cfg.layout, source_of(ring.rank, source), local_len)
    return None if block is None else (block, None)


# ---------------------------------------------------------------------------------------------------------------
# Variant "ring"
# ---------------------------------------------------------------------------------------------------------------

def _merge(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """In place: log-sum-exp merge of a partial result into the accumulator views, in float32 whatever the dtypes
    (each accumulator element rounded once); rows where both are empty stay (0, -inf), no NaN. Under
    torch.compile (`compile_merge`) one pass over the accumulator."""
    new_lse = torch.logaddexp(acc_lse, lse)
    safe_lse = torch.where(torch.isfinite(new_lse), new_lse, torch.zeros_like(new_lse))

    def weight(part_lse):  # [B, H, S] -> [B, S, H, 1], the share of the merged softmax denominator
        return torch.exp(part_lse - safe_lse).transpose(1, 2).unsqueeze(-1)

    acc_out.copy_(acc_out.float() * weight(acc_lse) + out.float() * weight(lse))
    acc_lse.copy_(new_lse)


@functools.cache
def _compiled_merge():
    """`_merge` under torch.compile, one wrapper for the process: a fresh `torch.compile(_merge)` per call hits
    dynamo's cache but still costs milliseconds of host time (9.6 ms against 0.76 ms on a 2-core CPU host), once per
    layer and step; on 2×H200 the 1B step at 8k spent 155 of its 265 ms with the GPU idle."""
    return torch.compile(_merge)


def _ring_forward(ring: Ring, cfg: _RingConfig, q, k, v, ids):
    """(out, lse float32) of the local queries. Partial outputs come in the backend's `exact_output_dtype`; they
    accumulate in float32, except where no row is merged twice (two ranks, or one) and the partials are in q's
    dtype already: the accumulator is then q's dtype, rounded once per merged row as the final cast would. With
    documents the segment ids travel with their K/V block."""
    partial_dtype = exact_output_dtype(cfg.backend, q.dtype) if ring.world > 1 else q.dtype
    acc_dtype = q.dtype if ring.world <= 2 and partial_dtype == q.dtype else torch.float32
    merge = _compiled_merge() if cfg.compile_merge else _merge
    acc_out = acc_lse = None
    blocks = _travelling(k, v, ids)
    for step in range(ring.world):
        incoming = ring.exchange(blocks) if step + 1 < ring.world else None
        k_block, v_block, *block_ids = blocks
        pair = _step_pair(ring, cfg, step, q.shape[1], ids, *block_ids)
        if pair is not None:
            block, spans = pair
            out, lse = flash_attention_forward(
                q[:, block.rows], k_block[:, block.cols], v_block[:, block.cols], causal=block.causal,
                softmax_scale=cfg.softmax_scale, out_dtype=partial_dtype, backend=cfg.backend, spans=spans)
            if step == 0:  # always the whole diagonal block
                acc_out, acc_lse = out.to(acc_dtype), lse
            else:
                merge(acc_out[:, block.rows], acc_lse[:, :, block.rows], out, lse)
        if incoming is not None:
            blocks = incoming.wait()
    return acc_out, acc_lse


def _travelling(k, v, ids) -> list[torch.Tensor]:
    """What goes around the ring with each block: K, V and, with documents, the block's segment ids."""
    return [k, v] if ids is None else [k, v, ids]


def _ring_backward(ring: Ring, cfg: _RingConfig, dout, q, k, v, out, lse, ids):
    """(dq, dk, dv) float32; dk/dv accumulators travel with their K/V block and end at their owner."""
    dq = dk_acc = dv_acc = None
    blocks = _travelling(k, v, ids)
    returning = None  # the accumulators of the block that arrives next, on their way
    for step in range(ring.world):
        incoming = ring.exchange(blocks) if step + 1 < ring.world else None
        k_block, v_block, *block_ids = blocks
        pair = _step_pair(ring, cfg, step, q.shape[1], ids, *block_ids)
        grads = None
        if pair is not None:
            block, spans = pair
            grads = flash_attention_backward(
                dout[:, block.rows], q[:, block.rows], k_block[:, block.cols], v_block[:, block.cols],
                out[:, block.rows], lse[:, :, block.rows], causal=block.causal, softmax_scale=cfg.softmax_scale,
                backend=cfg.backend, spans=spans)
        if step == 0:  # the whole diagonal block: its gradients start the accumulators
            dq, dk_acc, dv_acc = grads
        else:
            dk_acc, dv_acc = returning.wait()
            if grads is not None:
                dq[:, block.rows] += grads[0]
                dk_acc[:, block.cols] += grads[1]
                dv_acc[:, block.cols] += grads[2]
        if ring.world > 1:
            returning = ring.exchange([dk_acc, dv_acc])
        if incoming is not None:
            blocks = incoming.wait()
    if returning is not None:  # the last hop brings each rank its own block's accumulators
        dk_acc, dv_acc = returning.wait()
    return dq, dk_acc, dv_acc


# ---------------------------------------------------------------------------------------------------------------
# Variant "allgather"
# ---------------------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=32)
def _position_slots(seq_len: int, world: int, layout: str, device: torch.device) -> torch.Tensor:
    """int64 [seq_len]: for each position, its index in layout order (rank 0's tokens, then rank 1's, ...).
    `x.index_select(dim, slots)` puts a layout-ordered x in position order; `index_add_(dim, slots, ...)` scatters
    position-ordered rows back to layout order."""
    return torch.from_numpy(inverse_order(layout_order(seq_len, world, layout))).to(device)


def _gather_in_position_order(ring: Ring, cfg: _RingConfig, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each of `tensors` [B, S_local, ...] gathered from every rank: [B, S_total, ...] in position order."""
    pending = [ring.all_gather(t) for t in tensors]  # all issued before the first wait
    slots = _position_slots(tensors[0].shape[1] * ring.world, ring.world, cfg.layout, tensors[0].device)
    # [P, B, S_local, ...] in rank order -> [B, S_total, ...] in layout order (a view when B == 1) -> positions
    return [p.wait().movedim(0, 1).flatten(1, 2).index_select(1, slots) for p in pending]


def _query_runs(ring: Ring, cfg: _RingConfig, local_len: int, ids=None, ids_all=None
                ) -> tuple[tuple[slice, int, bool, Spans | None], ...]:
    """(local rows, key prefix length, causal, spans) of the kernel calls: one per run of consecutive positions, or
    with documents one call on the key spans of the local tokens (segment ids `ids`) in the whole sequence
    (`ids_all`, position order)."""
    seq_len = local_len * ring.world
    if cfg.documents:
        positions = _layout_positions(seq_len, ring.world, cfg.layout, ids.device)
        every = torch.arange(seq_len, dtype=torch.int32, device=ids.device)
        return ((ALL, seq_len, False, key_spans(ids, positions[ring.rank], ids_all, every, causal=cfg.causal)),)
    if not cfg.causal:
        return ((ALL, seq_len, False, None),)
    return tuple((rows, end, True, None) for rows, end in position_runs(seq_len, ring.world, ring.rank, cfg.layout))


def _allgather_forward(ring: Ring, cfg: _RingConfig, q, k, v, ids):
    """(out in q's dtype, lse float32) of the local queries."""
    k_all, v_all, *ids_all = _gather_in_position_order(ring, cfg, _travelling(k, v, ids))
    parts = [flash_attention_forward(q[:, rows], k_all[:, :end], v_all[:, :end], causal=causal,
                                     softmax_scale=cfg.softmax_scale, backend=cfg.backend, spans=spans)
             for rows, end, causal, spans in _query_runs(ring, cfg, q.shape[1], ids, *ids_all)]
    return torch.cat([o for o, _ in parts], dim=1), torch.cat([lse for _, lse in parts], dim=2)


def _allgather_backward(ring: Ring, cfg: _RingConfig, dout, q, k, v, out, lse, ids):
    k_all, v_all, *ids_all = _gather_in_position_order(ring, cfg, _travelling(k, v, ids))
    slots = _position_slots(k_all.shape[1], ring.world, cfg.layout, k.device)
    dq = torch.empty_like(q, dtype=torch.float32)
    dk_all, dv_all = (torch.zeros_like(x, dtype=torch.float32) for x in (k_all, v_all))  # layout order
    for rows, end, causal, spans in _query_runs(ring, cfg, q.shape[1], ids, *ids_all):
        dq[:, rows], dk, dv = flash_attention_backward(
            dout[:, rows], q[:, rows], k_all[:, :end], v_all[:, :end], out[:, rows], lse[:, :, rows],
            causal=causal, softmax_scale=cfg.softmax_scale, backend=cfg.backend, spans=spans)
        dk_all.index_add_(1, slots[:end], dk)
        dv_all.index_add_(1, slots[:end], dv)
    # [B, S_total, ...] in layout order -> [P, B, S_local, ...] (a view when B == 1), summed over ranks, own slice
    pending = [ring.reduce_scatter(x.unflatten(1, (ring.world, -1)).movedim(1, 0)) for x in (dk_all, dv_all)]
    return dq, pending[0].wait(), pending[1].wait()


# ---------------------------------------------------------------------------------------------------------------
# autograd
# ---------------------------------------------------------------------------------------------------------------

class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ids, ring: Ring, cfg: _RingConfig):
        def attend():
            run = _allgather_forward if cfg.variant == "allgather" and ring.world > 1 else _ring_forward
            with ring.draining():
                out, lse = run(ring, cfg, q, k, v, ids)
            return out.to(q.dtype), lse

        out, lse = keep_for_backward(attend)
        ctx.save_for_backward(q, k, v, out, lse, ids)
        ctx.ring, ctx.cfg = ring, cfg
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, ids = ctx.saved_tensors
        ring, cfg = ctx.ring, ctx.cfg
        run = _allgather_backward if cfg.variant == "allgather" and ring.world > 1 else _ring_backward
        with ring.draining():
            dq, dk, dv = run(ring, cfg, dout.contiguous(), q, k, v, out, lse, ids)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


# ---------------------------------------------------------------------------------------------------------------
# Argument checks
# ---------------------------------------------------------------------------------------------------------------

def _code(value, choices) -> int:
    return choices.index(value) if value in choices else -1


def agreement_fields(q, k, v, causal, layout, variant, softmax_scale, segment_ids
                      ) -> dict[str, tuple[int, ...]]:
    """Fixed-length integer encodings of everything that must be equal on all ranks."""
    fields = {"segment_ids": (int(segment_ids is not None),)}
    for name, x in (("q", q), ("k", k), ("v", v)):
        dims = tuple(x.shape)[:_MAX_DIMS]
        fields[f"{name} shape"] = (x.ndim, *dims, *(-1,) * (_MAX_DIMS - len(dims)))
        fields[f"{name} dtype"] = (_code(x.dtype, _DTYPES),)
    fields["causal"] = (int(bool(causal)),)
    fields["layout"] = (_code(layout, LAYOUTS),)
    fields["variant"] = (_code(variant, VARIANTS),)
    scale_bits = struct.unpack("<q", struct.pack("<d", float(softmax_scale)))[0] if softmax_scale is not None else 0
    fields["softmax_scale"] = (int(softmax_scale is not None), scale_bits)
    return fields


def _describe(name: str, code: tuple[int, ...]) -> str:
    if name.endswith("shape"):
        return str(code[1:1 + min(code[0], _MAX_DIMS)]) + ("..." if code[0] > _MAX_DIMS else "")
    if name.endswith("dtype"):
        return str(_DTYPES[code[0]]) if code[0] >= 0 else "non-float"
    choices = {"layout": LAYOUTS, "variant": VARIANTS}.get(name)
    if choices is not None:
        return repr(choices[code[0]]) if code[0] >= 0 else "unknown"
    if name == "softmax_scale":
        return repr(struct.unpack("<d", struct.pack("<q", code[1]))[0]) if code[0] else "None"
    if name == "segment_ids":
        return "given" if code[0] else "None"
    return str(bool(code[0]))


def check_agreement(ring: Ring, fields: dict[str, tuple[int, ...]], caller: str = "ring_attention") -> None:
    """Raises the same ValueError on every rank of `ring` when any rank's arguments (`agreement_fields`) differ
    from the others'; `caller` names the function in the message."""
    flat = [value for code in fields.values() for value in code]
    everyone = ring.all_gather_ints(flat)
    if all(row == flat for row in everyone):
        return
    offset = 0
    for name, code in fields.items():
        values = [tuple(row[offset:offset + len(code)]) for row in everyone]
        offset += len(code)
        if len(set(values)) > 1:
            per_rank = ", ".join(f"{_describe(name, c)} on rank {r}" for r, c in enumerate(values))
            raise ValueError(f"{caller} arguments differ across the {ring.world} ranks: {name} is {per_rank}")


def _local_segment_ids(segment_ids, q, check_values: bool) -> torch.Tensor:
    """int32 [B, S_local] segment ids of the local tokens: the given ones (their local order, increasing positions,
    must be non-decreasing: checked with `check_values`, a host copy), or one document for a layout that runs on
    key spans without documents."""
    if segment_ids is None:
        return torch.zeros(q.shape[:2], dtype=torch.int32, device=q.device)
    if check_values:
        return checked_segment_ids(segment_ids, q.shape[0], q.shape[1], q.device)
    if not isinstance(segment_ids, torch.Tensor) or tuple(segment_ids.shape) != tuple(q.shape[:2]):
        raise ValueError(f"segment_ids must be a tensor [B, S_local] = {tuple(q.shape[:2])}")
    return segment_ids.to(device=q.device, dtype=torch.int32).contiguous()


def _check_local_shapes(q, k, v, world: int, layout: str) -> None:
    check_ring_shapes(q.shape, k.shape, v.shape, world, layout)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype not in _DTYPES:
            raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device} and {v.device}")


# ---------------------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------------------

def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: dist.ProcessGroup | None = None,
                   causal: bool = True, layout: str = "zigzag", variant: str = "ring", return_lse: bool = False,
                   softmax_scale: float | None = None, backend: str = "triton", check_ranks: bool = True,
                   compile_merge: bool = False, local_copies: bool = False, comm_log: CommLog | None = None,
                   segment_ids: torch.Tensor | None = None):
    """Attention over a sequence sharded across the ranks of `group`; see the module docstring. `segment_ids`
    [B, S_local]: this rank's tokens' documents (`weights/documents.py`, in the layout's order like q).

    Raises ValueError (on every rank alike) for bad or, with `check_ranks`, cross-rank-inconsistent arguments,
    LayoutError (a ValueError) when the local length does not split in `layout` (zigzag needs an even local length).
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    ring = Ring(group, q.device, local_copies=local_copies, log=comm_log)
    if ring.world > 1 and check_ranks:
        check_agreement(ring, agreement_fields(q, k, v, causal, layout, variant, softmax_scale, segment_ids))
    check_ring_choices(layout, variant)
    _check_local_shapes(q, k, v, ring.world, layout)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    documents = segment_ids is not None or layout not in BLOCK_LAYOUTS
    cfg = _RingConfig(bool(causal), layout, variant, scale, backend, compile_merge, documents)
    ids = _local_segment_ids(segment_ids, q, check_ranks) if documents else None
    out, lse = _RingAttention.apply(q, k, v, ids, ring, cfg)
    return (out, lse) if return_lse else out


def shard_for_ring(x: torch.Tensor, group: dist.ProcessGroup | None, layout: str, dim: int = 1) -> torch.Tensor:
    """This rank's part of a full sequence along `dim` (positions `weights.layout.rank_positions`, in local
    order); differentiable, no communication. Raises LayoutError when the length does not split."""
    ring = Ring(group, x.device)
    positions = rank_positions(x.shape[dim], ring.world, ring.rank, layout)
    return x.index_select(dim, torch.from_numpy(positions).to(x.device))


class _GatherFromRing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_local, ring: Ring, layout: str, dim: int):
        gathered = ring.all_gather(x_local).wait()  # [P, ...], rank order
        joined = gathered.movedim(0, dim).flatten(dim, dim + 1)  # layout order along dim
        ctx.ring, ctx.layout, ctx.dim = ring, layout, dim
        return joined.index_select(dim, _position_slots(joined.shape[dim], ring.world, layout, joined.device))

    @staticmethod
    def backward(ctx, grad):
        ring, dim = ctx.ring, ctx.dim
        positions = rank_positions(grad.shape[dim], ring.world, ring.rank, ctx.layout)
        return grad.index_select(dim, torch.from_numpy(positions).to(grad.device)), None, None, None


def gather_from_ring(x_local: torch.Tensor, group: dist.ProcessGroup | None, layout: str,
                     dim: int = 1) -> torch.Tensor:
    """Inverse of `shard_for_ring`: all ranks' parts joined along `dim` in position order (a collective: every
    rank must call it with the same shape). Differentiable under the replicated convention: every rank is assumed
    to use the gathered tensor identically (e.g. the same loss on the full logits), so the gradient of the local
    part is this rank's positions of the incoming gradient, with no communication."""
    ring = Ring(group, x_local.device)
    dim = dim % x_local.ndim
    if ring.world == 1:
        check_split(x_local.shape[dim], 1, layout)
        return x_local
    return _GatherFromRing.apply(x_local, ring, layout, dim)
