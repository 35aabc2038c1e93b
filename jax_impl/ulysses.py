"""Ulysses (all-to-all) and hybrid Ulysses x ring sequence parallelism for JAX, with `sequence_parallel_attention`,
the one entry of the three schemes (ring, ulysses, hybrid) inside `jax.shard_map`. Twin of `torch_impl/ulysses.py`
(process groups there, mesh axes here). The schemes, their degrees and checks, the KV heads each device receives, the
token order after the all-to-all and the bytes each scheme sends are `weights/sequence_parallel.py`'s; the ring inside
the hybrid is `jax_impl/ring_attention.py`'s, unchanged.

Public API:

  sequence_parallel_mesh(mesh, degrees, axis_name="sp") -> Mesh
      `mesh` with its axis `axis_name` (U x R devices) split into the two axes `scheme_axes(axis_name)`, the ring's
      ("sp_ring", R, outer) and the all-to-all's ("sp_ulysses", U, inner): device s of the axis is (r, u) =
      divmod(s, U), the torch twin's ranks. A dim sharded over both axes together has the same parts on the same
      devices as one sharded over `axis_name`, so arrays placed on `mesh` enter a shard_map over this mesh without a
      transfer (the two-axis mesh is how the hybrid's two collectives each reach their devices: shard_map has no
      device subgroups of one axis).
  sequence_parallel_attention(q, k, v, *, ulysses_axis="sp_ulysses", ring_axis="sp_ring", causal=True,
                              layout="zigzag", variant="ring", return_lse=False, softmax_scale=None,
                              backend="pallas", local_copies=False, segment_ids=None)
      Called INSIDE `jax.shard_map` over a mesh with both axes; q [B, S_local, H, D], k/v [B, S_local, Hkv, D] are
      this device's tokens in `layout` order over all U x R devices, as for `ring_attention` (which U = 1 is);
      `segment_ids` [B, S_local]: their packed documents (`weights/documents.py`), in the same order.
      Returns out in q's dtype, or (out, lse [B, H, S_local] float32, a constant for autodiff) with `return_lse`.
      Differentiable (JAX transposes the all-to-alls; the pair kernels and the ring are custom_vjps);
      `local_copies` makes every collective a same-sized local array, as the ring's.
  sequence_parallel_sharded(q, k, v, mesh, *, scheme="ring", ulysses_degree=None, axis_name="sp",
                            batch_axis=None, ...the same keywords, segment_ids=None)
      GLOBAL arrays (segment_ids [B, S]) in natural position order: reordered into the layout's order, run in
      `jax.shard_map` over `sequence_parallel_mesh`, the result back in natural order (twin of
      `ring_attention_sharded`).

Ulysses and hybrid, on each device: K/V heads put in the all-to-all's slots (`kv_head_slots`: repeated only where
U > Hkv); q, k, v through one `jax.lax.all_to_all` each over the Ulysses axis, from this device's tokens of all heads
to the group's tokens of H / U heads, put in increasing position order (`gathered_chunk_order`, static slices: no
gather); then our flash kernel on the whole sequence of those heads (ulysses, `flash_attention`) or the ring over
the ring axis (hybrid, `ring_attention` on the group's tokens, which are the ring layout's over R); out (and lse,
when asked) back through the inverse all-to-all. XLA schedules the all-to-alls; the latency-hiding scheduler of the
train step may overlap them with independent work.

Packed documents (`segment_ids`): the group's ids are all-gathered over the Ulysses axis (int32 [B, U L], tiny beside
q/k/v) and put in position order exactly like q/k/v (`gathered_chunk_order`); ulysses then runs
`flash_attention(..., segment_ids=)` on the whole sequence, the hybrid its ring over R with them
(`ring_attention(..., segment_ids=)`, on key spans). Balance: Ulysses computes every token of its H / U heads on each
device, so no document lengths can unbalance it. The hybrid's ring runs in the layout over R that the U x R layout
gives the groups (zigzag over P is zigzag over R, contiguous contiguous), whose work per device follows the
documents' lengths as a zigzag (or contiguous) ring's does. zigzag_stripes is refused whenever U > 1 with
`weights.sequence_parallel.check_gathered_layout`'s one ValueError line (torch's too): a group's stripes over P are
not the stripes of a ring over R, and `gathered_chunk_order` knows zigzag's two chunks per device, not one per
stripe. Packed training runs Ulysses and the hybrid in zigzag (`weights.parallel.scheme_layout`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from jax_impl.documents import checked_segment_ids
from jax_impl.kernels.flash_attention import flash_attention
from jax_impl.ring_attention import gather_from_ring, ring_attention, shard_for_ring
from jax_impl.ring_comm import MeshRing, mesh_ring
from weights.attention import check_ring_choices, check_ring_shapes
from weights.layout import check_split
from weights.sequence_parallel import (SchemeDegrees, check_gathered_layout, check_heads, gathered_chunk_order,
                                       kv_head_slots, scheme_degrees)


def scheme_axes(axis_name: str = "sp") -> tuple[str, str]:
    """(ring axis, Ulysses axis) of `sequence_parallel_mesh` split from mesh axis `axis_name`."""
    return f"{axis_name}_ring", f"{axis_name}_ulysses"


def sequence_parallel_mesh(mesh: Mesh, degrees: SchemeDegrees, axis_name: str = "sp") -> Mesh:
    """`mesh` with axis `axis_name` split into `scheme_axes(axis_name)` of sizes (R, U) (module docstring)."""
    if mesh.shape.get(axis_name) != degrees.sp:
        raise ValueError(f"mesh axis {axis_name!r} must have the scheme's {degrees.sp} devices, the mesh has "
                         f"{dict(mesh.shape)}")
    index = mesh.axis_names.index(axis_name)
    devices = mesh.devices.reshape(*mesh.devices.shape[:index], degrees.ring, degrees.ulysses,
                                   *mesh.devices.shape[index + 1:])
    names = (*mesh.axis_names[:index], *scheme_axes(axis_name), *mesh.axis_names[index + 1:])
    return Mesh(devices, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))


# ---------------------------------------------------------------------------------------------------------------
# The all-to-all between sequence shards and head shards
# ---------------------------------------------------------------------------------------------------------------

def _reordered(x: jax.Array, order: tuple[int, ...]) -> jax.Array:
    chunks = jnp.split(x, len(order), axis=1)
    return jnp.concatenate([chunks[i] for i in order], axis=1)


def _group_order(ulysses: int, layout: str):
    """(to positions, to devices): the static permutations of the group's gathered chunks along dim 1, from device
    order to increasing position order and back (the same on every group, `gathered_chunk_order`)."""
    order = gathered_chunk_order(ulysses, layout)
    inverse = tuple(int(i) for i in np.argsort(order))
    return functools.partial(_reordered, order=order), functools.partial(_reordered, order=inverse)


def _to_heads(exchange: MeshRing, x: jax.Array, to_positions) -> jax.Array:
    """[B, L, U n, ...] this device's tokens of every device's heads -> [B, U L, n, ...] the group's tokens of this
    device's heads, in increasing position order."""
    return to_positions(exchange.all_to_all(x, split_axis=2, concat_axis=1))


