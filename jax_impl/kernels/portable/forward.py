"""FlashAttention forward as a Pallas kernel (Triton lowering on GPU, interpreted on CPU), plus the
kernel-side pieces the backward kernels share: the launch configs (`KernelConfig` per kernel, `TritonConfig` for
the three, and the `default_config` heuristic), the fp32-accumulating matmuls, the visibility mask and the causal
block ranges. Twin of `torch_impl/flash_forward.py`.

Layout is the model's own, q [B, Sq, H, D] and k/v [B, Sk, Hkv, D]: BlockSpecs stride over the head axis,
so nothing is transposed. GQA is native: the K/V index map picks KV head h // (H // Hkv).

Kernel shape (one program = one block of `block_q` query rows of one (batch, head)):
  - online softmax in the exp2 domain (scores pre-multiplied by scale * log2(e), so each element costs one
    exp2), fp32 accumulation, P cast to V's dtype for the PV matmul;
  - the K/V loop is split in two: blocks every row of the query block fully sees run without any mask, then
    the few blocks that cross the causal diagonal (or hold padded keys) run masked; blocks no row sees are
    never visited;
  - causal grids run the query blocks in reverse, so the longest programs start first and the short ones
    fill the tail.
Tails: the wrapper pads Sq/Sk to the block multiple and D to a power of two (>= 16, Triton's smallest dot);
padded keys are masked by position, padded query rows are sliced off.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
MIN_BLOCK = 16  # Triton's smallest matmul tile edge


class KernelConfig(NamedTuple):
    """Launch parameters of one kernel. For the forward and dQ kernels a program owns `block_q` query rows
    and steps over K/V `block_k` rows at a time; for the dK/dV kernel a program owns `block_k` key rows and
    steps over queries `block_q` rows at a time. num_warps/num_stages only matter on the GPU."""
    block_q: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class TritonConfig:
    """Block sizes of the Triton-lowering kernels (the Mosaic kernels' twin is `HopperConfig`). forward and
    backward_dq: a program owns `block_q` query rows and steps over K/V by `block_k`; backward_dkdv: a program
    owns `block_k` key rows and steps over queries by `block_q` (for every query head of its GQA group)."""
    forward: KernelConfig
    backward_dkdv: KernelConfig
    backward_dq: KernelConfig


# GPU defaults for bf16/fp16 per kernel head dim (`padded_head_dim`: a power of two >= 16), starting points
# for the H200, screened offline for sm_90 (Triton IR compiled with ptxas: no register spills, shared memory
# within 227 KB); time them with compare/bench/pallas_sweep.py.
GPU_CONFIGS: dict[int, TritonConfig] = {
    16: TritonConfig(KernelConfig(128, 64, 4, 3), KernelConfig(64, 128, 8, 2), KernelConfig(128, 64, 4, 2)),
    32: TritonConfig(KernelConfig(128, 64, 4, 3), KernelConfig(64, 128, 8, 2), KernelConfig(128, 64, 4, 2)),
    64: TritonConfig(KernelConfig(64, 64, 4, 2), KernelConfig(32, 128, 4, 3), KernelConfig(128, 64, 4, 3)),
    128: TritonConfig(KernelConfig(128, 128, 8, 2), KernelConfig(64, 64, 4, 2), KernelConfig(128, 64, 8, 3)),
    256: TritonConfig(KernelConfig(64, 32, 8, 2), KernelConfig(32, 32, 8, 2), KernelConfig(64, 32, 8, 2)),
}
# fp32 inputs on the GPU run true-fp32 FMA dots (no tensor cores), whose operands and accumulators all sit in
# registers: only small tiles fit (spill-free up to head dim 128). A correctness path (fp32 models), not a
# speed path.
GPU_FP32_CONFIG = TritonConfig(KernelConfig(32, 16, 8, 2), KernelConfig(16, 16, 8, 2), KernelConfig(32, 16, 8, 2))
# Interpret mode (CPU): small, unequal tiles, so short test sequences still cross several blocks and tails.
INTERPRET_CONFIG = TritonConfig(KernelConfig(32, 16, 1, 1), KernelConfig(16, 32, 1, 1), KernelConfig(32, 16, 1, 1))


def default_config(head_dim: int, dtype, *, interpret: bool) -> TritonConfig:
    """Heuristic: the block sizes a call with this head dim and input dtype gets when it passes no config."""
    if interpret:
        return INTERPRET_CONFIG
    return GPU_FP32_CONFIG if jnp.dtype(dtype) == jnp.float32 else GPU_CONFIGS[padded_head_dim(head_dim)]


def padded_head_dim(head_dim: int) -> int:
    """Head dim the kernels run at: the next power of two, at least MIN_BLOCK (Triton tiles are powers of two)."""
    return max(MIN_BLOCK, pl.next_power_of_2(head_dim))


def fit_block(block: int, seq_len: int) -> int:
    """Shrink a block to the smallest power of two covering a short sequence, so tiny inputs aren't padded
    to a full 128-row tile."""
    return min(block, max(MIN_BLOCK, pl.next_power_of_2(seq_len)))


def pad_axis(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
    """Pad `axis` of x at the end up to `size` (no-op when already that long)."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def output_struct(shape, dtype, *inputs: jax.Array) -> jax.ShapeDtypeStruct:
    """pallas_call output spec. Inside `jax.shard_map` (check_vma) outputs must declare the mesh axes they vary
    over: the union of the inputs' (outside shard_map that set is empty)."""
    types = [jax.typeof(x).manual_axis_type for x in inputs]
    varying = frozenset().union(*(t.varying for t in types))
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=types[0].update(varying=varying))


