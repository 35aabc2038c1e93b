"""What more than one kernel module of the JAX backend uses: the exp2-domain constants, padding and int32 index
arithmetic, the `pallas_call` output spec that declares its varying mesh axes, and then per family what its forward
and backward share. Twin of `torch_impl/kernels/tiles.py`.

Portable (Pallas Triton lowering): head dim and block fitting, the fp32-accumulating matmuls, the visibility mask,
the causal block ranges, the documents' span block ranges, the runs of key blocks the forward and dQ kernels walk
(`key_block_runs`, `fold_block_runs`) and the grid's index maps.

Hopper (Pallas Mosaic GPU): the GPU interpreter switch, register-layout hints, the Q K^T wgmma, a query tile's K/V
step range, the documents' block ranges of a tile and its warpgroups (`tile_span_bounds`, from the same
`span_bounds` as the portable kernels'), per-row vectors in register layout, the TMA producer loop and every Mosaic
kernel's launch. Pallas's Mosaic GPU interpreter (CPU tests,
`interpret=True`) lacks wgmma with a register left operand, `pl.run_state` over a wgmma accumulator, a rule for
register-layout casts and wgmma reading a transposed operand, so a few helpers differ under interpretation (lines
marked INTERPRET: `wgmma_nt` here and `matmul_acc` in `hopper/forward.py` are plain fp32-accumulating dots on the
operands read from shared memory, the same tiles the wgmma reads; `layout` leaves values without a hint, which does
not change values); everything else -- TMA copies, barriers and their phases, warpgroup roles, step ranges, masks,
softmax, epilogue stores -- is the same code.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import config as jax_config
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

try:  # public from jax 0.11; jax 0.10 has it only under _src
    from jax.experimental.pallas.mosaic_gpu import InterpretGPUParams
except ImportError:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

# jax 0.10's plgpu.load takes an index argument that 0.11 dropped.
_LOAD_TAKES_INDEX = "idx" in inspect.signature(plgpu.load).parameters


LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
MIN_BLOCK = 16  # Triton's smallest matmul tile edge


# --- both families ---------------------------------------------------------------------------------------

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


# --- portable kernels --------------------------------------------------------------------------------------

def padded_head_dim(head_dim: int) -> int:
    """Head dim the kernels run at: the next power of two, at least MIN_BLOCK (Triton tiles are powers of two)."""
    return max(MIN_BLOCK, pl.next_power_of_2(head_dim))


def fit_block(block: int, seq_len: int) -> int:
    """Shrink a block to the smallest power of two covering a short sequence, so tiny inputs aren't padded
    to a full 128-row tile."""
    return min(block, max(MIN_BLOCK, pl.next_power_of_2(seq_len)))


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


def visible_keys(q_pos: jax.Array, k_block, block_k: int, row_spans, *, causal: bool, offset: int,
                 seq_k: int) -> jax.Array:
    """[rows, block_k] mask of the keys of key block `k_block` each query row (positions `q_pos` [rows, 1]) sees:
    with documents (`row_spans`: the rows' key span (start, end), [rows] each) the keys in the row's span, else
    `visible`'s."""
    k_pos = k_block * block_k + jnp.arange(block_k, dtype=jnp.int32)[None, :]
    if row_spans is not None:
        span_start, span_end = row_spans
        return in_spans(span_start[:, None], span_end[:, None], k_pos)
    return visible(q_pos, k_pos, causal=causal, offset=offset, seq_k=seq_k)


def traced(value: int):
    """`value` as a traced int32 (Triton folds it back to the constant). Loop bounds go through this: with
    Python-int bounds fori_loop becomes a scan that carries the kernel's refs, and Pallas's interpreter cannot
    run that inside `jax.shard_map` (the scan carry fails the varying-mesh-axes check); a while loop it can."""
    return value + pl.program_id(0) * 0


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


def edge_padded_spans(spans, size: int) -> tuple[jax.Array, jax.Array]:
    """(start, end) of documents' spans [B, rows] padded to `size` rows with copies of the last row's: a padded row
    then leaves every bound of a block's spans as it is (`span_block_range`), and its results are sliced off."""
    def pad(x):
        return x if x.shape[1] == size else jnp.pad(x, ((0, 0), (0, size - x.shape[1])), mode="edge")
    return pad(spans.start), pad(spans.end)


def span_block_range(span_start_ref, span_end_ref, block: int):
    """For a block of rows with spans [start, end) in the two Refs (documents, `weights/documents.py`): (first,
    full_first, full_end, end) in units of `block` columns. Blocks [first, end) hold every column any row sees
    (none when every span is empty), [full_first, full_end) those every row sees whole (no mask needed); the rest
    of [first, end) needs the mask.

    Computed in a loop of one trip (none on the GPU, where Triton folds it): Pallas's interpreter types a value read
    from a Ref outside every loop as varying over `jax.shard_map`'s mesh axes and refuses its arithmetic with
    constants (which do not vary), while values read inside a loop body pass (the kernels' other reads all are,
    or only feed dots)."""
    def bounds(_, unused):
        span_start, span_end = span_start_ref[...], span_end_ref[...]
        return span_bounds(jnp.min(span_start), jnp.max(span_start), jnp.min(span_end), jnp.max(span_end), block)
    return lax.fori_loop(0, traced(1), bounds, (traced(0),) * 4)


def span_bounds(lowest_start, highest_start, lowest_end, highest_end, block: int):
    """`span_block_range`'s (first, full_first, full_end, end) from the extremes of a block of rows' spans (int32
    scalars in a kernel, or arrays in plain JAX: `tile_span_bounds`)."""
    first = index_div(lowest_start, block)
    end = jnp.where(highest_end > lowest_start, index_div(highest_end + block - 1, block), first)
    full_first = jnp.clip(index_div(highest_start + block - 1, block), first, end)
    full_end = jnp.clip(index_div(lowest_end, block), full_first, end)
    return first, full_first, full_end, end


def block_runs(bounds):
    """(first, full_first, full_end, end) as the runs of blocks a kernel loops over, (first, end, masked) each: the
    blocks only some rows see part of (masked), those every row sees whole (unmasked), then the rest (masked)."""
    return tuple(zip(bounds, bounds[1:], (True, False, True)))


def span_block_runs(span_start_ref, span_end_ref, block: int):
    """`span_block_range` as the runs of blocks a kernel loops over (`block_runs`)."""
    return block_runs(span_block_range(span_start_ref, span_end_ref, block))


def key_block_runs(q_first, block_q: int, block_k: int, *, causal: bool, offset: int, seq_k: int, num_k_blocks: int,
                   span_refs=None):
    """The key blocks the query rows [q_first, q_first + block_q) visit, as runs (first, end, masked) of blocks in
    the order the forward and dQ kernels walk them. With documents (`span_refs`: the Refs of the rows' key spans)
    `span_block_runs`; otherwise the blocks every row sees whole from block 0 on, unmasked, then those crossing the
    causal diagonal or holding padded keys, masked (no such run is traced where there can be none)."""
    if span_refs is not None:
        return span_block_runs(*span_refs, block_k)
    n_full, n_end = kv_block_range(q_first, block_q, block_k, causal=causal, offset=offset, seq_k=seq_k,
                                   num_k_blocks=num_k_blocks)
    masked_run = ((n_full, n_end, True),) if has_masked_blocks(causal, seq_k, block_k) else ()
    return ((0, n_full, False),) + masked_run


def fold_block_runs(step, runs, carry):
    """`carry` threaded through `step(block, carry, masked=...)` over every block of `runs` (`key_block_runs`) in
    order, one fori_loop a run (`masked` is static: each run traces its own loop body)."""
    for first, end, masked in runs:
        carry = lax.fori_loop(first, end, functools.partial(step, masked=masked), carry)
    return carry


def in_spans(span_start: jax.Array, span_end: jax.Array, pos: jax.Array) -> jax.Array:
    """Which (row, column) pairs attend with documents: the column in the row's span (broadcast shapes)."""
    return (pos >= span_start) & (pos < span_end)


def program_q_block(causal: bool, num_q_blocks: int):
    """This program's query block; causal grids run in reverse so the longest programs are scheduled first."""
    i = pl.program_id(0)
    return num_q_blocks - 1 - i if causal else i


def q_block_index(causal: bool, num_q_blocks: int, i):
    """Index-map twin of `program_q_block` (index maps see grid indices, not program_id)."""
    return num_q_blocks - 1 - i if causal else i


def query_block_map(causal: bool, num_q_blocks: int):
    """BlockSpec index map of a block of a per-row array [B, Sq] (documents' key spans) on a grid over (query
    block, batch, head)."""
    def rows_map(i, b, h):
        return b, q_block_index(causal, num_q_blocks, i)
    return rows_map


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


# --- hopper kernels ----------------------------------------------------------------------------------------

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


def load_rows(ref, kind, *, interpret: bool, from_global: bool = False):
    """A vector of per-row values (lse, delta, documents' spans) from a Ref in shared memory, or `from_global`
    memory, in register layout `kind` (a reduction of `plgpu.Layout.WGMMA`: the rows or the columns of a wgmma
    tile). Mosaic GPU plans its vectorised ("optimized") transfers for shared memory only; a global load of one
    vector per warpgroup and tile, as the documents' spans are, takes the plain one."""
    if interpret:  # INTERPRET: layouts are Mosaic compiler hints (see `layout`)
        return ref[...]
    options = dict(layout=kind, optimized=False) if from_global else dict(layout=kind)
    return plgpu.load(ref, (), **options) if _LOAD_TAKES_INDEX else plgpu.load(ref, **options)


def tile_span_bounds(span_start: jax.Array, span_end: jax.Array, *, rows: int, parts: int, block: int) -> jax.Array:
    """Documents' block ranges for the Mosaic kernels, in plain JAX before the launch (a kernel would need a
    reduction across its warps for them): int32 [B, tiles, parts + 1, 4]. A tile (a CTA's rows: `parts` compute
    warpgroups of `rows` rows each; `span_start` / `span_end` [B, tiles * parts * rows], padded rows repeating the
    last row's: `edge_padded_spans`) gets `span_bounds` in units of `block` columns for each warpgroup's rows,
    clipped into the tile's, and at index `parts` the tile's own: the blocks its producer streams, [first, end)."""
    batch, total = span_start.shape
    parted = (batch, total // (parts * rows), parts, rows)

    def bounds(start, end):  # [..., rows] -> [..., 4]
        return jnp.stack(span_bounds(start.min(-1), start.max(-1), end.min(-1), end.max(-1), block), axis=-1)
    part = bounds(span_start.reshape(parted), span_end.reshape(parted))
    tile = bounds(span_start.reshape(parted[:2] + (-1,)), span_end.reshape(parted[:2] + (-1,)))[:, :, None]
    # A warpgroup whose rows see nothing has first == end anywhere; clipped, its steps are the tile's to drain.
    return jnp.concatenate([jnp.clip(part, tile[..., :1], tile[..., 3:]), tile], axis=2)


def tile_span(bounds_ref, batch, tile):
    """In a Mosaic kernel: (first block, number of blocks) that tile `tile` streams (`tile_span_bounds`' Ref)."""
    parts = bounds_ref.shape[2] - 1
    first = bounds_ref[batch, tile, parts, 0]
    return first, bounds_ref[batch, tile, parts, 3] - first


def part_runs(bounds_ref, batch, tile, part, tile_first):
    """In a Mosaic kernel: warpgroup `part`'s runs of the tile's steps (step s: block tile_first + s), (first, end,
    masked) each (`block_runs`); the tile's steps before the first run and after the last are its to drain."""
    return block_runs([bounds_ref[batch, tile, part, i] - tile_first for i in range(4)])


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


def wgmma_nt(a_smem, b_smem, *, then=None, interpret: bool):
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


def warpgroup_rows(first, wg, block: int, batch, head):
    """Compute warpgroup `wg`'s `block` rows of a tile starting at row `first`: (its first row, its index into a
    [B, S, H, D] array)."""
    start = first + wg * block
    return start, (batch, pl.ds(start, block), head)


def query_tile(*, causal: bool, num_tiles: int, block_q: int, block_kv: int, offset: int, seq_k: int, num_kv: int,
               warpgroups: int, tile=None):
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
           compiler_params: dict | None = None):
    """Every Mosaic kernel's launch: `kernel(*refs, **scratch refs)` over a named `grid` of CTAs of `warpgroups`
    compute warpgroups and one TMA producer, with named scratch buffers (allocated collectively for all
    warpgroups; a None entry reaches the kernel as None), compiled with approximate math (every Mosaic kernel's) and
    `compiler_params`, further `plgpu.CompilerParams` fields. `pl.kernel` with a `plgpu.Mesh` rather than
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
                            compiler_params=plgpu.CompilerParams(approx_math=True, **(compiler_params or {})),
                            interpret=interpret_params(interpret) or False, name=name)(*inputs)
    return jax.tree.map(declared_varying, results, out_type)


def declared_varying(result: jax.Array, declared: jax.ShapeDtypeStruct) -> jax.Array:
    """`result` typed as varying over every mesh axis `declared` varies over (a no-op outside shard_map)."""
    missing = tuple(sorted(declared.manual_axis_type.varying - jax.typeof(result).manual_axis_type.varying))
    return jax.lax.pcast(result, missing, to="varying") if missing else result


def _unchecked_vma():
    check_vma = getattr(jax_config, "_check_vma", None)  # a private switch: absent, there is nothing to turn off
    return check_vma(False) if check_vma is not None else contextlib.nullcontext()
