"""The warp-specialised form of the Gluon (sm_90) FlashAttention backward (FlashAttention-3's structure), and the
tile walk both forms share, with documents' query spans too (`program_heads`, `key_block_walk`, `masked_block`,
`visible_pairs`).
The public API is `backward.hopper_backward`, which launches this kernel when its config says `warp_specialize`
(see `backward.py` for the math and the contract, the same here).

Where the lockstep form (`backward._gluon_backward_kernel`) runs two warpgroups that issue their own
loads and meet at a CTA-wide barrier every step, here one program (`block_n` = 128 keys of one batch and KV head)
forks into four partitions (`gl.warp_specialize`):
  - two consumer warpgroups (the default partition and a worker), each owning 64 of the keys: its K/V rows, its dK
    and dV accumulators. Per query block: S^T = K_c Q^T and dP^T = V_c dO^T, P^T = exp2(S^T - lse) while dP^T is
    in flight, dS^T = P^T (dP^T - delta) into its half of a shared dS tile, dV += P^T dO and dK += dS^T Q from
    registers, and dQ's `D/2` columns of its own: dQ_c = dS K[:, c], which needs both halves of dS (the one place
    the consumers wait on each other, through an mbarrier, not a barrier both must reach);
  - a loader warp: K and V once, then Q, dO, lse and delta tiles by TMA into a `num_stages`-deep ring (a ready
    barrier with the transaction count, an empty barrier both consumers release);
  - a dQ writer warp: each consumer stores its float32 dQ half to a shared tile (`dq_buffers` deep; in register
    order with `dq_register_order`, `dq_register_order_bases`) and tells the writer, which adds it to the global
    float32 accumulator by one TMA reduce-add and frees the tile once the TMA unit has read it: the consumers never
    wait on the reduction.
Each step waits all five of its wgmma (FlashAttention-3's choice at D=128 too: dQ deferred by a step would need 32
more registers than the consumers' 240). `kv_in_regs` holds each consumer's K and V rows in registers, so that
S^T and dP^T read only Q and dO from shared memory (it fits at D=64). Registers (setmaxnreg): the worker consumer
gets `consumer_regs`, the two single warps `producer_regs`, the default consumer what `max_regs` for all 384
threads leaves (240 each at the defaults). Measured on H200: compare/results/
kernels-gluon-backward-2026-11-23-h200-h13d.
"""

from __future__ import annotations

import triton.language as tl

from torch_impl.kernels.tiles import GLUON_AVAILABLE, LOG2E, gluon_jit, span_block_range

if GLUON_AVAILABLE:
    from triton._C.libtriton import ir as triton_ir
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language._core import builtin
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
else:
    def builtin(fn):
        return fn

# One warpgroup's wgmma tile height; two consumers make the 128-key block.
KEYS_PER_CONSUMER = tl.constexpr(64)
# Floats per row of the TMA box a consumer's dQ tile leaves in, in register order (TMA's widest box dimension).
DQ_TMA_ROW = tl.constexpr(256)


