"""FlashAttention forward for Hopper (sm90) as a Pallas Mosaic GPU kernel, plus what the Mosaic backward shares
with it: the GPU interpreter switch, the producer loop and the causal step ranges. The launch config
(`HopperConfig`, heuristics, autotune space) and each kernel's shared memory live in `flash_hopper_config.py`
(re-exported here). Twin of `torch_impl/flash_hopper_forward.py`.

Same contract as `flash_forward.pallas_forward`: q [B, Sq, H, D], k/v [B, Sk, Hkv, D] (GQA: the KV head is
h // (H // Hkv), K/V never repeated), causal aligned bottom-right (query i sees key j iff j <= i + Sk - Sq),
any lengths, out in `out_dtype`, lse [B, H, Sq] natural log, -inf (with out 0) for a row that sees no key.
Head dims 64 and 128, bf16/fp16 only (`supports` says which calls this kernel serves).

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
Tails: the wrapper pads Sq to compute_warpgroups * block_q and Sk to block_kv (padded keys are masked by
position, padded query rows are sliced off).

GPU interpreter (CPU tests, `interpret=True`): Pallas's Mosaic GPU interpreter lacks wgmma with a register
left operand and `pl.run_state` over a wgmma accumulator. It also has no rule for register-layout
casts. Its wgmma also cannot read a transposed operand. So three helpers differ under interpretation (lines
marked INTERPRET): `matmul_nt` (Q K^T) and `matmul_acc` (P V) are plain fp32-accumulating dots on the operands
read from shared memory (the same shared-memory tiles the wgmma reads), and `layout` leaves values without a
layout hint (hints do not change values); everything else -- TMA copies, barriers and their phases, warpgroup
roles and the turn, step ranges, masks, softmax, epilogue stores -- is the same code.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import config as jax_config
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .flash_forward import LN2, LOG2E, index_div, index_rem, output_struct, pad_axis, round_up
# HopperConfig, autotune_space, default_config and supports are imported from here too (scripts, tests).
from .flash_hopper_config import (COMPUTE_WARPGROUPS, PRODUCER_REGISTERS, HopperConfig, autotune_space,  # noqa: F401
                                  check_smem, default_config, forward_scratch, forward_stages, register_caps, supports)

try:  # public from jax 0.11; jax 0.10 has it only under _src
    from jax.experimental.pallas.mosaic_gpu import InterpretGPUParams
except ImportError:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams


def sm_count(interpret: bool) -> int:
    """CTAs of a persistent grid: the GPU's SM count (132 on an H100/H200 SXM if the device does not say);
    under the interpreter 2, so the tests' CTAs each walk several items."""
    return 2 if interpret else getattr(jax.devices()[0], "core_count", 132)


def interpret_params(interpret: bool):
    """`interpret=` of plgpu.kernel: the GPU interpreter on CPU, compiled Mosaic GPU otherwise."""
    return InterpretGPUParams() if interpret else None


def causal_kv_steps(q_first, block_q: int, block_kv: int, *, causal: bool, offset: int, seq_k: int,
                    num_kv: int):
    """For query rows [q_first, q_first + block_q): (n_full, n_end). K/V blocks [0, n_full) are seen fully by
    every row, [n_full, n_end) need the mask, blocks from n_end on are seen by no row."""
    if not causal:  # blocks wholly past seq_k (padding for another kernel's tiles) are seen by no row
        return seq_k // block_kv, min(-(-seq_k // block_kv), num_kv)
    n_end = jnp.clip(index_div(jnp.maximum(q_first + block_q + offset + block_kv - 1, 0), block_kv), 0, num_kv)
    n_full = jnp.minimum(index_div(jnp.maximum(q_first + offset + 1, 0), block_kv), n_end)
    return n_full, n_end


def tile_index(causal: bool, num_tiles: int):
    """This CTA's query tile: causal grids run tiles in reverse so the longest CTAs start first."""
    i = lax.axis_index("q_tile")
    return num_tiles - 1 - i if causal else i


