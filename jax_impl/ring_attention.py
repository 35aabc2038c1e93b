"""Sequence-parallel (ring) attention for JAX: every device holds a slice of the sequence's tokens, K/V blocks go
around a named `jax.shard_map` mesh axis, and each device merges its queries' partial results by log-sum-exp. Twin
of `torch_impl/ring_attention.py` (same names; torch.distributed there, JAX collectives here).

Public API (kept stable for the models and for `compare/bench/ring_bench.py`):

  ring_attention(q, k, v, *, axis_name="sp", causal=True, layout="zigzag", variant="ring", return_lse=False,
                 softmax_scale=None, backend="pallas", local_copies=False)
      Called INSIDE `jax.shard_map` over the mesh axis `axis_name`; q [B, S_local, H, D], k/v [B, S_local, Hkv, D]
      are this device's tokens in the layout's order (`weights.layout.rank_positions`: increasing positions).
      Returns out [B, S_local, H, D] in q's dtype, or (out, lse [B, H, S_local] float32) with `return_lse`; lse is
      returned as a constant (gradients flow through `out` only). Differentiable (a `jax.custom_vjp`), composes
      with `jax.jit` and with other mesh axes (e.g. batch sharded over "fsdp"). With its keywords bound by
      `functools.partial`, it is the model's `AttentionFn` (`fn(q, k, v) -> out`, causal). `local_copies`: every
      collective becomes a local array of the same size (results wrong by design): the benchmark's ring minus its
      communication, for measuring how much communication the overlap leaves exposed (twin of the torch ring's).
  ring_attention_sharded(q, k, v, mesh, *, axis_name="sp", batch_axis=None, ...same keywords)
      GLOBAL arrays in natural position order: reorders them into the layout's order, runs `ring_attention` in
      `jax.shard_map` (sequence over `axis_name`, batch over `batch_axis` if given) and returns the global
      result in natural order.
  schedule_forward(ring, cfg, q, k, v) / schedule_backward(ring, cfg, residuals, dout), cfg = ring_config(q, ...)
      One device's whole forward / backward on any `jax_impl.ring_comm.Ring`: `ring_attention` runs them on the
      mesh axis's ring inside its custom_vjp; the tests run every rank's exact schedule on one device through a
      lockstep ring (the interpreted Mosaic GPU kernels cannot run inside a multi-device shard_map on the CPU).
  shard_for_ring(x, world, layout, axis=1) / gather_from_ring(x, world, layout, axis=1)
      Reorder a GLOBAL array between natural position order and layout order (rank 0's positions, then rank 1's,
      ...), so that sharding `axis` evenly over the ring's mesh axis gives each device its layout positions. (The
      torch twins take a process group and return / take one rank's part; here the mesh does the splitting.)

Layouts are defined once in `weights.layout`. Only the Hkv K/V heads travel (GQA is never
expanded on the wire).

Variant "ring": at step s device r holds the K/V block of device j = (r - s) mod P, passed on with
`jax.lax.ppermute` (P-1 hops; a hop depends only on the previous block, so XLA can overlap it with the step's
compute). j == r only at step 0 (static); later j < r exactly when r >= s, which depends on the traced
`jax.lax.axis_index`, so the step's block is chosen with `jax.lax.cond`. The causal work of each step is the table
of `weights.attention.ring_block` (shared with the torch twin), a half-rows or half-columns block run as its
half-by-half squares where the Mosaic kernels serve the calls (`_kernel_pieces`: one kernel shape for every
off-diagonal call). Partial results are merged in float32; a row that saw no
key keeps lse -inf and output 0, without NaN. Backward: K/V go around again with float32 dK/dV accumulators
travelling with their block (a separate ppermute, so the K/V hop need not wait for the gradients), arriving back
at their owner after P hops; dq accumulates locally in float32; the pair backward gets the GLOBAL merged out and
lse, so per-pair gradients sum to the exact ones. Results are cast to the inputs' dtypes.

Variant "allgather" (Llama-3's context parallelism): K/V are all-gathered once and put in position order; each run
of consecutive positions among the local queries (one for contiguous, two for zigzag) then attends, in one kernel
call, to the key prefix that ends at its last position, with the bottom-right-aligned causal mask; no merge is
needed. The prefix lengths depend on the traced rank, so the calls sit in a `jax.lax.switch` with one branch per
rank (static shapes in each). Its backward gathers K/V again (instead of keeping P copies alive) and
`psum_scatter`s float32 dK/dV.

Packed documents (`segment_ids`, `weights/documents.py`), and the zigzag_stripes layout with or without them: every
step is the whole K/V block on its key spans (`_step_spans`: segment ids travel with their block, positions come
from a table indexed by the traced rank, so no cond); the allgather variant makes one call on the spans of the
whole sequence (no switch). The pair calls take the spans in whichever Pallas family serves them (`"pallas"`: the
Mosaic kernels on sm90), one kernel shape for every step.

Per-pair work goes to `jax_impl.kernels.flash_attention` (`backend="pallas"` kernels, `"reference"` plain math, or
`"cudnn"`). Shapes are static in JAX, so inside `shard_map` every device has the same local shapes and settings:
the cross-rank mismatch the torch twin checks at run time cannot occur. P = 1 runs the single diagonal step
without collectives (for either variant).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from jax_impl.documents import checked_segment_ids, key_spans
from jax_impl.kernels.flash_attention import flash_attention_backward, flash_attention_forward, runs_hopper_kernels
from jax_impl.remat import keep_for_backward
from jax_impl.ring_comm import Ring, mesh_ring
from weights.attention import ALL, BLOCK_LAYOUTS, RingBlock, check_ring_choices, check_ring_shapes, ring_block
from weights.layout import check_split, inverse_order, layout_order, position_runs, rank_positions


@dataclass(frozen=True)
class RingConfig:
    """The static (hashable) settings of one call (`ring_config`): the custom_vjp's non-differentiable argument."""

    axis_name: str
    causal: bool
    layout: str
    variant: str
    softmax_scale: float
    backend: str
    local_copies: bool = False  # static: a jit traced with it is cached apart from one without
    square_pieces: bool = False  # `_kernel_pieces`: the Mosaic kernels serve the pair calls
    documents: bool = False  # every step on key spans (`_step_spans`): segment ids given, or the zigzag_stripes layout


