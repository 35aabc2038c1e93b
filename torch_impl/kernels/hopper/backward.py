"""The Hopper family's backward: a FlashAttention backward for sm_90 written in Gluon (`triton.experimental.gluon`,
Triton 3.6), one kernel in FlashAttention-2/3's form, the twin in structure of the family's forward (`forward.py`).
The public API is `torch_impl.kernels.flash_attention`, backend "triton_hopper" (forced) or "triton" (picked with the
forward: `flash_attention._uses_hopper`); launch shapes in `config.py`.

Why one kernel: the portable backward (`kernels/portable/backward.py`) runs two kernels, dK/dV and dQ, 4 + 3 matmuls
for the 5 that the backward's FLOP count credits, and tops out near 390 TF/s on H200. Here one program owns
`block_n` keys of one (batch, KV head), keeps K and V in shared memory and dK, dV in float32 registers, and walks
the query blocks of every query head of its group (GQA reads K/V once per KV head, dK/dV come out summed over the
group), or of its share of the group's heads (`head_splits`: float32 partial dK/dV, summed after). Each step of
`block_m` query rows runs the five matmuls as asynchronous `warpgroup_mma`, keys on the rows so that K and V are the
resident A operands:
    S^T = K Q^T, then dP^T = V dO^T;  P^T = exp2(S^T - lse) while dP^T is in flight;
    dV += P^T dO and dK += dS^T Q (P^T, dS^T straight from registers);  dQ = dS K from dS^T staged in shared memory,
added into a float32 dQ accumulator that all programs share (FA3's way, `dq_reduction="tma"`: the block is stored
to a double-buffered shared tile and added by one asynchronous TMA reduce-add, `cp.reduce.async.bulk.tensor`, that
Triton 3.6 lowers but its Gluon does not name; or by atomic reductions from registers, `red.v2.f32` pairs by inline
PTX). The warp-specialised form's default keeps that accumulator in the wgmma accumulator's register order, as FA3
does (`dq_register_order`: conflict-free 16-byte shared stores, one contiguous TMA box a tile; the backward 3-5 %
faster on H200, a tie at D=128 64k without a mask), and `dq_from_register_order` permutes, scales and casts it in
one pass.

Two forms of that step. The default (`warp_specialize`, FlashAttention-3's structure: `backward_ws.py`)
splits the program into two consumer warpgroups of 64 keys each, a TMA loader warp and a dQ writer warp, the
registers handed over by setmaxnreg (240 a consumer thread): 520-540 TF/s at D=128 on H200 against 415 / 398 for
the lockstep form. The lockstep form, here, runs `block_n // 16` warps that issue their own loads: one warpgroup
per 64 keys, which split the dQ matmul by columns. A step's dQ, dK and dV matmuls stay in flight into the next
step, until its S^T matmul is done; then the previous dQ goes out (with `dp_first`, while dP^T runs), and the
softmax runs while dP^T does. Registers are the limit at D=128 (255 a thread, dK and dV take 128): the compile
check (tests/test_triton_compile.py) holds ptxas to keeping every wgmma asynchronous, in both forms.
Q and dO tiles, and the row statistics (lse in log2 units, delta: padded copies, so one TMA row each) come in by
TMA through a `num_stages`-deep ring guarded by mbarriers; in the lockstep form the refill of a slot is issued right
after the per-step barrier that tells both warpgroups are past the step that last read it (the barrier is needed
anyway: the dQ matmul reads both warpgroups' halves of dS, double-buffered so the next step's store cannot
overwrite it while the other warpgroup's dQ still reads it).

Causal: a key block skips the query blocks that see none of it and masks only the diagonal ones (plus, in the last
key block, the keys past the end); longest key blocks are the first ones, launched first by the grid's order.
Non-causal, every key block walks the query blocks from the first, so that the programs running at once read the
same Q/dO tiles and add into the same dQ rows while L2 holds them (`stagger` starts each at a different block: slower).

Documents (SPANS, `weights/documents.py`; the causal rule folded into the spans): a key block walks the query
blocks between its keys' lowest query_start and highest query_end (QueryStart / QueryEnd, int32 [B, Sk], derived
from the key spans as for the portable dK/dV kernel), those whose rows all see every key of the block unmasked
(`backward_ws.key_block_walk`); the masked ones test each key's query span (`backward_ws.visible_pairs`). The dQ side
needs no key spans: it is this same walk. A key block no row sees walks nothing and writes dK = dV = 0.

Contract as the portable backward: delta = rowsum(dout * out) from the `out` it is given (the portable
preprocessing kernel), so a ring passing the global out/lse gets its exact share; P recomputed from the given lse
(rows with lse -inf and padding rows get P = 0); bottom-right causal alignment; any lengths (descriptor loads read
rows past the end as zero; dK/dV rows past the end are not stored); gradients in any float dtype, summed in float32.
Twin of `jax_impl/kernels/hopper/backward.py` (the family's JAX backward: Pallas Mosaic GPU kernels of their own
design).
Gluon has no interpreter: CPU CI compiles this kernel for sm_90 (tests/test_triton_compile.py) where the installed
Triton is the one it is written for, and GPU tests (tests/test_kernels_hopper_backward_torch.py) hold it to the
portable backward and a float64 oracle.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from torch_impl.documents import Spans, query_spans
from torch_impl.kernels.hopper.backward_ws import (dq_register_order_bases, gluon_backward_ws_kernel,
                                                   input_descriptors, issue_tile_loads, key_block_walk,
                                                   key_query_spans, masked_block, program_heads, step_tile,
                                                   tma_reduce_add, visible_pairs)
from torch_impl.kernels.hopper.config import HopperBackwardConfig, backward_config
from torch_impl.kernels.tiles import (GLUON_AVAILABLE, LOG2E, gluon_jit, row_delta, set_descriptor_allocator,
                                      spans_or_none)

if GLUON_AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_init, warpgroup_mma_wait)


# dQ += x for a pair (x0 at p0, x1 at p1) of one thread's dQ values: one 8-byte vector reduction where the pair is
# two adjacent, aligned floats (as the wgmma accumulator layout holds them), else two scalar ones (inline assembly
# does not promise which pairs it gets). Triton 3.6 emits only scalar float32 atomics.
_PAIR_ATOMIC_ADD = tl.constexpr("""{
.reg .pred adjacent;
.reg .b64 next, misalign;
add.s64 next, $2, 4;
and.b64 misalign, $2, 7;
setp.eq.s64 adjacent, next, $3;
setp.eq.and.s64 adjacent, misalign, 0, adjacent;
@adjacent red.relaxed.gpu.global.add.v2.f32 [$2], {$4, $5};
@!adjacent red.relaxed.gpu.global.add.f32 [$2], $4;
@!adjacent red.relaxed.gpu.global.add.f32 [$3], $5;
mov.b32 $0, 0;
mov.b32 $1, 0;
}""")


@gluon_jit
def _add_to_dq(dq, dq_base, step, walk, seq_q, stride_dqs):
    """Add step `step`'s dQ block into the float32 accumulator [Sq, H * D] (of this batch) all programs share, by
    8-byte atomic reductions from registers; rows past the end add 0 to the last row instead, so that the pairs'
    pointers stay adjacent."""
    block_m: gl.constexpr = dq.shape[0]
    head_dim: gl.constexpr = dq.shape[1]
    head, block = step_tile(step, walk)
    rows = block * block_m + gl.arange(0, block_m, layout=gl.SliceLayout(1, dq.type.layout))
    cols = gl.arange(0, head_dim, layout=gl.SliceLayout(0, dq.type.layout))
    in_bounds = gl.expand_dims(rows < seq_q, 1)
    rows = gl.minimum(rows, seq_q - 1)
    ptrs = dq_base + gl.expand_dims(rows.to(gl.int64) * stride_dqs, 1) + head * head_dim + gl.expand_dims(cols, 0)
    gl.inline_asm_elementwise(_PAIR_ATOMIC_ADD, "=r,=r,l,l,f,f", [ptrs.to(gl.int64), gl.where(in_bounds, dq, 0.0)],
                              dtype=gl.int32, is_pure=False, pack=2)


@gluon_jit
def _dq_out(dq, dq_bufs, dq_base, step, walk, seq_q, stride_dqs, DQ_REDUCTION: gl.constexpr):
    """Step `step`'s dQ block leaves the registers: into its shared buffer for the TMA reduce-add that follows the
    step's barrier, or by atomics."""
    if DQ_REDUCTION == "tma":
        dq_bufs.index(step % 2).store(dq)
    else:
        _add_to_dq(dq, dq_base, step, walk, seq_q, stride_dqs)


