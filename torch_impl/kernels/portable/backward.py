"""The portable family's backward: Triton (`tl`) FlashAttention backward kernels (FA2 algorithm, no atomics).
Twin of `jax_impl/kernels/portable/backward.py`. The public API is `torch_impl.kernels.flash_attention`; the tile
helpers and the delta kernel are in `kernels/tiles.py`, the launch configs and autotune spaces in `config.py`.

Three launches, all of them deterministic:
  delta:  delta = rowsum(dout * out) per query row, float32 [B, H, Sq], from the `out` it is given, so a ring
          step passing the globally merged out/lse gets its exact share of the global gradient;
  dK/dV:  one program per block of BLOCK_N keys of one (batch, KV head); K/V stay on chip while it walks the
          query blocks of every query head of the group, so a KV head's dk/dv is the sum over its query heads
          without materialising per-query-head gradients;
  dQ:     one program per block of BLOCK_M query rows of one (batch, query head), walking the key blocks.
Both main kernels split their loop like the forward: blocks fully visible and in bounds run without masks,
the causal diagonal and the sequence tails run masked. P = exp2(S * scale * log2(e) - lse * log2(e)) is
recomputed from the saved lse; rows that see no key (lse = -inf) and padding rows use lse = +inf, so their P
is exactly 0. Gradients accumulate in float32 and are written in the requested dtype. With documents (SPANS) the
dQ kernel walks key blocks as the forward does, and the dK/dV kernel the query blocks between its keys' query
spans (`weights/documents.py`), those that see all of its keys unmasked; blocks without a pair are never loaded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torch_impl.kernels.portable.config import (DKDV_SHAPES, DQ_SHAPES, PortableConfig, autotuned,
                                                dkdv_shared_bytes, dq_shared_bytes, launch)
from torch_impl.documents import Spans, query_spans
from torch_impl.kernels.tiles import (INTERPRETED, LOG2E, dot_precision, key_block_runs, key_scores,
                                      key_tile_pointers, load_tile, query_block_program, round_to, row_delta,
                                      seq_bucket, span_block_range, spans_or_none, store_tile, visible_keys)


@triton.jit
def load_row_stats(lse_ptrs, delta_ptrs, rows, n_rows, CHECK_ROWS: tl.constexpr):
    """(lse in log2 units with -inf and padding rows mapped to +inf, delta) for a block of query rows."""
    if CHECK_ROWS:
        lse = tl.load(lse_ptrs, mask=rows < n_rows, other=float("inf"))
        delta = tl.load(delta_ptrs, mask=rows < n_rows, other=0.0)
    else:
        lse = tl.load(lse_ptrs)
        delta = tl.load(delta_ptrs)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    return lse2, delta


@triton.jit
def key_block_program(n_kv_heads, BLOCK_N: tl.constexpr):
    """(batch, kv head, first key) of a program of the grid (key blocks, batch * kv heads). Causal key blocks near
    the start are seen by the most queries: the natural order launches them first."""
    pid_bh = tl.program_id(1)
    return pid_bh // n_kv_heads, pid_bh % n_kv_heads, tl.program_id(0) * BLOCK_N


@triton.jit
def _dkdv_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_qh, stride_dos, stride_doh,
                key_start_base, key_end_base, cols, offs_m, offs_d, start, end, seq_q, diagonal, qk_scale,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr, SPANS: tl.constexpr, GROUP: tl.constexpr,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, EMULATE: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    """Accumulate dk (unscaled) and dv of one key block over the query blocks in [start, end) (multiples of
    BLOCK_M) of every query head of the group, transposed (keys on the rows) so K and V are the resident
    operands. One flat loop over (query block, head in group): a nested head loop costs registers."""
    for step in range(start // BLOCK_M * GROUP, end // BLOCK_M * GROUP):
        head_in_group = step % GROUP
        rows = (step // GROUP) * BLOCK_M + offs_m
        q_ptrs = q_base + head_in_group * stride_qh + rows.to(tl.int64)[:, None] * stride_qs + offs_d[None, :]
        do_ptrs = do_base + head_in_group * stride_doh + rows.to(tl.int64)[:, None] * stride_dos + offs_d[None, :]
        q = load_tile(q_ptrs, rows, seq_q, offs_d, HEAD_DIM, BLOCK_D, MASKED, EMULATE)
        lse2, delta = load_row_stats(lse_base + head_in_group * seq_q + rows,
                                      delta_base + head_in_group * seq_q + rows, rows, seq_q, MASKED)
        p_t = tl.math.exp2(tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale - lse2[None, :])
        if MASKED and SPANS:  # rows past seq_q read as empty spans
            span_start = tl.load(key_start_base + rows, mask=rows < seq_q, other=0)
            span_end = tl.load(key_end_base + rows, mask=rows < seq_q, other=0)
            p_t = tl.where((cols[:, None] >= span_start[None, :]) & (cols[:, None] < span_end[None, :]), p_t, 0.0)
        elif MASKED and CAUSAL:
            p_t = tl.where(cols[:, None] <= rows[None, :] + diagonal, p_t, 0.0)
        do = load_tile(do_ptrs, rows, seq_q, offs_d, HEAD_DIM, BLOCK_D, MASKED, EMULATE)
        dv = tl.dot(round_to(p_t, do_base.dtype.element_ty, EMULATE), do, dv, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(round_to(ds_t, q_base.dtype.element_ty, EMULATE), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@autotuned(DKDV_SHAPES, (32, 64), dkdv_shared_bytes)
@triton.jit
def _dkdv_kernel(Q, K, V, DOut, Lse, Delta, DK, DV, KeyStart, KeyEnd, QueryStart, QueryEnd,
                 stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                 stride_vb, stride_vs, stride_vh, stride_dob, stride_dos, stride_doh,
                 stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
                 n_kv_heads, seq_q, seq_k, softmax_scale, SEQ_BUCKET,
                 GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
                 SPANS: tl.constexpr, EMULATE: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    batch, kv_head, col0 = key_block_program(n_kv_heads, BLOCK_N)
    cols = col0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    k_ptrs, v_ptrs = key_tile_pointers(K + batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh,
                                       V + batch.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh,
                                       stride_ks, stride_vs, cols, offs_d)
    k = load_tile(k_ptrs, cols, seq_k, offs_d, HEAD_DIM, BLOCK_D, True, EMULATE)
    v = load_tile(v_ptrs, cols, seq_k, offs_d, HEAD_DIM, BLOCK_D, True, EMULATE)

    diagonal = seq_k - seq_q
    if CAUSAL:
        # Query i sees key j iff i >= j - diagonal. Rows before `first` see none of this block; rows from
        # `full_start` on see all of it (both rounded to query blocks).
        first = tl.maximum(col0 - diagonal, 0) // BLOCK_M * BLOCK_M
        full_start = tl.maximum(first, (col0 + BLOCK_N - 1 - diagonal + BLOCK_M - 1) // BLOCK_M * BLOCK_M)
    else:
        first = 0
        full_start = 0
    in_bounds_end = seq_q // BLOCK_M * BLOCK_M
    padded_end = (seq_q + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    qk_scale = softmax_scale * LOG2E

    first_head = kv_head * GROUP
    q_base = Q + batch.to(tl.int64) * stride_qb + first_head.to(tl.int64) * stride_qh
    do_base = DOut + batch.to(tl.int64) * stride_dob + first_head.to(tl.int64) * stride_doh
    lse_base = Lse + (batch * n_kv_heads * GROUP + first_head).to(tl.int64) * seq_q
    delta_base = Delta + (batch * n_kv_heads * GROUP + first_head).to(tl.int64) * seq_q
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    key_start_base = KeyStart + batch.to(tl.int64) * seq_q
    key_end_base = KeyEnd + batch.to(tl.int64) * seq_q
    if SPANS:  # documents: the query blocks that see none of these keys are skipped, those that see all unmasked
        spans_col0 = batch.to(tl.int64) * seq_k
        _, _, first, full_start, full_end, end = span_block_range(QueryStart + spans_col0, QueryEnd + spans_col0, cols,
                                                                  seq_k, seq_q, BLOCK_M)
    else:  # the query tail past seq_q is masked too
        full_start = tl.minimum(full_start, padded_end)
        full_end = tl.maximum(full_start, in_bounds_end)
        end = padded_end
    dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_qh, stride_dos,
                         stride_doh, key_start_base, key_end_base, cols, offs_m, offs_d, first, full_start, seq_q,
                         diagonal, qk_scale, True, CAUSAL, SPANS, GROUP, HEAD_DIM, BLOCK_D, BLOCK_M, EMULATE,
                         DOT_PRECISION)
    dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_qh, stride_dos,
                         stride_doh, key_start_base, key_end_base, cols, offs_m, offs_d, full_start, full_end, seq_q,
                         diagonal, qk_scale, False, CAUSAL, SPANS, GROUP, HEAD_DIM, BLOCK_D, BLOCK_M, EMULATE,
                         DOT_PRECISION)
    dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_qh, stride_dos,
                         stride_doh, key_start_base, key_end_base, cols, offs_m, offs_d, full_end, end, seq_q,
                         diagonal, qk_scale, True, CAUSAL, SPANS, GROUP, HEAD_DIM, BLOCK_D, BLOCK_M, EMULATE,
                         DOT_PRECISION)

    dk_ptrs = (DK + batch.to(tl.int64) * stride_dkb + kv_head.to(tl.int64) * stride_dkh
               + cols.to(tl.int64)[:, None] * stride_dks + offs_d[None, :])
    dv_ptrs = (DV + batch.to(tl.int64) * stride_dvb + kv_head.to(tl.int64) * stride_dvh
               + cols.to(tl.int64)[:, None] * stride_dvs + offs_d[None, :])
    store_tile(dk_ptrs, dk * softmax_scale, cols, seq_k, offs_d, HEAD_DIM, BLOCK_D, EMULATE)
    store_tile(dv_ptrs, dv, cols, seq_k, offs_d, HEAD_DIM, BLOCK_D, EMULATE)


@triton.jit
def _dq_tiles(dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_vs, offs_m, offs_n, offs_d,
              start, end, seq_k, diagonal, span_start, span_end, qk_scale,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr, SPANS: tl.constexpr, HEAD_DIM: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, EMULATE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Accumulate dq (unscaled) of one query block over key blocks [start, end). P is recomputed from the saved
    row statistics (lse2 in log2 units), so masked keys are zeroed after the exp2 rather than set to -inf before."""
    k_ptrs, v_ptrs = key_tile_pointers(k_base, v_base, stride_ks, stride_vs, start + offs_n, offs_d)
    for start_n in range(start, end, BLOCK_N):
        cols, k, qk = key_scores(q, k_ptrs, start_n, offs_n, seq_k, offs_d, HEAD_DIM, BLOCK_D, MASKED, EMULATE,
                                 DOT_PRECISION)
        p = tl.math.exp2(qk * qk_scale - lse2[:, None])
        if MASKED:
            p = tl.where(visible_keys(cols, offs_m, seq_k, diagonal, span_start, span_end, CAUSAL, SPANS), p, 0.0)
        v = load_tile(v_ptrs, cols, seq_k, offs_d, HEAD_DIM, BLOCK_D, MASKED, EMULATE)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(round_to(ds, k_base.dtype.element_ty, EMULATE), k, dq, input_precision=DOT_PRECISION)
        k_ptrs += BLOCK_N * stride_ks
        v_ptrs += BLOCK_N * stride_vs
    return dq


