"""Triton FlashAttention forward kernel (FA2 algorithm) and the pieces the backward kernels share: the tile
helpers, the autotuning, and the launch configs a caller may pass instead (`KernelConfig` per kernel,
`TritonConfig` for the three). Twin of `jax_impl/flash_forward.py` (the Pallas forward). The public API is
`torch_impl.flash_attention`.

Layout is flash-attention's: q [B, Sq, H, D], k/v [B, Sk, Hkv, D], last dim contiguous, any other strides.
One program computes one block of BLOCK_M query rows of one (batch, query head); its KV head is
h // (H // Hkv), so grouped-query attention reads K/V in place. The online softmax runs in the exp2 domain
(log2(e) folded into the scale). The key loop is split in two: blocks every row of the query block sees in
full run without any mask; the remaining blocks (the causal diagonal and the Sk tail) run with masks.
Causal is bottom-right aligned: query i sees key j iff j <= i + Sk - Sq. A row that sees no key gets
out 0 and lse -inf.

Under Triton's interpreter 16-bit tiles are wrong in two silent ways (bf16 is held as uint16, so bf16 dots
and arithmetic are garbage; fp32 -> bf16 casts truncate instead of rounding). With EMULATE set the kernels
load every tile as float32 and round values to the operand dtype themselves (round-to-nearest-even), so the
interpreter computes what the GPU computes: 16-bit operands, exact products, float32 accumulation.

Without CUDA the kernels run in Triton's interpreter, which TRITON_INTERPRET=1 selects: set it before anything
imports triton (the `twinflash` CLI and tests/conftest.py do so when there is no CUDA GPU). Triton decides per
function, when `@triton.jit` decorates it: its own library (tl.sum, tl.max, tl.zeros, ...) when triton is imported,
these kernels when this module is. `interpreter_problem` says why CPU tensors cannot run here when the two disagree
or the interpreter is off; `torch_impl.flash_attention` raises it as one line.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

# Read now, exactly as `triton.jit` reads it when it decorates the kernels below.
INTERPRETED = bool(triton.knobs.runtime.interpret)


def interpreter_problem() -> str | None:
    """Why CPU tensors cannot run through the kernels in this process (one line naming the fix), or None when
    Triton's interpreter runs them."""
    fix = ("move them to CUDA, or set TRITON_INTERPRET=1 before anything imports triton (the twinflash CLI and the "
           "tests do so when there is no CUDA GPU)")
    if not INTERPRETED:
        return f"Triton's interpreter is off; {fix}"
    if not isinstance(tl.sum, InterpretedFunction):
        return f"TRITON_INTERPRET=1 was set after triton was imported, so triton's own functions are compiled; {fix}"
    return None


LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x * LOG2E)
LN2 = tl.constexpr(0.6931471805599453)  # log(x) = log2(x) * LN2


