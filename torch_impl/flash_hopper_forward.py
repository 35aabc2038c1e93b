"""Hopper (sm_90) FlashAttention forward: the portable kernel's algorithm (`flash_forward.py`) with tiles moved by
the tensor-memory accelerator through on-device tensor descriptors (`tl.make_tensor_descriptor`), 128-row query
blocks and Hopper-sized configs, plus the `Config` both Hopper kernels take. Twin of
`jax_impl/flash_hopper_forward.py`. The public API is `torch_impl.flash_attention`, backend "triton_hopper"
("triton" never picks this forward: the portable one measured as fast or faster on H200, see
`flash_attention._forward_path`).

A descriptor covers one (batch, head) slice [S, D] of q/k/v, so rows past the sequence read as zero and the kernel
needs no row masks on its loads; the causal diagonal and the key tail are masked on the scores exactly as in the
portable kernel (which shares `online_softmax_step` with this one). The kernel runs under Triton's interpreter too
(descriptor loads are emulated there), which is how the CPU tests cover it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources
from triton.testing import do_bench

from torch_impl.flash_forward import (INTERPRETED, LOG2E, empty_softmax_state, key_range, normalized_output,
                                      online_softmax_step, query_block_program, round_to, seq_bucket)

HOPPER_HEAD_DIMS = (64, 128)
HOPPER_DTYPES = (torch.bfloat16, torch.float16)


@dataclasses.dataclass(frozen=True)
class Config:
    """Launch shape of a Hopper kernel. Forward: `block_m` query rows per program, `block_n` keys per step.
    Backward: `block_n` resident keys per program, `block_m` query rows per step, and `tma_reduce` picks how dq is
    accumulated (a descriptor reduce-add, else `tl.atomic_add`), `dq_transposed` whether as dQ^T = K^T dS^T into a
    [B, H, D, Sq] accumulator (else dQ = dS K into [B, Sq, H, D])."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    warp_specialize: bool = False
    tma_reduce: bool = False
    dq_transposed: bool = False


def forward_configs(head_dim: int) -> list[Config]:
    """The forward's autotune space; `forward_config` picks from it. One space serves D = 64 and 128 (a
    128 x 128 float32 score tile fits 8 warps' registers at both)."""
    del head_dim
    return [Config(128, n, 8, s, ws) for n in (128, 64) for s in (2, 3) for ws in (False, True)]


def forward_config(head_dim: int, causal: bool, seq_bucket: int) -> Config:
    """The configuration measured fastest on H200 (16k, causal, D=128: 516 TF/s; see compare/results/i13-*)."""
    del head_dim, causal, seq_bucket
    if INTERPRETED:
        return Config(64, 32, 4, 1)
    return Config(128, 128, 8, 3, warp_specialize=True)


def autotune(launch: Callable[[Config], object], configs: list[Config]) -> Config:
    """The fastest of `configs` for `launch(config)` (median CUDA-event time), skipping those that do not fit the
    GPU. The caller keys and keeps the result (a Config per shape class), and passes it as `config=`."""
    timings = {}
    for config in configs:
        try:
            timings[config] = do_bench(functools.partial(launch, config), warmup=5, rep=20, return_mode="median")
        except OutOfResources:
            continue
    if not timings:
        raise ValueError("no Hopper config fits this GPU's shared memory")
    return min(timings, key=timings.get)