@autotuned(DQ_SHAPES, (64, 32), dq_shared_bytes)
@triton.jit
def _dq_kernel(Q, K, V, DOut, Lse, Delta, DQ, KeyStart, KeyEnd,
               stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
               stride_vb, stride_vs, stride_vh, stride_dob, stride_dos, stride_doh,
               stride_dqb, stride_dqs, stride_dqh,
               n_heads, seq_q, seq_k, softmax_scale, SEQ_BUCKET,
               GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
               SPANS: tl.constexpr, EMULATE: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):
    batch, head, kv_head, row0 = query_block_program(n_heads, GROUP, BLOCK_M, CAUSAL)
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = load_tile(Q + batch.to(tl.int64) * stride_qb + head.to(tl.int64) * stride_qh
                  + offs_m.to(tl.int64)[:, None] * stride_qs + offs_d[None, :],
                  offs_m, seq_q, offs_d, HEAD_DIM, BLOCK_D, True, EMULATE)
    do = load_tile(DOut + batch.to(tl.int64) * stride_dob + head.to(tl.int64) * stride_doh
                   + offs_m.to(tl.int64)[:, None] * stride_dos + offs_d[None, :],
                   offs_m, seq_q, offs_d, HEAD_DIM, BLOCK_D, True, EMULATE)
    row_stats = (batch * n_heads + head).to(tl.int64) * seq_q + offs_m
    lse2, delta = load_row_stats(Lse + row_stats, Delta + row_stats, offs_m, seq_q, True)
    k_base = K + batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_base = V + batch.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh

    diagonal = seq_k - seq_q
    qk_scale = softmax_scale * LOG2E
    # The forward's walk: with documents, key blocks outside every row's span skipped.
    span_start, span_end, first, full_first, full_end, end = key_block_runs(
        KeyStart, KeyEnd, batch, row0, seq_q, seq_k, diagonal, BLOCK_M, BLOCK_N, CAUSAL, SPANS)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    dq = _dq_tiles(dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_vs, offs_m, offs_n, offs_d,
                   first, full_first, seq_k, diagonal, span_start, span_end, qk_scale,
                   True, CAUSAL, SPANS, HEAD_DIM, BLOCK_D, BLOCK_N, EMULATE, DOT_PRECISION)
    dq = _dq_tiles(dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_vs, offs_m, offs_n, offs_d,
                   full_first, full_end, seq_k, diagonal, span_start, span_end, qk_scale,
                   False, CAUSAL, SPANS, HEAD_DIM, BLOCK_D, BLOCK_N, EMULATE, DOT_PRECISION)
    dq = _dq_tiles(dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_vs, offs_m, offs_n, offs_d,
                   full_end, end, seq_k, diagonal, span_start, span_end, qk_scale,
                   True, CAUSAL, SPANS, HEAD_DIM, BLOCK_D, BLOCK_N, EMULATE, DOT_PRECISION)
    dq_ptrs = (DQ + batch.to(tl.int64) * stride_dqb + head.to(tl.int64) * stride_dqh
               + offs_m.to(tl.int64)[:, None] * stride_dqs + offs_d[None, :])
    store_tile(dq_ptrs, dq * softmax_scale, offs_m, seq_q, offs_d, HEAD_DIM, BLOCK_D, EMULATE)


