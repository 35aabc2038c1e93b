"""The Hopper family's forward: FlashAttention forward for sm90 as a Pallas Mosaic GPU kernel. Twin of
`torch_impl/kernels/hopper/forward.py` (the family's torch forward, a Gluon kernel of its own design). The public API
is `jax_impl.kernels.flash_attention`; the launch config (`HopperConfig`, heuristics, autotune space) and each
kernel's shared memory live in `config.py`, the warpgroup plumbing it shares with the backward (TMA producer loop,
step ranges, launch, interpreter switch) in `kernels/tiles.py`.

Same contract as `portable.forward.portable_forward`: q [B, Sq, H, D], k/v [B, Sk, Hkv, D] (GQA: the KV head is
h // (H // Hkv), K/V never repeated), causal aligned bottom-right (query i sees key j iff j <= i + Sk - Sq),
any lengths, out in `out_dtype`, lse [B, H, Sq] natural log, -inf (with out 0) for a row that sees no key.
Head dims 64 and 128, bf16/fp16 only (`config.hopper_unsupported` says which calls this kernel serves).

Kernel shape (one CTA = compute_warpgroups * block_q query rows of one (batch, head)), after FlashAttention-3:
  - two or three compute warpgroups (`HopperConfig.compute_warpgroups`; three = FA3's 192-row tiles at D=64)
    own block_q = 64 query rows each, one more warpgroup issues the TMA copies of K/V blocks into a
    `num_stages`-deep ring of shared-memory slots (full/consumed barriers);
  - a turn goes round the compute warpgroups (FA3's ping-pong for any count), so one's softmax overlaps the
    others' matmuls;
  - online softmax in the exp2 domain (one FMA + exp2 per score), fp32 accumulators in registers;
  - the K/V loop is split: blocks every row sees run unmasked, then the few crossing the causal diagonal
    or holding padded keys run masked; blocks no row sees are never loaded;
  - causal grids visit the query tiles longest first; full attention may take its own K/V block and warpgroup
    count and a persistent grid (one CTA per SM walking (batch, head, query tile) items): `forward_schedule`.
Documents (`spans`, `weights/documents.py`): each row sees its key span instead of the causal rule. A tile streams
the K/V blocks between its rows' lowest start and highest end (`tiles.tile_span_bounds`, computed before the launch);
each warpgroup runs its own rows' blocks, masked by each row's span where only some rows see part of a block,
unmasked where every row sees it whole, and drains the tile's other blocks without reading them, so a block of
another document is never loaded by a warpgroup that does not attend it. Documents take the causal schedule (no
persistent grid: tiles walk different step counts).
Tails: the wrapper pads Sq to compute_warpgroups * block_q and Sk to block_kv (padded keys are masked by
position, or lie past every span; padded query rows repeat the last row's span and are sliced off).

GPU interpreter (CPU tests, `interpret=True`): `matmul_acc` (P V) here, like `tiles.wgmma_nt` (Q K^T), is a plain
fp32-accumulating dot under interpretation (lines marked INTERPRET; `kernels/tiles.py` says why).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_impl.kernels.hopper.config import (HopperConfig, check_smem, forward_scratch, forward_stages,
                                            register_caps)
from jax_impl.kernels.tiles import (LN2, LOG2E, edge_padded_spans, fold_block_runs, index_div, index_rem, iota,
                                    launch, layout, load_rows, output_struct, pad_axis, part_runs, query_tile,
                                    round_up, stream_blocks, tile_index, tile_span, tile_span_bounds, warpgroup_rows,
                                    wgmma_nt)


def sm_count(interpret: bool) -> int:
    """CTAs of a persistent grid: the GPU's SM count (132 on an H100/H200 SXM if the device does not say);
    under the interpreter 2, so the tests' CTAs each walk several items."""
    return 2 if interpret else getattr(jax.devices()[0], "core_count", 132)


def matmul_acc(acc, a, b_smem, *, interpret: bool):
    """acc + a @ b in fp32, a in registers (the wgmma register-A form) or shared memory, b in shared memory."""
    if interpret:  # INTERPRET: the interpreter has neither register-A wgmma nor run_state on an accumulator
        a = a if isinstance(a, jax.Array) else a[...]
        return acc + jnp.dot(a, b_smem[...], preferred_element_type=jnp.float32)

    def compute(acc_ref):
        plgpu.wgmma(acc_ref, a, b_smem)
    return pl.run_state(compute)(plgpu.ACC.init(acc))