def layout(x, kind, *, interpret: bool):
    """x pinned to a register layout (`plgpu.Layout.WGMMA` or one of its reductions): a hint to the Mosaic
    compiler with no effect on values, which the interpreter has no rule for (INTERPRET: x unchanged)."""
    return x if interpret else plgpu.layout_cast(x, kind)


def iota(shape, dimension: int, *, interpret: bool):
    """int32 indices along `dimension` in the wgmma accumulator's register layout."""
    return layout(lax.broadcasted_iota(jnp.int32, shape, dimension), plgpu.Layout.WGMMA, interpret=interpret)


def matmul_nt(a_smem, b_smem, *, then=None, interpret: bool):
    """a @ b^T in fp32 for two shared-memory tiles (a wgmma reading b transposed); `then()` runs while the
    wgmma is in flight (a scheduling barrier)."""
    if interpret:  # INTERPRET: the interpreter's wgmma cannot read a transposed operand
        result = lax.dot_general(a_smem[...], b_smem[...], (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32)
        if then is not None:
            then()
        return result

    def compute(acc_ref):
        plgpu.wgmma(acc_ref, a_smem, plgpu.transpose_ref(b_smem, (1, 0)))
        if then is not None:
            then()
        return acc_ref[...]
    return pl.run_scoped(compute, plgpu.ACC((a_smem.shape[0], b_smem.shape[0]), jnp.float32))


def matmul_acc(acc, a, b_smem, *, interpret: bool):
    """acc + a @ b in fp32, a in registers (the wgmma register-A form) or shared memory, b in shared memory."""
    if interpret:  # INTERPRET: the interpreter has neither register-A wgmma nor run_state on an accumulator
        a = a if isinstance(a, jax.Array) else a[...]
        return acc + jnp.dot(a, b_smem[...], preferred_element_type=jnp.float32)

    def compute(acc_ref):
        plgpu.wgmma(acc_ref, a, b_smem)
    return pl.run_state(compute)(plgpu.ACC.init(acc))


def warpgroup_rows(first, wg, block: int, batch, head):
    """Compute warpgroup `wg`'s `block` rows of a tile starting at row `first`: (its first row, its index into a
    [B, S, H, D] array)."""
    start = first + wg * block
    return start, (batch, pl.ds(start, block), head)


def query_tile(*, causal: bool, num_tiles: int, block_q: int, block_kv: int, offset: int, seq_k: int, num_kv: int,
               warpgroups: int = COMPUTE_WARPGROUPS, tile=None):
    """A query tile (this CTA's, longest causal tiles first, unless `tile` names one) in a kernel whose
    `warpgroups` compute warpgroups own `block_q` query rows each: (its first row, `causal_kv_steps` bound to the
    call, the number of K/V blocks the producer streams). The last warpgroup's rows are the tile's latest, so its
    range covers the whole tile's."""
    tile = tile_index(causal, num_tiles) if tile is None else tile
    tile_first = tile * (warpgroups * block_q)
    kv_range = functools.partial(causal_kv_steps, block_q=block_q, block_kv=block_kv, causal=causal,
                                 offset=offset, seq_k=seq_k, num_kv=num_kv)
    _, tile_steps = kv_range(tile_first + (warpgroups - 1) * block_q)
    return tile_first, kv_range, tile_steps


def _forward_kernel(q_ref, k_ref, v_ref, out_ref, lse_ref, q_smem2, o_smem2, lse_smem2, k_smem, v_smem,
                    q_barriers, k_barriers, v_barriers, k_consumed, v_consumed, turn_barriers, *,
                    causal: bool, scale_log2: float, block_q: int, block_kv: int, stages: int, group: int,
                    offset: int, seq_k: int, num_kv: int, num_tiles: int, heads: int, warpgroups: int,
                    num_items: int | None, interpret: bool):
    """One CTA's work: its query tile, or (persistent, `num_items` set: full attention only) the work items
    (batch, head, query tile) cta, cta + num_ctas, ... in turn, K/V steps and barrier phases running on
    across items (every non-causal item walks the same steps)."""
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
    first_row, kv_range, tile_steps = query_tile(causal=causal, num_tiles=num_tiles, block_q=block_q,
                                                 block_kv=block_kv, offset=offset, seq_k=seq_k, num_kv=num_kv,
                                                 warpgroups=warpgroups, tile=first_tile)

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

        def work_item(j):
            item_batch, item_head, tile_first, first_step = coordinates(j)
            q_first, rows = warpgroup_rows(tile_first, wg, block_q, item_batch, item_head)
            n_full, n_end = kv_range(q_first)
            plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem, q_barriers.at[wg])
            plgpu.barrier_wait(q_barriers.at[wg])

            rows_layout = plgpu.Layout.WGMMA.reduce(1)
            row_max = layout(jnp.full((block_q,), -jnp.inf, jnp.float32), rows_layout, interpret=interpret)
            row_sum = layout(jnp.zeros((block_q,), jnp.float32), rows_layout, interpret=interpret)
            acc = layout(jnp.zeros((block_q, head_dim), jnp.float32), plgpu.Layout.WGMMA, interpret=interpret)

            @pl.when(n_end > 0)
            def _():
                plgpu.barrier_wait(k_barriers.at[index_rem(first_step, stages)])
            take_turn()

            def step(kv_step, carry, *, masked: bool):
                acc, row_max, row_sum = carry
                slot = index_rem(first_step + kv_step, stages)

                scores = matmul_nt(q_smem, k_smem.at[slot], then=pass_turn, interpret=interpret)
                plgpu.barrier_arrive(k_consumed.at[slot])
                scores = scores * scale_log2
                if masked:
                    q_pos = q_first + iota(scores.shape, 0, interpret=interpret)
                    k_pos = kv_step * block_kv + iota(scores.shape, 1, interpret=interpret)
                    seen = (k_pos <= q_pos + offset) if causal else (k_pos < seq_k)
                    scores = jnp.where(seen, scores, -jnp.inf)
                new_max = jnp.maximum(row_max, scores.max(axis=1))
                if masked:  # a row that has seen only masked keys keeps max -inf: subtract 0 so exp2 gives 0
                    new_max = jnp.where(new_max == -jnp.inf, 0.0, new_max)
                rescale = jnp.exp2(row_max - new_max)
                probs = jnp.exp2(scores - lax.broadcast_in_dim(new_max, scores.shape, [0]))
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

            carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False), (acc, row_max, row_sum))
            if causal or seq_k % block_kv:
                carry = lax.fori_loop(n_full, n_end, functools.partial(step, masked=True), carry)
            acc, row_max, row_sum = carry

            @pl.loop(n_end, tile_steps)
            def _drain(kv_step):
                # Steps only later warpgroups of the tile need: observe their loads (every barrier phase is
                # waited for once by each warpgroup, which keeps the phase parity right), release their slots
                # and keep the turn going round.
                slot = index_rem(first_step + kv_step, stages)
                plgpu.barrier_wait(k_barriers.at[slot])
                plgpu.barrier_wait(v_barriers.at[slot])
                plgpu.barrier_arrive(k_consumed.at[slot])
                plgpu.barrier_arrive(v_consumed.at[slot])
                pass_turn()
                take_turn()
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
            return item_batch, pl.ds((step - first_step) * block_kv, block_kv), index_div(item_head, group)
        stream_blocks((k_ref, v_ref), (k_smem, v_smem), (k_barriers, v_barriers), (k_consumed, v_consumed),
                      rows_of=rows_of, steps=items * tile_steps, stages=stages, registers=producer_registers)