def _to_sequence(exchange: MeshRing, y: jax.Array, to_devices) -> jax.Array:
    """Inverse of `_to_heads`: [B, U L, n, ...] in position order -> [B, L, U n, ...]."""
    return exchange.all_to_all(to_devices(y), split_axis=1, concat_axis=2)


# ---------------------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------------------

def sequence_parallel_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, ulysses_axis: str = "sp_ulysses",
                                ring_axis: str = "sp_ring", causal: bool = True, layout: str = "zigzag",
                                variant: str = "ring", return_lse: bool = False, softmax_scale: float | None = None,
                                backend: str = "pallas", local_copies: bool = False, segment_ids=None):
    """Attention over the sequence sharded along mesh axes `ring_axis` x `ulysses_axis`; call inside
    `jax.shard_map` (module docstring). `segment_ids` [B, S_local]: this device's tokens' documents, in their
    order. Raises ValueError for bad arguments (heads the Ulysses degree cannot split: one line naming the degrees
    that work), LayoutError (a ValueError) when the local length does not split in `layout`, and for the
    zigzag_stripes layout with U > 1 (module docstring)."""
    check_ring_choices(layout, variant)
    try:
        ulysses, ring = jax.lax.axis_size(ulysses_axis), jax.lax.axis_size(ring_axis)
    except NameError as err:
        raise ValueError(f"mesh axes {ulysses_axis!r} and {ring_axis!r} are not both in scope: call "
                         "sequence_parallel_attention inside jax.shard_map over a sequence_parallel_mesh") from err
    ring_keywords = dict(causal=causal, layout=layout, variant=variant, return_lse=True, softmax_scale=softmax_scale,
                         backend=backend, local_copies=local_copies)
    if ulysses == 1:
        out, lse = ring_attention(q, k, v, axis_name=ring_axis, segment_ids=segment_ids, **ring_keywords)
        return (out, lse) if return_lse else out
    check_gathered_layout(layout)
    check_ring_shapes(q.shape, k.shape, v.shape, ulysses * ring, layout)
    heads, kv_heads = q.shape[2], k.shape[2]
    check_heads(ulysses, heads, kv_heads)
    exchange = mesh_ring(ulysses_axis, local_copies=local_copies)
    to_positions, to_devices = _group_order(ulysses, layout)
    ids = None
    if segment_ids is not None:  # the group's ids in the tokens' position order (every head shares them)
        ids = to_positions(exchange.all_gather(checked_segment_ids(segment_ids, q.shape[0], q.shape[1]), axis=1))
    if ulysses > kv_heads:  # each KV head once per device of its query heads
        slots = kv_head_slots(heads, kv_heads, ulysses).astype(np.int32)
        k, v = (jnp.take(x, slots, axis=2) for x in (k, v))
    q, k, v = (_to_heads(exchange, x, to_positions) for x in (q, k, v))
    if ring == 1:
        out, lse = flash_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=True,
                                   backend=backend, segment_ids=ids)
    else:
        out, lse = ring_attention(q, k, v, axis_name=ring_axis, segment_ids=ids, **ring_keywords)
    out = _to_sequence(exchange, out, to_devices)
    if not return_lse:
        return out
    # lse [B, n, U L] -> [B, U L, n] for the exchange -> [B, L, H] -> [B, H, L]
    return out, _to_sequence(exchange, lse.transpose(0, 2, 1), to_devices).transpose(0, 2, 1)