def _forward_kernel(q_ref, k_ref, v_ref, out_ref, lse_ref, q_smem2, o_smem2, lse_smem2, k_smem, v_smem,
                    q_barriers, k_barriers, v_barriers, k_consumed, v_consumed, turn_barriers, *,
                    causal: bool, scale_log2: float, block_q: int, block_kv: int, stages: int, group: int,
                    offset: int, seq_k: int, num_kv: int, num_tiles: int, heads: int, warpgroups: int,
                    num_items: int | None, interpret: bool, span_refs=None):
    """One CTA's work: its query tile, or (persistent, `num_items` set: full attention only) the work items
    (batch, head, query tile) cta, cta + num_ctas, ... in turn, K/V steps and barrier phases running on
    across items (every non-causal item walks the same steps). `span_refs`: documents' (key_start, key_end,
    tile_span_bounds) in global memory (then `causal` is False and `num_items` None)."""
    wg = lax.axis_index("wg")
    head_dim = q_smem2.shape[-1]
    producer_registers, compute_registers = register_caps(warpgroups)
    if num_items is None:
        batch, head = lax.axis_index("batch"), lax.axis_index("heads")
        items, item_tile = 1, None
    else:
        cta, num_ctas = lax.axis_index("cta"), lax.axis_size("cta")
        items = index_div(num_items - cta + num_ctas - 1, num_ctas)

        def item_tile(j):  # query tiles fastest, so the CTAs running together share K/V heads in L2
            item = cta + j * num_ctas
            return (index_div(item, num_tiles * heads), index_rem(index_div(item, num_tiles), heads),
                    index_rem(item, num_tiles))
    first_tile = None if item_tile is None else item_tile(0)[2]
    first_block = None  # with documents, the tile streams K/V blocks first_block + [0, tile_steps)
    if span_refs is None:
        first_row, kv_range, tile_steps = query_tile(causal=causal, num_tiles=num_tiles, block_q=block_q,
                                                     block_kv=block_kv, offset=offset, seq_k=seq_k, num_kv=num_kv,
                                                     warpgroups=warpgroups, tile=first_tile)
    else:  # documents: the blocks between the tile's rows' lowest start and highest end
        tile = tile_index(True, num_tiles)  # longest first, as causal: a document's later rows see more keys
        first_row = tile * (warpgroups * block_q)
        first_block, tile_steps = tile_span(span_refs[2], batch, tile)

    def key_block(step):
        """The K/V block of the tile's step `step`."""
        return step if first_block is None else first_block + step

    def coordinates(j):
        """Work item j's (batch, head, first query row, first global K/V step)."""
        if item_tile is None:
            return batch, head, first_row, 0
        item_batch, item_head, tile = item_tile(j)
        return item_batch, item_head, tile * (warpgroups * block_q), j * tile_steps

    # The tensor cores go round the compute warpgroups: a warpgroup waits for its turn before its P V (and the
    # next block's Q K^T) and passes the turn on once that Q K^T is issued, so each one's softmax overlaps the
    # others' matmuls (FA3's ping-pong, for any count). One turn circulates: it enters at warpgroup 0 and comes
    # back to it at the end, so every barrier phase is waited for exactly once.
    def take_turn():
        plgpu.barrier_wait(turn_barriers.at[wg])

    def pass_turn():
        plgpu.barrier_arrive(turn_barriers.at[index_rem(wg + 1, warpgroups)])

    @pl.when(wg < warpgroups)
    def _compute():
        plgpu.set_max_registers(compute_registers, action="increase")
        q_smem, o_smem, lse_smem = q_smem2.at[wg], o_smem2.at[wg], lse_smem2.at[wg]
        pl.when(wg == 0)(functools.partial(plgpu.barrier_arrive, turn_barriers.at[0]))

        def drain(begin, end, first_step):
            """Steps [begin, end) this warpgroup computes nothing of, which other warpgroups of the tile need (or
            with documents, which its rows see no key of): observe their loads (every barrier phase is waited for
            once by each warpgroup, which keeps the phase parity right), release their slots and keep the turn
            going round."""
            @pl.loop(begin, end)
            def _drain(kv_step):
                slot = index_rem(first_step + kv_step, stages)
                plgpu.barrier_wait(k_barriers.at[slot])
                plgpu.barrier_wait(v_barriers.at[slot])
                plgpu.barrier_arrive(k_consumed.at[slot])
                plgpu.barrier_arrive(v_consumed.at[slot])
                pass_turn()
                take_turn()

        def work_item(j):
            item_batch, item_head, tile_first, first_step = coordinates(j)
            q_first, rows = warpgroup_rows(tile_first, wg, block_q, item_batch, item_head)
            if span_refs is None:  # blocks every row sees whole, then those crossing the diagonal or padded keys
                n_full, n_end = kv_range(q_first)
                runs = ((0, n_full, False),) + (((n_full, n_end, True),) if causal or seq_k % block_kv else ())
            else:  # documents: this warpgroup's runs of the tile's steps (`tiles.tile_span_bounds`)
                runs = part_runs(span_refs[2], item_batch, tile, wg, first_block)
                n_end = runs[-1][1]
            plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem, q_barriers.at[wg])
            plgpu.barrier_wait(q_barriers.at[wg])

            rows_layout = plgpu.Layout.WGMMA.reduce(1)
            row_max = layout(jnp.full((block_q,), -jnp.inf, jnp.float32), rows_layout, interpret=interpret)
            row_sum = layout(jnp.zeros((block_q,), jnp.float32), rows_layout, interpret=interpret)
            acc = layout(jnp.zeros((block_q, head_dim), jnp.float32), plgpu.Layout.WGMMA, interpret=interpret)
            if span_refs is None:
                @pl.when(n_end > 0)
                def _():
                    plgpu.barrier_wait(k_barriers.at[index_rem(first_step, stages)])
                take_turn()
            else:  # each row's key span, for the masked runs; the steps before this warpgroup's first are drained
                span_rows = (item_batch, pl.ds(q_first, block_q))
                key_start, key_end = (load_rows(ref.at[span_rows], rows_layout, interpret=interpret, from_global=True)
                                      for ref in span_refs[:2])
                take_turn()
                drain(0, runs[0][0], first_step)

                @pl.when(runs[0][0] < n_end)
                def _():
                    plgpu.barrier_wait(k_barriers.at[index_rem(first_step + runs[0][0], stages)])

            def step(kv_step, carry, *, masked: bool):
                acc, row_max, row_sum = carry
                slot = index_rem(first_step + kv_step, stages)

                scores = wgmma_nt(q_smem, k_smem.at[slot], then=pass_turn, interpret=interpret)
                plgpu.barrier_arrive(k_consumed.at[slot])
                scores = scores * scale_log2
                if masked and span_refs is None:
                    q_pos = q_first + iota(scores.shape, 0, interpret=interpret)
                    k_pos = kv_step * block_kv + iota(scores.shape, 1, interpret=interpret)
                    seen = (k_pos <= q_pos + offset) if causal else (k_pos < seq_k)
                    scores = jnp.where(seen, scores, -jnp.inf)
                elif masked:  # documents: the keys in each row's span
                    k_pos = key_block(kv_step) * block_kv + iota(scores.shape, 1, interpret=interpret)
                    seen = ((k_pos >= lax.broadcast_in_dim(key_start, scores.shape, [0]))
                            & (k_pos < lax.broadcast_in_dim(key_end, scores.shape, [0])))
                    scores = jnp.where(seen, scores, -jnp.inf)
                new_max = jnp.maximum(row_max, scores.max(axis=1))
                shift = new_max
                if masked:  # a row that has seen only masked keys keeps max -inf: subtract 0 so exp2 gives 0
                    shift = jnp.where(new_max == -jnp.inf, 0.0, new_max)
                if span_refs is None:
                    new_max = shift
                # With documents a row's max stays -inf until it sees a key, as the portable kernel keeps it: a
                # row whose span starts in a later block would otherwise shift its scores by 0 instead of their
                # max, and fp16 P would lose its small values.
                rescale = jnp.exp2(row_max - shift)
                probs = jnp.exp2(scores - lax.broadcast_in_dim(shift, scores.shape, [0]))
                acc = acc * lax.broadcast_in_dim(rescale, acc.shape, [0])
                row_sum = row_sum * rescale + probs.sum(axis=1)
                probs = probs.astype(q_smem.dtype)
                # The softmax is done before the turn is awaited: the others' matmuls run meanwhile.
                acc, row_sum, new_max, probs = lax.optimization_barrier((acc, row_sum, new_max, probs))
                plgpu.barrier_wait(v_barriers.at[slot])
                take_turn()
                acc = matmul_acc(acc, probs, v_smem.at[slot], interpret=interpret)

                @pl.when(kv_step + 1 < n_end)
                def _():
                    plgpu.barrier_wait(k_barriers.at[index_rem(first_step + kv_step + 1, stages)])
                plgpu.barrier_arrive(v_consumed.at[slot])
                return acc, new_max, row_sum

            acc, row_max, row_sum = fold_block_runs(step, runs, (acc, row_max, row_sum))
            drain(n_end, tile_steps, first_step)
            pass_turn()

            seen = row_sum > 0  # False only for rows that see no key (causal with Sq > Sk): out 0, lse -inf
            inverse = jnp.where(seen, 1.0 / jnp.where(seen, row_sum, 1.0), 0.0)
            o_smem[...] = (acc * lax.broadcast_in_dim(inverse, acc.shape, [0])).astype(o_smem.dtype)
            lse_smem[...] = jnp.where(seen, row_max * LN2 + jnp.log(jnp.where(seen, row_sum, 1.0)), -jnp.inf)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, out_ref.at[rows])
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[item_batch, item_head, pl.ds(q_first, block_q)])
            plgpu.wait_smem_to_gmem(0)  # the next item's Q lands where this out tile is read from

        if item_tile is None:
            work_item(0)
        else:
            pl.loop(0, items)(work_item)
        pl.when(wg == 0)(take_turn)

    @pl.when(wg == warpgroups)
    def _producer():
        def rows_of(step):
            item_batch, item_head, _, first_step = coordinates(0 if item_tile is None else index_div(step, tile_steps))
            return item_batch, pl.ds(key_block(step - first_step) * block_kv, block_kv), index_div(item_head, group)
        stream_blocks((k_ref, v_ref), (k_smem, v_smem), (k_barriers, v_barriers), (k_consumed, v_consumed),
                      rows_of=rows_of, steps=items * tile_steps, stages=stages, registers=producer_registers)