def stream_kv(refs, smem, barriers, consumed, *, batch, kv_head, block_kv: int, steps, stages: int):
    """The TMA warpgroup of a kernel whose compute warpgroups walk K/V blocks [0, steps) of one KV head: block s's
    K and V (`refs` in global memory) go into slot s % stages of `smem` (`stream_blocks`)."""
    stream_blocks(refs, smem, barriers, consumed, rows_of=lambda step: (batch, pl.ds(step * block_kv, block_kv),
                                                                         kv_head),
                  steps=steps, stages=stages, registers=PRODUCER_REGISTERS)


def stream_blocks(refs, smem, barriers, consumed, *, rows_of, steps, stages: int, registers: int):
    """A TMA warpgroup (register cap `registers`) streaming steps [0, steps): step s's tiles `refs.at[rows_of(s)]`
    go into slot s % stages of `smem`, each completing on its slot's barrier of `barriers`, through `produce`."""
    plgpu.set_max_registers(registers, action="decrease")

    def load(step, slot):
        for ref, tile, barrier in zip(refs, smem, barriers):
            plgpu.copy_gmem_to_smem(ref.at[rows_of(step)], tile.at[slot], barrier.at[slot])
    produce(load, consumed, begin=0, end=steps, stages=stages)


def copy_in(copies, barriers, first):
    """A compute warpgroup's operands that stay for its whole loop: each (global, shared) pair of `copies` on its
    own barrier, barriers.at[first + i], all issued before the first wait."""
    for i, (src, dst) in enumerate(copies):
        plgpu.copy_gmem_to_smem(src, dst, barriers.at[first + i])
    for i in range(len(copies)):
        plgpu.barrier_wait(barriers.at[first + i])