@gluon_jit
def _reduce_dq_tile(dq_desc, dq_bufs, step, walk):
    """Issue the TMA reduce-add of step `step`'s staged dQ block (rows past the end are clipped by the TMA unit)."""
    block_m: gl.constexpr = dq_bufs.type.shape[1]
    head_dim: gl.constexpr = dq_bufs.type.shape[2]
    head, block = step_tile(step, walk)
    tma_reduce_add(dq_desc, [block * block_m, head * head_dim], dq_bufs.index(step % 2))


# Lengths and head counts are not specialized on (divisible by 16, equal to 1): one compile per head dim, causal
# setting, config and dtype serves every shape, so the GPU tests' odd lengths run the very kernels the bench times.
@(gluon.jit(do_not_specialize=("n_kv_heads", "group", "seq_q", "seq_k")) if GLUON_AVAILABLE else gluon_jit)
def _gluon_backward_kernel(Q, K, V, DOut, Lse2, Delta, DQ, DK, DV, QueryStart, QueryEnd,
                           stride_qb, stride_qs, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                           stride_dob, stride_dos, stride_dqb, stride_dqs,
                           stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
                           n_kv_heads, group, seq_q, seq_k, seq_pad, softmax_scale,
                           HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, SPANS: gl.constexpr, BLOCK_M: gl.constexpr,
                           BLOCK_N: gl.constexpr,
                           NUM_STAGES: gl.constexpr, DQ_REDUCTION: gl.constexpr, DP_FIRST: gl.constexpr,
                           STAGGER: gl.constexpr, HEAD_SPLITS: gl.constexpr,
                           Q_LAYOUT: gl.constexpr, KV_LAYOUT: gl.constexpr, DS_LAYOUT: gl.constexpr,
                           STATS_LAYOUT: gl.constexpr, DQ_LAYOUT: gl.constexpr):
    NUM_WARPS: gl.constexpr = BLOCK_N // 16
    K_STEP: gl.constexpr = 256 // Q.dtype.element_ty.primitive_bitwidth
    # [keys, queries] tiles (S^T, dP^T) and the resident [keys, D] accumulators: one warpgroup per 64 keys.
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                        instr_shape=[16, BLOCK_M, K_STEP])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                        instr_shape=[16, HEAD_DIM, K_STEP])
    kv_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout,
                                                   k_width=32 // Q.dtype.element_ty.primitive_bitwidth)
    # [queries, D] dQ tile: 64 rows, the warpgroups split its columns.
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, NUM_WARPS // 4],
                                                        instr_shape=[16, HEAD_DIM // (NUM_WARPS // 4), K_STEP])

    batch, kv_head, out_row, first_head, heads = program_heads(gl.program_id(1), n_kv_heads, group, HEAD_SPLITS)
    col0 = gl.program_id(0) * BLOCK_N
    n_heads = n_kv_heads * group
    diagonal = seq_k - seq_q
    query_start, query_end = QueryStart, QueryEnd
    if SPANS:  # this batch row's query spans [Sk]
        query_start, query_end = QueryStart + batch.to(gl.int64) * seq_k, QueryEnd + batch.to(gl.int64) * seq_k
    walk, n_steps, full = key_block_walk(col0, seq_q, seq_k, heads, first_head, query_start, query_end, CAUSAL,
                                         SPANS, STAGGER, BLOCK_M, BLOCK_N)

    k_desc, v_desc, q_desc, do_desc, lse_desc, delta_desc = input_descriptors(
        Q, K, V, DOut, Lse2, Delta, stride_qb, stride_qs, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
        stride_vh, stride_dob, stride_dos, batch, kv_head, n_heads, seq_q, seq_k, seq_pad, HEAD_DIM, BLOCK_M,
        BLOCK_N, Q_LAYOUT, KV_LAYOUT, STATS_LAYOUT)
    k_buf = gl.allocate_shared_memory(K.dtype.element_ty, [BLOCK_N, HEAD_DIM], KV_LAYOUT)
    v_buf = gl.allocate_shared_memory(V.dtype.element_ty, [BLOCK_N, HEAD_DIM], KV_LAYOUT)
    q_bufs = gl.allocate_shared_memory(Q.dtype.element_ty, [NUM_STAGES, BLOCK_M, HEAD_DIM], Q_LAYOUT)
    do_bufs = gl.allocate_shared_memory(Q.dtype.element_ty, [NUM_STAGES, BLOCK_M, HEAD_DIM], Q_LAYOUT)
    ds_bufs = gl.allocate_shared_memory(Q.dtype.element_ty, [2, BLOCK_N, BLOCK_M], DS_LAYOUT)
    lse_bufs = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_M], STATS_LAYOUT)
    delta_bufs = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_M], STATS_LAYOUT)
    # dQ blocks staged for the TMA reduce-add, double-buffered: a step stores into the one whose reduce was issued
    # a step earlier and has been waited for before the barrier between them. ([Sq, H * D] per batch like Q.)
    if DQ_REDUCTION == "tma":
        dq_desc = tma.make_tensor_descriptor(DQ + batch.to(gl.int64) * stride_dqb, [seq_q, n_heads * HEAD_DIM],
                                             [stride_dqs, 1], [BLOCK_M, HEAD_DIM], DQ_LAYOUT)
        dq_bufs = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, HEAD_DIM], DQ_LAYOUT)
    else:  # unused: dQ leaves by atomics
        dq_desc = None
        dq_bufs = None
    descs = (q_desc, do_desc, lse_desc, delta_desc)
    bufs = (q_bufs, do_bufs, lse_bufs, delta_bufs)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)

    mbarrier.expect(kv_ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [col0, 0], kv_ready, k_buf)
    tma.async_copy_global_to_shared(v_desc, [col0, 0], kv_ready, v_buf)
    for i in gl.static_range(NUM_STAGES - 1):
        issue_tile_loads(descs, bufs, ready, i, n_steps, walk, seq_pad)

    qk_scale = softmax_scale * LOG2E
    cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout))
    cols_spans = key_query_spans(query_start, query_end, cols, seq_k, SPANS)
    dq_base = DQ + batch.to(gl.int64) * stride_dqb
    zeros_t = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, st_layout)
    zeros_q = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, dq_layout)
    # Loop-carried in flight: each step's dQ, dK and dV matmuls run on while the next step waits for its tiles and
    # issues S^T.
    dk = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout))
    dv = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout))
    dq = warpgroup_mma_init(zeros_q)
    mbarrier.wait(kv_ready, 0)
    for step in range(n_steps):
        slot = step % NUM_STAGES
        block = step_tile(step, walk)[1]
        rows = block * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))
        mbarrier.wait(ready.index(slot), (step // NUM_STAGES) & 1)
        q_buf = q_bufs.index(slot)
        do_buf = do_bufs.index(slot)
        s_t = warpgroup_mma(k_buf, q_buf.permute((1, 0)), zeros_t, use_acc=False, is_async=True)
        # The previous step's dQ, dK, dV and this S^T done, the previous dQ goes out. (Reading an accumulator
        # across the loop's back edge under a partial wait makes ptxas serialize every wgmma.) With DP_FIRST dP^T
        # runs meanwhile; its accumulator beside dQ's leaves ptxas too few registers at D=128.
        dq, dk, dv, s_t = warpgroup_mma_wait(num_outstanding=0, deps=(dq, dk, dv, s_t))
        if DP_FIRST:
            dp_t = warpgroup_mma(v_buf, do_buf.permute((1, 0)), zeros_t, use_acc=False, is_async=True)
        if step > 0:
            _dq_out(dq, dq_bufs, dq_base, step - 1, walk, seq_q, stride_dqs, DQ_REDUCTION)
        if not DP_FIRST:
            dp_t = warpgroup_mma(v_buf, do_buf.permute((1, 0)), zeros_t, use_acc=False, is_async=True)
        lse2 = lse_bufs.index(slot).load(gl.SliceLayout(0, st_layout))
        p_t = gl.exp2(s_t * qk_scale - gl.expand_dims(lse2, 0))
        if masked_block(block, full, SPANS):
            p_t = gl.where(visible_pairs(cols, rows, seq_k, diagonal, cols_spans, CAUSAL, SPANS), p_t, 0.0)
        dv = warpgroup_mma(gl.convert_layout(p_t.to(Q.dtype.element_ty), kv_operand), do_buf, dv, is_async=True)
        dp_t = warpgroup_mma_wait(num_outstanding=1, deps=(dp_t, ))
        delta = delta_bufs.index(slot).load(gl.SliceLayout(0, st_layout))
        ds_t = (p_t * (dp_t - gl.expand_dims(delta, 0))).to(Q.dtype.element_ty)
        dk = warpgroup_mma(gl.convert_layout(ds_t, kv_operand), q_buf, dk, is_async=True)
        ds_buf = ds_bufs.index(step % 2)
        ds_buf.store(ds_t)
        if DQ_REDUCTION == "tma":  # the reduce issued a step ago is done reading the buffer the next step fills
            tma.store_wait(0)
        fence_async_shared()
        # Both warpgroups' dS halves (and dQ parts) are in, and both are past the previous step's matmuls: its Q/dO
        # slot is free.
        gl.thread_barrier()
        if DQ_REDUCTION == "tma":
            if step > 0:
                _reduce_dq_tile(dq_desc, dq_bufs, step - 1, walk)
        issue_tile_loads(descs, bufs, ready, step + NUM_STAGES - 1, n_steps, walk, seq_pad)
        dq = warpgroup_mma(ds_buf.permute((1, 0)), k_buf, zeros_q, use_acc=False, is_async=True)
    dq, dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dq, dk, dv))
    if n_steps > 0:
        _dq_out(dq, dq_bufs, dq_base, n_steps - 1, walk, seq_q, stride_dqs, DQ_REDUCTION)
        if DQ_REDUCTION == "tma":
            fence_async_shared()
            gl.thread_barrier()
            _reduce_dq_tile(dq_desc, dq_bufs, n_steps - 1, walk)
    if DQ_REDUCTION == "tma":  # shared memory must outlive the reduce's read of it
        tma.store_wait(0)

    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(ready.index(i))
    mbarrier.invalidate(kv_ready)
    out_rows = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, kv_layout))
    out_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, kv_layout))
    in_bounds = gl.expand_dims(out_rows < seq_k, 1)
    dk_ptrs = (DK + out_row.to(gl.int64) * stride_dkb + kv_head.to(gl.int64) * stride_dkh
               + gl.expand_dims(out_rows.to(gl.int64) * stride_dks, 1) + gl.expand_dims(out_cols, 0))
    dv_ptrs = (DV + out_row.to(gl.int64) * stride_dvb + kv_head.to(gl.int64) * stride_dvh
               + gl.expand_dims(out_rows.to(gl.int64) * stride_dvs, 1) + gl.expand_dims(out_cols, 0))
    gl.store(dk_ptrs, (dk * softmax_scale).to(DK.dtype.element_ty), mask=in_bounds)
    gl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=in_bounds)


