"""The Hopper family's backward: FlashAttention backward for sm90 as Pallas Mosaic GPU kernels, fp32 gradients.
Twin of `torch_impl/kernels/hopper/backward.py` (the family's torch backward, a Gluon kernel of its own design). This
module owns the form's choice, the dK/dV kernel (and in the one-kernel forms its dQ) and the wrapper; the two-kernel
form's dQ kernel is `backward_dq.py`, the step both kernels run `backward_step.py`; the config and the kernels'
scratch (with its shared-memory check) come from `config.py`, the producer loop, step ranges, launch and interpreter
switch from `kernels/tiles.py`.
Same contract as `portable.backward.portable_backward`: dout, q, k, v and a (possibly globally merged) out/lse;
returns fp32 dq [B, Sq, H, D], dk/dv [B, Sk, Hkv, D]. Plain JAX first forms, in fp32, delta = rowsum(dout *
out) and lse in the exp2 domain (rows with lse -inf and padded rows get +inf, so their P is exactly 0).

  - dK/dV kernel: a CTA owns 2 * bwd_block_kv key rows of one (batch, KV head), one compute warpgroup per
    bwd_block_kv; a TMA warpgroup streams (Q, dO, lse, delta) blocks of every query head of the GQA group
    (one flat loop, head fastest) through `bwd_num_stages` slots, starting at the first query block that
    sees the CTA's keys. With `HopperConfig.bwd_head_splits` the group's heads are shared out among that many CTAs
    (FA3's grid, one CTA per query head, at the most), each writing partial dK/dV that the wrapper sums. Per step
    (4 wgmmas): S^T = K Q^T, P^T, dV += P^T dO, dP^T = V dO^T, dS^T = P^T (dP^T - delta), dK += dS^T Q, P^T and dS^T
    the wgmmas' register operands. With `HopperConfig.bwd_query_rows` (FA3's orientation) the step computes
    S = Q K^T and dP = dO V^T instead, and P and dS reach dV += P^T dO and dK += dS^T Q through shared memory. Blocks
    crossing the causal diagonal are masked.
  - dQ kernel (`backward_dq.py`): a CTA owns 2 * dq_block_q query rows of one (batch, head); the TMA warpgroup
    streams K/V blocks of dq_block_kv keys as in the forward (unmasked, then masked steps; longest tiles first).
    Per step (3 wgmmas): S = Q K^T, P, dP = dO V^T, dS = P (dP - delta), dQ += dS K.
Documents (`spans`, `weights/documents.py`): the dQ kernel walks key blocks as the forward does, the dK/dV kernel
the query blocks between its keys' query spans (a CTA streams those of both warpgroups' keys; each warpgroup
computes its own keys' runs, masked by the query span of each key at the edges, and drains the other blocks
unread); blocks without a pair are never loaded. Two-kernel form only (`hopper_backward` says why).
The softmax scale multiplies dQ and dK once at the end. Both kernels run their steps through `gradient_step`,
which with `HopperConfig.bwd_overlap` issues S and dP together and awaits each wgmma only where its result is
read; every step still ends with all of its wgmmas complete (the accumulators are values between steps).

`HopperConfig.bwd_form` picks the form: "two_kernel" runs both kernels above; "one_kernel" (FlashAttention-3's
form, 5 wgmmas per step, no dQ kernel) runs the dK/dV kernel only, which also adds each step's dQ share into an
fp32 dQ in global memory by TMA reduce-add:
  - each compute warpgroup stores its dS tile (bf16) to shared memory and signals the other; once it has the
    other's, dQ[block] += dS K over the CTA's 2 * bwd_block_kv keys (two wgmmas), its D columns split in chunks
    of 64 between the warpgroups (D=64: one chunk, taken by the warpgroups in turn);
  - the fp32 chunk goes out by `copy_smem_to_gmem(..., reduction_op="add")` into a zeroed dQ that the kernel
    takes as a mutable JAX Ref (aliased in and out: `pl.kernel` with a `plgpu.Mesh`).
"one_kernel_private" is the same without the barrier and the turn-taking branch: each warpgroup adds the dQ share
of its own keys, all D columns (one dS buffer, twice the reduce-add traffic).

What bounded the forms (H200, D=128, S=16k; compare/results/kernels-mosaic-query-rows-2026-11-29-h200): ptxas spilled
in every backward kernel, 144-944 bytes a thread, most in the one-kernel forms. These were not values of the step's
math. Mosaic GPU gives each 16-deep slice of a wgmma its own 64-bit shared-memory descriptor, and LLVM hoisted those
of the tiles fixed through the loop (K, V, P, dS) out of it: about 72 registers stayed live and were spilled, then
reloaded before the wgmmas. `HopperConfig.bwd_rebuild_descriptors` (the default) re-indexes those tiles at each
step by a zero read from shared memory (`zero_smem`, which LLVM cannot see through), so their descriptors are
computed in the step. Spill stores: two-kernel dK/dV 144 -> 48 bytes (causal), one-kernel with query rows 540 -> 0.
Measured fwd+bwd: two kernels 468 -> 486 (causal) / 510 -> 520 (full). One kernel with query rows 389 -> 518 / 392 ->
549 (the last with each warpgroup signalling its dS as soon as it is stored). At 16k-64k in one run
the one-kernel form with query rows is 0.91-0.92x FA3 against the default's 0.86-0.88x, except at 64k full
attention (0.85x; each dQ block then takes 512 reduce-adds), and 0.98-1.02x cuDNN at D=64 against 0.91-0.94x. It is
not the default yet: it has not run in the ring on GPUs. Its dQ, read back from the Ref, was typed invariant
inside `jax.shard_map` until a21910a, so the ring could not take it.
The named scopes (`jax.named_scope`) in the dK/dV kernel are the regions of Mosaic GPU's in-kernel profiler
(`plgpu.CompilerParams(profile_space=..., profile_dir=...)`); without it they compile to nothing.
GPU interpreter: it has no TMA reduction (nor aliased Refs), so under interpretation (lines marked INTERPRET) each
CTA stores its dQ chunks into its own slice of a [K/V tiles, ...] output and the wrapper adds the slices up
(the slices of query blocks a causal CTA never visits are masked out there). Everything else is the same code.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_impl.documents import query_spans
from jax_impl.kernels.hopper.backward_dq import dq_call
from jax_impl.kernels.hopper.backward_step import gradient_step, store_fp32
from jax_impl.kernels.hopper.config import (COMPUTE_WARPGROUPS, DQ_CHUNK, HopperConfig, backward_lengths,
                                            backward_stages, check_smem, dkdv_scratch, dq_scratch)
from jax_impl.kernels.tiles import (LOG2E, copy_in, declared_varying, edge_padded_spans, index_div, index_rem, iota,
                                    launch, layout, load_rows, output_struct, pad_axis, part_runs, produce, tile_span,
                                    tile_span_bounds, warpgroup_rows)


def _matmul_sum(pairs, *, transpose_a: bool, interpret: bool):
    """sum of a @ b (`transpose_a`: a^T @ b, the wgmmas reading a transposed) in fp32 over (a, b) shared-memory tile
    pairs, one accumulator."""
    if interpret:  # INTERPRET: plain dots (see tiles.py)
        contract = 0 if transpose_a else 1
        return sum(lax.dot_general(a[...], b[...], (((contract,), (0,)), ((), ())),
                                   preferred_element_type=jnp.float32) for a, b in pairs)

    def compute(acc_ref):
        for a, b in pairs:
            plgpu.wgmma(acc_ref, plgpu.transpose_ref(a, (1, 0)) if transpose_a else a, b)
        return acc_ref[...]
    a, b = pairs[0]
    return pl.run_scoped(compute, plgpu.ACC((a.shape[1 if transpose_a else 0], b.shape[1]), jnp.float32))


def _dkdv_kernel(q_ref, k_ref, v_ref, dout_ref, lse2_ref, delta_ref, dq_ref, dk_ref, dv_ref, k_smem2, v_smem2,
                 out_smem2, q_smem, dout_smem, lse_smem, delta_smem, ds_smem, p_smem, zero_smem, kv_barriers,
                 q_barriers, dout_barriers, lse_barriers, delta_barriers, consumed, ds_ready, *, causal: bool,
                 scale: float, block_q: int, block_kv: int, stages: int, group: int, head_splits: int, offset: int,
                 num_q_blocks: int, overlap: bool, private_dq: bool, query_rows: bool, stagger: bool,
                 registers: tuple[int, int], interpret: bool, span_refs=None):
    """dK/dV (and with `dq_ref`, the one-kernel forms, dQ by reduce-add; else dq_ref and ds_ready are None).
    `private_dq`: each warpgroup adds the dQ share of its own keys (ds_ready is None). `query_rows`
    (`HopperConfig.bwd_query_rows`): each step computes S and dP with query rows and passes P and dS to the
    dK/dV wgmmas through p_smem and ds_smem (else S^T and dP^T, P^T and dS^T from registers; p_smem is None, and
    so is ds_smem in the two-kernel form). `zero_smem` (`HopperConfig.bwd_rebuild_descriptors`, else None): an int32
    0 that each step reads and adds to its index of every shared-memory tile it reads but does not stream (K, V, P,
    dS, the fp32 out tile), so that LLVM computes their wgmma descriptors (one 64-bit value per 16-deep slice of a
    wgmma) in the step instead of hoisting them out of the loop, where they stayed live throughout and ptxas spilled
    them (their reloads sat before the step's wgmmas). `span_refs`:
    documents' (query_start, query_end) of every key and their `tiles.tile_span_bounds` over query blocks (the
    two-kernel form only; then `causal` is False). `stagger` (`HopperConfig.bwd_stagger`, one-kernel forms): a
    full-attention walk starts as many flat steps in as the CTA's first key is query blocks in, and wraps around, so
    that the CTAs running at once add into different dQ rows. `registers`: the (TMA
    warpgroup's, compute warpgroups') caps, `HopperConfig.backward_registers`. `head_splits`
    (`HopperConfig.bwd_head_splits`, a divisor of `group`): the CTA walks `group // head_splits` of the group's query
    heads, the `head_split`-th share, and dk_ref/dv_ref take its partial sums at [head_split] (else no such axis)."""
    batch, kv_head, wg = lax.axis_index("batch"), lax.axis_index("kv_heads"), lax.axis_index("wg")
    walked = group // head_splits  # query heads of the group this CTA walks
    split = lax.axis_index("head_split") if head_splits > 1 else None  # which share of them
    first_head = kv_head * group + (split * walked if split is not None else 0)
    kv_tile = lax.axis_index("kv_tile")
    q_axis = 0 if query_rows else 1  # the axis of a step's score tile that runs over queries
    shared_dq = dq_ref is not None and not private_dq  # the warpgroups' dS tiles meet in each dQ product
    k_axis = 1 - q_axis
    cta_first = kv_tile * (COMPUTE_WARPGROUPS * block_kv)

    def q_range(k_first):
        """(first query block seeing any of the keys from k_first on, first query block seeing them all)."""
        if not causal:
            return 0, 0
        start = jnp.clip(index_div(jnp.maximum(k_first - offset, 0), block_q), 0, num_q_blocks)
        full = jnp.clip(index_div(jnp.maximum(k_first + block_kv - 1 - offset + block_q - 1, 0), block_q), 0,
                        num_q_blocks)
        return start, jnp.maximum(full, start)

    if span_refs is None:
        cta_start, _ = q_range(cta_first)
        begin, end = cta_start * walked, num_q_blocks * walked  # flat (query block, walked head) steps
    else:  # documents: the query blocks between the CTA's keys' lowest query_start and highest query_end
        first_block, blocks = tile_span(span_refs[2], batch, kv_tile)
        begin, end = first_block * walked, (first_block + blocks) * walked

    # stagger: the flat step the walk starts at (full attention; causal walks start staggered by the diagonal), in
    # steps, not query blocks: the next key tile's CTA runs as many steps ahead with GQA as without, so a Q block it
    # read is read again by this one a few steps later, from L2 (`HopperConfig.bwd_stagger`). Not in the two-kernel
    # form, which adds into nothing shared.
    rotation = (index_rem(index_div(cta_first, block_q), num_q_blocks * walked)
                if stagger and dq_ref is not None and not causal and span_refs is None else None)

    def q_block_and_head(t):
        if rotation is not None:
            t = index_rem(t + rotation, num_q_blocks * walked)
        return index_div(t, walked), first_head + index_rem(t, walked)

    @pl.when(wg < COMPUTE_WARPGROUPS)
    def _compute():
        plgpu.set_max_registers(registers[1], action="increase")
        k_smem, v_smem, out_smem = k_smem2.at[wg], v_smem2.at[wg], out_smem2.at[wg]
        if zero_smem is not None:
            zero_smem[0] = jnp.int32(0)
            if not interpret:  # every thread reads it from the first step on (`bwd_auto_barriers` may be off)
                plgpu.commit_smem()
        k_first, rows = warpgroup_rows(cta_first, wg, block_kv, batch, kv_head)
        copy_in(((k_ref.at[rows], k_smem), (v_ref.at[rows], v_smem)), kv_barriers, 2 * wg)
        if span_refs is None:
            _, full_start = q_range(k_first)
        else:  # the query rows that see each of this warpgroup's keys: its columns of S (rows of S^T)
            query_start, query_end = (load_rows(ref.at[batch, pl.ds(k_first, block_kv)],
                                                plgpu.Layout.WGMMA.reduce(q_axis), interpret=interpret,
                                                from_global=True)
                                      for ref in span_refs[:2])
        dim = k_smem.shape[-1]
        zeros = layout(jnp.zeros((block_kv, dim), jnp.float32), plgpu.Layout.WGMMA, interpret=interpret)

        def drain(first, last):
            """Flat steps [first, last) whose query rows see none of this warpgroup's keys (documents): the other
            warpgroup's. Observe their loads, release their slots; their tiles are never read (NaN in another
            document's Q or dO would reach dK/dV through a masked P of 0)."""
            @pl.loop(first, last)
            def _drain(t):
                slot = index_rem(t - begin, stages)
                for barrier in (q_barriers, lse_barriers, dout_barriers, delta_barriers):
                    plgpu.barrier_wait(barrier.at[slot])
                plgpu.barrier_arrive(consumed.at[slot])

        def add_dq(t, parity, zero):
            """dQ[block t] += dS K over the CTA's keys, for the column chunks this warpgroup takes at step t
            (`private_dq`: over this warpgroup's keys, every chunk); `zero`: the step's read of zero_smem."""
            q_block, head = q_block_and_head(t)
            rows = (batch, pl.ds(q_block * block_q, block_q), head)
            # INTERPRET: the CTA's (private_dq: the warpgroup's) own slice of dQ, added up by the wrapper
            dq_slice = (kv_tile * COMPUTE_WARPGROUPS + wg if private_dq else kv_tile,)
            for chunk in range(max(dim // DQ_CHUNK, 1)):
                cols = pl.ds(chunk * DQ_CHUNK, min(DQ_CHUNK, dim))
                taker = (lambda body: body()) if private_dq else pl.when(index_rem(chunk + t, COMPUTE_WARPGROUPS) == wg)

                @taker
                def _():
                    parts = (wg,) if private_dq else range(COMPUTE_WARPGROUPS)
                    pairs = [(ds_smem.at[parity, w + zero], k_smem2.at[w + zero, :, cols]) for w in parts]
                    with jax.named_scope("dq_mma"):  # dS is stored [queries, keys], dS^T [keys, queries]
                        dq = _matmul_sum(pairs, transpose_a=not query_rows, interpret=interpret)
                    with jax.named_scope("dq_wait_tma"):
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous reduce-add has read dq_smem
                    with jax.named_scope("dq_out"):
                        dq_smem = out_smem2.at[wg + zero]
                        dq_smem[...] = dq * scale
                        plgpu.commit_smem()
                        if interpret:  # INTERPRET: no TMA reduction; this CTA's own slice, added up by the wrapper
                            plgpu.copy_smem_to_gmem(dq_smem, dq_ref.at[dq_slice + rows + (cols,)])
                        else:
                            plgpu.copy_smem_to_gmem(dq_smem, dq_ref.at[rows + (cols,)], reduction_op="add")

        def step(t, carry, *, masked: bool):
            dk, dv = carry
            slot = index_rem(t - begin, stages)
            with jax.named_scope("inputs"):
                for barrier in (q_barriers, lse_barriers, dout_barriers, delta_barriers):
                    plgpu.barrier_wait(barrier.at[slot])
                stats_layout = plgpu.Layout.WGMMA.reduce(k_axis)  # one value per query of the tile
                lse2 = load_rows(lse_smem.at[slot], stats_layout, interpret=interpret)
                delta = load_rows(delta_smem.at[slot], stats_layout, interpret=interpret)
            zero = jnp.int32(0) if zero_smem is None else zero_smem[0]
            wg_tile = wg + zero  # this warpgroup's tiles, indexed anew at each step (zero_smem)
            # dS tiles of the shared one-kernel form alternate between two buffers: a warpgroup writes buffer
            # t % 2 again only after awaiting the ds_ready barrier of step t + 1, which the other arrives at once its
            # dS of step t + 1 is stored, after its dQ wgmmas of step t. (A warpgroup arrives as soon as its dS is
            # stored and awaits the other's after its own dK/dV wgmmas, so the barrier's latency hides behind them;
            # neither gets two phases ahead, as its next arrival follows its wait.) Every other form reads only its
            # own tile, awaited within the step: one.
            parity = index_rem(t - begin, ds_smem.shape[0]) if ds_smem is not None else 0

            def per_query(values, shape):
                return lax.broadcast_in_dim(values, shape, [q_axis])

            def probs_of(scores):  # S, or S^T without query_rows
                probs = jnp.exp2(scores * (scale * LOG2E) - per_query(lse2, scores.shape))
                if masked:
                    q_pos = q_block_and_head(t)[0] * block_q + iota(scores.shape, q_axis, interpret=interpret)
                if masked and span_refs is None:
                    k_pos = k_first + iota(scores.shape, k_axis, interpret=interpret)
                    probs = jnp.where(k_pos <= q_pos + offset, probs, 0.0)
                elif masked:  # documents: the query rows in each key's query span
                    seen = ((q_pos >= lax.broadcast_in_dim(query_start, scores.shape, [k_axis]))
                            & (q_pos < lax.broadcast_in_dim(query_end, scores.shape, [k_axis])))
                    probs = jnp.where(seen, probs, 0.0)
                return probs

            def dscores_stored():
                if shared_dq:  # the other warpgroup may read it from now on
                    plgpu.barrier_arrive(ds_ready)

            def dscores_of(probs, dprobs):
                dscores = (probs * (dprobs - per_query(delta, dprobs.shape))).astype(q_smem.dtype)
                if dq_ref is not None and not query_rows:  # with query_rows gradient_step stores it
                    ds_smem.at[parity, wg_tile][...] = dscores
                    plgpu.commit_smem()
                    dscores_stored()
                return dscores

            keys, values = k_smem2.at[wg_tile], v_smem2.at[wg_tile]
            if query_rows:
                scores_pair, dprobs_pair = (q_smem.at[slot], keys), (dout_smem.at[slot], values)
                lhs_smem = (p_smem.at[wg_tile], ds_smem.at[parity, wg_tile])
            else:
                scores_pair, dprobs_pair = (keys, q_smem.at[slot]), (values, dout_smem.at[slot])
                lhs_smem = None
            with jax.named_scope("grads"):
                dv, dk = gradient_step(scores_pair, dprobs_pair, probs_of, dscores_of, (dv, dout_smem.at[slot]),
                                        (dk, q_smem.at[slot]), overlap=overlap, interpret=interpret,
                                        lhs_smem=lhs_smem, dscores_stored=dscores_stored)
            plgpu.barrier_arrive(consumed.at[slot])
            if shared_dq:
                with jax.named_scope("ds_barrier"):
                    plgpu.barrier_wait(ds_ready)
            if dq_ref is not None:
                add_dq(t, parity, zero)
            return dk, dv

        carry = (zeros, zeros)
        if span_refs is not None:  # documents: this warpgroup's runs of the CTA's query blocks; it drains the rest
            runs = part_runs(span_refs[2], batch, kv_tile, wg, first_block)
            drain(begin, (first_block + runs[0][0]) * walked)
            for first, last, masked in runs:  # (first query block, end, masked), in flat steps of the walked heads
                carry = lax.fori_loop((first_block + first) * walked, (first_block + last) * walked,
                                      functools.partial(step, masked=masked), carry)
            drain((first_block + runs[-1][1]) * walked, end)
        else:
            if causal:  # the CTA's first blocks cross this warpgroup's diagonal (or see none of its keys: P = 0)
                carry = lax.fori_loop(begin, full_start * walked, functools.partial(step, masked=True), carry)
            carry = lax.fori_loop(full_start * walked if causal else begin, end,
                                  functools.partial(step, masked=False), carry)
        dk, dv = carry
        out_rows = (batch, pl.ds(k_first, block_kv), kv_head)
        if split is not None:  # this CTA's partial sums, added up by the wrapper
            out_rows = (split,) + out_rows
        store_fp32((dk * scale, dv), out_smem, (dk_ref.at[out_rows], dv_ref.at[out_rows]))

    @pl.when(wg == COMPUTE_WARPGROUPS)
    def _producer():
        plgpu.set_max_registers(registers[0], action="decrease")

        def load(t, slot):
            q_block, head = q_block_and_head(t)
            rows = (batch, pl.ds(q_block * block_q, block_q), head)
            stats = (batch, head, pl.ds(q_block * block_q, block_q))
            plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[slot], q_barriers.at[slot])
            plgpu.copy_gmem_to_smem(lse2_ref.at[stats], lse_smem.at[slot], lse_barriers.at[slot])
            plgpu.copy_gmem_to_smem(dout_ref.at[rows], dout_smem.at[slot], dout_barriers.at[slot])
            plgpu.copy_gmem_to_smem(delta_ref.at[stats], delta_smem.at[slot], delta_barriers.at[slot])
        produce(load, (consumed,), begin=begin, end=end, stages=stages)


def _summed_dq_slices(dq_slices, *, causal: bool, keys_per_cta: int, block_q: int, offset: int):
    """INTERPRET: dQ from the per-CTA slices [K/V tiles, B, Sq, H, D]; a causal CTA never writes the query
    blocks before the first one that sees its keys, so those are masked out (not assumed zero)."""
    tiles, q_len = dq_slices.shape[0], dq_slices.shape[2]
    if causal:
        first_block = jnp.maximum(jnp.arange(tiles) * keys_per_cta - offset, 0) // block_q
        written = jnp.arange(q_len)[None, :] // block_q >= first_block[:, None]
        dq_slices = jnp.where(written[:, None, :, None, None], dq_slices, 0.0)
    return dq_slices.sum(axis=0)


@functools.partial(jax.jit, static_argnames=("causal", "softmax_scale", "config", "interpret"))
def hopper_backward(dout: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, out: jax.Array, lse: jax.Array, *,
                    causal: bool, softmax_scale: float, config: HopperConfig, interpret: bool, spans=None
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Mosaic GPU backward on validated inputs (`hopper_unsupported` is None): (dq, dk, dv) in float32. `spans`:
    documents' key spans, as for `hopper_forward` (the dK/dV kernel walks the query spans derived from them)."""
    batch, seq_q, heads, head_dim = q.shape
    seq_k, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    head_splits = math.gcd(config.bwd_head_splits, group)
    block_q, block_kv = config.bwd_block_q, config.bwd_block_kv
    q_len, k_len = backward_lengths(config, seq_q=seq_q, seq_k=seq_k)
    num_q_blocks = q_len // block_q
    offset = seq_k - seq_q
    stages, dq_stages = backward_stages(config, seq_q=seq_q, seq_k=seq_k, group=group // head_splits)
    one_kernel, private_dq = config.bwd_form != "two_kernel", config.bwd_form == "one_kernel_private"
    if spans is not None and one_kernel:
        raise ValueError(f"HopperConfig.bwd_form={config.bwd_form!r} takes no documents; the two-kernel form does: "
                         f"a one-kernel step adds the dQ of both warpgroups' dS tiles, which a warpgroup skipping "
                         f"another document's query blocks would leave stale")
    mask = "documents" if spans is not None else "causal" if causal else "full"
    call = f"D={head_dim}, {q.dtype}, {mask} attention, Sq={seq_q}, Sk={seq_k}"
    dkdv_smem = dkdv_scratch(config, head_dim=head_dim, dtype=q.dtype, stages=stages)
    dq_smem = None if one_kernel else dq_scratch(config, head_dim=head_dim, dtype=q.dtype, stages=dq_stages)
    for kernel_smem in (dkdv_smem, dq_smem):
        if kernel_smem is not None:
            check_smem(config, kernel_smem, call, interpret=interpret)

    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1).transpose(0, 2, 1)
    lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse.astype(jnp.float32) * LOG2E)
    delta, lse2 = pad_axis(delta, 2, q_len), pad_axis(lse2, 2, q_len, value=jnp.inf)
    q, dout = pad_axis(q, 1, q_len), pad_axis(dout.astype(q.dtype), 1, q_len)
    k, v = pad_axis(k, 1, k_len), pad_axis(v, 1, k_len)
    inputs = (q, k, v, dout, lse2, delta)
    wgs = COMPUTE_WARPGROUPS
    dq_shape = (batch, q_len, heads, head_dim)
    partials = (head_splits,) if head_splits > 1 else ()  # dK/dV partial sums, one per share of the group's heads
    dkdv_out = (output_struct(partials + k.shape, jnp.float32, *inputs),
                output_struct(partials + v.shape, jnp.float32, *inputs))
    kv_tiles = k_len // (wgs * block_kv)
    span_inputs = dq_span_inputs = ()
    if spans is not None:  # the query spans of every key and their blocks' ranges; the dQ kernel's key spans
        span_inputs = edge_padded_spans(query_spans(spans, seq_k), k_len)
        span_inputs += (tile_span_bounds(*span_inputs, rows=block_kv, parts=wgs, block=block_q),)
        dq_span_inputs = edge_padded_spans(spans, q_len)
    dkdv_inputs = inputs + span_inputs
    if one_kernel and interpret:  # INTERPRET: per-CTA (per-warpgroup) dQ slices instead of a reduce-add target
        dq_slices = kv_tiles * (wgs if private_dq else 1)
        dkdv_out = (output_struct((dq_slices,) + dq_shape, jnp.float32, *inputs),) + dkdv_out
    elif one_kernel:
        dkdv_inputs += (jax.new_ref(jnp.zeros(dq_shape, jnp.float32)),)

    def dkdv_kernel(*refs, **smem):
        span_refs = refs[len(inputs):len(inputs) + len(span_inputs)] or None
        refs = refs[:len(inputs)] + refs[len(inputs) + len(span_inputs):]
        if not one_kernel:
            refs = refs[:len(inputs)] + (None,) + refs[len(inputs):]
        _dkdv_kernel(*refs, **smem, causal=causal, scale=softmax_scale, block_q=block_q, block_kv=block_kv,
                     stages=stages, group=group, head_splits=head_splits, offset=offset, num_q_blocks=num_q_blocks,
                     overlap=config.bwd_overlap, private_dq=private_dq, query_rows=config.bwd_query_rows,
                     stagger=config.bwd_stagger, registers=config.backward_registers,
                     interpret=interpret, span_refs=span_refs)

    grid = {"kv_heads": kv_heads, **({"head_split": head_splits} if partials else {}), "kv_tile": kv_tiles,
            "batch": batch}
    results = launch(
        dkdv_kernel, dkdv_smem.buffers, dkdv_out, grid, dkdv_inputs, warpgroups=wgs, interpret=interpret,
        name="twinflash_backward_dkdv" + ("_dq" if one_kernel else "") + "_hopper",
        compiler_params=dict(unsafe_no_auto_barriers=not config.bwd_auto_barriers))
    if one_kernel and interpret:
        dq_slices, dk, dv = results
        dq = _summed_dq_slices(dq_slices, causal=causal, keys_per_cta=block_kv * (1 if private_dq else wgs),
                               block_q=block_q, offset=offset)
    elif one_kernel:  # dQ is read from the Ref, typed invariant inside shard_map like the launch's outputs (`launch`)
        (dk, dv), dq = results, declared_varying(dkdv_inputs[-1][...], output_struct(dq_shape, jnp.float32, *inputs))
    else:
        dk, dv = results
        dq = dq_call(inputs, dq_span_inputs, dq_smem, causal=causal, scale=softmax_scale, config=config, group=group,
                     offset=offset, seq_k=seq_k, stages=dq_stages, dq_shape=dq_shape, interpret=interpret)
    if partials:
        dk, dv = dk.sum(axis=0), dv.sum(axis=0)
    return dq[:, :seq_q], dk[:, :seq_k], dv[:, :seq_k]