def produce(load, consumed, *, begin, end, stages: int):
    """The TMA warpgroup's loop: steps [begin, end) go through `stages` shared-memory slots (step s uses slot
    (s - begin) % stages); `load(step, slot)` issues a step's copies, each completing on its slot's barrier,
    and a slot is refilled once every compute warpgroup has arrived at its `consumed` barriers."""
    for slot in range(stages):
        pl.when(begin + slot < end)(functools.partial(load, begin + slot, slot))

    @pl.loop(begin + stages, end)
    def _refill(step):
        slot = index_rem(step - begin, stages)
        for barrier in consumed:
            plgpu.barrier_wait(barrier.at[slot])
        load(step, slot)

    @pl.loop(jnp.maximum(end - stages, begin), end)
    def _last_releases(step):
        # Nothing is refilled after the last steps, but their releases complete barrier phases: observe them so
        # every phase has been waited for when the kernel exits (the GPU interpreter checks this).
        for barrier in consumed:
            plgpu.barrier_wait(barrier.at[index_rem(step - begin, stages)])


def launch(kernel, scratch: dict, out_type, grid: dict, inputs, *, warpgroups: int, interpret: bool, name: str,
           compiler_params=None):
    """Every Mosaic kernel's launch: `kernel(*refs, **scratch refs)` over a named `grid` of CTAs of `warpgroups`
    compute warpgroups and one TMA producer, with named scratch buffers (allocated collectively for all
    warpgroups; a None entry reaches the kernel as None). `pl.kernel` with a `plgpu.Mesh` rather than
    `plgpu.kernel`, whose batching wrapper does not take the mutable Refs of the one-kernel backward's dQ.

    Inside `jax.shard_map` the kernel's varying-axes check cannot see through the Refs, so the call runs unchecked
    (as `plgpu.kernel` runs it), and the unchecked call returns its outputs typed as INVARIANT over the mesh axes
    (the same value on every device). They are declared varying again over the axes `out_type` names (the
    inputs'): an output typed invariant makes JAX's autodiff treat its per-device use as an implicit broadcast,
    whose transpose is a psum, so the ring's backward received the cotangent summed over the devices (issue 32:
    gradients off by up to 11 on 2 GPUs while out and lse were right)."""
    names = [name for name, value in scratch.items() if value is not None]

    def entry(*refs):
        def body(*smem):
            kernel(*refs, **({name: None for name in scratch} | dict(zip(names, smem))))
        pl.run_scoped(body, *(scratch[name] for name in names), collective_axes="wg")

    mesh = plgpu.Mesh(grid=tuple(grid.values()), grid_names=tuple(grid), num_threads=warpgroups + 1,
                      thread_name="wg", kernel_name=name)
    with _unchecked_vma():
        results = pl.kernel(entry, out_type=out_type, mesh=mesh,
                            compiler_params=compiler_params or plgpu.CompilerParams(approx_math=True),
                            interpret=interpret_params(interpret) or False, name=name)(*inputs)
    return jax.tree.map(declared_varying, results, out_type)


