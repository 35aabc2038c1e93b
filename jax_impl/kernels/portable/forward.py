"""The portable family's forward: FlashAttention forward as a Pallas kernel (Triton lowering on GPU, interpreted on
CPU). Twin of `torch_impl/kernels/portable/forward.py`. The public API is `jax_impl.kernels.flash_attention`; the
helpers it shares with the backward are in `kernels/tiles.py`, its launch configs in `config.py`.

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
Documents (`spans`, `weights/documents.py`): each row sees its key span instead of the causal rule; a program
visits the key blocks between its rows' lowest start and highest end, those inside every row's span unmasked, the
rest masked, and never loads the blocks outside (padded rows repeat the last row's span, so they move no bound).
Tails: the wrapper pads Sq/Sk to the block multiple and D to a power of two (>= 16, Triton's smallest dot);
padded keys are masked by position, padded query rows are sliced off.
"""


from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_impl.kernels.portable.config import KernelConfig
from jax_impl.kernels.tiles import (LN2, LOG2E, dot_precision, edge_padded_spans, fit_block, fold_block_runs,
                                    key_block_runs, matmul, matmul_nt, output_struct, pad_axis, padded_head_dim,
                                    program_q_block, query_block_map, query_grid_maps, round_up, visible_keys)


def _forward_kernel(*refs, causal: bool, spans: bool, scale_log2: float, block_k: int, offset: int, seq_k: int,
                    num_q_blocks: int, num_k_blocks: int, precision):
    if spans:
        q_ref, k_ref, v_ref, span_start_ref, span_end_ref, out_ref, lse_ref = refs
        row_spans = span_start_ref[...], span_end_ref[...]
    else:
        q_ref, k_ref, v_ref, out_ref, lse_ref = refs
        row_spans = None
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
            seen = visible_keys(q_pos, k_block, block_k, row_spans, causal=causal, offset=offset, seq_k=seq_k)
            scores = jnp.where(seen, scores, -jnp.inf)
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
    # With documents, key blocks outside every row's span are skipped and those inside all of them run unmasked.
    runs = key_block_runs(q_first, block_q, block_k, causal=causal, offset=offset, seq_k=seq_k,
                          num_k_blocks=num_k_blocks, span_refs=(span_start_ref, span_end_ref) if spans else None)
    acc, row_max, row_sum = fold_block_runs(step, runs, carry)

    seen = row_sum > 0  # False only for rows that see no key (causal with Sq > Sk): out 0, lse -inf
    out_ref[...] = (acc * jnp.where(seen, 1.0 / row_sum, 0.0)[:, None]).astype(out_ref.dtype)
    lse_ref[...] = jnp.where(seen, row_max * LN2 + jnp.log(row_sum), -jnp.inf)


@functools.partial(jax.jit, static_argnames=("causal", "softmax_scale", "out_dtype", "config", "interpret"))
def portable_forward(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool, softmax_scale: float, out_dtype,
                     config: KernelConfig, interpret: bool, spans=None) -> tuple[jax.Array, jax.Array]:
    """Pallas forward on validated inputs: (out [B, Sq, H, D] in `out_dtype`, lse [B, H, Sq] float32). `spans`:
    the documents' key spans (`jax_impl.documents.Spans`), which replace the causal rule (the caller folds it in:
    `causal` is then False)."""
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
    inputs = [q, k, v]
    in_specs = [pl.BlockSpec((pl.squeezed, block_q, pl.squeezed, dim), q_map),
                pl.BlockSpec((pl.squeezed, k_len, pl.squeezed, dim), kv_map),
                pl.BlockSpec((pl.squeezed, k_len, pl.squeezed, dim), kv_map)]
    if spans is not None:
        inputs += edge_padded_spans(spans, q_len)
        in_specs += [pl.BlockSpec((pl.squeezed, block_q), query_block_map(causal, num_q_blocks))] * 2
    kernel = functools.partial(
        _forward_kernel, causal=causal, spans=spans is not None, scale_log2=softmax_scale * LOG2E, block_k=block_k,
        offset=seq_k - seq_q, seq_k=seq_k, num_q_blocks=num_q_blocks, num_k_blocks=num_k_blocks,
        precision=dot_precision(q.dtype))
    out, lse = pl.pallas_call(
        kernel,
        grid=(num_q_blocks, batch, heads),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((pl.squeezed, block_q, pl.squeezed, dim), q_map),
                   pl.BlockSpec((pl.squeezed, pl.squeezed, block_q), lse_map)],
        out_shape=[output_struct((batch, q_len, heads, dim), out_dtype, *inputs),
                   output_struct((batch, heads, q_len), jnp.float32, *inputs)],
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="twinflash_forward",
    )(*inputs)
    return out[:, :seq_q, :, :head_dim], lse[:, :, :seq_q]