WHOLE = (RingBlock(ALL, ALL, False),)  # a step with documents: the whole block, masked by its key spans


@functools.lru_cache(maxsize=32)
def _layout_positions(seq_len: int, world: int, layout: str) -> np.ndarray:
    """int32 [P, S_local]: every rank's positions (`weights.layout.rank_positions`), where the spans look keys up."""
    return np.stack([rank_positions(seq_len, world, rank, layout) for rank in range(world)]).astype(np.int32)


def _step_spans(ring: Ring, cfg: RingConfig, step: int, ids, block_ids):
    """With documents, the key spans of the local tokens (segment ids `ids`) against the K/V block of ring step
    `step`, rank (rank - step) mod P's (`block_ids`), looked up at both ranks' positions (the rank may be traced);
    None without."""
    if not cfg.documents:
        return None
    positions = jnp.asarray(_layout_positions(ids.shape[1] * ring.world, ring.world, cfg.layout))
    return key_spans(ids, positions[ring.rank], block_ids, positions[(ring.rank - step) % ring.world],
                     causal=cfg.causal)


def _travelling(k, v, ids) -> tuple:
    """What goes around the ring with each block: K, V and, with documents, the block's segment ids."""
    return (k, v) if ids is None else (k, v, ids)


def _updated(acc, index: slice, axis: int, value, *, add: bool = False):
    """`acc` with `value` written (or added) at the static slice `index` of `axis`: a dynamic-update-slice that
    XLA does in place, where `.at[...]` would be a scatter."""
    start = index.start or 0
    if add:
        value = jax.lax.slice_in_dim(acc, start, start + value.shape[axis], axis=axis) + value
    if value.shape[axis] == acc.shape[axis]:
        return value
    return jax.lax.dynamic_update_slice_in_dim(acc, value, start, axis=axis)


