"""The portable family's backward: FlashAttention backward as two Pallas kernels (FlashAttention-2 split), fp32
gradients. Twin of `torch_impl/kernels/portable/backward.py`. The public API is `jax_impl.kernels.flash_attention`;
the helpers it shares with the forward are in `kernels/tiles.py`, its launch configs in `config.py`.

Inputs are the pair contract's: dout, q, k, v and the (possibly globally merged) out and lse. Plain JAX
first computes, in fp32, delta = rowsum(dout * out) and lse in the exp2 domain (rows whose lse is -inf, and
padded rows, get +inf so their probabilities come out exactly 0). With a global out/lse, P = exp(S - lse) is
this pair's share of the global softmax, so per-pair gradients sum to the full ones.

  - dK/dV kernel: one program per (KV block, batch, KV head) keeps its K/V tile and fp32 dK/dV accumulators
    and steps over every query block of every query head of its GQA group (one flat loop, so Triton pipelines
    across head boundaries), starting at the first query block that sees the keys; blocks crossing the causal
    diagonal are masked, the rest are not. Scores are formed transposed (K Q^T) so P^T and dS^T feed the
    dV += P^T dO and dK += dS^T Q matmuls straight from registers. dK/dV come out per KV head.
  - dQ kernel: one program per (query block, batch, head) steps over K/V blocks up to the diagonal, with the
    same unmasked/masked split and reverse causal scheduling as the forward.
With documents (`spans`) the dQ kernel walks key blocks as the forward does, and the dK/dV kernel the query
blocks between its keys' query spans (`weights/documents.py`), unmasked where they see all of its keys; blocks
without a pair are never loaded.
The softmax scale multiplies dQ and dK once at the end instead of every dS tile.
"""


from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_impl.documents import query_spans
from jax_impl.kernels.portable.config import KernelConfig
from jax_impl.kernels.tiles import (LOG2E, causal_visible, dot_precision, edge_padded_spans, fit_block,
                                    fold_block_runs, in_spans, index_div, index_rem, key_block_runs, matmul,
                                    matmul_nt, output_struct, pad_axis, padded_head_dim, program_q_block,
                                    q_block_range, query_block_map, query_grid_maps, round_up, span_block_runs,
                                    visible_keys)


def _dkdv_kernel(*refs, causal: bool, spans: bool, scale: float, block_q: int, group: int, offset: int,
                 num_q_blocks: int, precision):
    if spans:  # the key spans of every query row, and the query spans of this block's keys
        (q_ref, k_ref, v_ref, dout_ref, lse2_ref, delta_ref, key_start_ref, key_end_ref, query_start_ref,
         query_end_ref, dk_ref, dv_ref) = refs
    else:
        q_ref, k_ref, v_ref, dout_ref, lse2_ref, delta_ref, dk_ref, dv_ref = refs
    block_k = k_ref.shape[0]
    k_first = pl.program_id(0) * block_k
    k = k_ref[...]
    v = v_ref[...]
    k_pos = k_first + jnp.arange(block_k, dtype=jnp.int32)[:, None]
    scale_log2 = scale * LOG2E

    def step(t, carry, *, first_q_block, masked: bool):
        dk, dv = carry
        # Flat loop over (query block, head of the group), head fastest; t >= 0, so truncating lax ops suffice.
        head = index_rem(t, group) if group > 1 else 0
        q_first = (first_q_block + (index_div(t, group) if group > 1 else t)) * block_q
        rows = pl.ds(q_first, block_q)
        q = q_ref[rows, head, :]
        dout = dout_ref[rows, head, :]
        lse2 = lse2_ref[head, rows]
        delta = delta_ref[head, rows]
        probs_t = jnp.exp2(matmul_nt(k, q, precision) * scale_log2 - lse2[None, :])  # [block_k, block_q]
        if masked and spans:  # padded query rows repeat the last real row's span: their P is 0 by lse2 = +inf
            seen = in_spans(key_start_ref[rows][None, :], key_end_ref[rows][None, :], k_pos)
            probs_t = jnp.where(seen, probs_t, 0.0)
        elif masked:  # only causal runs have masked blocks; padded keys need no mask, their rows are sliced off
            q_pos = q_first + jnp.arange(block_q, dtype=jnp.int32)[None, :]
            probs_t = jnp.where(causal_visible(q_pos, k_pos, offset), probs_t, 0.0)
        dv = dv + matmul(probs_t.astype(dout.dtype), dout, precision)
        dscores_t = probs_t * (matmul_nt(v, dout, precision) - delta[None, :])
        dk = dk + matmul(dscores_t.astype(q.dtype), q, precision)
        return dk, dv

    carry = (jnp.zeros(dk_ref.shape, jnp.float32), jnp.zeros(dv_ref.shape, jnp.float32))
    if spans:  # documents: query blocks that see none of these keys are skipped, those that see all unmasked
        runs = span_block_runs(query_start_ref, query_end_ref, block_q)
    else:
        start, full_start = q_block_range(k_first, block_k, block_q, causal=causal, offset=offset,
                                          num_q_blocks=num_q_blocks)
        runs = ((start, full_start, True),) if causal else ()
        runs += ((full_start, num_q_blocks, False),)
    for first, end, masked in runs:  # (first query block, end, masked) of each run of query blocks
        carry = lax.fori_loop(0, (end - first) * group, functools.partial(step, first_q_block=first, masked=masked),
                              carry)
    dk, dv = carry
    dk_ref[...] = dk * scale
    dv_ref[...] = dv