@triton.jit
def round_to(x, DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """float32 `x` rounded to DTYPE (round-to-nearest-even). Compiled: a cast to DTYPE. Emulated: float32
    holding DTYPE-representable values, since the interpreter truncates fp32 -> bf16."""
    if EMULATE:
        if DTYPE == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            rounded = bits.to(tl.float32, bitcast=True)
        else:
            rounded = x.to(DTYPE).to(tl.float32)
    else:
        rounded = x.to(DTYPE)
    return rounded


@triton.jit
def load_tile(ptrs, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
              CHECK_ROWS: tl.constexpr, EMULATE: tl.constexpr):
    """A [rows, BLOCK_D] tile; rows past `n_rows` and columns past HEAD_DIM read as 0. Masks are only
    emitted where they can matter, so interior tiles load unmasked."""
    if CHECK_ROWS:
        if BLOCK_D == HEAD_DIM:
            tile = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
        else:
            tile = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    else:
        if BLOCK_D == HEAD_DIM:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    if EMULATE:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def store_tile(ptrs, tile, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               EMULATE: tl.constexpr):
    """Store a float32 tile in the pointee dtype, rows past `n_rows` and columns past HEAD_DIM dropped."""
    value = round_to(tile, ptrs.dtype.element_ty, EMULATE).to(ptrs.dtype.element_ty)
    if BLOCK_D == HEAD_DIM:
        tl.store(ptrs, value, mask=rows[:, None] < n_rows)
    else:
        tl.store(ptrs, value, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def visible_keys(cols, rows, seq_k, diagonal, CAUSAL: tl.constexpr):
    """[rows, cols] mask of the keys each query row sees: keys before seq_k and, if CAUSAL, at most `diagonal`
    past the row (bottom-right alignment)."""
    visible = cols[None, :] < seq_k
    if CAUSAL:
        visible = visible & (cols[None, :] <= rows[:, None] + diagonal)
    return visible


@triton.jit
def key_tile_pointers(k_base, v_base, stride_ks, stride_vs, cols, offs_d):
    """Pointers to the [cols, offs_d] tiles of K and V (int64 row offsets: long sequences overflow int32)."""
    k_ptrs = k_base + cols.to(tl.int64)[:, None] * stride_ks + offs_d[None, :]
    v_ptrs = v_base + cols.to(tl.int64)[:, None] * stride_vs + offs_d[None, :]
    return k_ptrs, v_ptrs


@triton.jit
def online_softmax_step(qk, l_i, m_i, cols, offs_m, seq_k, diagonal, qk_scale,
                        MASKED: tl.constexpr, CAUSAL: tl.constexpr):
    """One key block's online-softmax update from raw scores `qk` [rows, cols]: (p, alpha, l_i, m_i) with p the
    unnormalised probabilities, alpha the factor rescaling what was accumulated before, m_i in log2 units."""
    if MASKED:
        qk = tl.where(visible_keys(cols, offs_m, seq_k, diagonal, CAUSAL), qk * qk_scale, float("-inf"))
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
def key_scores(q, k_ptrs, start_n, offs_n, seq_k, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               MASKED: tl.constexpr, EMULATE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """(cols, k, q k^T) of the key tile starting at start_n: its key indices, the K tile (rows past seq_k read as 0
    when MASKED) and the raw scores."""
    cols = start_n + offs_n
    k = load_tile(k_ptrs, cols, seq_k, offs_d, HEAD_DIM, BLOCK_D, MASKED, EMULATE)
    return cols, k, tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)


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
                   start, end, seq_k, diagonal, qk_scale,
                   MASKED: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_N: tl.constexpr, EMULATE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online-softmax update of (acc, l_i, m_i) over key blocks [start, end); m_i is in log2 units."""
    k_ptrs, v_ptrs = key_tile_pointers(k_base, v_base, stride_ks, stride_vs, start + offs_n, offs_d)
    for start_n in range(start, end, BLOCK_N):
        cols, k, qk = key_scores(q, k_ptrs, start_n, offs_n, seq_k, offs_d, HEAD_DIM, BLOCK_D, MASKED, EMULATE,
                                 DOT_PRECISION)
        p, alpha, l_i, m_i = online_softmax_step(qk, l_i, m_i, cols, offs_m, seq_k, diagonal, qk_scale,
                                                 MASKED, CAUSAL)
        v = load_tile(v_ptrs, cols, seq_k, offs_d, HEAD_DIM, BLOCK_D, MASKED, EMULATE)
        acc = acc * alpha[:, None]
        acc = tl.dot(round_to(p, v_base.dtype.element_ty, EMULATE), v, acc, input_precision=DOT_PRECISION)
        k_ptrs += BLOCK_N * stride_ks
        v_ptrs += BLOCK_N * stride_vs
    return acc, l_i, m_i


@triton.jit
def query_block_program(n_heads, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """(batch, head, kv head, first row) of a program of the grid (query blocks, batch * heads). Causal query
    blocks near the end do the most work: they are launched first so the tail of the grid is short."""
    pid_bh = tl.program_id(1)
    batch = pid_bh // n_heads
    head = pid_bh % n_heads
    if CAUSAL:
        block_m = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        block_m = tl.program_id(0)
    return batch, head, head // GROUP, block_m * BLOCK_M


@triton.jit
def key_range(row0, seq_k, diagonal, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """(full_end, end) for the query block at row0: keys [0, full_end) are whole BLOCK_N blocks that every row
    sees (no mask needed), keys [full_end, end) the rest that any row sees (masked)."""
    if CAUSAL:  # query i sees key j iff j <= i + diagonal
        full_end = tl.maximum(tl.minimum(row0 + diagonal + 1, seq_k), 0) // BLOCK_N * BLOCK_N
        end = tl.minimum(row0 + BLOCK_M + diagonal, seq_k)
    else:
        full_end = seq_k // BLOCK_N * BLOCK_N
        end = seq_k
    return full_end, end


def autotune_configs(gpu_shapes, interpreter_blocks):
    """triton.Configs from (BLOCK_M, BLOCK_N, warps, stages) shapes; the interpreter gets one config, with
    unequal blocks so that it exercises the same block arithmetic as the GPU's."""
    if INTERPRETED:
        return [triton.Config({"BLOCK_M": interpreter_blocks[0], "BLOCK_N": interpreter_blocks[1]})]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in gpu_shapes]


class KernelConfig(NamedTuple):
    """Launch parameters of one portable kernel. For the forward and dQ kernels a program owns `block_m` query
    rows and steps over K/V `block_n` rows at a time; for the dK/dV kernel a program owns `block_n` key rows and
    steps over queries `block_m` rows at a time. num_warps/num_stages only matter on the GPU."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class TritonConfig:
    """Block sizes of the three portable kernels (the Hopper kernels take `flash_hopper_forward.Config`). Passed
    as `config=`, it replaces the autotuner: each kernel launches with its entry as given, on the GPU and under
    the interpreter alike."""
    forward: KernelConfig
    backward_dkdv: KernelConfig
    backward_dq: KernelConfig


def launch(kernel, grid, config: KernelConfig | None, *args, **kwargs) -> None:
    """Launch an `autotuned` kernel: tuned over its space when `config` is None, else its jit function with
    `config`'s blocks, warps and stages."""
    if config is None:
        kernel[grid](*args, **kwargs)
    else:
        kernel.fn[grid](*args, **kwargs, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                        num_warps=config.num_warps, num_stages=config.num_stages)


def _max_shared_memory(device_index: int) -> int:
    return triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"]


# Calls whose longer sequence is below this take the first fitting config untuned: for them, tuning (a compile
# and a benchmark per config) costs more than it can save, and a test suite would spend minutes compiling.
AUTOTUNE_MIN_SEQ = 4096


def fitting(shared_bytes):
    """An autotune `early_config_prune` that keeps the configs whose shared memory fits the device, only the
    first of them for short calls (AUTOTUNE_MIN_SEQ). `shared_bytes(BLOCK_M, BLOCK_N, stages, row_bytes)` is the
    kernel's need (its resident tiles plus `stages` copies of its streamed ones), which is what Triton allocates
    on sm_90 up to ~1 KB of scratch. float32 operands (FMA dots, no tensor cores) also keep tiles small."""
    def prune(configs, named_args, **kwargs):
        if len(configs) == 1:
            return configs
        q = named_args["Q"]
        row_bytes = triton.next_power_of_2(kwargs["HEAD_DIM"]) * q.element_size()
        limit = _max_shared_memory(q.device.index) - 2048

        def need(config):
            return shared_bytes(config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_stages, row_bytes)

        kept = [c for c in configs if need(c) <= limit
                and (q.dtype != torch.float32 or c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 64 * 64)]
        kept = kept or [min(configs, key=need)]
        return kept if named_args["SEQ_BUCKET"] >= AUTOTUNE_MIN_SEQ else kept[:1]
    return prune


def autotuned(gpu_shapes, interpreter_blocks, shared_bytes):
    """The autotune decorator of a kernel tiled by BLOCK_M x BLOCK_N: configs from `autotune_configs`, pruned by
    `fitting(shared_bytes)`, tuned per head dim, mask and sequence bucket."""
    return triton.autotune(configs=autotune_configs(gpu_shapes, interpreter_blocks),
                           key=["HEAD_DIM", "CAUSAL", "SEQ_BUCKET"],
                           prune_configs_by={"early_config_prune": fitting(shared_bytes)})


# (BLOCK_M, BLOCK_N, warps, stages): no register spills on sm_90 at D=128 (128 x 128 x 2: a few bytes); the last
# one is for D=256.
FORWARD_SHAPES = [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3),
                  (64, 32, 4, 3)]