def shared_layouts(dtype: torch.dtype, head_dim: int, config: HopperBackwardConfig):
    """(Q/dO tile, K/V tile, dS^T tile, row statistics, float32 dQ tile) shared-memory layouts: the widest swizzle
    for each bf16/fp16 2D tile (the matmuls' operands), none for the float32 rows, the config's `dq_swizzle` for the
    float32 dQ tile (config.DQ_SWIZZLES: why not the widest), or in register order none: the tile is one contiguous
    TMA box there (`dq_store_layout`). The warp-specialised form stages dQ in halves of D."""
    element = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return (gl.NVMMASharedLayout.get_default_for([config.block_m, head_dim], element),
            gl.NVMMASharedLayout.get_default_for([config.block_n, head_dim], element),
            gl.NVMMASharedLayout.get_default_for([config.block_n, config.block_m], element),
            gl.NVMMASharedLayout.get_default_for([config.block_m], gl.float32),
            gl.NVMMASharedLayout(swizzle_byte_width=0 if config.dq_register_order else config.dq_swizzle,
                                 element_bitwidth=32, rank=2))


def dq_store_layout(head_dim: int, config: HopperBackwardConfig, dq_layout):
    """The layout a warp-specialised consumer stores its [block_m, D/2] float32 dQ tile in: in register order the
    tile's offsets (`backward_ws.dq_register_order_bases`), else `dq_layout`, the dQ tile's own (`shared_layouts`)."""
    if config.dq_register_order:
        return gl.SharedLinearLayout(dq_register_order_bases(config.block_m, head_dim // 2))
    return dq_layout


@triton.jit
def _dq_from_register_order_kernel(Acc, DQ, seq_q, n_heads, n_blocks, stride_dqb, stride_dqs, stride_dqh, scale,
                                   ROW_BITS: tl.constexpr, COL_BITS: tl.constexpr, BLOCK_M: tl.constexpr,
                                   HEAD_DIM: tl.constexpr):
    """dQ[b, rows of query block, h, :] = scale * the accumulator's two register-order chunks of that block (one per
    D/2 columns); ROW_BITS / COL_BITS: the offset bit each bit of a row / column index stands at."""
    block = tl.program_id(0)
    batch_head = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)[:, None]
    cols = tl.arange(0, HEAD_DIM)[None, :]
    half_dim: tl.constexpr = HEAD_DIM // 2
    offset = (batch_head.to(tl.int64) * n_blocks + block) * 2 * BLOCK_M * half_dim + cols // half_dim * (
        BLOCK_M * half_dim)
    for bit in tl.static_range(len(ROW_BITS)):
        offset += ((rows >> bit) & 1) << ROW_BITS[bit]
    for bit in tl.static_range(len(COL_BITS)):
        offset += ((cols % half_dim >> bit) & 1) << COL_BITS[bit]
    dq = tl.load(Acc + offset) * scale
    out_rows = block * BLOCK_M + rows
    batch, head = batch_head // n_heads, batch_head % n_heads
    ptrs = DQ + batch.to(tl.int64) * stride_dqb + out_rows.to(tl.int64) * stride_dqs + head * stride_dqh + cols
    tl.store(ptrs, dq.to(DQ.dtype.element_ty), mask=out_rows < seq_q)


