"""The Hopper family's forward: a FlashAttention forward for sm_90 written in Gluon (`triton.experimental.gluon`,
Triton 3.6), the FA3 structure that Triton's `tl` language cannot express. The public API is
`torch_impl.kernels.flash_attention`, backend "triton_hopper" (forced) or "triton" (picked on sm_90 where
`config.hopper_unsupported` is None: see `flash_attention._uses_hopper`); launch shapes in `config.py`. Same
contract as the portable forward (`kernels/portable/forward.py`): out [B, Sq, H, D] in any float dtype, lse
[B, H, Sq] float32, GQA read in place, any lengths, bottom-right causal alignment, a row that sees no key gets out 0
and lse -inf, and packed documents as key spans (KeyStart / KeyEnd, int32 [B, Sq], under the SPANS switch, which
leaves the kernel without documents as it was).

One program owns 64 query rows per consumer (128 with two, 192 with three as FlashAttention-3 runs D=64) of one
(batch, head) and runs its partitions under `gl.warp_specialize`:
  - a producer warp that moves tiles with the tensor-memory accelerator: the consumers' 64-row Q tiles once, then K
    and V tiles into `num_stages`-deep rings, each slot guarded by a ready barrier (TMA transaction count) and an
    empty barrier that every consumer releases;
  - `consumers` warpgroups of 64 query rows each (the default partition and the workers). Each keeps its online
    softmax in registers and overlaps its own matmuls: S_j = Q K_j^T is issued together with O += P_{j-1} V_{j-1}
    (`warpgroup_mma` async), and the softmax of S_j runs while the P V matmul is still in flight;
  - with `pingpong`, the consumers take turns issuing their matmuls (one mbarrier each, passed round the ring), so
    that one warpgroup's softmax runs while another's matmuls occupy the tensor cores.
Keys are walked in three parts: the first tile (always masked: it may be the only, partly visible, one), the tiles
every row sees in full (no mask), and the causal diagonal / key tail (masked). Causal query blocks are launched
longest first. With documents (`weights/documents.py`; the causal rule folded into the spans) the program walks
only the key tiles between its rows' lowest key_start and highest key_end (`tiles.span_block_range`, the portable
kernels' block ranges): masked up to the first tile all its rows see whole, unmasked through the last such, masked
after; each row masked by its own span. A program whose rows see no key loads no key tile (blocks without a pair
are skipped, not masked) and writes out 0, lse -inf. Tensor descriptors are made on the device per (batch, head)
slice, so rows past a sequence's end read as zero; the output goes out with plain masked stores, since a ring asks
for float32 partial outputs.

Twin of `jax_impl/kernels/hopper/forward.py` (the family's JAX forward, a Pallas Mosaic GPU kernel of its own design).
Gluon has no interpreter: CPU CI compiles this kernel for sm_90 (tests/test_triton_compile.py) where the installed
Triton is the one it is written for, and GPU tests hold it to the portable kernel and cuDNN.
"""

from __future__ import annotations

import torch
import triton

from torch_impl.kernels.hopper.config import HopperConfig, forward_config
from torch_impl.documents import Spans
from torch_impl.kernels.tiles import (GLUON_AVAILABLE, LN2, LOG2E, gluon_jit, seq_bucket, set_descriptor_allocator,
                                      span_block_range, spans_or_none)

if GLUON_AVAILABLE:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

ROWS_PER_CONSUMER = 64  # one warpgroup's wgmma tile height; the query block is `consumers` of them


@gluon_jit
def _load_partition(args):
    (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_bars, k_ready, k_empty, v_ready, v_empty, turns,
     row0, n_tiles, seq_q, seq_k, qk_scale, o_base, stride_os, lse_base, documents) = args
    num_stages: gl.constexpr = k_bufs.type.shape[0]
    block_n: gl.constexpr = k_bufs.type.shape[1]
    consumers: gl.constexpr = q_bufs.type.shape[0]
    key0 = documents[2]  # the program's first key tile (0 without documents)
    for c in gl.static_range(consumers):
        mbarrier.expect(q_bars.index(c), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [row0 + c * q_desc.block_type.shape[0], 0], q_bars.index(c),
                                        q_bufs.index(c))
    # K then V per step: the consumers need K_j before V_{j-1}, so K runs one tile ahead of V on the wire.
    for j in range(n_tiles):
        slot = j % num_stages
        phase = (j // num_stages) & 1
        mbarrier.wait(k_empty.index(slot), phase ^ 1)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [key0 + j * block_n, 0], k_ready.index(slot), k_bufs.index(slot))
        mbarrier.wait(v_empty.index(slot), phase ^ 1)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [key0 + j * block_n, 0], v_ready.index(slot), v_bufs.index(slot))