def portable_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      lse: torch.Tensor, *, causal: bool, softmax_scale: float, grad_dtype: torch.dtype,
                      config: PortableConfig | None = None, spans: Spans | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward kernels on validated inputs: (dq, dk, dv) in grad_dtype; autotuned, or with the
    backward entries of `config` when given. `spans` as for `portable_forward` (the dK/dV kernel walks the query
    spans derived from them)."""
    batch, seq_q, n_heads, head_dim = q.shape
    seq_k, n_kv_heads = k.shape[1], k.shape[2]
    block_d = triton.next_power_of_2(head_dim)
    lse = lse.contiguous()
    delta = row_delta(out, dout)

    dq = torch.empty(q.shape, dtype=grad_dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=grad_dtype, device=q.device)
    dv = torch.empty(v.shape, dtype=grad_dtype, device=q.device)
    shared = dict(GROUP=n_heads // n_kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, CAUSAL=causal,
                  SPANS=spans is not None, EMULATE=INTERPRETED, DOT_PRECISION=dot_precision(q.dtype))
    key_start, key_end = spans_or_none(spans, q.device)
    query_start, query_end = spans_or_none(None if spans is None else query_spans(spans, seq_k), q.device)
    bucket = seq_bucket(seq_q, seq_k)
    dkdv_config, dq_config = (None, None) if config is None else (config.backward_dkdv, config.backward_dq)

    def dkdv_grid(meta):
        return (triton.cdiv(seq_k, meta["BLOCK_N"]), batch * n_kv_heads)

    launch(
        _dkdv_kernel, dkdv_grid, dkdv_config, q, k, v, dout, lse, delta, dk, dv, key_start, key_end, query_start,
        query_end,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
        dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
        n_kv_heads, seq_q, seq_k, softmax_scale, bucket, **shared)

    def dq_grid(meta):
        return (triton.cdiv(seq_q, meta["BLOCK_M"]), batch * n_heads)

    launch(
        _dq_kernel, dq_grid, dq_config, q, k, v, dout, lse, delta, dq, key_start, key_end,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
        dq.stride(0), dq.stride(1), dq.stride(2),
        n_heads, seq_q, seq_k, softmax_scale, bucket, **shared)
    return dq, dk, dv