def dq_from_register_order(acc: torch.Tensor, seq_q: int, n_heads: int, head_dim: int, block_m: int, scale: float,
                           dtype: torch.dtype) -> torch.Tensor:
    """dQ [B, Sq, H, D] in `dtype`, scaled, from the float32 accumulator in register order ([B, H, seq_pad /
    block_m, 2, block_m * D/2]: `backward_ws.dq_register_order_bases`) in one pass (FlashAttention-3's postprocess)."""
    batch = acc.shape[0]
    n_blocks = acc.numel() // (batch * n_heads * block_m * head_dim)
    bases = dq_register_order_bases(block_m, head_dim // 2)
    row_bits = tuple(next(i for i, b in enumerate(bases) if b == [1 << k, 0]) for k in range(block_m.bit_length() - 1))
    col_bits = tuple(next(i for i, b in enumerate(bases) if b == [0, 1 << k])
                     for k in range((head_dim // 2).bit_length() - 1))
    dq = torch.empty((batch, seq_q, n_heads, head_dim), dtype=dtype, device=acc.device)
    _dq_from_register_order_kernel[(n_blocks, batch * n_heads)](
        acc, dq, seq_q, n_heads, n_blocks, dq.stride(0), dq.stride(1), dq.stride(2), scale, ROW_BITS=row_bits,
        COL_BITS=col_bits, BLOCK_M=block_m, HEAD_DIM=head_dim, num_warps=8)
    return dq


def padded_row_stats(lse: torch.Tensor, delta: torch.Tensor, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(lse in log2 units, delta), float32 [B, H, Sq rounded up to block_m] for the kernel's TMA loads: rows that
    see no key (lse -inf) and padding rows get lse +inf, so their P = 0, and padding rows delta 0."""
    batch, n_heads, seq_q = lse.shape
    seq_pad = triton.cdiv(seq_q, block_m) * block_m
    lse2 = torch.full((batch, n_heads, seq_pad), math.inf, dtype=torch.float32, device=lse.device)
    lse2[..., :seq_q] = torch.where(lse == -math.inf, math.inf, lse * LOG2E.value)
    delta_pad = torch.zeros((batch, n_heads, seq_pad), dtype=torch.float32, device=lse.device)
    delta_pad[..., :seq_q] = delta
    return lse2, delta_pad


def _heads_packed(x: torch.Tensor) -> torch.Tensor:
    """x [B, S, H, D] with each row's heads adjacent ([S, H * D] row-major per batch), copying only if needed."""
    return x if x.stride(3) == 1 and x.stride(2) == x.shape[3] else x.contiguous()


def hopper_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, *, causal: bool, softmax_scale: float, grad_dtype: torch.dtype,
                    config: HopperBackwardConfig | None = None, delta: torch.Tensor | None = None,
                    spans: Spans | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the Gluon backward on validated inputs that `hopper_unsupported` accepts: (dq, dk, dv) in grad_dtype.
    `delta` (rowsum(dout * out), float32 [B, H, Sq]) replaces the one computed from `out` (tests' negative
    control). `spans`: the documents' key spans as for `portable_backward` (the causal rule folded in, `causal`
    False); the kernel walks the query spans derived from them."""
    batch, seq_q, n_heads, head_dim = q.shape
    seq_k, n_kv_heads = k.shape[1], k.shape[2]
    config = config or backward_config(head_dim, causal, 0)
    q, dout = _heads_packed(q), _heads_packed(dout)
    if delta is None:
        delta = row_delta(out, dout)
    lse2, delta = padded_row_stats(lse, delta, config.block_m)
    seq_pad = lse2.shape[-1]
    # the float32 accumulator: [B, Sq, H, D], or [B, H, seq_pad / block_m, 2, block_m * D/2] in register order
    dq = torch.zeros((batch, n_heads * seq_pad * head_dim) if config.dq_register_order
                     else (batch, seq_q, n_heads, head_dim), dtype=torch.float32, device=q.device)
    head_splits = math.gcd(config.head_splits, n_heads // n_kv_heads)
    # each split's dK/dV share: float32 partials, summed below ([B * splits, Sk, Hkv, D], `program_heads`)
    parts_dtype = grad_dtype if head_splits == 1 else torch.float32
    dk = torch.empty((batch * head_splits, *k.shape[1:]), dtype=parts_dtype, device=q.device)
    dv = torch.empty((batch * head_splits, *v.shape[1:]), dtype=parts_dtype, device=q.device)
    q_layout, kv_layout, ds_layout, stats_layout, dq_layout = shared_layouts(q.dtype, head_dim, config)
    set_descriptor_allocator(q.device)
    query_start, query_end = spans_or_none(None if spans is None else query_spans(spans, seq_k), q.device)
    grid = (triton.cdiv(seq_k, config.block_n), batch * n_kv_heads * head_splits)
    tensors_and_strides = (
        q, k, v, dout, lse2, delta, dq, dk, dv, query_start, query_end,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        dout.stride(0), dout.stride(1), dq.stride(0), dq.stride(1),
        dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
        n_kv_heads, n_heads // n_kv_heads, seq_q, seq_k, seq_pad, softmax_scale)
    constexprs = dict(SPANS=spans is not None, HEAD_SPLITS=head_splits, Q_LAYOUT=q_layout, KV_LAYOUT=kv_layout,
                      DS_LAYOUT=ds_layout, STATS_LAYOUT=stats_layout, DQ_LAYOUT=dq_layout)
    if config.warp_specialize:
        gluon_backward_ws_kernel[grid](
            *tensors_and_strides, HEAD_DIM=head_dim, CAUSAL=causal, BLOCK_M=config.block_m,
            NUM_STAGES=config.num_stages, DQ_BUFFERS=config.dq_buffers, STAGGER=config.stagger,
            KV_IN_REGS=config.kv_in_regs, LSE_FIRST=config.lse_first, DQ_REGISTER_ORDER=config.dq_register_order,
            DQ_STORE_LAYOUT=dq_store_layout(head_dim, config, dq_layout), **constexprs,
            CONSUMER_REGS=config.consumer_regs, PRODUCER_REGS=config.producer_regs,
            num_warps=config.num_warps, maxnreg=config.max_regs)
    else:
        _gluon_backward_kernel[grid](
            *tensors_and_strides, HEAD_DIM=head_dim, CAUSAL=causal, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
            NUM_STAGES=config.num_stages, DQ_REDUCTION=config.dq_reduction, DP_FIRST=config.dp_first,
            STAGGER=config.stagger, **constexprs, num_warps=config.num_warps)
    if config.dq_register_order:
        dq = dq_from_register_order(dq, seq_q, n_heads, head_dim, config.block_m, softmax_scale, grad_dtype)
    else:
        dq = dq.mul_(softmax_scale).to(grad_dtype)
    if head_splits > 1:
        dk, dv = (g.view(batch, head_splits, *g.shape[1:]).sum(1).to(grad_dtype) for g in (dk, dv))
    return dq, dk, dv