def _dq_kernel(*refs, causal: bool, spans: bool, scale: float, block_k: int, offset: int, seq_k: int,
               num_q_blocks: int, num_k_blocks: int, precision):
    if spans:
        q_ref, k_ref, v_ref, dout_ref, lse2_ref, delta_ref, span_start_ref, span_end_ref, dq_ref = refs
        row_spans = span_start_ref[...], span_end_ref[...]
    else:
        q_ref, k_ref, v_ref, dout_ref, lse2_ref, delta_ref, dq_ref = refs
        row_spans = None
    block_q = q_ref.shape[0]
    q_first = program_q_block(causal, num_q_blocks) * block_q
    q = q_ref[...]
    dout = dout_ref[...]
    lse2 = lse2_ref[...]
    delta = delta_ref[...]
    q_pos = q_first + jnp.arange(block_q, dtype=jnp.int32)[:, None]
    scale_log2 = scale * LOG2E

    def step(k_block, dq, *, masked: bool):
        rows = pl.ds(k_block * block_k, block_k)
        k = k_ref[rows, :]
        v = v_ref[rows, :]
        probs = jnp.exp2(matmul_nt(q, k, precision) * scale_log2 - lse2[:, None])
        if masked:
            seen = visible_keys(q_pos, k_block, block_k, row_spans, causal=causal, offset=offset, seq_k=seq_k)
            probs = jnp.where(seen, probs, 0.0)
        dscores = probs * (matmul_nt(dout, v, precision) - delta[:, None])
        return dq + matmul(dscores.astype(k.dtype), k, precision)

    # The forward's walk: with documents, key blocks outside every row's span skipped.
    runs = key_block_runs(q_first, block_q, block_k, causal=causal, offset=offset, seq_k=seq_k,
                          num_k_blocks=num_k_blocks, span_refs=(span_start_ref, span_end_ref) if spans else None)
    dq_ref[...] = fold_block_runs(step, runs, jnp.zeros(dq_ref.shape, jnp.float32)) * scale