@gluon_jit
def _take_turn(turns, consumer: gl.constexpr, step, PINGPONG: gl.constexpr):
    """Wait until the consumer before this one in the ring has issued its matmuls of this step (consumer 0: the
    last consumer, of the previous step; consumer 0 starts)."""
    if PINGPONG:
        mbarrier.wait(turns.index(consumer), (step & 1) ^ (1 if consumer == 0 else 0))


@gluon_jit
def _pass_turn(turns, consumer: gl.constexpr, PINGPONG: gl.constexpr):
    consumers: gl.constexpr = turns.type.shape[0]
    if PINGPONG:
        mbarrier.arrive(turns.index((consumer + 1) % consumers), count=1)


@gluon_jit
def _softmax_step(s, l_i, m_i, start_n, rows, seq_k, diagonal, span_start, span_end, qk_scale,
                  MASKED: gl.constexpr, CAUSAL: gl.constexpr, SPANS: gl.constexpr, s_layout: gl.constexpr):
    """One key tile's online-softmax update from raw scores `s`: (p, alpha, l_i, m_i), m_i in log2 units. Masked,
    a row sees the keys of its span [span_start, span_end) with documents (SPANS; spans end at seq_k at the
    latest), else those before seq_k and, if CAUSAL, at most `diagonal` past it (`tiles.visible_keys`' rule)."""
    if MASKED:
        cols = gl.expand_dims(start_n + gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, s_layout)), 0)
        if SPANS:
            visible = (cols >= gl.expand_dims(span_start, 1)) & (cols < gl.expand_dims(span_end, 1))
        else:
            visible = cols < seq_k
            if CAUSAL:
                visible = visible & (cols <= gl.expand_dims(rows, 1) + diagonal)
        s = gl.where(visible, s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        # A row with nothing visible yet keeps m = -inf; subtracting 0 keeps its p at 0 instead of NaN.
        m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - gl.expand_dims(m_shift, 1))
    else:
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        m_shift = m_new
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_shift, 1))
    alpha = gl.exp2(m_i - m_shift)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, l_i, m_new


