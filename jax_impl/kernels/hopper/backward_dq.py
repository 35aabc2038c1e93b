"""The Hopper family's dQ kernel (the two-kernel backward form, `HopperConfig.bwd_form == "two_kernel"`): a CTA owns
2 * dq_block_q query rows of one (batch, head), one compute warpgroup per dq_block_q; the TMA warpgroup streams K/V
blocks of dq_block_kv keys as in the forward (unmasked, then masked steps; longest tiles first). Per step (3
wgmmas, `backward_step.gradient_step`): S = Q K^T, P, dP = dO V^T, dS = P (dP - delta), dQ += dS K. Split from
`backward.py` (which owns the form's choice, the dK/dV kernel and the wrapper) by responsibility.

Documents (`span_refs`): the tile streams the K/V blocks between its rows' lowest key_start and highest key_end,
each warpgroup computes its own rows' runs of them (masked by each row's span at the edges, unmasked inside) and
drains the rest (`tiles.tile_span_bounds`), as the forward does.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_impl.kernels.hopper.backward_step import gradient_step, store_fp32
from jax_impl.kernels.hopper.config import COMPUTE_WARPGROUPS, HopperConfig
from jax_impl.kernels.tiles import (LOG2E, copy_in, fold_block_runs, index_div, index_rem, iota, launch, layout,
                                    load_rows, output_struct, part_runs, query_tile, stream_blocks, tile_index,
                                    tile_span, tile_span_bounds, warpgroup_rows)


def stream_kv(refs, smem, barriers, consumed, *, batch, kv_head, block_kv: int, steps, stages: int, registers: int,
              first_block=None):
    """The TMA warpgroup of a kernel whose compute warpgroups walk K/V blocks [0, steps) of one KV head (from
    `first_block` on, with documents): block s's K and V (`refs` in global memory) go into slot s % stages of
    `smem` (`stream_blocks`, under the register cap `registers`)."""
    def rows_of(step):
        return batch, pl.ds((step if first_block is None else first_block + step) * block_kv, block_kv), kv_head
    stream_blocks(refs, smem, barriers, consumed, rows_of=rows_of, steps=steps, stages=stages,
                  registers=registers)


def _dq_kernel(q_ref, k_ref, v_ref, dout_ref, lse2_ref, delta_ref, *refs, q_smem2, dout_smem2, lse_smem2,
               delta_smem2, out_smem2, k_smem, v_smem, row_barriers, k_barriers, v_barriers, k_consumed,
               v_consumed, causal: bool, scale: float, block_q: int, block_kv: int, stages: int, group: int,
               offset: int, seq_k: int, num_kv: int, num_tiles: int, overlap: bool, registers: tuple[int, int],
               interpret: bool):
    """refs: dq_ref, after documents' (key_start, key_end, tile_span_bounds) when given (then `causal` is False).
    `registers`: the (TMA warpgroup's, compute warpgroups') caps, `HopperConfig.backward_registers`."""
    *span_refs, dq_ref = refs
    batch, head, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
    first_block = None  # with documents, the tile streams K/V blocks first_block + [0, tile_steps)
    if not span_refs:
        tile_first, kv_range, tile_steps = query_tile(causal=causal, num_tiles=num_tiles, block_q=block_q,
                                                      block_kv=block_kv, offset=offset, seq_k=seq_k, num_kv=num_kv,
                                                      warpgroups=COMPUTE_WARPGROUPS)
    else:
        tile = tile_index(True, num_tiles)  # longest first, as the forward runs documents
        tile_first = tile * (COMPUTE_WARPGROUPS * block_q)
        first_block, tile_steps = tile_span(span_refs[2], batch, tile)

    def drain(begin, end):
        """Steps [begin, end) that only the other warpgroup needs: observe their loads, release their slots."""
        @pl.loop(begin, end)
        def _drain(kv_step):
            slot = index_rem(kv_step, stages)
            for full, done in ((k_barriers, k_consumed), (v_barriers, v_consumed)):
                plgpu.barrier_wait(full.at[slot])
                plgpu.barrier_arrive(done.at[slot])

    @pl.when(wg < COMPUTE_WARPGROUPS)
    def _compute():
        plgpu.set_max_registers(registers[1], action="increase")
        q_smem, dout_smem = q_smem2.at[wg], dout_smem2.at[wg]
        q_first, rows = warpgroup_rows(tile_first, wg, block_q, batch, head)
        stats = (batch, head, pl.ds(q_first, block_q))
        copies = ((q_ref.at[rows], q_smem), (dout_ref.at[rows], dout_smem),
                  (lse2_ref.at[stats], lse_smem2.at[wg]), (delta_ref.at[stats], delta_smem2.at[wg]))
        copy_in(copies, row_barriers, len(copies) * wg)
        lse2 = load_rows(lse_smem2.at[wg], plgpu.Layout.WGMMA.reduce(1), interpret=interpret)
        delta = load_rows(delta_smem2.at[wg], plgpu.Layout.WGMMA.reduce(1), interpret=interpret)
        if not span_refs:  # blocks every row sees whole, then those crossing the diagonal or holding padded keys
            n_full, n_end = kv_range(q_first)
            runs = ((0, n_full, False),) + (((n_full, n_end, True),) if causal or seq_k % block_kv else ())
        else:  # documents: this warpgroup's runs of the tile's steps, each row's key span for the masked ones
            runs = part_runs(span_refs[2], batch, tile, wg, first_block)
            n_end = runs[-1][1]
            key_start, key_end = (load_rows(ref.at[batch, pl.ds(q_first, block_q)], plgpu.Layout.WGMMA.reduce(1),
                                            interpret=interpret, from_global=True) for ref in span_refs[:2])
            drain(0, runs[0][0])

        def step(kv_step, dq, *, masked: bool):
            slot = index_rem(kv_step, stages)
            plgpu.barrier_wait(k_barriers.at[slot])
            plgpu.barrier_wait(v_barriers.at[slot])

            def probs_of(scores):
                probs = jnp.exp2(scores * (scale * LOG2E) - lax.broadcast_in_dim(lse2, scores.shape, [0]))
                if masked and not span_refs:
                    q_pos = q_first + iota(scores.shape, 0, interpret=interpret)
                    k_pos = kv_step * block_kv + iota(scores.shape, 1, interpret=interpret)
                    seen = (k_pos <= q_pos + offset) if causal else (k_pos < seq_k)
                    probs = jnp.where(seen, probs, 0.0)
                elif masked:  # documents: the keys in each row's span
                    k_pos = (first_block + kv_step) * block_kv + iota(scores.shape, 1, interpret=interpret)
                    seen = ((k_pos >= lax.broadcast_in_dim(key_start, scores.shape, [0]))
                            & (k_pos < lax.broadcast_in_dim(key_end, scores.shape, [0])))
                    probs = jnp.where(seen, probs, 0.0)
                return probs

            def dscores_of(probs, dprobs):
                return probs * (dprobs - lax.broadcast_in_dim(delta, dprobs.shape, [0]))

            _, dq = gradient_step((q_smem, k_smem.at[slot]), (dout_smem, v_smem.at[slot]), probs_of, dscores_of,
                                  None, (dq, k_smem.at[slot]), overlap=overlap, interpret=interpret)
            plgpu.barrier_arrive(v_consumed.at[slot])
            plgpu.barrier_arrive(k_consumed.at[slot])
            return dq

        dq = layout(jnp.zeros((block_q, q_smem.shape[-1]), jnp.float32), plgpu.Layout.WGMMA, interpret=interpret)
        dq = fold_block_runs(step, runs, dq)
        drain(n_end, tile_steps)
        store_fp32((dq * scale,), out_smem2.at[wg], (dq_ref.at[rows],))

    @pl.when(wg == COMPUTE_WARPGROUPS)
    def _producer():
        stream_kv((k_ref, v_ref), (k_smem, v_smem), (k_barriers, v_barriers), (k_consumed, v_consumed),
                  batch=batch, kv_head=index_div(head, group), block_kv=block_kv, steps=tile_steps, stages=stages,
                  registers=registers[0], first_block=first_block)


def dq_call(inputs, span_inputs, smem, *, causal: bool, scale: float, config: HopperConfig, group: int,
            offset: int, seq_k: int, stages: int, dq_shape, interpret: bool):
    """The two-kernel form's dQ kernel on the padded inputs, its scratch `smem` (`config.dq_scratch`).
    `span_inputs`: documents' key spans padded to the query rows (`tiles.edge_padded_spans`), or ()."""
    batch, q_len, heads, _ = dq_shape
    block_q, block_kv, wgs = config.dq_block_q, config.dq_block_kv, COMPUTE_WARPGROUPS
    num_kv = inputs[1].shape[1] // block_kv
    num_tiles = q_len // (wgs * block_q)
    if span_inputs:  # the block ranges of each tile and its warpgroups
        span_inputs += (tile_span_bounds(*span_inputs, rows=block_q, parts=wgs, block=block_kv),)
    return launch(
        functools.partial(_dq_kernel, causal=causal, scale=scale, block_q=block_q, block_kv=block_kv,
                          stages=stages, group=group, offset=offset, seq_k=seq_k, num_kv=num_kv,
                          num_tiles=num_tiles, overlap=config.bwd_overlap, registers=config.backward_registers,
                          interpret=interpret),
        smem.buffers, output_struct(dq_shape, jnp.float32, *inputs),
        dict(heads=heads, q_tile=num_tiles, batch=batch), inputs + tuple(span_inputs), warpgroups=wgs,
        interpret=interpret, name="twinflash_backward_dq_hopper")