@functools.partial(jax.jit, static_argnames=("causal", "softmax_scale", "dkdv_config", "dq_config", "interpret"))
def portable_backward(dout: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, out: jax.Array, lse: jax.Array, *,
                      causal: bool, softmax_scale: float, dkdv_config: KernelConfig, dq_config: KernelConfig,
                      interpret: bool, spans=None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Pallas backward on validated inputs: (dq, dk, dv) in float32, shaped like q, k, v. `spans` as for
    `portable_forward` (the dK/dV kernel walks the query spans derived from them)."""
    batch, seq_q, heads, head_dim = q.shape
    seq_k, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    dkdv_block_q, dkdv_block_k = fit_block(dkdv_config.block_q, seq_q), fit_block(dkdv_config.block_k, seq_k)
    dq_block_q, dq_block_k = fit_block(dq_config.block_q, seq_q), fit_block(dq_config.block_k, seq_k)
    q_len = round_up(seq_q, math.lcm(dkdv_block_q, dq_block_q))
    k_len = round_up(seq_k, math.lcm(dkdv_block_k, dq_block_k))
    dim = padded_head_dim(head_dim)
    offset = seq_k - seq_q
    precision = dot_precision(q.dtype)

    # Row statistics in fp32 plain JAX, padded rows neutral: delta 0 and lse2 +inf make their P and dS exactly 0.
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1).transpose(0, 2, 1)
    lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse.astype(jnp.float32) * LOG2E)
    delta = pad_axis(delta, 2, q_len)
    lse2 = pad_axis(lse2, 2, q_len, value=jnp.inf)
    q = pad_axis(pad_axis(q, 1, q_len), 3, dim)
    dout = pad_axis(pad_axis(dout.astype(q.dtype), 1, q_len), 3, dim)
    k = pad_axis(pad_axis(k, 1, k_len), 3, dim)
    v = pad_axis(pad_axis(v, 1, k_len), 3, dim)
    inputs = (q, k, v, dout, lse2, delta)
    key_spans = () if spans is None else edge_padded_spans(spans, q_len)
    dkdv_spans = () if spans is None else key_spans + edge_padded_spans(query_spans(spans, seq_k), k_len)

    # dK/dV: grid over (KV block, batch, KV head); Q-side refs hold the whole group's heads.
    def kv_block_map(j, b, g):
        return b, j, g, 0

    def group_rows_map(j, b, g):
        return b, 0, g, 0

    def group_stats_map(j, b, g):
        return b, g, 0

    def all_rows_map(j, b, g):  # the key spans of every query row
        return b, 0

    def key_rows_map(j, b, g):  # the query spans of this block's keys
        return b, j

    span_specs = [] if spans is None else [pl.BlockSpec((pl.squeezed, q_len), all_rows_map)] * 2 + \
        [pl.BlockSpec((pl.squeezed, dkdv_block_k), key_rows_map)] * 2
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, causal=causal, spans=spans is not None, scale=softmax_scale,
                          block_q=dkdv_block_q, group=group, offset=offset, num_q_blocks=q_len // dkdv_block_q,
                          precision=precision),
        grid=(k_len // dkdv_block_k, batch, kv_heads),
        in_specs=[pl.BlockSpec((pl.squeezed, q_len, group, dim), group_rows_map),
                  pl.BlockSpec((pl.squeezed, dkdv_block_k, pl.squeezed, dim), kv_block_map),
                  pl.BlockSpec((pl.squeezed, dkdv_block_k, pl.squeezed, dim), kv_block_map),
                  pl.BlockSpec((pl.squeezed, q_len, group, dim), group_rows_map),
                  pl.BlockSpec((pl.squeezed, group, q_len), group_stats_map),
                  pl.BlockSpec((pl.squeezed, group, q_len), group_stats_map)] + span_specs,
        out_specs=[pl.BlockSpec((pl.squeezed, dkdv_block_k, pl.squeezed, dim), kv_block_map),
                   pl.BlockSpec((pl.squeezed, dkdv_block_k, pl.squeezed, dim), kv_block_map)],
        out_shape=[output_struct(k.shape, jnp.float32, *inputs), output_struct(v.shape, jnp.float32, *inputs)],
        compiler_params=plgpu.CompilerParams(num_warps=dkdv_config.num_warps, num_stages=dkdv_config.num_stages),
        interpret=interpret,
        name="twinflash_backward_dkdv",
    )(*inputs, *dkdv_spans)

    # dQ: grid over (query block, batch, head); K/V refs hold the whole sequence of the head's KV head.
    num_q_blocks = q_len // dq_block_q

    q_block_map, kv_rows_map, q_stats_map = query_grid_maps(causal, num_q_blocks, group)

    dq = pl.pallas_call(
        functools.partial(_dq_kernel, causal=causal, spans=spans is not None, scale=softmax_scale, block_k=dq_block_k,
                          offset=offset, seq_k=seq_k, num_q_blocks=num_q_blocks, num_k_blocks=k_len // dq_block_k,
                          precision=precision),
        grid=(num_q_blocks, batch, heads),
        in_specs=[pl.BlockSpec((pl.squeezed, dq_block_q, pl.squeezed, dim), q_block_map),
                  pl.BlockSpec((pl.squeezed, k_len, pl.squeezed, dim), kv_rows_map),
                  pl.BlockSpec((pl.squeezed, k_len, pl.squeezed, dim), kv_rows_map),
                  pl.BlockSpec((pl.squeezed, dq_block_q, pl.squeezed, dim), q_block_map),
                  pl.BlockSpec((pl.squeezed, pl.squeezed, dq_block_q), q_stats_map),
                  pl.BlockSpec((pl.squeezed, pl.squeezed, dq_block_q), q_stats_map)]
        + [pl.BlockSpec((pl.squeezed, dq_block_q), query_block_map(causal, num_q_blocks))] * len(key_spans),
        out_specs=pl.BlockSpec((pl.squeezed, dq_block_q, pl.squeezed, dim), q_block_map),
        out_shape=output_struct(q.shape, jnp.float32, *inputs),
        compiler_params=plgpu.CompilerParams(num_warps=dq_config.num_warps, num_stages=dq_config.num_stages),
        interpret=interpret,
        name="twinflash_backward_dq",
    )(*inputs, *key_spans)
    return dq[:, :seq_q, :, :head_dim], dk[:, :seq_k, :, :head_dim], dv[:, :seq_k, :, :head_dim]