def dot_precision(dtype) -> lax.Precision | None:
    """fp32 inputs get true fp32 matmuls (Triton would otherwise use TF32); half types need no setting."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def matmul(a: jax.Array, b: jax.Array, precision) -> jax.Array:
    """a [m, k] @ b [k, n], accumulated in float32."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def matmul_nt(a: jax.Array, b: jax.Array, precision) -> jax.Array:
    """a [m, k] @ b[n, k]^T, accumulated in float32 (Triton reads b transposed from shared memory)."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def causal_visible(q_pos: jax.Array, k_pos: jax.Array, offset: int) -> jax.Array:
    """Causal, bottom-right aligned: key j is visible to query i iff j <= i + offset, offset = Sk - Sq (this
    also hides padded keys from every real query row)."""
    return k_pos <= q_pos + offset


def visible(q_pos: jax.Array, k_pos: jax.Array, *, causal: bool, offset: int, seq_k: int) -> jax.Array:
    """Which (query, key) pairs attend: `causal_visible`, or without causality every real (unpadded) key."""
    return causal_visible(q_pos, k_pos, offset) if causal else k_pos < seq_k


def traced(value: int):
    """`value` as a traced int32 (Triton folds it back to the constant). Loop bounds go through this: with
    Python-int bounds fori_loop becomes a scan that carries the kernel's refs, and Pallas's interpreter cannot
    run that inside `jax.shard_map` (the scan carry fails the varying-mesh-axes check); a while loop it can."""
    return value + pl.program_id(0) * 0


def _int32(value):
    """A Python or numpy int as an int32 constant; traced values as they are (the kernels' indices are int32)."""
    return np.int32(value) if isinstance(value, (int, np.integer)) else value


def index_div(x, divisor):
    """x // divisor on the kernels' int32 indices (lax.div truncates, which is floor for x >= 0). Python ints
    enter as int32: with jax_enable_x64 on lax would make them int64, which it does not mix with the int32
    program, axis and loop indices."""
    return lax.div(_int32(x), _int32(divisor))


def index_rem(x, divisor):
    """x % divisor on the kernels' int32 indices (`index_div`'s remainder; x >= 0)."""
    return lax.rem(_int32(x), _int32(divisor))


def _nonneg_div(x, divisor: int):
    """x // divisor for a traced int clamped at 0."""
    return index_div(jnp.maximum(x, 0), divisor)


def kv_block_range(q_first, block_q: int, block_k: int, *, causal: bool, offset: int, seq_k: int,
                   num_k_blocks: int):
    """For query rows [q_first, q_first + block_q): (n_full, n_end). K/V blocks [0, n_full) are fully
    visible to every row; [n_full, n_end) need the mask; blocks from n_end on are seen by no row."""
    if not causal:
        return traced(seq_k // block_k), traced(num_k_blocks)
    n_end = jnp.minimum(_nonneg_div(q_first + block_q + offset + block_k - 1, block_k), num_k_blocks)
    n_full = jnp.minimum(_nonneg_div(q_first + offset + 1, block_k), n_end)
    return n_full, n_end


def has_masked_blocks(causal: bool, seq_k: int, block_k: int) -> bool:
    """Whether a query block can meet K/V blocks that need the mask: the causal diagonal, or padded keys."""
    return causal or seq_k % block_k != 0


def q_block_range(k_first, block_k: int, block_q: int, *, causal: bool, offset: int, num_q_blocks: int):
    """For key rows [k_first, k_first + block_k): (start, full_start). Query blocks before `start` see none
    of these keys, [start, full_start) see some (masked), [full_start, num_q_blocks) see all of them."""
    if not causal:
        return traced(0), traced(0)
    start = jnp.minimum(_nonneg_div(k_first - offset, block_q), num_q_blocks)
    full_start = jnp.minimum(_nonneg_div(k_first + block_k - 1 - offset + block_q - 1, block_q), num_q_blocks)
    return start, jnp.maximum(full_start, start)


def program_q_block(causal: bool, num_q_blocks: int):
    """This program's query block; causal grids run in reverse so the longest programs are scheduled first."""
    i = pl.program_id(0)
    return num_q_blocks - 1 - i if causal else i


def q_block_index(causal: bool, num_q_blocks: int, i):
    """Index-map twin of `program_q_block` (index maps see grid indices, not program_id)."""
    return num_q_blocks - 1 - i if causal else i


def query_grid_maps(causal: bool, num_q_blocks: int, group: int):
    """BlockSpec index maps of a grid over (query block, batch, head), as the forward and dQ kernels run:
    (a block of a [B, Sq, H, D] array, the whole sequence of the head's KV head in [B, Sk, Hkv, D], a block of
    the row statistics [B, H, Sq])."""
    def rows_map(i, b, h):
        return b, q_block_index(causal, num_q_blocks, i), h, 0

    def kv_map(i, b, h):
        return b, 0, h // group, 0

    def stats_map(i, b, h):
        return b, h, q_block_index(causal, num_q_blocks, i)

    return rows_map, kv_map, stats_map


def _forward_kernel(q_ref, k_ref, v_ref, out_ref, lse_ref, *, causal: bool, scale_log2: float, block_k: int,
                    offset: int, seq_k: int, num_q_blocks: int, num_k_blocks: int, precision):
    block_q, head_dim = q_ref.shape
    q_first = program_q_block(causal, num_q_blocks) * block_q
    q = q_ref[...]
    q_pos = q_first + jnp.arange(block_q, dtype=jnp.int32)[:, None]

    def step(k_block, carry, *, masked: bool):
        acc, row_max, row_sum = carry
        rows = pl.ds(k_block * block_k, block_k)
        k = k_ref[rows, :]
        v = v_ref[rows, :]
        scores = matmul_nt(q, k, precision) * scale_log2
        if masked:
            k_pos = k_block * block_k + jnp.arange(block_k, dtype=jnp.int32)[None, :]
            scores = jnp.where(visible(q_pos, k_pos, causal=causal, offset=offset, seq_k=seq_k), scores, -jnp.inf)
        new_max = jnp.maximum(row_max, jnp.max(scores, axis=1))
        if masked:
            # A row that has seen only masked keys keeps max -inf; subtracting 0 instead keeps exp2 at 0, not NaN.
            new_max_safe = jnp.where(new_max == -jnp.inf, 0.0, new_max)
        else:
            new_max_safe = new_max
        probs = jnp.exp2(scores - new_max_safe[:, None])
        rescale = jnp.exp2(row_max - new_max_safe)
        row_sum = row_sum * rescale + jnp.sum(probs, axis=1)
        acc = acc * rescale[:, None] + matmul(probs.astype(v.dtype), v, precision)
        return acc, new_max, row_sum

    carry = (jnp.zeros((block_q, head_dim), jnp.float32),
             jnp.full((block_q,), -jnp.inf, jnp.float32),
             jnp.zeros((block_q,), jnp.float32))
    n_full, n_end = kv_block_range(q_first, block_q, block_k, causal=causal, offset=offset, seq_k=seq_k,
                                   num_k_blocks=num_k_blocks)
    carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False), carry)
    if has_masked_blocks(causal, seq_k, block_k):
        carry = lax.fori_loop(n_full, n_end, functools.partial(step, masked=True), carry)
    acc, row_max, row_sum = carry

    seen = row_sum > 0  # False only for rows that see no key (causal with Sq > Sk): out 0, lse -inf
    out_ref[...] = (acc * jnp.where(seen, 1.0 / row_sum, 0.0)[:, None]).astype(out_ref.dtype)
    lse_ref[...] = jnp.where(seen, row_max * LN2 + jnp.log(row_sum), -jnp.inf)


