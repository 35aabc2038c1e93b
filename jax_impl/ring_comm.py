"""The communication under the JAX ring attention: what one device of the ring needs of the others, as an object
the ring's schedule (`jax_impl/ring_attention.py`) is given rather than collectives it calls itself. Twin of
`torch_impl/ring_comm.py` (same names; there each operation is issued on a side stream and waited for, here XLA
schedules the collectives, so each returns its result).

  Ring(world, rank)                 the interface: this device's `rank` of `world`, and
      exchange(arrays)              sends a pytree to the next rank (r -> r+1 mod P), returns the previous rank's;
      all_gather(x, axis)           every rank's x concatenated along `axis` in rank order;
      reduce_scatter(x, axis)       the sum over ranks of x, split along `axis`: this rank's part;
      all_to_all(x, split_axis, concat_axis)  x split along `split_axis`, part j to rank j; the parts received
                                    concatenated along `concat_axis` in rank order (`jax_impl/ulysses.py`).
  MeshRing(axis_name, local_copies) the ring of a `jax.shard_map` mesh axis (jax.lax.ppermute / all_gather /
                                    psum_scatter / all_to_all); rank is the traced `jax.lax.axis_index`. With
                                    `local_copies` every collective becomes a local array of the same size (results
                                    wrong by design): the benchmark's ring minus its communication, for measuring
                                    how much communication the overlap leaves exposed (twin of the torch Ring's
                                    `local_copies`).

The schedule never asks which kind of ring it runs on, so any `Ring` runs it unchanged: the tests drive every rank's
exact schedule on one device through a lockstep `Ring` (tests/ring_lockstep.py), which is how the interpreted Mosaic
GPU kernels, which cannot run inside a multi-device `shard_map` on the CPU, are checked inside the ring.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp


class Ring(Protocol):
    """One device's view of the ring: its size, its rank (a Python int or a traced int32 scalar) and three
    collectives over the ring's devices."""

    world: int
    rank: Any

    def exchange(self, arrays):
        """Sends the pytree `arrays` to the next rank and returns the one received from the previous rank."""

    def all_gather(self, x: jax.Array, axis: int) -> jax.Array:
        """Every rank's `x` concatenated along `axis`, rank 0's first."""

    def reduce_scatter(self, x: jax.Array, axis: int) -> jax.Array:
        """The sum over ranks of `x` (whose `axis` splits evenly into `world` parts): this rank's part of it."""

    def all_to_all(self, x: jax.Array, split_axis: int, concat_axis: int) -> jax.Array:
        """`x` split into `world` parts along `split_axis`, part j sent to rank j; the parts received concatenated
        along `concat_axis`, rank 0's first."""


@dataclasses.dataclass(frozen=True)
class MeshRing:
    """The `Ring` over the `jax.shard_map` mesh axis `axis_name` (build it with `mesh_ring` inside the shard_map)."""

    world: int
    rank: Any
    axis_name: str
    local_copies: bool = False

    def exchange(self, arrays):
        if self.local_copies:
            return jax.tree.map(jnp.copy, arrays)
        return jax.lax.ppermute(arrays, self.axis_name, perm=[(r, (r + 1) % self.world) for r in range(self.world)])

    def all_gather(self, x: jax.Array, axis: int) -> jax.Array:
        if self.local_copies:
            return jnp.concatenate([x] * self.world, axis=axis)
        return jax.lax.all_gather(x, self.axis_name, axis=axis, tiled=True)

    def reduce_scatter(self, x: jax.Array, axis: int) -> jax.Array:
        if self.local_copies:
            return jax.lax.slice_in_dim(x, 0, x.shape[axis] // self.world, axis=axis)
        return jax.lax.psum_scatter(x, self.axis_name, scatter_dimension=axis, tiled=True)


    def all_to_all(self, x: jax.Array, split_axis: int, concat_axis: int) -> jax.Array:
        if self.local_copies:
            return jnp.concatenate(jnp.split(x, self.world, axis=split_axis), axis=concat_axis)
        return jax.lax.all_to_all(x, self.axis_name, split_axis, concat_axis, tiled=True)


def mesh_ring(axis_name: str, *, local_copies: bool = False) -> MeshRing:
    """The `MeshRing` of mesh axis `axis_name`; call inside `jax.shard_map` (NameError when the axis is not in
    scope)."""
    return MeshRing(jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name), axis_name, local_copies)