@gluon_jit
def _key_steps(acc, l_i, m_i, p, q_buf, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, turns, rows,
               first, last, key0, seq_k, diagonal, span_start, span_end, qk_scale, consumer: gl.constexpr,
               MASKED: gl.constexpr, CAUSAL: gl.constexpr, SPANS: gl.constexpr, PINGPONG: gl.constexpr,
               s_layout: gl.constexpr, p_layout: gl.constexpr):
    """Steps j in [first, last) (key tile j starts at key key0 + j * block_n): issue S_j = Q K_j^T and
    O += P_{j-1} V_{j-1}, softmax S_j while the second runs, then rescale O once it has landed. `p` carries P_{j-1}
    between steps."""
    num_stages: gl.constexpr = k_bufs.type.shape[0]
    block_n: gl.constexpr = k_bufs.type.shape[1]
    block_m: gl.constexpr = q_buf.type.shape[0]
    for j in range(first, last):
        slot = j % num_stages
        prev = (j - 1) % num_stages
        mbarrier.wait(k_ready.index(slot), (j // num_stages) & 1)
        mbarrier.wait(v_ready.index(prev), ((j - 1) // num_stages) & 1)
        _take_turn(turns, consumer, j, PINGPONG)
        s = warpgroup_mma(q_buf, k_bufs.index(slot).permute((1, 0)),
                          gl.zeros([block_m, block_n], gl.float32, s_layout), use_acc=False,
                          is_async=True)
        acc = warpgroup_mma(p, v_bufs.index(prev), acc, is_async=True)
        _pass_turn(turns, consumer, PINGPONG)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
        mbarrier.arrive(k_empty.index(slot), count=1)
        p_new, alpha, l_i, m_i = _softmax_step(s, l_i, m_i, key0 + j * block_n, rows, seq_k, diagonal, span_start,
                                               span_end, qk_scale, MASKED, CAUSAL, SPANS, s_layout)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(v_empty.index(prev), count=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout)), 1)
        p = gl.convert_layout(p_new.to(v_bufs.dtype), p_layout)
    return acc, l_i, m_i, p


@gluon_jit
def _walk_keys(args, q_buf, rows, lead, full, span_start, span_end, consumer: gl.constexpr, CAUSAL: gl.constexpr,
               SPANS: gl.constexpr, PINGPONG: gl.constexpr, s_layout: gl.constexpr, p_layout: gl.constexpr,
               o_layout: gl.constexpr):
    """(acc, l_i, m_i) of one consumer's rows after the program's n_tiles >= 1 key tiles: step 0 (S_0 alone, always
    masked), steps [1, lead) masked, [lead, full) unmasked, [full, n_tiles) masked, then the last P V."""
    (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_bars, k_ready, k_empty, v_ready, v_empty, turns,
     row0, n_tiles, seq_q, seq_k, qk_scale, o_base, stride_os, lse_base, documents) = args
    num_stages: gl.constexpr = k_bufs.type.shape[0]
    block_n: gl.constexpr = k_bufs.type.shape[1]
    block_m: gl.constexpr = q_bufs.type.shape[1]
    head_dim: gl.constexpr = q_bufs.type.shape[2]
    key0 = documents[2]
    diagonal = seq_k - seq_q

    mbarrier.wait(k_ready.index(0), 0)
    _take_turn(turns, consumer, 0, PINGPONG)
    s = warpgroup_mma(q_buf, k_bufs.index(0).permute((1, 0)), gl.zeros([block_m, block_n], gl.float32, s_layout),
                      use_acc=False, is_async=True)
    _pass_turn(turns, consumer, PINGPONG)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    mbarrier.arrive(k_empty.index(0), count=1)
    m_i = gl.full([block_m], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([block_m], gl.float32, gl.SliceLayout(1, s_layout))
    p, alpha, l_i, m_i = _softmax_step(s, l_i, m_i, key0, rows, seq_k, diagonal, span_start, span_end, qk_scale,
                                       True, CAUSAL, SPANS, s_layout)
    p = gl.convert_layout(p.to(v_bufs.dtype), p_layout)
    acc = gl.zeros([block_m, head_dim], gl.float32, o_layout)

    if SPANS:  # documents: the tiles before the first one every row of the program sees whole are masked too
        acc, l_i, m_i, p = _key_steps(acc, l_i, m_i, p, q_buf, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty,
                                      turns, rows, 1, lead, key0, seq_k, diagonal, span_start, span_end, qk_scale,
                                      consumer, True, CAUSAL, SPANS, PINGPONG, s_layout, p_layout)
    acc, l_i, m_i, p = _key_steps(acc, l_i, m_i, p, q_buf, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty,
                                  turns, rows, lead, full, key0, seq_k, diagonal, span_start, span_end, qk_scale,
                                  consumer, False, CAUSAL, SPANS, PINGPONG, s_layout, p_layout)
    acc, l_i, m_i, p = _key_steps(acc, l_i, m_i, p, q_buf, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty,
                                  turns, rows, full, n_tiles, key0, seq_k, diagonal, span_start, span_end, qk_scale,
                                  consumer, True, CAUSAL, SPANS, PINGPONG, s_layout, p_layout)

    # Last step: O += P_{n-1} V_{n-1}.
    last = n_tiles - 1
    mbarrier.wait(v_ready.index(last % num_stages), (last // num_stages) & 1)
    _take_turn(turns, consumer, n_tiles, PINGPONG)
    acc = warpgroup_mma(p, v_bufs.index(last % num_stages), acc, is_async=True)
    _pass_turn(turns, consumer, PINGPONG)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.arrive(v_empty.index(last % num_stages), count=1)
    return acc, l_i, m_i


@gluon_jit
def _consume(args, consumer: gl.constexpr, CAUSAL: gl.constexpr, SPANS: gl.constexpr, PINGPONG: gl.constexpr):
    (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_bars, k_ready, k_empty, v_ready, v_empty, turns,
     row0, n_tiles, seq_q, seq_k, qk_scale, o_base, stride_os, lse_base, documents) = args
    block_n: gl.constexpr = k_bufs.type.shape[1]
    block_m: gl.constexpr = q_bufs.type.shape[1]
    head_dim: gl.constexpr = q_bufs.type.shape[2]
    k_step: gl.constexpr = 256 // q_desc.dtype.primitive_bitwidth
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, block_n, k_step])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, head_dim, k_step])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout,
                                                 k_width=32 // q_desc.dtype.primitive_bitwidth)
    my_row0 = row0 + consumer * block_m
    rows = my_row0 + gl.arange(0, block_m, layout=gl.SliceLayout(1, s_layout))
    q_buf = q_bufs.index(consumer)
    mbarrier.wait(q_bars.index(consumer), 0)

    if SPANS:
        # Documents: each row's key span (rows past seq_q see nothing) for the masked tiles; the runs of tiles are
        # the program's (`_gluon_forward_kernel`), so every consumer walks the tiles the producer loads.
        key_start, key_end, key0, lead, full = documents
        span_start = gl.load(key_start + rows, mask=rows < seq_q, other=0)
        span_end = gl.load(key_end + rows, mask=rows < seq_q, other=0)
        if n_tiles > 0:
            acc, l_i, m_i = _walk_keys(args, q_buf, rows, gl.maximum(lead, 1), gl.maximum(full, 1), span_start,
                                       span_end, consumer, CAUSAL, SPANS, PINGPONG, s_layout, p_layout, o_layout)
        else:  # no row of the program sees a key: nothing is loaded (blocks without a pair are skipped)
            acc = gl.zeros([block_m, head_dim], gl.float32, o_layout)
            l_i = gl.zeros([block_m], gl.float32, gl.SliceLayout(1, s_layout))
            m_i = gl.full([block_m], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    else:
        # Tiles [1, full) are ones this consumer's rows all see whole; the walk all consumers share ends at n_tiles.
        diagonal = seq_k - seq_q
        if CAUSAL:  # query i sees key j iff j <= i + diagonal
            seen_by_all = gl.minimum(my_row0 + diagonal + 1, seq_k)
        else:
            seen_by_all = seq_k
        full = gl.minimum(gl.maximum(seen_by_all // block_n, 1), n_tiles)
        acc, l_i, m_i = _walk_keys(args, q_buf, rows, 1, full, 0, 0, consumer, CAUSAL, SPANS, PINGPONG, s_layout,
                                   p_layout, o_layout)

    sees_nothing = l_i == 0.0
    l_safe = gl.where(sees_nothing, 1.0, l_i)
    lse = gl.where(sees_nothing, float("-inf"), (m_i + gl.log2(l_safe)) * LN2)
    out = acc / gl.expand_dims(gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout)), 1)
    out_rows = my_row0 + gl.arange(0, block_m, layout=gl.SliceLayout(1, o_layout))
    out_cols = gl.arange(0, head_dim, layout=gl.SliceLayout(0, o_layout))
    o_ptrs = (o_base + gl.expand_dims(out_rows.to(gl.int64) * stride_os, 1) + gl.expand_dims(out_cols, 0))
    gl.store(o_ptrs, out.to(o_base.dtype.element_ty), mask=gl.expand_dims(out_rows < seq_q, 1))
    gl.store(lse_base + rows, lse, mask=rows < seq_q)


@gluon_jit
def _consumer0(args, CAUSAL: gl.constexpr, SPANS: gl.constexpr, PINGPONG: gl.constexpr):
    _consume(args, 0, CAUSAL, SPANS, PINGPONG)


@gluon_jit
def _consumer1(args, CAUSAL: gl.constexpr, SPANS: gl.constexpr, PINGPONG: gl.constexpr):
    _consume(args, 1, CAUSAL, SPANS, PINGPONG)


@gluon_jit
def _consumer2(args, CAUSAL: gl.constexpr, SPANS: gl.constexpr, PINGPONG: gl.constexpr):
    _consume(args, 2, CAUSAL, SPANS, PINGPONG)


@gluon_jit
def _producer(args, CAUSAL: gl.constexpr, SPANS: gl.constexpr, PINGPONG: gl.constexpr):
    _load_partition(args)


@gluon_jit
def _gluon_forward_kernel(Q, K, V, Out, Lse, KeyStart, KeyEnd,
                          stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                          stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh,
                          n_heads, group, seq_q, seq_k, softmax_scale, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr,
                          SPANS: gl.constexpr, CONSUMERS: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                          PINGPONG: gl.constexpr,
                          Q_LAYOUT: gl.constexpr, KV_LAYOUT: gl.constexpr,
                          CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    BLOCK_M: gl.constexpr = CONSUMERS * 64
    pid_bh = gl.program_id(1)
    batch = pid_bh // n_heads
    head = pid_bh % n_heads
    kv_head = head // group  # GQA: query heads [kv_head * group, (kv_head + 1) * group) read this K/V head
    if CAUSAL:  # the last query blocks see the most keys: launched first, the grid's tail is short
        row0 = (gl.num_programs(0) - 1 - gl.program_id(0)) * BLOCK_M
    else:
        row0 = gl.program_id(0) * BLOCK_M
    if SPANS:
        # Documents (the causal rule folded into the spans): the tiles between the block's lowest key_start and
        # highest key_end, [key0, key0 + n_tiles * BLOCK_N), none when no row sees a key; steps [lead, full) of them
        # are tiles every row of the block sees whole. One span_block_range for the block (the portable kernels'
        # `tiles.key_block_runs`; a tl helper that compiles in Gluon too, given rows with a layout): per-consumer
        # runs would need a reduction across warps inside each warp-specialised partition.
        SPAN_ROWS: gl.constexpr = 256 if CONSUMERS == 3 else 128  # a power of two for arange; rows past BLOCK_M
        spans_row0 = batch.to(gl.int64) * seq_q                   # are left out through n_rows
        span_rows = row0 + gl.arange(0, SPAN_ROWS, layout=gl.BlockedLayout([1], [32], [gl.num_warps()], [0]))
        _, _, first, full_first, full_end, end = span_block_range(
            KeyStart + spans_row0, KeyEnd + spans_row0, span_rows, gl.minimum(seq_q, row0 + BLOCK_M), seq_k, BLOCK_N)
        n_tiles = (end - first) // BLOCK_N
        documents = (KeyStart + spans_row0, KeyEnd + spans_row0, first, (full_first - first) // BLOCK_N,
                     (full_end - first) // BLOCK_N)
    else:
        diagonal = seq_k - seq_q
        if CAUSAL:  # the block's last row sees keys up to row0 + BLOCK_M - 1 + diagonal
            end = gl.minimum(row0 + BLOCK_M + diagonal, seq_k)
        else:
            end = seq_k
        # At least one (then fully masked) tile, so a block that sees no key still runs the same pipeline.
        n_tiles = gl.maximum(gl.cdiv(end, BLOCK_N), 1)
        documents = (KeyStart, KeyEnd, 0, 0, 0)  # unused but the first tile's key

    q_desc = tma.make_tensor_descriptor(Q + batch.to(gl.int64) * stride_qb + head.to(gl.int64) * stride_qh,
                                        [seq_q, HEAD_DIM], [stride_qs, 1], [64, HEAD_DIM], Q_LAYOUT)
    k_desc = tma.make_tensor_descriptor(K + batch.to(gl.int64) * stride_kb + kv_head.to(gl.int64) * stride_kh,
                                        [seq_k, HEAD_DIM], [stride_ks, 1], [BLOCK_N, HEAD_DIM], KV_LAYOUT)
    v_desc = tma.make_tensor_descriptor(V + batch.to(gl.int64) * stride_vb + kv_head.to(gl.int64) * stride_vh,
                                        [seq_k, HEAD_DIM], [stride_vs, 1], [BLOCK_N, HEAD_DIM], KV_LAYOUT)
    q_bufs = gl.allocate_shared_memory(Q.dtype.element_ty, [CONSUMERS, 64, HEAD_DIM], Q_LAYOUT)
    k_bufs = gl.allocate_shared_memory(K.dtype.element_ty, [NUM_STAGES, BLOCK_N, HEAD_DIM], KV_LAYOUT)
    v_bufs = gl.allocate_shared_memory(V.dtype.element_ty, [NUM_STAGES, BLOCK_N, HEAD_DIM], KV_LAYOUT)
    q_bars = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(CONSUMERS):
        mbarrier.init(q_bars.index(c), count=1)
        mbarrier.init(turns.index(c), count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)  # released by every consumer
        mbarrier.init(v_empty.index(i), count=CONSUMERS)

    o_base = Out + batch.to(gl.int64) * stride_ob + head.to(gl.int64) * stride_oh
    lse_base = Lse + (batch * n_heads + head).to(gl.int64) * seq_q
    args = (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_bars, k_ready, k_empty, v_ready, v_empty, turns,
            row0, n_tiles, seq_q, seq_k, softmax_scale * LOG2E, o_base, stride_os, lse_base, documents)
    if CONSUMERS == 3:
        gl.warp_specialize([
            (_consumer0, (args, CAUSAL, SPANS, PINGPONG)),
            (_consumer1, (args, CAUSAL, SPANS, PINGPONG)),
            (_consumer2, (args, CAUSAL, SPANS, PINGPONG)),
            (_producer, (args, CAUSAL, SPANS, PINGPONG)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer0, (args, CAUSAL, SPANS, PINGPONG)),
            (_consumer1, (args, CAUSAL, SPANS, PINGPONG)),
            (_producer, (args, CAUSAL, SPANS, PINGPONG)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def shared_layouts(dtype: torch.dtype, head_dim: int, block_n: int):
    """(Q tile, K/V tile) shared-memory layouts: the widest swizzle for a [rows, head_dim] 16-bit tile."""
    element = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return (gl.NVMMASharedLayout.get_default_for([ROWS_PER_CONSUMER, head_dim], element),
            gl.NVMMASharedLayout.get_default_for([block_n, head_dim], element))


def hopper_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, softmax_scale: float,
                   out_dtype: torch.dtype, config: HopperConfig | None = None, spans: Spans | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the Gluon forward on validated, supported inputs (`hopper_unsupported` is None):
    (out [B, Sq, H, D] in out_dtype, lse [B, H, Sq] float32). `spans`: the documents' key spans, which replace the
    causal rule (the caller folds it in: `causal` is then False), as for `portable_forward`."""
    batch, seq_q, n_heads, head_dim = q.shape
    seq_k, n_kv_heads = k.shape[1], k.shape[2]
    config = config or forward_config(head_dim, causal, seq_bucket(seq_q, seq_k))
    out = torch.empty((batch, seq_q, n_heads, head_dim), dtype=out_dtype, device=q.device)
    lse = torch.empty((batch, n_heads, seq_q), dtype=torch.float32, device=q.device)
    q_layout, kv_layout = shared_layouts(q.dtype, head_dim, config.block_n)
    set_descriptor_allocator(q.device)
    key_start, key_end = spans_or_none(spans, q.device)
    _gluon_forward_kernel[(triton.cdiv(seq_q, config.consumers * ROWS_PER_CONSUMER), batch * n_heads)](
        q, k, v, out, lse, key_start, key_end,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        n_heads, n_heads // n_kv_heads, seq_q, seq_k, softmax_scale, HEAD_DIM=head_dim, CAUSAL=causal,
        SPANS=spans is not None,
        CONSUMERS=config.consumers, BLOCK_N=config.block_n, NUM_STAGES=config.num_stages, PINGPONG=config.pingpong,
        Q_LAYOUT=q_layout,
        KV_LAYOUT=kv_layout,
        CONSUMER_REGS=config.consumer_regs, PRODUCER_REGS=config.producer_regs,
        num_warps=4, maxnreg=config.max_regs)
    return out, lse
