"""Hopper (sm_90) FlashAttention backward: one kernel in FlashAttention-3's form. Twin of
`jax_impl/flash_hopper_backward.py`. The public API is `torch_impl.flash_attention`.

One program owns a block of BLOCK_N keys of one (batch, KV head) and keeps K, V and their float32 dk, dv on chip
while it walks the query blocks of every query head of the group (GQA reads K/V once per KV head). Each step does
the five matmuls of the backward: S^T = K Q^T, dV += P^T dO, dP^T = V dO^T, dK += dS^T Q and this block's share
of dQ, as dQ^T = K^T dS^T into a [B, H, D, Sq] accumulator (`Config.dq_transposed`; both operands then come from
shared memory) or as dQ = dS K into [B, Sq, H, D], added into the float32 accumulator all programs share by a
tensor-descriptor reduce-add (`Config.tma_reduce`) or `tl.atomic_add` (always under the interpreter). Against the
portable two-kernel backward (`flash_backward.py`: 4 + 3 matmuls) this saves the recomputation of S and dP for dq,
at the cost of atomics and a non-deterministic summation order of dq; on H200 it still runs slower (~340 against
~400 TF/s, compare/results/kernels-2026-11-22-h200-i13-hopper.md), so backend "triton" does not take it.

Contract as the portable backward: delta = rowsum(dout * out) from the `out` it is given (so a ring passing the
global out/lse gets its exact share), P recomputed from the given lse (rows with lse -inf and padding rows get
P = 0), causal bottom-right alignment, any lengths (descriptor loads read rows past the end as zero; dk/dv rows
past the end are not stored and zero K rows add nothing to dq), gradients accumulated in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torch_impl.flash_backward import key_block_program, load_row_stats, row_delta
from torch_impl.flash_forward import INTERPRETED, LOG2E, round_to, seq_bucket
from torch_impl.flash_hopper_forward import Config, row_descriptor, load_block, set_descriptor_allocator


def backward_configs(head_dim: int) -> list[Config]:
    """The backward's autotune space; `backward_config` picks from it. (128-row steps do not fit shared memory.)"""
    del head_dim
    return [Config(m, 128, 8, s, tma_reduce=True, dq_transposed=t) for m in (64, 32) for s in (2, 3)
            for t in (True, False)] + [Config(64, 64, 4, 3, tma_reduce=True, dq_transposed=True)]


def backward_config(head_dim: int, causal: bool, seq_bucket: int) -> Config:
    """The configuration measured fastest on H200 (see compare/results/i13-*)."""
    del head_dim, causal, seq_bucket
    if INTERPRETED:
        return Config(32, 64, 4, 1, dq_transposed=True)
    return Config(64, 128, 8, 3, tma_reduce=True, dq_transposed=True)


@triton.jit
def _backward_steps(dk, dv, k, v, q_desc, do_desc, dq_desc, dq_ptrs, lse_base, delta_base, stride_dqs, head_col,
                    cols, offs_m, start, end, seq_q, diagonal, qk_scale, softmax_scale,
                    MASKED: tl.constexpr, BLOCK_M: tl.constexpr, EMULATE: tl.constexpr, TMA_REDUCE: tl.constexpr,
                    DQ_TRANSPOSED: tl.constexpr):
    """The five-matmul step over the query blocks [start, end) of one query head; MASKED applies the causal
    diagonal."""
    for row0 in tl.range(start, end, BLOCK_M):
        rows = row0 + offs_m
        q = load_block(q_desc, row0, head_col, EMULATE)
        do = load_block(do_desc, row0, head_col, EMULATE)
        lse2, delta = load_row_stats(lse_base + rows, delta_base + rows, rows, seq_q, True)
        # S^T = K Q^T (keys on the rows, as the resident dk and dv). The query-major form S = Q K^T, which keeps K
        # and V as B operands only, measured half as fast on H200 (compare/results/i13-hopper-check-2-h200.json).
        p_t = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse2[None, :])
        if MASKED:
            p_t = tl.where(cols[:, None] <= rows[None, :] + diagonal, p_t, 0.0)
        dv = tl.dot(round_to(p_t, do_desc.dtype, EMULATE), do, dv)
        dp_t = tl.dot(v, tl.trans(do))
        ds_t = round_to(p_t * (dp_t - delta[None, :]), q_desc.dtype, EMULATE)
        dk = tl.dot(ds_t, q, dk)
        if DQ_TRANSPOSED:  # dQ^T = K^T dS^T: both operands already in wgmma-ready form (K in shared memory)
            dq_t = tl.dot(tl.trans(k), ds_t) * softmax_scale
            if TMA_REDUCE:
                dq_desc.atomic_add([head_col, row0], dq_t)
            else:
                tl.atomic_add(dq_ptrs + rows[None, :], dq_t, mask=rows[None, :] < seq_q, sem="relaxed")
        else:
            dq = tl.dot(tl.trans(ds_t), k) * softmax_scale
            if TMA_REDUCE:
                dq_desc.atomic_add([row0, head_col], dq)
            else:
                tl.atomic_add(dq_ptrs + rows.to(tl.int64)[:, None] * stride_dqs, dq, mask=rows[:, None] < seq_q,
                              sem="relaxed")
    return dk, dv