def forward_shared_bytes(block_m, block_n, stages, row_bytes):
    return (block_m + stages * 2 * block_n) * row_bytes  # Q resident; K and V streamed


@autotuned(FORWARD_SHAPES, (64, 32), forward_shared_bytes)
@triton.jit
def _forward_kernel(Q, K, V, Out, Lse,
                    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                    stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh,
                    n_heads, seq_q, seq_k, softmax_scale, SEQ_BUCKET,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
                    EMULATE: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
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
    full_end, end = key_range(row0, seq_k, diagonal, BLOCK_M, BLOCK_N, CAUSAL)

    qk_scale = softmax_scale * LOG2E
    acc, l_i, m_i = empty_softmax_state(BLOCK_M, BLOCK_D)
    acc, l_i, m_i = _forward_tiles(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, offs_m, offs_n, offs_d,
                                   0, full_end, seq_k, diagonal, qk_scale,
                                   False, CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_N, EMULATE, DOT_PRECISION)
    acc, l_i, m_i = _forward_tiles(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, offs_m, offs_n, offs_d,
                                   full_end, end, seq_k, diagonal, qk_scale,
                                   True, CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_N, EMULATE, DOT_PRECISION)

    out, lse = normalized_output(acc, l_i, m_i)
    o_base = Out + batch.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh
    store_tile(o_base + offs_m.to(tl.int64)[:, None] * stride_os + offs_d[None, :], out, offs_m, seq_q, offs_d,
               HEAD_DIM, BLOCK_D, EMULATE)
    tl.store(Lse + (batch * n_heads + head).to(tl.int64) * seq_q + offs_m, lse, mask=offs_m < seq_q)


def seq_bucket(seq_q: int, seq_k: int) -> int:
    """Autotuning key for the sequence lengths: the power of two above the longer one (at least 1024), so
    a training run with varying lengths tunes a handful of times, not once per length."""
    return max(1024, triton.next_power_of_2(max(seq_q, seq_k)))


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs get IEEE dots (the CPU model tests compare against float32 math); 16-bit inputs use
    tensor cores whatever this says."""
    return "ieee" if dtype == torch.float32 else "tf32"


def triton_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, softmax_scale: float,
                   out_dtype: torch.dtype, config: KernelConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel on validated inputs: (out [B, Sq, H, D] in out_dtype, lse [B, H, Sq] fp32),
    autotuned, or with `config`'s launch parameters when given."""
    batch, seq_q, n_heads, head_dim = q.shape
    seq_k, n_kv_heads = k.shape[1], k.shape[2]
    out = torch.empty((batch, seq_q, n_heads, head_dim), dtype=out_dtype, device=q.device)
    lse = torch.empty((batch, n_heads, seq_q), dtype=torch.float32, device=q.device)

    def grid(meta):
        return (triton.cdiv(seq_q, meta["BLOCK_M"]), batch * n_heads)

    launch(
        _forward_kernel, grid, config, q, k, v, out, lse,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        n_heads, seq_q, seq_k, softmax_scale, seq_bucket(seq_q, seq_k),
        GROUP=n_heads // n_kv_heads, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), CAUSAL=causal,
        EMULATE=INTERPRETED, DOT_PRECISION=dot_precision(q.dtype))
    return out, lse
