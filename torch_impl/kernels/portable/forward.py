"""The portable family's forward: a Triton (`tl`) FlashAttention forward kernel (FA2 algorithm), which the CPU
interpreter and every CUDA GPU run. Twin of `jax_impl/kernels/portable/forward.py` (the Pallas forward). The
public API is `torch_impl.kernels.flash_attention`; the tile helpers it shares with the backward are in
`kernels/tiles.py`, its launch configs and autotune space in `config.py`.

Layout is flash-attention's: q [B, Sq, H, D], k/v [B, Sk, Hkv, D], last dim contiguous, any other strides.
One program computes one block of BLOCK_M query rows of one (batch, query head); its KV head is
h // (H // Hkv), so grouped-query attention reads K/V in place. The online softmax runs in the exp2 domain
(log2(e) folded into the scale). The key loop is split in two: blocks every row of the query block sees in
full run without any mask; the remaining blocks (the causal diagonal and the Sk tail) run with masks.
Causal is bottom-right aligned: query i sees key j iff j <= i + Sk - Sq. A row that sees no key gets
out 0 and lse -inf. With documents (SPANS) each row sees its key span instead (`weights/documents.py`): the
program visits the key blocks between its rows' lowest start and highest end, those inside every row's span
unmasked, the rest masked; the blocks outside are never loaded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torch_impl.kernels.portable.config import FORWARD_SHAPES, KernelConfig, autotuned, forward_shared_bytes, launch
from torch_impl.documents import Spans
from torch_impl.kernels.tiles import (INTERPRETED, LN2, LOG2E, dot_precision, key_block_runs, key_scores,
                                      key_tile_pointers, load_tile, query_block_program, round_to, seq_bucket,
                                      spans_or_none, store_tile, visible_keys)


@triton.jit
def online_softmax_step(qk, l_i, m_i, cols, offs_m, seq_k, diagonal, span_start, span_end, qk_scale,
                        MASKED: tl.constexpr, CAUSAL: tl.constexpr, SPANS: tl.constexpr):
    """One key block's online-softmax update from raw scores `qk` [rows, cols]: (p, alpha, l_i, m_i) with p the
    unnormalised probabilities, alpha the factor rescaling what was accumulated before, m_i in log2 units."""
    if MASKED:
        qk = tl.where(visible_keys(cols, offs_m, seq_k, diagonal, span_start, span_end, CAUSAL, SPANS),
                      qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # A row with nothing visible yet keeps m = -inf; subtracting 0 keeps its p at 0 instead of NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk - m_shift[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        m_shift = m_new
        p = tl.math.exp2(qk * qk_scale - m_shift[:, None])
    alpha = tl.math.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, l_i, m_new


@triton.jit
def empty_softmax_state(BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """(acc, l_i, m_i) of query rows that have seen no key yet: nothing accumulated, running max -inf."""
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    return acc, l_i, m_i


@triton.jit
def normalized_output(acc, l_i, m_i):
    """(out in float32, lse in natural log) from the final (acc, l_i, m_i); a row that saw no key gets out 0 and
    lse -inf."""
    sees_nothing = l_i == 0.0
    l_safe = tl.where(sees_nothing, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(sees_nothing, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2)
    return out, lse


@triton.jit
def _forward_tiles(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, offs_m, offs_n, offs_d,
                   start, end, seq_k, diagonal, span_start, span_end, qk_scale,
                   MASKED: tl.constexpr, CAUSAL: tl.constexpr, SPANS: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, EMULATE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online-softmax update of (acc, l_i, m_i) over key blocks [start, end); m_i is in log2 units."""
    k_ptrs, v_ptrs = key_tile_pointers(k_base, v_base, stride_ks, stride_vs, start + offs_n, offs_d)
    for start_n in range(start, end, BLOCK_N):
        cols, k, qk = key_scores(q, k_ptrs, start_n, offs_n, seq_k, offs_d, HEAD_DIM, BLOCK_D, MASKED, EMULATE,
                                 DOT_PRECISION)
        p, alpha, l_i, m_i = online_softmax_step(qk, l_i, m_i, cols, offs_m, seq_k, diagonal, span_start, span_end,
                                                 qk_scale, MASKED, CAUSAL, SPANS)
        v = load_tile(v_ptrs, cols, seq_k, offs_d, HEAD_DIM, BLOCK_D, MASKED, EMULATE)
        acc = acc * alpha[:, None]
        acc = tl.dot(round_to(p, v_base.dtype.element_ty, EMULATE), v, acc, input_precision=DOT_PRECISION)
        k_ptrs += BLOCK_N * stride_ks
        v_ptrs += BLOCK_N * stride_vs
    return acc, l_i, m_i


