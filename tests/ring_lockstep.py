"""Every rank of a JAX ring on one device: each rank's exact schedule (`jax_impl.ring_attention.schedule_forward` /
`schedule_backward`: the same pieces, LSE slices, merges and accumulations as inside `jax.shard_map`) runs as a
greenlet of its own, and their collectives meet in a `LockstepRing`. Used where the kernels cannot run inside a
multi-device `shard_map`: Pallas's Mosaic GPU interpreter sat idle for 15 minutes in one at P=2 on the CPU.

Greenlets rather than threads: all ranks run in the calling OS thread, one at a time, so JAX sees one thread issuing
one computation after another, as in any single-device test. (With a thread per rank, two interpreted kernels ran at
once through JAX's per-thread ordering of effectful computations and deadlocked in the interpreter's simulated
barriers at P=4.) A scheduler resumes the ranks in rank order; each runs until its next collective, where it hands
over its operand; once every rank has, each gets the collective's result and runs on to the next one. The ranks are
SPMD, so they reach the same collectives in the same order; one that does not, or raises, fails the run at once.
Pallas's GPU interpreter waits forever when a computation is dispatched while an interpreted kernel still runs its
nested callbacks, so each pair kernel call of the schedule is awaited before it goes on (`_pair_calls_awaited`), and
it needs several emulated host devices (tests/conftest.py; with one, the nested callbacks wait forever too).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
from greenlet import getcurrent, greenlet

from jax_impl.ring_attention import RingConfig, schedule_backward, schedule_forward

_MEET, _DONE = "meet", "done"


class LockstepRing:
    """Rank `index`'s `jax_impl.ring_comm.Ring` in a lockstep run (see the module docstring)."""

    def __init__(self, world: int, index: int, scheduler: greenlet):
        self.world, self.index, self._scheduler = world, index, scheduler
        self.rank = index  # a Python int: the schedule chooses each step's pieces in Python, not by lax.cond/switch

    def _meet(self, operand) -> list:
        """Hands `operand` to the scheduler and returns every rank's operand of this collective, in rank order."""
        return self._scheduler.switch((_MEET, operand))

    def exchange(self, arrays):
        return self._meet(arrays)[(self.index - 1) % self.world]

    def all_gather(self, x: jax.Array, axis: int) -> jax.Array:
        return jnp.concatenate(self._meet(x), axis=axis)

    def reduce_scatter(self, x: jax.Array, axis: int) -> jax.Array:
        total = sum(self._meet(x))
        part = x.shape[axis] // self.world
        return jax.lax.slice_in_dim(total, self.index * part, (self.index + 1) * part, axis=axis)


def run_ranks(world: int, rank_fn: Callable[[LockstepRing], object]) -> list:
    """`rank_fn(ring)` for every rank of a lockstep ring of `world` ranks; their results in rank order. An exception
    in any rank is raised here."""
    scheduler = getcurrent()
    ranks = [greenlet(lambda ring: (_DONE, rank_fn(ring))) for _ in range(world)]
    sends = [(LockstepRing(world, index, scheduler),) for index in range(world)]  # what each rank is resumed with
    collectives = 0
    while True:
        events = [rank.switch(*send) for rank, send in zip(ranks, sends)]
        kinds = {kind for kind, _ in events}
        if kinds == {_DONE}:
            return [value for _, value in events]
        if kinds != {_MEET}:
            raise RuntimeError(f"lockstep ring: after {collectives} collectives some ranks finished while others "
                               "wait at another one")
        operands = [operand for _, operand in events]
        sends = [(operands,)] * world
        collectives += 1


@contextlib.contextmanager
def _pair_calls_awaited():
    """The ring's pair kernels (`flash_attention_forward` / `_backward` as `jax_impl.ring_attention` calls them)
    each awaited before the schedule goes on: nothing else is dispatched while an interpreted kernel still runs its
    nested callbacks (that deadlocked the interpreter at P=4). The calls and their arguments are unchanged."""
    ring_module = importlib.import_module("jax_impl.ring_attention")
    originals = {name: getattr(ring_module, name) for name in ("flash_attention_forward", "flash_attention_backward")}

    def awaited(call):
        def run(*args, **kwargs):
            results = jax.block_until_ready(call(*args, **kwargs))
            jax.effects_barrier()
            return results
        return run
    try:
        for name, call in originals.items():
            setattr(ring_module, name, awaited(call))
        yield
    finally:
        for name, call in originals.items():
            setattr(ring_module, name, call)


def ring_results(cfg: RingConfig, world: int, q_parts, k_parts, v_parts, dout_parts) -> list[tuple]:
    """Per rank: (out, lse, dq, dk, dv) of the ring's forward and backward on that rank's local inputs (the
    `*_parts`, one per rank in the layout's order: `shard_for_ring` then split)."""
    def rank_fn(ring: LockstepRing):
        r = ring.index
        (out, lse), residuals = schedule_forward(ring, cfg, q_parts[r], k_parts[r], v_parts[r])
        return jax.block_until_ready((out, lse, *schedule_backward(ring, cfg, residuals, dout_parts[r])))
    with _pair_calls_awaited():
        return run_ranks(world, rank_fn)