def _with_segment_ids(attention, q, k, v, segment_ids):
    return attention(q, k, v, segment_ids=segment_ids)


def sequence_parallel_sharded(q: jax.Array, k: jax.Array, v: jax.Array, mesh: Mesh, *, scheme: str = "ring",
                              ulysses_degree: int | None = None, axis_name: str = "sp", batch_axis: str | None = None,
                              causal: bool = True, layout: str = "zigzag", variant: str = "ring",
                              return_lse: bool = False, softmax_scale: float | None = None, backend: str = "pallas",
                              local_copies: bool = False, segment_ids=None):
    """`sequence_parallel_attention` in `scheme` on GLOBAL arrays in natural position order (q [B, S, H, D], k/v
    [B, S, Hkv, D], segment_ids [B, S] or None): the sequence sharded over mesh axis `axis_name` in `layout`, the
    batch over `batch_axis` (None: replicated). Returns out [B, S, H, D] (and lse [B, H, S] with `return_lse`) in
    natural order. Jittable."""
    check_ring_choices(layout, variant)
    if axis_name not in mesh.axis_names:
        raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh (axes: {mesh.axis_names})")
    degrees = scheme_degrees(scheme, mesh.shape[axis_name], ulysses_degree)
    check_split(q.shape[1], degrees.sp, layout)
    ring_axis, ulysses_axis = scheme_axes(axis_name)
    sequence = (ring_axis, ulysses_axis)
    tokens = PartitionSpec(batch_axis, sequence, None, None)
    attention = functools.partial(sequence_parallel_attention, ulysses_axis=ulysses_axis, ring_axis=ring_axis,
                                  causal=causal, layout=layout, variant=variant, return_lse=return_lse,
                                  softmax_scale=softmax_scale, backend=backend, local_copies=local_copies)
    inputs, in_specs = [shard_for_ring(x, degrees.sp, layout) for x in (q, k, v)], [tokens] * 3
    if segment_ids is not None:
        inputs.append(shard_for_ring(checked_segment_ids(segment_ids, q.shape[0], q.shape[1]), degrees.sp, layout))
        in_specs.append(PartitionSpec(batch_axis, sequence))
        attention = functools.partial(_with_segment_ids, attention)
    attend = jax.shard_map(attention, mesh=sequence_parallel_mesh(mesh, degrees, axis_name), in_specs=tuple(in_specs),
                           out_specs=(tokens, PartitionSpec(batch_axis, None, sequence)) if return_lse else tokens)
    result = attend(*inputs)
    if not return_lse:
        return gather_from_ring(result, degrees.sp, layout)
    out, lse = result
    return gather_from_ring(out, degrees.sp, layout), gather_from_ring(lse, degrees.sp, layout, axis=2)