def declared_varying(result: jax.Array, declared: jax.ShapeDtypeStruct) -> jax.Array:
    """`result` typed as varying over every mesh axis `declared` varies over (a no-op outside shard_map)."""
    missing = tuple(sorted(declared.manual_axis_type.varying - jax.typeof(result).manual_axis_type.varying))
    return jax.lax.pcast(result, missing, to="varying") if missing else result


def _unchecked_vma():
    check_vma = getattr(jax_config, "_check_vma", None)  # a private switch: absent, there is nothing to turn off
    return check_vma(False) if check_vma is not None else contextlib.nullcontext()


@functools.partial(jax.jit, static_argnames=("causal", "softmax_scale", "out_dtype", "config", "interpret"))
def mosaic_forward(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool, softmax_scale: float, out_dtype,
                   config: HopperConfig, interpret: bool) -> tuple[jax.Array, jax.Array]:
    """Mosaic GPU forward on validated inputs (`supports` is None): (out [B, Sq, H, D] in `out_dtype`,
    lse [B, H, Sq] float32)."""
    batch, seq_q, heads, head_dim = q.shape
    seq_k, kv_heads = k.shape[1], k.shape[2]
    block_q = config.block_q
    block_kv, warpgroups, persistent = config.forward_schedule(causal)
    q_len = round_up(seq_q, warpgroups * block_q)
    k_len = round_up(seq_k, block_kv)
    num_tiles, num_kv = q_len // (warpgroups * block_q), k_len // block_kv
    num_items = batch * heads * num_tiles if persistent else None
    stages = forward_stages(config, causal=causal, seq_k=seq_k)
    out_dtype = jnp.dtype(out_dtype)
    kernel_smem = forward_scratch(config, head_dim=head_dim, dtype=q.dtype, out_dtype=out_dtype, causal=causal,
                                  stages=stages)
    check_smem(config, kernel_smem, f"D={head_dim}, {q.dtype} in, {out_dtype} out, {'causal' if causal else 'full'} "
               f"attention, Sk={seq_k}", interpret=interpret)
    scratch = kernel_smem.buffers
    inputs = (q, k, v)
    q = pad_axis(q, 1, q_len)
    k, v = pad_axis(k, 1, k_len), pad_axis(v, 1, k_len)

    def kernel(q_ref, k_ref, v_ref, out_ref, lse_ref, *, o_smem2, q_smem2, **smem):
        _forward_kernel(q_ref, k_ref, v_ref, out_ref, lse_ref, q_smem2=q_smem2,
                        o_smem2=q_smem2 if o_smem2 is None else o_smem2, **smem, causal=causal,
                        scale_log2=softmax_scale * LOG2E, block_q=block_q, block_kv=block_kv, stages=stages,
                        group=heads // kv_heads, offset=seq_k - seq_q, seq_k=seq_k, num_kv=num_kv,
                        num_tiles=num_tiles, heads=heads, warpgroups=warpgroups, num_items=num_items,
                        interpret=interpret)

    out, lse = launch(
        kernel, scratch,
        (output_struct((batch, q_len, heads, head_dim), out_dtype, *inputs),
         output_struct((batch, heads, q_len), jnp.float32, *inputs)),
        dict(heads=heads, q_tile=num_tiles, batch=batch) if num_items is None else
        dict(cta=min(num_items, sm_count(interpret))),
        (q, k, v), warpgroups=warpgroups, interpret=interpret, name="twinflash_hopper_forward",
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=kernel_smem.reduction_bytes))
    return out[:, :seq_q], lse[:, :, :seq_q]