@functools.partial(jax.jit, static_argnames=("causal", "softmax_scale", "out_dtype", "config", "interpret"))
def hopper_forward(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool, softmax_scale: float, out_dtype,
                   config: HopperConfig, interpret: bool, spans=None) -> tuple[jax.Array, jax.Array]:
    """Mosaic GPU forward on validated inputs (`hopper_unsupported` is None): (out [B, Sq, H, D] in `out_dtype`,
    lse [B, H, Sq] float32). `spans`: the documents' key spans (`jax_impl.documents.Spans`), which replace the
    causal rule (the caller folds it in: `causal` is then False), as for `portable.forward.portable_forward`."""
    batch, seq_q, heads, head_dim = q.shape
    seq_k, kv_heads = k.shape[1], k.shape[2]
    block_q = config.block_q
    # Documents take the causal schedule: tiles walk different numbers of K/V blocks, which the persistent grid's
    # items cannot (they share one step count), and their causal documents are causal attention's triangles.
    schedule = causal or spans is not None
    block_kv, warpgroups, persistent = config.forward_schedule(schedule)
    q_len = round_up(seq_q, warpgroups * block_q)
    k_len = round_up(seq_k, block_kv)
    num_tiles, num_kv = q_len // (warpgroups * block_q), k_len // block_kv
    num_items = batch * heads * num_tiles if persistent else None
    stages = forward_stages(config, causal=schedule, seq_k=seq_k)
    out_dtype = jnp.dtype(out_dtype)
    kernel_smem = forward_scratch(config, head_dim=head_dim, dtype=q.dtype, out_dtype=out_dtype, causal=schedule,
                                  stages=stages)
    mask = "documents" if spans is not None else "causal" if causal else "full"
    check_smem(config, kernel_smem, f"D={head_dim}, {q.dtype} in, {out_dtype} out, {mask} attention, Sk={seq_k}",
               interpret=interpret)
    scratch = kernel_smem.buffers
    inputs = (q, k, v)
    q = pad_axis(q, 1, q_len)
    k, v = pad_axis(k, 1, k_len), pad_axis(v, 1, k_len)
    span_inputs = ()
    if spans is not None:  # each row's span, and the block ranges of each tile and its warpgroups
        span_inputs = edge_padded_spans(spans, q_len)
        span_inputs += (tile_span_bounds(*span_inputs, rows=block_q, parts=warpgroups, block=block_kv),)

    def kernel(q_ref, k_ref, v_ref, *refs, o_smem2, q_smem2, **smem):
        *span_refs, out_ref, lse_ref = refs
        _forward_kernel(q_ref, k_ref, v_ref, out_ref, lse_ref, q_smem2=q_smem2,
                        o_smem2=q_smem2 if o_smem2 is None else o_smem2, **smem, causal=causal,
                        scale_log2=softmax_scale * LOG2E, block_q=block_q, block_kv=block_kv, stages=stages,
                        group=heads // kv_heads, offset=seq_k - seq_q, seq_k=seq_k, num_kv=num_kv,
                        num_tiles=num_tiles, heads=heads, warpgroups=warpgroups, num_items=num_items,
                        interpret=interpret, span_refs=tuple(span_refs) or None)

    out, lse = launch(
        kernel, scratch,
        (output_struct((batch, q_len, heads, head_dim), out_dtype, *inputs),
         output_struct((batch, heads, q_len), jnp.float32, *inputs)),
        dict(heads=heads, q_tile=num_tiles, batch=batch) if num_items is None else
        dict(cta=min(num_items, sm_count(interpret))),
        (q, k, v) + span_inputs, warpgroups=warpgroups, interpret=interpret, name="twinflash_forward_hopper",
        compiler_params=dict(reduction_scratch_bytes=kernel_smem.reduction_bytes))
    return out[:, :seq_q], lse[:, :, :seq_q]