def _kernel_pieces(block: RingBlock | None, local_len: int, squares: bool) -> tuple[RingBlock, ...]:
    """The kernel calls of a step's block. With `squares` (the Mosaic kernels serve the calls), a non-causal block
    of half the rows or half the columns (the zigzag layout's "earlier" and "later" blocks, whose shapes differ)
    runs as its half-by-half squares, so that every off-diagonal call of the ring has one shape: each shape of a
    Pallas call is a kernel of its own that Mosaic GPU compiles for every step compilation (jax 0.11 stamps each
    lowering's kernel bytes, so none is reused across compilations: compare/results/
    jax-compile-profile-2026-11-23-h200/), and one shape instead of two spares a 2-GPU step three of its nine
    kernels. Other kernels gain nothing from fewer shapes (an interpreted call only costs more), nor does the
    torch twin (Triton kernels take any shape): whole blocks."""
    if block is None:
        return ()
    if not squares or block.causal or block.rows == block.cols == ALL:
        return (block,)
    halves = (slice(None, local_len // 2), slice(local_len // 2, None))
    return tuple(RingBlock(rows, cols, False) for rows in (halves if block.rows == ALL else (block.rows,))
                 for cols in (halves if block.cols == ALL else (block.cols,)))


def _run_step(step_fn, step: int, rank, cfg: RingConfig, local_len: int, *operands):
    """`step_fn(pieces, *operands)` for the block of step `step` (`_kernel_pieces`), whose source rank is
    (rank - step) mod P. Only step 0 holds the local block; later, the source is an earlier rank exactly when
    rank >= step (no wrap-around), which depends on the traced rank, so the choice is a `lax.cond` when the two
    blocks differ (a Python choice when the rank is a Python int: the lockstep ring of the tests, where Pallas's GPU
    interpreter cannot run inside a `lax.cond`)."""
    def pieces(source: str) -> tuple[RingBlock, ...]:
        return _kernel_pieces(ring_block(cfg.causal, cfg.layout, source, local_len), local_len, cfg.square_pieces)
    if step == 0:
        return step_fn(pieces("same"), *operands, cfg=cfg)
    earlier, later = pieces("earlier"), pieces("later")
    if earlier == later or isinstance(rank, int):  # a rank known when tracing (a lockstep ring) needs no cond
        return step_fn(earlier if earlier == later or rank >= step else later, *operands, cfg=cfg)
    return jax.lax.cond(rank >= step, functools.partial(step_fn, earlier, cfg=cfg),
                        functools.partial(step_fn, later, cfg=cfg), *operands)


# ---------------------------------------------------------------------------------------------------------------
# Variant "ring"
# ---------------------------------------------------------------------------------------------------------------

def _merge(acc_out, acc_lse, out, lse):
    """Log-sum-exp merge of two float32 partial results; rows where both are empty stay (0, -inf), no NaN."""
    new_lse = jnp.logaddexp(acc_lse, lse)
    safe_lse = jnp.where(jnp.isfinite(new_lse), new_lse, 0.0)

    def weight(part_lse):  # [B, H, S] -> [B, S, H, 1], the share of the merged softmax denominator
        return jnp.exp(part_lse - safe_lse).transpose(0, 2, 1)[..., None]

    return weight(acc_lse) * acc_out + weight(lse) * out, new_lse


def _forward_step(pieces: tuple[RingBlock, ...], acc, q, k_block, v_block, cfg: RingConfig, spans=None):
    """The accumulated (out float32, lse) of the local queries with this step's partial results merged in."""
    for block in pieces:
        out, lse = flash_attention_forward(q[:, block.rows], k_block[:, block.cols], v_block[:, block.cols],
                                           causal=block.causal, softmax_scale=cfg.softmax_scale,
                                           out_dtype=jnp.float32, backend=cfg.backend, spans=spans)
        acc_out, acc_lse = acc
        out, lse = _merge(acc_out[:, block.rows], acc_lse[:, :, block.rows], out, lse)
        acc = _updated(acc_out, block.rows, 1, out), _updated(acc_lse, block.rows, 2, lse)
    return acc


def _backward_step(pieces: tuple[RingBlock, ...], grads, dout, q, k_block, v_block, out, lse, cfg: RingConfig,
                   spans=None):
    """(dq, dk, dv) float32 accumulators with this step's gradients added (dk/dv: those of the block in hand)."""
    for block in pieces:
        dq_part, dk_part, dv_part = flash_attention_backward(
            dout[:, block.rows], q[:, block.rows], k_block[:, block.cols], v_block[:, block.cols],
            out[:, block.rows], lse[:, :, block.rows], causal=block.causal, softmax_scale=cfg.softmax_scale,
            backend=cfg.backend, spans=spans)
        dq, dk, dv = grads
        grads = (_updated(dq, block.rows, 1, dq_part, add=True), _updated(dk, block.cols, 1, dk_part, add=True),
                 _updated(dv, block.cols, 1, dv_part, add=True))
    return grads


def _ring_forward(ring: Ring, cfg: RingConfig, q, k, v, ids):
    """(out float32, in q's dtype when P = 1; lse float32) of the local queries. With documents the segment ids
    travel with their K/V block and every step is the whole block on its key spans."""
    world, local_len = ring.world, q.shape[1]
    # Step 0 is the whole diagonal block (`ring_block`'s "same"), whose result starts the accumulators as it is:
    # merging it into empty ones, (0, -inf), gives the same numbers with one more pass over them per layer. With
    # no other block (P = 1) the kernel writes the inputs' dtype, the cast back to it then being none.
    acc = flash_attention_forward(q, k, v, causal=cfg.causal and not cfg.documents, softmax_scale=cfg.softmax_scale,
                                  out_dtype=jnp.float32 if world > 1 else q.dtype, backend=cfg.backend,
                                  spans=_step_spans(ring, cfg, 0, ids, ids))
    blocks = _travelling(k, v, ids)
    for step in range(1, world):
        blocks = ring.exchange(blocks)
        k_block, v_block, *block_ids = blocks
        if cfg.documents:
            acc = _forward_step(WHOLE, acc, q, k_block, v_block, cfg=cfg,
                                spans=_step_spans(ring, cfg, step, ids, *block_ids))
        else:
            acc = _run_step(_forward_step, step, ring.rank, cfg, local_len, acc, q, k_block, v_block)
    return acc


def _ring_backward(ring: Ring, cfg: RingConfig, dout, q, k, v, out, lse, ids):
    """(dq, dk, dv) float32; the dk/dv accumulators travel with their K/V block and end at their owner."""
    world, local_len = ring.world, q.shape[1]
    # zeros_like keeps the inputs' varying-over-mesh-axes type, which both cond branches must return.
    grads = tuple(jnp.zeros_like(x, jnp.float32) for x in (q, k, v))
    blocks = _travelling(k, v, ids)
    for step in range(world):
        if step:  # two transfers: the K/V one does not wait for the previous step's gradients
            blocks = ring.exchange(blocks)
            grads = (grads[0], *ring.exchange(grads[1:]))
        k_block, v_block, *block_ids = blocks
        if cfg.documents:
            grads = _backward_step(WHOLE, grads, dout, q, k_block, v_block, out, lse, cfg=cfg,
                                   spans=_step_spans(ring, cfg, step, ids, *block_ids))
        else:
            grads = _run_step(_backward_step, step, ring.rank, cfg, local_len, grads, dout, q, k_block, v_block,
                              out, lse)
    dq, dk, dv = grads
    if world > 1:  # the last hop brings each rank its own block's accumulators
        dk, dv = ring.exchange((dk, dv))
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------------------------
# Variant "allgather"
# ---------------------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=32)
def _query_runs(cfg: RingConfig, world: int, rank: int, local_len: int) -> tuple[tuple[slice, int, bool], ...]:
    """(local rows, key prefix length, causal) of the kernel calls: one per run of consecutive positions."""
    seq_len = local_len * world
    if not cfg.causal:
        return ((ALL, seq_len, False),)
    return tuple((rows, end, True) for rows, end in position_runs(seq_len, world, rank, cfg.layout))


def _gather_kv_in_position_order(ring: Ring, cfg: RingConfig, k, v):
    """The full K and V [B, S_total, Hkv, D] in position order (one all-gather of both)."""
    gathered = ring.all_gather(jnp.stack([k, v]), axis=2)  # layout order
    kv = gather_from_ring(gathered, ring.world, cfg.layout, axis=2)
    return kv[0], kv[1]


def _for_each_rank(ring: Ring, cfg: RingConfig, local_len: int, run_fn, *operands):
    """`run_fn(runs, *operands)` with this rank's query runs. Their key prefixes are static shapes that depend on
    the traced rank, so ranks with different runs go through a `lax.switch` with one branch per rank."""
    runs = [_query_runs(cfg, ring.world, r, local_len) for r in range(ring.world)]
    if all(r == runs[0] for r in runs):
        return run_fn(runs[0], *operands)
    if isinstance(ring.rank, int):  # a rank known when tracing (a lockstep ring) needs no switch
        return run_fn(runs[ring.rank], *operands)
    return jax.lax.switch(ring.rank, [functools.partial(run_fn, r) for r in runs], *operands)


def _allgather_spans(ring: Ring, cfg: RingConfig, ids):
    """The key spans of the local tokens (segment ids `ids`) in the whole sequence (position order), whose segment
    ids are gathered from every rank."""
    seq_len = ids.shape[1] * ring.world
    ids_all = gather_from_ring(ring.all_gather(ids, axis=1), ring.world, cfg.layout, axis=1)
    positions = jnp.asarray(_layout_positions(seq_len, ring.world, cfg.layout))
    return key_spans(ids, positions[ring.rank], ids_all, jnp.arange(seq_len, dtype=jnp.int32), causal=cfg.causal)


def _allgather_forward(ring: Ring, cfg: RingConfig, q, k, v, ids):
    """(out in q's dtype, lse float32) of the local queries; no merge, each query run is one kernel call (with
    documents one call on the key spans, whatever the rank)."""
    if cfg.documents:
        k_all, v_all = _gather_kv_in_position_order(ring, cfg, k, v)
        return flash_attention_forward(q, k_all, v_all, causal=False, softmax_scale=cfg.softmax_scale,
                                       backend=cfg.backend, spans=_allgather_spans(ring, cfg, ids))

    def attend(runs, q, k_all, v_all):
        parts = [flash_attention_forward(q[:, rows], k_all[:, :end], v_all[:, :end], causal=causal,
                                         softmax_scale=cfg.softmax_scale, backend=cfg.backend)
                 for rows, end, causal in runs]
        return jnp.concatenate([o for o, _ in parts], axis=1), jnp.concatenate([lse for _, lse in parts], axis=2)

    return _for_each_rank(ring, cfg, q.shape[1], attend, q, *_gather_kv_in_position_order(ring, cfg, k, v))


def _allgather_backward(ring: Ring, cfg: RingConfig, dout, q, k, v, out, lse, ids):
    """(dq, dk, dv) float32; K/V gathered again (rather than keeping P copies alive from the forward), dK/dV of
    the whole sequence reduce-scattered back to their owners."""
    def grads(runs, dout, q, k_all, v_all, out, lse):
        dq_parts = []
        dk_all, dv_all = (jnp.zeros_like(x, jnp.float32) for x in (k_all, v_all))  # position order
        for rows, end, causal in runs:
            dq_part, dk, dv = flash_attention_backward(
                dout[:, rows], q[:, rows], k_all[:, :end], v_all[:, :end], out[:, rows], lse[:, :, rows],
                causal=causal, softmax_scale=cfg.softmax_scale, backend=cfg.backend)
            dq_parts.append(dq_part)
            dk_all = _updated(dk_all, slice(None, end), 1, dk, add=True)
            dv_all = _updated(dv_all, slice(None, end), 1, dv, add=True)
        return jnp.concatenate(dq_parts, axis=1), jnp.stack([dk_all, dv_all])

    k_all, v_all = _gather_kv_in_position_order(ring, cfg, k, v)
    if cfg.documents:
        dq, dk_all, dv_all = flash_attention_backward(dout, q, k_all, v_all, out, lse, causal=False,
                                                      softmax_scale=cfg.softmax_scale, backend=cfg.backend,
                                                      spans=_allgather_spans(ring, cfg, ids))
        dkv_all = jnp.stack([dk_all, dv_all])
    else:
        dq, dkv_all = _for_each_rank(ring, cfg, q.shape[1], grads, dout, q, k_all, v_all, out, lse)
    dkv_all = shard_for_ring(dkv_all, ring.world, cfg.layout, axis=2)  # layout order: rank r's part is the r-th
    dk, dv = ring.reduce_scatter(dkv_all, axis=2)
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------------------------
# custom_vjp
# ---------------------------------------------------------------------------------------------------------------

def _uses_allgather(ring: Ring, cfg: RingConfig) -> bool:
    return cfg.variant == "allgather" and ring.world > 1


def schedule_forward(ring: Ring, cfg: RingConfig, q, k, v, ids=None):
    """One device's whole forward on any `Ring` (the mesh axis's, or the tests' lockstep one): ((out in q's
    dtype, lse), the residuals of `schedule_backward`). `ids`: the local tokens' segment ids when cfg.documents."""
    run = _allgather_forward if _uses_allgather(ring, cfg) else _ring_forward
    out, lse = run(ring, cfg, q, k, v, ids)
    out, lse = keep_for_backward(out.astype(q.dtype), lse)
    return (out, lse), (q, k, v, out, lse, ids)


def schedule_backward(ring: Ring, cfg: RingConfig, residuals, dout):
    """One device's whole backward on any `Ring`: (dq, dk, dv) in the inputs' dtypes."""
    q, k, v, out, lse, ids = residuals
    run = _allgather_backward if _uses_allgather(ring, cfg) else _ring_backward
    dq, dk, dv = run(ring, cfg, dout, q, k, v, out, lse, ids)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _ring_attention_fwd(q, k, v, ids, cfg: RingConfig):
    return schedule_forward(mesh_ring(cfg.axis_name, local_copies=cfg.local_copies), cfg, q, k, v, ids)


def _ring_attention_bwd(cfg: RingConfig, residuals, cotangents):
    dout = cotangents[0]  # lse leaves the public API as a constant, so its cotangent is ignored
    dq, dk, dv = schedule_backward(mesh_ring(cfg.axis_name, local_copies=cfg.local_copies), cfg, residuals, dout)
    return dq, dk, dv, None  # the segment ids are integers


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _ring_attention(q, k, v, ids, cfg: RingConfig):
    return _ring_attention_fwd(q, k, v, ids, cfg)[0]


_ring_attention.defvjp(_ring_attention_fwd, _ring_attention_bwd)


# ---------------------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------------------

def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, axis_name: str = "sp", causal: bool = True,
                   layout: str = "zigzag", variant: str = "ring", return_lse: bool = False,
                   softmax_scale: float | None = None, backend: str = "pallas", local_copies: bool = False,
                   segment_ids=None):
    """Attention over the sequence sharded along mesh axis `axis_name`; call inside `jax.shard_map`.

    q [B, S_local, H, D], k/v [B, S_local, Hkv, D]: this device's tokens in `layout` order; `segment_ids`
    [B, S_local]: their documents (`weights/documents.py`), in the same order. Returns out in q's dtype, or (out,
    lse [B, H, S_local] float32, a constant for autodiff) when `return_lse`. `softmax_scale` defaults to
    1/sqrt(D). Raises ValueError for bad arguments, LayoutError (a ValueError) when zigzag's local length is odd.
    See the module docstring for the per-step work and the backward.
    """
    check_ring_choices(layout, variant)
    try:
        world = jax.lax.axis_size(axis_name)
    except NameError as err:
        raise ValueError(f"axis_name {axis_name!r} is not a mesh axis in scope: call ring_attention inside "
                         "jax.shard_map over a mesh with that axis (or use ring_attention_sharded)") from err
    check_ring_shapes(q.shape, k.shape, v.shape, world, layout)
    cfg = ring_config(q, axis_name=axis_name, causal=causal, layout=layout, variant=variant,
                      softmax_scale=softmax_scale, backend=backend, local_copies=local_copies,
                      documents=segment_ids is not None)
    ids = None
    if cfg.documents:  # one document where the layout runs on spans without documents
        ids = (jnp.zeros(q.shape[:2], jnp.int32) if segment_ids is None
               else checked_segment_ids(segment_ids, q.shape[0], q.shape[1]))
    out, lse = _ring_attention(q, k, v, ids, cfg)
    return (out, jax.lax.stop_gradient(lse)) if return_lse else out


def ring_config(q: jax.Array, *, axis_name: str = "sp", causal: bool = True, layout: str = "zigzag",
                variant: str = "ring", softmax_scale: float | None = None, backend: str = "pallas",
                local_copies: bool = False, documents: bool = False) -> RingConfig:
    """The static settings `ring_attention` runs a call on local queries like `q` with (same keywords; `documents`:
    segment ids given): what `schedule_forward` / `schedule_backward` take beside their `Ring`."""
    check_ring_choices(layout, variant)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    documents = documents or layout not in BLOCK_LAYOUTS
    return RingConfig(axis_name, bool(causal), layout, variant, scale, backend, bool(local_copies),
                      not documents and runs_hopper_kernels(backend, q), documents)


def shard_for_ring(x: jax.Array, world: int, layout: str, axis: int = 1) -> jax.Array:
    """Reorders a global array from natural position order to layout order along `axis` (rank 0's positions,
    then rank 1's, ...): sharding `axis` evenly over `world` devices then gives each its layout positions."""
    order = layout_order(x.shape[axis], world, layout)
    return jnp.take(x, order.astype(np.int32), axis=axis)


def gather_from_ring(x: jax.Array, world: int, layout: str, axis: int = 1) -> jax.Array:
    """Inverse of `shard_for_ring`: restores natural position order along `axis`."""
    order = layout_order(x.shape[axis], world, layout)
    return jnp.take(x, inverse_order(order).astype(np.int32), axis=axis)


def _with_segment_ids(attention, q, k, v, segment_ids):
    return attention(q, k, v, segment_ids=segment_ids)


def ring_attention_sharded(q: jax.Array, k: jax.Array, v: jax.Array, mesh: Mesh, *, axis_name: str = "sp",
                           batch_axis: str | None = None, causal: bool = True, layout: str = "zigzag",
                           variant: str = "ring", return_lse: bool = False, softmax_scale: float | None = None,
                           backend: str = "pallas", local_copies: bool = False, segment_ids=None):
    """`ring_attention` on GLOBAL arrays in natural position order (q [B, S, H, D], k/v [B, S, Hkv, D],
    segment_ids [B, S]): the sequence is sharded over mesh axis `axis_name` in `layout`, the batch over
    `batch_axis` (None: replicated). Returns out [B, S, H, D] (and lse [B, H, S] with `return_lse`) in natural
    order. Jittable; raises LayoutError when S does not split over the axis in that layout."""
    check_ring_choices(layout, variant)
    if axis_name not in mesh.axis_names:
        raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh (axes: {mesh.axis_names})")
    if batch_axis is not None and batch_axis not in mesh.axis_names:
        raise ValueError(f"batch_axis {batch_axis!r} is not an axis of the mesh (axes: {mesh.axis_names})")
    world = mesh.shape[axis_name]
    check_split(q.shape[1], world, layout)
    tokens = PartitionSpec(batch_axis, axis_name, None, None)
    attention = functools.partial(ring_attention, axis_name=axis_name, causal=causal, layout=layout,
                                  variant=variant, return_lse=return_lse, softmax_scale=softmax_scale,
                                  backend=backend, local_copies=local_copies)
    inputs, in_specs = [shard_for_ring(x, world, layout) for x in (q, k, v)], [tokens] * 3
    if segment_ids is not None:
        ids = checked_segment_ids(segment_ids, q.shape[0], q.shape[1])
        inputs.append(shard_for_ring(ids, world, layout))
        in_specs.append(PartitionSpec(batch_axis, axis_name))
        attention = functools.partial(_with_segment_ids, attention)
    attend = jax.shard_map(attention, mesh=mesh, in_specs=tuple(in_specs),
                           out_specs=(tokens, PartitionSpec(batch_axis, None, axis_name)) if return_lse else tokens)
    result = attend(*inputs)
    if not return_lse:
        return gather_from_ring(result, world, layout)
    out, lse = result
    return gather_from_ring(out, world, layout), gather_from_ring(lse, world, layout, axis=2)