@triton.jit
def _hopper_backward_kernel(Q, K, V, DOut, Lse, Delta, DQ, DK, DV,
                            stride_qb, stride_qs, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                            stride_dob, stride_dos, stride_dqb, stride_dqs,
                            stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
                            n_kv_heads, seq_q, seq_k, softmax_scale,
                            GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                            EMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            TMA_REDUCE: tl.constexpr, DQ_TRANSPOSED: tl.constexpr):
    batch, kv_head, col0 = key_block_program(n_kv_heads, BLOCK_N)
    cols = col0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    k = load_block(row_descriptor(K + batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh, seq_k,
                                  stride_ks, HEAD_DIM, BLOCK_N, HEAD_DIM), col0, 0, EMULATE)
    v = load_block(row_descriptor(V + batch.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh, seq_k,
                                  stride_vs, HEAD_DIM, BLOCK_N, HEAD_DIM), col0, 0, EMULATE)
    # Q, dO and dq are [S, H * D] row-major per batch: one descriptor each serves every head of the group.
    n_heads = n_kv_heads * GROUP
    q_desc = row_descriptor(Q + batch.to(tl.int64) * stride_qb, seq_q, stride_qs, n_heads * HEAD_DIM, BLOCK_M,
                            HEAD_DIM)
    do_desc = row_descriptor(DOut + batch.to(tl.int64) * stride_dob, seq_q, stride_dos, n_heads * HEAD_DIM,
                             BLOCK_M, HEAD_DIM)
    if DQ_TRANSPOSED:  # dq accumulator [B, H * D, Sq] (row stride stride_dqs)
        dq_desc = row_descriptor(DQ + batch.to(tl.int64) * stride_dqb, n_heads * HEAD_DIM, stride_dqs, seq_q,
                                 HEAD_DIM, BLOCK_M)
    else:  # dq accumulator [B, Sq, H * D]
        dq_desc = row_descriptor(DQ + batch.to(tl.int64) * stride_dqb, seq_q, stride_dqs, n_heads * HEAD_DIM,
                                 BLOCK_M, HEAD_DIM)

    diagonal = seq_k - seq_q
    padded_end = (seq_q + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    if CAUSAL:
        # Query i sees key j iff i >= j - diagonal. Rows before `first` see none of this block; rows from
        # `full_start` on see all of it (both rounded to query blocks).
        first = tl.minimum(tl.maximum(col0 - diagonal, 0) // BLOCK_M * BLOCK_M, padded_end)
        full_start = tl.minimum(tl.maximum(first, (col0 + BLOCK_N - 1 - diagonal + BLOCK_M - 1) // BLOCK_M * BLOCK_M),
                                padded_end)
    else:
        first = 0
        full_start = 0
    qk_scale = softmax_scale * LOG2E
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for head_in_group in range(GROUP):
        head = kv_head * GROUP + head_in_group
        head_col = head * HEAD_DIM
        lse_base = Lse + (batch * n_heads + head).to(tl.int64) * seq_q
        delta_base = Delta + (batch * n_heads + head).to(tl.int64) * seq_q
        if DQ_TRANSPOSED:
            dq_ptrs = DQ + batch.to(tl.int64) * stride_dqb + (head_col + offs_d).to(tl.int64)[:, None] * stride_dqs
        else:
            dq_ptrs = DQ + batch.to(tl.int64) * stride_dqb + head_col + offs_d[None, :]
        dk, dv = _backward_steps(dk, dv, k, v, q_desc, do_desc, dq_desc, dq_ptrs, lse_base, delta_base, stride_dqs,
                                 head_col, cols, offs_m, first, full_start, seq_q, diagonal, qk_scale,
                                 softmax_scale, True, BLOCK_M, EMULATE, TMA_REDUCE, DQ_TRANSPOSED)
        dk, dv = _backward_steps(dk, dv, k, v, q_desc, do_desc, dq_desc, dq_ptrs, lse_base, delta_base, stride_dqs,
                                 head_col, cols, offs_m, full_start, padded_end, seq_q, diagonal, qk_scale,
                                 softmax_scale, False, BLOCK_M, EMULATE, TMA_REDUCE, DQ_TRANSPOSED)

    dk_ptrs = (DK + batch.to(tl.int64) * stride_dkb + kv_head.to(tl.int64) * stride_dkh
               + cols.to(tl.int64)[:, None] * stride_dks + offs_d[None, :])
    dv_ptrs = (DV + batch.to(tl.int64) * stride_dvb + kv_head.to(tl.int64) * stride_dvh
               + cols.to(tl.int64)[:, None] * stride_dvs + offs_d[None, :])
    in_bounds = cols[:, None] < seq_k
    tl.store(dk_ptrs, round_to(dk * softmax_scale, DK.dtype.element_ty, EMULATE).to(DK.dtype.element_ty),
             mask=in_bounds)
    tl.store(dv_ptrs, round_to(dv, DV.dtype.element_ty, EMULATE).to(DV.dtype.element_ty), mask=in_bounds)


def _heads_packed(x: torch.Tensor) -> torch.Tensor:
    """x [B, S, H, D] with each row's heads adjacent ([S, H * D] row-major per batch), copying only if needed."""
    return x if x.stride(3) == 1 and x.stride(2) == x.shape[3] else x.contiguous()


def hopper_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, *, causal: bool, softmax_scale: float, grad_dtype: torch.dtype,
                    config: Config | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the Hopper backward on validated, supported inputs: (dq, dk, dv) in grad_dtype."""
    batch, seq_q, n_heads, head_dim = q.shape
    seq_k, n_kv_heads = k.shape[1], k.shape[2]
    config = config or backward_config(head_dim, causal, seq_bucket(seq_q, seq_k))
    q, dout = _heads_packed(q), _heads_packed(dout)
    delta = row_delta(out, dout)
    if config.dq_transposed:  # [B, H, D, Sq rounded up to 16 bytes], the row stride a descriptor needs
        dq = torch.zeros((batch, n_heads, head_dim, triton.cdiv(seq_q, 4) * 4), dtype=torch.float32, device=q.device)
        dq_strides = (dq.stride(0), dq.stride(2))
    else:
        dq = torch.zeros((batch, seq_q, n_heads, head_dim), dtype=torch.float32, device=q.device)
        dq_strides = (dq.stride(0), dq.stride(1))
    dk = torch.empty(k.shape, dtype=grad_dtype, device=q.device)
    dv = torch.empty(v.shape, dtype=grad_dtype, device=q.device)
    set_descriptor_allocator(q.device)
    _hopper_backward_kernel[(triton.cdiv(seq_k, config.block_n), batch * n_kv_heads)](
        q, k, v, dout, lse.contiguous(), delta, dq, dk, dv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        dout.stride(0), dout.stride(1), *dq_strides,
        dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
        n_kv_heads, seq_q, seq_k, softmax_scale,
        GROUP=n_heads // n_kv_heads, HEAD_DIM=head_dim, CAUSAL=causal, EMULATE=INTERPRETED,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, TMA_REDUCE=config.tma_reduce and not INTERPRETED,
        DQ_TRANSPOSED=config.dq_transposed,
        num_warps=config.num_warps, num_stages=config.num_stages)
    if config.dq_transposed:
        dq = dq[..., :seq_q].permute(0, 3, 1, 2)
    return dq.to(grad_dtype).contiguous(), dk, dv