@autotuned(FORWARD_SHAPES, (64, 32), forward_shared_bytes)
@triton.jit
def _forward_kernel(Q, K, V, Out, Lse, KeyStart, KeyEnd,
                    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                    stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh,
                    n_heads, seq_q, seq_k, softmax_scale, SEQ_BUCKET,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
                    SPANS: tl.constexpr, EMULATE: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    batch, head, kv_head, row0 = query_block_program(n_heads, GROUP, BLOCK_M, CAUSAL)
    q_base = Q + batch.to(tl.int64) * stride_qb + head.to(tl.int64) * stride_qh
    k_base = K + batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_base = V + batch.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = load_tile(q_base + offs_m.to(tl.int64)[:, None] * stride_qs + offs_d[None, :], offs_m, seq_q, offs_d,
                  HEAD_DIM, BLOCK_D, True, EMULATE)

    diagonal = seq_k - seq_q
    qk_scale = softmax_scale * LOG2E
    acc, l_i, m_i = empty_softmax_state(BLOCK_M, BLOCK_D)
    # With documents, key blocks outside every row's span are skipped and those inside all of them run unmasked.
    span_start, span_end, first, full_first, full_end, end = key_block_runs(
        KeyStart, KeyEnd, batch, row0, seq_q, seq_k, diagonal, BLOCK_M, BLOCK_N, CAUSAL, SPANS)
    acc, l_i, m_i = _forward_tiles(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, offs_m, offs_n, offs_d,
                                   first, full_first, seq_k, diagonal, span_start, span_end, qk_scale,
                                   True, CAUSAL, SPANS, HEAD_DIM, BLOCK_D, BLOCK_N, EMULATE, DOT_PRECISION)
    acc, l_i, m_i = _forward_tiles(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, offs_m, offs_n, offs_d,
                                   full_first, full_end, seq_k, diagonal, span_start, span_end, qk_scale,
                                   False, CAUSAL, SPANS, HEAD_DIM, BLOCK_D, BLOCK_N, EMULATE, DOT_PRECISION)
    acc, l_i, m_i = _forward_tiles(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, offs_m, offs_n, offs_d,
                                   full_end, end, seq_k, diagonal, span_start, span_end, qk_scale,
                                   True, CAUSAL, SPANS, HEAD_DIM, BLOCK_D, BLOCK_N, EMULATE, DOT_PRECISION)

    out, lse = normalized_output(acc, l_i, m_i)
    o_base = Out + batch.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh
    store_tile(o_base + offs_m.to(tl.int64)[:, None] * stride_os + offs_d[None, :], out, offs_m, seq_q, offs_d,
               HEAD_DIM, BLOCK_D, EMULATE)
    tl.store(Lse + (batch * n_heads + head).to(tl.int64) * seq_q + offs_m, lse, mask=offs_m < seq_q)


def portable_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, softmax_scale: float,
                     out_dtype: torch.dtype, config: KernelConfig | None = None, spans: Spans | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel on validated inputs: (out [B, Sq, H, D] in out_dtype, lse [B, H, Sq] fp32),
    autotuned, or with `config`'s launch parameters when given. `spans`: the documents' key spans, which replace
    the causal rule (the caller folds it in: `causal` is then False)."""
    batch, seq_q, n_heads, head_dim = q.shape
    seq_k, n_kv_heads = k.shape[1], k.shape[2]
    out = torch.empty((batch, seq_q, n_heads, head_dim), dtype=out_dtype, device=q.device)
    lse = torch.empty((batch, n_heads, seq_q), dtype=torch.float32, device=q.device)

    def grid(meta):
        return (triton.cdiv(seq_q, meta["BLOCK_M"]), batch * n_heads)

    key_start, key_end = spans_or_none(spans, q.device)
    launch(
        _forward_kernel, grid, config, q, k, v, out, lse, key_start, key_end,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        n_heads, seq_q, seq_k, softmax_scale, seq_bucket(seq_q, seq_k),
        GROUP=n_heads // n_kv_heads, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), CAUSAL=causal,
        SPANS=spans is not None, EMULATE=INTERPRETED, DOT_PRECISION=dot_precision(q.dtype))
    return out, lse