@functools.partial(jax.jit, static_argnames=("causal", "softmax_scale", "out_dtype", "config", "interpret"))
def pallas_forward(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool, softmax_scale: float, out_dtype,
                  config: KernelConfig, interpret: bool) -> tuple[jax.Array, jax.Array]:
    """Pallas forward on validated inputs: (out [B, Sq, H, D] in `out_dtype`, lse [B, H, Sq] float32)."""
    batch, seq_q, heads, head_dim = q.shape
    seq_k, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    block_q = fit_block(config.block_q, seq_q)
    block_k = fit_block(config.block_k, seq_k)
    dim = padded_head_dim(head_dim)
    q_len, k_len = round_up(seq_q, block_q), round_up(seq_k, block_k)
    num_q_blocks, num_k_blocks = q_len // block_q, k_len // block_k

    q = pad_axis(pad_axis(q, 1, q_len), 3, dim)
    k = pad_axis(pad_axis(k, 1, k_len), 3, dim)
    v = pad_axis(pad_axis(v, 1, k_len), 3, dim)

    q_map, kv_map, lse_map = query_grid_maps(causal, num_q_blocks, group)
    kernel = functools.partial(
        _forward_kernel, causal=causal, scale_log2=softmax_scale * LOG2E, block_k=block_k,
        offset=seq_k - seq_q, seq_k=seq_k, num_q_blocks=num_q_blocks, num_k_blocks=num_k_blocks,
        precision=dot_precision(q.dtype))
    out, lse = pl.pallas_call(
        kernel,
        grid=(num_q_blocks, batch, heads),
        in_specs=[pl.BlockSpec((pl.squeezed, block_q, pl.squeezed, dim), q_map),
                  pl.BlockSpec((pl.squeezed, k_len, pl.squeezed, dim), kv_map),
                  pl.BlockSpec((pl.squeezed, k_len, pl.squeezed, dim), kv_map)],
        out_specs=[pl.BlockSpec((pl.squeezed, block_q, pl.squeezed, dim), q_map),
                   pl.BlockSpec((pl.squeezed, pl.squeezed, block_q), lse_map)],
        out_shape=[output_struct((batch, q_len, heads, dim), out_dtype, q, k, v),
                   output_struct((batch, heads, q_len), jnp.float32, q, k, v)],
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="twinflash_forward",
    )(q, k, v)
    return out[:, :seq_q, :, :head_dim], lse[:, :, :seq_q]