def hopper_unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the Hopper kernels cannot run these (validated) inputs, or None when they can."""
    if not INTERPRETED and not (q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9):
        return "needs an sm_90 (Hopper) GPU"
    if q.dtype not in HOPPER_DTYPES:
        return f"supports bfloat16 and float16, got {q.dtype}"
    if q.shape[-1] not in HOPPER_HEAD_DIMS:
        return f"supports head dims {HOPPER_HEAD_DIMS}, got {q.shape[-1]}"
    for name, t in (("q", q), ("k", k), ("v", v)):
        # A tensor descriptor needs a 16-byte aligned base and 16-byte multiples for every stride but the last.
        aligned = t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1])
        if t.stride(-1) == 1 and not aligned:  # (a strided last dim is copied to a contiguous one anyway)
            return f"needs {name} with a 16-byte aligned base and strides"
    return None


def set_descriptor_allocator(device: torch.device) -> None:
    """On-device descriptors live in a scratch buffer Triton asks its allocator for at each launch."""
    if INTERPRETED:
        return

    def alloc(size: int, alignment: int, stream):
        return torch.empty(size, dtype=torch.int8, device=device)

    triton.set_allocator(alloc)


@triton.jit
def row_descriptor(base, n_rows, stride_row, width, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """Descriptor of a row-major [n_rows, width] matrix at `base` read in [BLOCK_ROWS, BLOCK_COLS] tiles; rows
    past n_rows read as zero and are dropped on writes."""
    return tl.make_tensor_descriptor(base, shape=[n_rows, width], strides=[stride_row, 1],
                                     block_shape=[BLOCK_ROWS, BLOCK_COLS])


@triton.jit
def load_block(desc, row, col, EMULATE: tl.constexpr):
    tile = desc.load([row, col])
    if EMULATE:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def _forward_tiles(acc, l_i, m_i, q, k_desc, v_desc, offs_m, offs_n, start, end, seq_k, diagonal, qk_scale,
                   MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, EMULATE: tl.constexpr,
                   WARP_SPECIALIZE: tl.constexpr):
    for start_n in tl.range(start, end, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        k = load_block(k_desc, start_n, 0, EMULATE)
        qk = tl.dot(q, tl.trans(k))
        p, alpha, l_i, m_i = online_softmax_step(qk, l_i, m_i, start_n + offs_n, offs_m, seq_k, diagonal, qk_scale,
                                                 MASKED, CAUSAL)
        v = load_block(v_desc, start_n, 0, EMULATE)
        acc = acc * alpha[:, None]
        acc = tl.dot(round_to(p, v_desc.dtype, EMULATE), v, acc)
    return acc, l_i, m_i


@triton.jit
def _hopper_forward_kernel(Q, K, V, Out, Lse,
                           stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                           stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh,
                           n_heads, seq_q, seq_k, softmax_scale,
                           GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, EMULATE: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    batch, head, kv_head, row0 = query_block_program(n_heads, GROUP, BLOCK_M, CAUSAL)
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q_desc = row_descriptor(Q + batch.to(tl.int64) * stride_qb + head.to(tl.int64) * stride_qh, seq_q, stride_qs,
                            HEAD_DIM, BLOCK_M, HEAD_DIM)
    k_desc = row_descriptor(K + batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh, seq_k,
                            stride_ks, HEAD_DIM, BLOCK_N, HEAD_DIM)
    v_desc = row_descriptor(V + batch.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh, seq_k,
                            stride_vs, HEAD_DIM, BLOCK_N, HEAD_DIM)
    q = load_block(q_desc, row0, 0, EMULATE)

    diagonal = seq_k - seq_q
    full_end, end = key_range(row0, seq_k, diagonal, BLOCK_M, BLOCK_N, CAUSAL)
    qk_scale = softmax_scale * LOG2E
    acc, l_i, m_i = empty_softmax_state(BLOCK_M, HEAD_DIM)
    acc, l_i, m_i = _forward_tiles(acc, l_i, m_i, q, k_desc, v_desc, offs_m, offs_n, 0, full_end, seq_k, diagonal,
                                   qk_scale, False, CAUSAL, BLOCK_N, EMULATE, WARP_SPECIALIZE)
    acc, l_i, m_i = _forward_tiles(acc, l_i, m_i, q, k_desc, v_desc, offs_m, offs_n, full_end, end, seq_k, diagonal,
                                   qk_scale, True, CAUSAL, BLOCK_N, EMULATE, WARP_SPECIALIZE)

    out, lse = normalized_output(acc, l_i, m_i)
    # A plain store: `out` may be float32 (a ring's partial output), whose tile would not fit a TMA staging buffer.
    o_ptrs = (Out + batch.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh
              + offs_m.to(tl.int64)[:, None] * stride_os + offs_d[None, :])
    out = round_to(out, Out.dtype.element_ty, EMULATE).to(Out.dtype.element_ty)
    tl.store(o_ptrs, out, mask=offs_m[:, None] < seq_q)
    tl.store(Lse + (batch * n_heads + head).to(tl.int64) * seq_q + offs_m, lse, mask=offs_m < seq_q)


def hopper_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, softmax_scale: float,
                   out_dtype: torch.dtype, config: Config | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the Hopper forward on validated, supported inputs (`hopper_unsupported` is None):
    (out [B, Sq, H, D] in out_dtype, lse [B, H, Sq] float32)."""
    batch, seq_q, n_heads, head_dim = q.shape
    seq_k, n_kv_heads = k.shape[1], k.shape[2]
    config = config or forward_config(head_dim, causal, seq_bucket(seq_q, seq_k))
    out = torch.empty((batch, seq_q, n_heads, head_dim), dtype=out_dtype, device=q.device)
    lse = torch.empty((batch, n_heads, seq_q), dtype=torch.float32, device=q.device)
    set_descriptor_allocator(q.device)
    _hopper_forward_kernel[(triton.cdiv(seq_q, config.block_m), batch * n_heads)](
        q, k, v, out, lse,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        n_heads, seq_q, seq_k, softmax_scale,
        GROUP=n_heads // n_kv_heads, HEAD_DIM=head_dim, CAUSAL=causal, EMULATE=INTERPRETED,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, WARP_SPECIALIZE=config.warp_specialize,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out, lse