def dq_register_order_bases(block_m: int, half_dim: int) -> list[list[int]]:
    """The (row, col) of a consumer's [block_m, half_dim] float32 dQ tile that each bit of an element's offset in
    register order stands for (`HopperBackwardConfig.dq_register_order`, FlashAttention-3's dQ accumulator), lowest
    bit first. The wgmma accumulator layout of one warpgroup (m64nNk16: lane l of warp w holds rows 16w + l/4 + 8r,
    cols 8j + 2(l%4) + c, as its registers c + 2r + 4j) with a thread's registers 0-3 (c, r) innermost: it stores
    them as one 16-byte vector, a warp 512 contiguous bytes (no bank conflict; the swizzled row-major tile conflicts);
    then the lanes, the warps, the column groups j. The tile is one contiguous chunk: it leaves as one TMA box of
    DQ_TMA_ROW-float rows into a float32 accumulator kept in that order, which `backward.dq_from_register_order`
    permutes back."""
    if block_m != 64 or half_dim & (half_dim - 1) or half_dim < 8:
        raise ValueError(f"register order is laid out for 64-row tiles of a power-of-two width >= 8, got "
                         f"[{block_m}, {half_dim}]")
    registers = [[0, 1], [8, 0]]
    lanes = [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]]
    warps = [[16, 0], [32, 0]]
    column_groups = [[0, 8 << i] for i in range((half_dim // 8).bit_length() - 1)]
    return registers + lanes + warps + column_groups


@gluon_jit
def input_descriptors(Q, K, V, DOut, Lse2, Delta, stride_qb, stride_qs, stride_kb, stride_ks, stride_kh,
                      stride_vb, stride_vs, stride_vh, stride_dob, stride_dos, batch, kv_head, n_heads, seq_q, seq_k,
                      seq_pad, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      Q_LAYOUT: gl.constexpr, KV_LAYOUT: gl.constexpr, STATS_LAYOUT: gl.constexpr):
    """TMA descriptors (k, v, q, dout, lse, delta) of one program's inputs: its KV head's [Sk, D] K and V rows; Q
    and dO as [Sq, H * D] row-major per batch (one descriptor each serves every head of the group); lse (log2
    units) and delta as [H * seq_pad] per batch (padded with lse +inf, P = 0, and delta 0)."""
    k_desc = tma.make_tensor_descriptor(K + batch.to(gl.int64) * stride_kb + kv_head.to(gl.int64) * stride_kh,
                                        [seq_k, HEAD_DIM], [stride_ks, 1], [BLOCK_N, HEAD_DIM], KV_LAYOUT)
    v_desc = tma.make_tensor_descriptor(V + batch.to(gl.int64) * stride_vb + kv_head.to(gl.int64) * stride_vh,
                                        [seq_k, HEAD_DIM], [stride_vs, 1], [BLOCK_N, HEAD_DIM], KV_LAYOUT)
    q_desc = tma.make_tensor_descriptor(Q + batch.to(gl.int64) * stride_qb, [seq_q, n_heads * HEAD_DIM],
                                        [stride_qs, 1], [BLOCK_M, HEAD_DIM], Q_LAYOUT)
    do_desc = tma.make_tensor_descriptor(DOut + batch.to(gl.int64) * stride_dob, [seq_q, n_heads * HEAD_DIM],
                                         [stride_dos, 1], [BLOCK_M, HEAD_DIM], Q_LAYOUT)
    stats = (batch * n_heads).to(gl.int64) * seq_pad
    lse_desc = tma.make_tensor_descriptor(Lse2 + stats, [n_heads * seq_pad], [1], [BLOCK_M], STATS_LAYOUT)
    delta_desc = tma.make_tensor_descriptor(Delta + stats, [n_heads * seq_pad], [1], [BLOCK_M], STATS_LAYOUT)
    return k_desc, v_desc, q_desc, do_desc, lse_desc, delta_desc


@gluon_jit
def program_heads(pid, n_kv_heads, group, HEAD_SPLITS: gl.constexpr):
    """(batch, kv_head, out_row, first_head, heads) of grid row `pid` (batch, KV head, split; the split fastest):
    the program walks `heads` = group // HEAD_SPLITS of its GQA group's query heads from `first_head`
    (`HopperBackwardConfig.head_splits`) and writes its dK/dV at row `out_row` = batch * HEAD_SPLITS + split of
    DK / DV ([B * HEAD_SPLITS, Sk, Hkv, D]: with HEAD_SPLITS > 1, float32 partials that the wrapper sums). A
    compile-time count, so that at 1 the kernel is the one without splits."""
    split = pid % HEAD_SPLITS
    batch = pid // HEAD_SPLITS // n_kv_heads
    kv_head = pid // HEAD_SPLITS % n_kv_heads
    heads = group // HEAD_SPLITS
    return batch, kv_head, batch * HEAD_SPLITS + split, kv_head * group + split * heads, heads


@gluon_jit
def key_block_walk(col0, seq_q, seq_k, heads, first_head, query_start, query_end, CAUSAL: gl.constexpr,
                   SPANS: gl.constexpr, STAGGER: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """(walk, n_steps, full) of the key block at `col0`: the query blocks it meets of each of the `heads` query heads
    from `first_head` (`program_heads`), and which of them need no mask (`masked_block`). Without documents: blocks
    [first_block, n_blocks), masked before full = full_block (query i sees key j iff j <= i + diagonal, and everywhere
    in the key block that runs past the end). With documents (SPANS: the batch row's query spans at query_start /
    query_end, [Sk]): blocks [first, end) between the keys' lowest query_start and highest query_end (none when no row
    sees a key of the block), unmasked in full = (full_first, full_end), the blocks whose rows all see every key of the
    block (`tiles.span_block_range`, the portable dK/dV kernel's walk; a tl helper that compiles in Gluon too). walk =
    (first_block, blocks_per_head, first_head, rotation) for `step_tile`."""
    if SPANS:
        cols = col0 + gl.arange(0, BLOCK_N, layout=gl.BlockedLayout([1], [32], [gl.num_warps()], [0]))
        _, _, first, full_first, full_end, end = span_block_range(query_start, query_end, cols, seq_k, seq_q,
                                                                  BLOCK_M)
        # The last key block's keys past the end read as zero: masked at every step, as without documents.
        full_end = gl.where(col0 + BLOCK_N > seq_k, full_first, full_end)
        first_block = first // BLOCK_M
        n_walk = (end - first) // BLOCK_M
        full = (full_first // BLOCK_M, full_end // BLOCK_M)
    else:
        diagonal = seq_k - seq_q
        n_blocks = gl.cdiv(seq_q, BLOCK_M)
        if CAUSAL:
            first_block = gl.minimum(gl.maximum(col0 - diagonal, 0) // BLOCK_M, n_blocks)
            full_block = gl.minimum(gl.maximum(gl.cdiv(gl.maximum(col0 + BLOCK_N - 1 - diagonal, 0), BLOCK_M),
                                               first_block), n_blocks)
        else:
            first_block = 0
            full_block = 0
        full = gl.where(col0 + BLOCK_N > seq_k, n_blocks, full_block)
        n_walk = n_blocks - first_block
    blocks_per_head = gl.maximum(n_walk, 1)
    n_steps = heads * n_walk
    # Without a causal mask the programs running at once walk the same query blocks in step (their Q/dO tiles and dQ
    # rows shared in L2); STAGGER starts key block j's walk 2j blocks in, as the causal walks start (measured slower).
    rotation = (col0 // BLOCK_M) % blocks_per_head if STAGGER and not CAUSAL else 0
    return (first_block, blocks_per_head, first_head, rotation), n_steps, full


@gluon_jit
def masked_block(block, full, SPANS: gl.constexpr):
    """Whether query block `block` of a key block's walk needs the mask: before the run of blocks every row of which
    sees every key (`key_block_walk`'s `full`), and with documents after it too."""
    if SPANS:
        masked = (block < full[0]) | (block >= full[1])
    else:
        masked = block < full
    return masked


@gluon_jit
def key_query_spans(query_start, query_end, cols, seq_k, SPANS: gl.constexpr):
    """With documents, (first row, rows) of the query span of each key `cols` (keys past seq_k: none, as their K and
    V read as zero), read once per key block for `visible_pairs`; else unused zeros."""
    if SPANS:
        first_row = gl.load(query_start + cols, mask=cols < seq_k, other=0)
        n_rows = gl.maximum(gl.load(query_end + cols, mask=cols < seq_k, other=0) - first_row, 0)
    else:
        first_row = 0
        n_rows = 0
    return first_row, n_rows


@gluon_jit
def visible_pairs(cols, rows, seq_k, diagonal, query_spans, CAUSAL: gl.constexpr, SPANS: gl.constexpr):
    """[keys, queries] mask of a masked step (keys `cols` on the rows, query `rows` on the columns). With documents
    the rows in each key's query span (`key_query_spans`): for monotone key spans the pairs of the key spans'
    `tiles.visible_keys` (the rows that see key j are a run, `weights.documents.query_spans`), at two values a
    thread per key block where the key spans would take two per query column and step; one unsigned compare (a row
    before the span wraps around past any count). Without documents: keys before seq_k and, if CAUSAL, at most
    `diagonal` past the row."""
    if SPANS:
        first_row, n_rows = query_spans
        offset = gl.expand_dims(rows, 0) - gl.expand_dims(first_row, 1)
        visible = offset.to(gl.uint32, bitcast=True) < gl.expand_dims(n_rows, 1).to(gl.uint32, bitcast=True)
    else:
        visible = gl.expand_dims(cols, 1) < seq_k
        if CAUSAL:
            visible = visible & (gl.expand_dims(cols, 1) <= gl.expand_dims(rows, 0) + diagonal)
    return visible


@gluon_jit
def step_tile(step, walk):
    """(query head, query block) of step `step` of a program's walk (first_block, blocks_per_head, first_head,
    rotation): the walked heads one after the other, each one's blocks [first_block, first_block +
    blocks_per_head) from `rotation` blocks in, wrapping around."""
    first_block, blocks_per_head, first_head, rotation = walk
    return first_head + step // blocks_per_head, first_block + (step % blocks_per_head + rotation) % blocks_per_head


@gluon_jit
def issue_tile_loads(descs, bufs, ready, step, n_steps, walk, seq_pad):
    """Start the TMA loads of step `step`'s tiles (Q, dO: [block_m, D]; lse2, delta: [block_m]) into their ring
    slot (nothing past the last step)."""
    q_desc, do_desc, lse_desc, delta_desc = descs
    q_bufs, do_bufs, lse_bufs, delta_bufs = bufs
    num_stages: gl.constexpr = q_bufs.type.shape[0]
    block_m: gl.constexpr = q_bufs.type.shape[1]
    head_dim: gl.constexpr = q_bufs.type.shape[2]
    slot = step % num_stages
    bar = ready.index(slot)
    in_range = step < n_steps
    head, block = step_tile(step, walk)
    row0 = block * block_m
    mbarrier.expect(bar, 2 * q_desc.block_type.nbytes + 2 * lse_desc.block_type.nbytes, pred=in_range)
    tma.async_copy_global_to_shared(q_desc, [row0, head * head_dim], bar, q_bufs.index(slot), pred=in_range)
    tma.async_copy_global_to_shared(do_desc, [row0, head * head_dim], bar, do_bufs.index(slot), pred=in_range)
    tma.async_copy_global_to_shared(lse_desc, [head * seq_pad + row0], bar, lse_bufs.index(slot), pred=in_range)
    tma.async_copy_global_to_shared(delta_desc, [head * seq_pad + row0], bar, delta_bufs.index(slot), pred=in_range)


@builtin
def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """Add the shared-memory tile `src` into the global block of `tensor_desc` at `coord` by one asynchronous TMA
    reduce-add (`cp.reduce.async.bulk.tensor`): the op Triton 3.6 lowers for sm_90 but its Gluon does not name;
    `tma.store_wait` waits for its read of `src` like a TMA store's."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(triton_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                              src.handle)


@gluon_jit
def _loader(args):
    (descs, bufs, k_desc, v_desc, k_buf, v_buf, kv_ready, ready, empty, ds_bufs, ds_ready, dq_desc, dq_bufs,
     dq_full, dq_empty, walk, n_steps, full, col0, seq_q, seq_k, seq_pad, softmax_scale, dk_base, dv_base,
     stride_dks, stride_dvs, query_start, query_end) = args
    num_stages: gl.constexpr = bufs[0].type.shape[0]
    mbarrier.expect(kv_ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [col0, 0], kv_ready, k_buf)
    tma.async_copy_global_to_shared(v_desc, [col0, 0], kv_ready, v_buf)
    for step in range(n_steps):
        mbarrier.wait(empty.index(step % num_stages), ((step // num_stages) & 1) ^ 1)
        issue_tile_loads(descs, bufs, ready, step, n_steps, walk, seq_pad)


@gluon_jit
def _dq_writer(args, DQ_REGISTER_ORDER: gl.constexpr):
    (descs, bufs, k_desc, v_desc, k_buf, v_buf, kv_ready, ready, empty, ds_bufs, ds_ready, dq_desc, dq_bufs,
     dq_full, dq_empty, walk, n_steps, full, col0, seq_q, seq_k, seq_pad, softmax_scale, dk_base, dv_base,
     stride_dks, stride_dvs, query_start, query_end) = args
    n_buffers: gl.constexpr = dq_bufs.type.shape[0] // 2
    block_m: gl.constexpr = bufs[0].type.shape[1]
    half_dim: gl.constexpr = bufs[0].type.shape[2] // 2
    box_rows: gl.constexpr = dq_bufs.type.shape[1]
    for step in range(n_steps):
        head, block = step_tile(step, walk)
        buffer = step % n_buffers
        for c in gl.static_range(2):
            mbarrier.wait(dq_full.index(2 * buffer + c), (step // n_buffers) & 1)
            if DQ_REGISTER_ORDER:  # the tile's chunk: [H, seq_pad / block_m, 2 halves] chunks per batch
                coord = [((head * (seq_pad // block_m) + block) * 2 + c) * box_rows, 0]
            else:
                coord = [block * block_m, (2 * head + c) * half_dim]
            tma_reduce_add(dq_desc, coord, dq_bufs.index(2 * buffer + c))
        tma.store_wait(0)  # the TMA unit has read both halves: the consumers may refill them
        for c in gl.static_range(2):
            mbarrier.arrive(dq_empty.index(2 * buffer + c), count=1)


@gluon_jit
def _consume(args, consumer: gl.constexpr, CAUSAL: gl.constexpr, SPANS: gl.constexpr, KV_IN_REGS: gl.constexpr,
             LSE_FIRST: gl.constexpr, DQ_REGISTER_ORDER: gl.constexpr, DQ_STORE_LAYOUT: gl.constexpr):
    (descs, bufs, k_desc, v_desc, k_buf, v_buf, kv_ready, ready, empty, ds_bufs, ds_ready, dq_desc, dq_bufs,
     dq_full, dq_empty, walk, n_steps, full, col0, seq_q, seq_k, seq_pad, softmax_scale, dk_base, dv_base,
     stride_dks, stride_dvs, query_start, query_end) = args
    q_bufs, do_bufs, lse_bufs, delta_bufs = bufs
    num_stages: gl.constexpr = q_bufs.type.shape[0]
    block_m: gl.constexpr = q_bufs.type.shape[1]
    head_dim: gl.constexpr = q_bufs.type.shape[2]
    n_buffers: gl.constexpr = dq_bufs.type.shape[0] // 2
    half_dim: gl.constexpr = head_dim // 2
    dtype: gl.constexpr = q_bufs.dtype
    k_step: gl.constexpr = 256 // dtype.primitive_bitwidth
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, block_m, k_step])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, head_dim, k_step])
    kv_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout,
                                                   k_width=32 // dtype.primitive_bitwidth)
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, half_dim, k_step])
    my_col0 = col0 + consumer * KEYS_PER_CONSUMER
    k_mine = k_buf.slice(consumer * KEYS_PER_CONSUMER, KEYS_PER_CONSUMER)
    v_mine = v_buf.slice(consumer * KEYS_PER_CONSUMER, KEYS_PER_CONSUMER)
    k_dq = k_buf.slice(consumer * half_dim, half_dim, dim=1)  # dQ's columns of this consumer
    cols = my_col0 + gl.arange(0, KEYS_PER_CONSUMER, layout=gl.SliceLayout(1, st_layout))
    cols_spans = key_query_spans(query_start, query_end, cols, seq_k, SPANS)
    diagonal = seq_k - seq_q
    qk_scale = softmax_scale * LOG2E
    zeros_t = gl.zeros([KEYS_PER_CONSUMER, block_m], gl.float32, st_layout)
    zeros_q = gl.zeros([block_m, half_dim], gl.float32, dq_layout)
    dk = gl.zeros([KEYS_PER_CONSUMER, head_dim], gl.float32, kv_layout)
    dv = gl.zeros([KEYS_PER_CONSUMER, head_dim], gl.float32, kv_layout)
    mbarrier.wait(kv_ready, 0)
    if KV_IN_REGS:  # S^T's and dP^T's A operands from registers: half their shared-memory reads
        st_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=st_layout,
                                                       k_width=32 // dtype.primitive_bitwidth)
        k_mine = k_mine.load(st_operand)
        v_mine = v_mine.load(st_operand)
    for step in range(n_steps):
        slot = step % num_stages
        block = step_tile(step, walk)[1]
        rows = block * block_m + gl.arange(0, block_m, layout=gl.SliceLayout(0, st_layout))
        q_buf = q_bufs.index(slot)
        do_buf = do_bufs.index(slot)
        mbarrier.wait(ready.index(slot), (step // num_stages) & 1)
        if LSE_FIRST:  # read before the matmuls, whose operand reads would queue ahead of it in shared memory
            lse2 = lse_bufs.index(slot).load(gl.SliceLayout(0, st_layout))
        s_t = warpgroup_mma(k_mine, q_buf.permute((1, 0)), zeros_t, use_acc=False, is_async=True)
        dp_t = warpgroup_mma(v_mine, do_buf.permute((1, 0)), zeros_t, use_acc=False, is_async=True)
        if not LSE_FIRST:
            lse2 = lse_bufs.index(slot).load(gl.SliceLayout(0, st_layout))
        s_t = warpgroup_mma_wait(num_outstanding=1, deps=(s_t, ))
        p_t = gl.exp2(s_t * qk_scale - gl.expand_dims(lse2, 0))
        if masked_block(block, full, SPANS):
            p_t = gl.where(visible_pairs(cols, rows, seq_k, diagonal, cols_spans, CAUSAL, SPANS), p_t, 0.0)
        delta = delta_bufs.index(slot).load(gl.SliceLayout(0, st_layout))
        dp_t = warpgroup_mma_wait(num_outstanding=0, deps=(dp_t, ))
        ds_t = (p_t * (dp_t - gl.expand_dims(delta, 0))).to(dtype)
        # This consumer's dS^T rows for both consumers' dQ matmuls. Its buffer was last read by the dQ matmuls
        # two steps ago, which both consumers waited for before storing the dS of the step in between.
        ds_buf = ds_bufs.index(step % 2)
        ds_buf.slice(consumer * KEYS_PER_CONSUMER, KEYS_PER_CONSUMER).store(ds_t)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(ds_ready.index(step % 2), count=1)
        dv = warpgroup_mma(gl.convert_layout(p_t.to(dtype), kv_operand), do_buf, dv, is_async=True)
        mbarrier.wait(ds_ready.index(step % 2), (step // 2) & 1)
        dq = warpgroup_mma(ds_buf.permute((1, 0)), k_dq, zeros_q, use_acc=False, is_async=True)
        dk = warpgroup_mma(gl.convert_layout(ds_t, kv_operand), q_buf, dk, is_async=True)
        dq = warpgroup_mma_wait(num_outstanding=1, deps=(dq, ))
        dq_slot = 2 * (step % n_buffers) + consumer
        mbarrier.wait(dq_empty.index(dq_slot), ((step // n_buffers) & 1) ^ 1)
        dq_tile = dq_bufs.index(dq_slot)
        if DQ_REGISTER_ORDER:  # the TMA box's rows seen as the [block_m, D/2] tile in register order
            dq_tile = dq_tile._reinterpret(gl.float32, [block_m, half_dim], DQ_STORE_LAYOUT)
        dq_tile.store(dq)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(dq_full.index(dq_slot), count=1)
        dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
        mbarrier.arrive(empty.index(slot), count=1)  # this consumer is done with the step's Q/dO slot

    out_rows = my_col0 + gl.arange(0, KEYS_PER_CONSUMER, layout=gl.SliceLayout(1, kv_layout))
    out_cols = gl.arange(0, head_dim, layout=gl.SliceLayout(0, kv_layout))
    in_bounds = gl.expand_dims(out_rows < seq_k, 1)
    dk_ptrs = dk_base + gl.expand_dims(out_rows.to(gl.int64) * stride_dks, 1) + gl.expand_dims(out_cols, 0)
    dv_ptrs = dv_base + gl.expand_dims(out_rows.to(gl.int64) * stride_dvs, 1) + gl.expand_dims(out_cols, 0)
    gl.store(dk_ptrs, (dk * softmax_scale).to(dk_base.dtype.element_ty), mask=in_bounds)
    gl.store(dv_ptrs, dv.to(dv_base.dtype.element_ty), mask=in_bounds)


@gluon_jit
def _consumer0(args, CAUSAL: gl.constexpr, SPANS: gl.constexpr, KV_IN_REGS: gl.constexpr, LSE_FIRST: gl.constexpr,
               DQ_REGISTER_ORDER: gl.constexpr, DQ_STORE_LAYOUT: gl.constexpr):
    _consume(args, 0, CAUSAL, SPANS, KV_IN_REGS, LSE_FIRST, DQ_REGISTER_ORDER, DQ_STORE_LAYOUT)


@gluon_jit
def _consumer1(args, CAUSAL: gl.constexpr, SPANS: gl.constexpr, KV_IN_REGS: gl.constexpr, LSE_FIRST: gl.constexpr,
               DQ_REGISTER_ORDER: gl.constexpr, DQ_STORE_LAYOUT: gl.constexpr):
    _consume(args, 1, CAUSAL, SPANS, KV_IN_REGS, LSE_FIRST, DQ_REGISTER_ORDER, DQ_STORE_LAYOUT)


def _kernel_decorator():
    if not GLUON_AVAILABLE:
        return gluon_jit
    from triton.experimental import gluon
    return gluon.jit(do_not_specialize=("n_kv_heads", "group", "seq_q", "seq_k"))


# Lengths and head counts are not specialized on, as in the lockstep form.
@_kernel_decorator()
def gluon_backward_ws_kernel(Q, K, V, DOut, Lse2, Delta, DQ, DK, DV, QueryStart, QueryEnd,
                             stride_qb, stride_qs, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                             stride_dob, stride_dos, stride_dqb, stride_dqs,
                             stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
                             n_kv_heads, group, seq_q, seq_k, seq_pad, softmax_scale,
                             HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, SPANS: gl.constexpr, BLOCK_M: gl.constexpr,
                             NUM_STAGES: gl.constexpr, DQ_BUFFERS: gl.constexpr, STAGGER: gl.constexpr,
                             HEAD_SPLITS: gl.constexpr,
                             KV_IN_REGS: gl.constexpr, LSE_FIRST: gl.constexpr, DQ_REGISTER_ORDER: gl.constexpr,
                             Q_LAYOUT: gl.constexpr, KV_LAYOUT: gl.constexpr, DS_LAYOUT: gl.constexpr,
                             STATS_LAYOUT: gl.constexpr, DQ_LAYOUT: gl.constexpr, DQ_STORE_LAYOUT: gl.constexpr,
                             CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    BLOCK_N: gl.constexpr = 2 * KEYS_PER_CONSUMER
    HALF_DIM: gl.constexpr = HEAD_DIM // 2
    batch, kv_head, out_row, first_head, heads = program_heads(gl.program_id(1), n_kv_heads, group, HEAD_SPLITS)
    col0 = gl.program_id(0) * BLOCK_N
    n_heads = n_kv_heads * group
    query_start, query_end = QueryStart, QueryEnd
    if SPANS:  # this batch row's query spans [Sk]
        query_start, query_end = QueryStart + batch.to(gl.int64) * seq_k, QueryEnd + batch.to(gl.int64) * seq_k
    walk, n_steps, full = key_block_walk(col0, seq_q, seq_k, heads, first_head, query_start, query_end, CAUSAL,
                                         SPANS, STAGGER, BLOCK_M, BLOCK_N)

    k_desc, v_desc, q_desc, do_desc, lse_desc, delta_desc = input_descriptors(
        Q, K, V, DOut, Lse2, Delta, stride_qb, stride_qs, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
        stride_vh, stride_dob, stride_dos, batch, kv_head, n_heads, seq_q, seq_k, seq_pad, HEAD_DIM, BLOCK_M,
        BLOCK_N, Q_LAYOUT, KV_LAYOUT, STATS_LAYOUT)
    # dQ halves ([block_m, D/2] per consumer) go to the float32 accumulator: [Sq, H * D] per batch like Q, or in
    # register order [H, seq_pad / BLOCK_M, 2, BLOCK_M * D/2] per batch, seen as DQ_TMA_ROW-float rows.
    if DQ_REGISTER_ORDER:
        dq_box: gl.constexpr = [BLOCK_M * HALF_DIM // DQ_TMA_ROW, DQ_TMA_ROW]
        dq_desc = tma.make_tensor_descriptor(DQ + batch.to(gl.int64) * stride_dqb,
                                             [n_heads * (seq_pad // (DQ_TMA_ROW // HEAD_DIM)), DQ_TMA_ROW],
                                             [DQ_TMA_ROW, 1], dq_box, DQ_LAYOUT)
    else:
        dq_box: gl.constexpr = [BLOCK_M, HALF_DIM]
        dq_desc = tma.make_tensor_descriptor(DQ + batch.to(gl.int64) * stride_dqb, [seq_q, n_heads * HEAD_DIM],
                                             [stride_dqs, 1], dq_box, DQ_LAYOUT)
    k_buf = gl.allocate_shared_memory(K.dtype.element_ty, [BLOCK_N, HEAD_DIM], KV_LAYOUT)
    v_buf = gl.allocate_shared_memory(V.dtype.element_ty, [BLOCK_N, HEAD_DIM], KV_LAYOUT)
    q_bufs = gl.allocate_shared_memory(Q.dtype.element_ty, [NUM_STAGES, BLOCK_M, HEAD_DIM], Q_LAYOUT)
    do_bufs = gl.allocate_shared_memory(Q.dtype.element_ty, [NUM_STAGES, BLOCK_M, HEAD_DIM], Q_LAYOUT)
    lse_bufs = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_M], STATS_LAYOUT)
    delta_bufs = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_M], STATS_LAYOUT)
    ds_bufs = gl.allocate_shared_memory(Q.dtype.element_ty, [2, BLOCK_N, BLOCK_M], DS_LAYOUT)
    dq_bufs = gl.allocate_shared_memory(gl.float32, [2 * DQ_BUFFERS, dq_box[0], dq_box[1]], DQ_LAYOUT)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_full = gl.allocate_shared_memory(gl.int64, [2 * DQ_BUFFERS, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [2 * DQ_BUFFERS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # released by both consumers
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=2)  # both halves of dS stored
    for i in gl.static_range(2 * DQ_BUFFERS):
        mbarrier.init(dq_full.index(i), count=1)
        mbarrier.init(dq_empty.index(i), count=1)

    dk_base = DK + out_row.to(gl.int64) * stride_dkb + kv_head.to(gl.int64) * stride_dkh
    dv_base = DV + out_row.to(gl.int64) * stride_dvb + kv_head.to(gl.int64) * stride_dvh
    args = ((q_desc, do_desc, lse_desc, delta_desc), (q_bufs, do_bufs, lse_bufs, delta_bufs), k_desc, v_desc,
            k_buf, v_buf, kv_ready, ready, empty, ds_bufs, ds_ready, dq_desc, dq_bufs, dq_full, dq_empty, walk,
            n_steps, full, col0, seq_q, seq_k, seq_pad, softmax_scale, dk_base, dv_base,
            stride_dks, stride_dvs, query_start, query_end)
    gl.warp_specialize([
        (_consumer0, (args, CAUSAL, SPANS, KV_IN_REGS, LSE_FIRST, DQ_REGISTER_ORDER, DQ_STORE_LAYOUT)),
        (_consumer1, (args, CAUSAL, SPANS, KV_IN_REGS, LSE_FIRST, DQ_REGISTER_ORDER, DQ_STORE_LAYOUT)),
        (_loader, (args, )),
        (_dq_writer, (args, DQ_REGISTER_ORDER)),
    ], [4, 1, 1], [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS])
