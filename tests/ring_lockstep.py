"""Every rank of a JAX ring on one device: each rank's exact schedule (`jax_impl.ring_attention.schedule_forward` /
`schedule_backward`: the same pieces, LSE slices, merges and accumulations as inside `jax.shard_map`) runs in a
thread of its own, and their collectives meet in a `LockstepRing`. Used where the kernels cannot run inside a
multi-device `shard_map`: Pallas's Mosaic GPU interpreter sat idle for 15 minutes in one at P=2 on the CPU.

It needs what tests/conftest.py sets up: several emulated host devices (with one, the interpreter's nested
callbacks wait forever) and inline dispatch of one-device computations (with asynchronous dispatch, a kernel still
running its callbacks and the next rank's dispatch deadlocked).

The threads take turns: exactly one runs JAX at a time, until it reaches a collective; it then deposits its
operand, waits for every pending computation (`jax.effects_barrier`: the interpreted kernels are ordered IO
effects), and passes the turn to the next rank. When the last rank has deposited, every rank's result of that
collective is known; the turn comes back round. The ranks are SPMD, so they reach the same collectives in the same
order; one that does not (or raises) aborts the others instead of leaving them waiting.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jax_impl.ring_attention import RingConfig, schedule_backward, schedule_forward


class _Turns:
    """The shared state of one lockstep run: whose turn it is and each collective's deposits, by call count."""

    def __init__(self, world: int):
        self.world = world
        self.turn = 0
        self.deposits: dict[int, dict[int, object]] = {}
        self.failed: BaseException | None = None
        self.cond = threading.Condition()

    def wait_for(self, predicate: Callable[[], bool]) -> None:
        if not self.cond.wait_for(lambda: predicate() or self.failed is not None, timeout=1800):
            raise TimeoutError("lockstep ring: a rank waited 30 minutes for its turn")
        if self.failed is not None:
            raise RuntimeError("lockstep ring: another rank failed") from self.failed


class LockstepRing:
    """Rank `rank`'s `jax_impl.ring_comm.Ring` in a lockstep run (see the module docstring)."""

    def __init__(self, turns: _Turns, rank: int):
        self._turns, self.world, self.index = turns, turns.world, rank
        self.rank = rank  # a Python int: the schedule chooses each step's pieces in Python, not by lax.cond/switch
        self._calls = 0

    def _meet(self, operand) -> list:
        """Deposits `operand` for this collective and returns every rank's, in rank order."""
        turns, call = self._turns, self._calls
        self._calls += 1
        operand = jax.block_until_ready(operand)
        jax.effects_barrier()
        with turns.cond:
            turns.deposits.setdefault(call, {})[self.index] = operand
            turns.turn = (self.index + 1) % self.world
            turns.cond.notify_all()
            turns.wait_for(lambda: turns.turn == self.index and len(turns.deposits[call]) == self.world)
            return [turns.deposits[call][r] for r in range(self.world)]

    def exchange(self, arrays):
        return self._meet(arrays)[(self.index - 1) % self.world]

    def all_gather(self, x: jax.Array, axis: int) -> jax.Array:
        return jnp.concatenate(self._meet(x), axis=axis)

    def reduce_scatter(self, x: jax.Array, axis: int) -> jax.Array:
        total = sum(self._meet(x))
        part = x.shape[axis] // self.world
        return jax.lax.slice_in_dim(total, self.index * part, (self.index + 1) * part, axis=axis)


def run_ranks(world: int, rank_fn: Callable[[LockstepRing], object], *, timeout_s: float = 1500.0) -> list:
    """`rank_fn(ring)` for every rank of a lockstep ring of `world` ranks, each in its own (daemon) thread; their
    results in rank order. An exception in any rank is raised here (the others are released); ranks still running
    after `timeout_s` raise TimeoutError rather than hang the test run."""
    turns = _Turns(world)
    results: list = [None] * world
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        ring = LockstepRing(turns, rank)
        try:
            with turns.cond:
                turns.wait_for(lambda: turns.turn == rank)
            results[rank] = rank_fn(ring)
            with turns.cond:  # done: pass the turn on for good
                if any(call >= ring._calls for call in turns.deposits):
                    turns.failed = RuntimeError(f"lockstep ring: rank {rank} finished after {ring._calls} "
                                                "collectives while another rank waits at a later one")
                turns.turn = (rank + 1) % world
                turns.cond.notify_all()
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread below
            errors.append(err)
            with turns.cond:
                turns.failed = turns.failed or err
                turns.cond.notify_all()

    threads = [threading.Thread(target=run, args=(rank,), name=f"lockstep-rank-{rank}", daemon=True)
               for rank in range(world)]
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(deadline - time.monotonic(), 0.0))
    if any(thread.is_alive() for thread in threads):
        raise TimeoutError(f"lockstep ring: ranks still running after {timeout_s:.0f} s")
    if errors:
        raise errors[0]
    return results


def ring_results(cfg: RingConfig, world: int, q_parts, k_parts, v_parts, dout_parts) -> list[tuple]:
    """Per rank: (out, lse, dq, dk, dv) of the ring's forward and backward on that rank's local inputs (the
    `*_parts`, one per rank in the layout's order: `shard_for_ring` then split)."""
    def rank_fn(ring: LockstepRing):
        r = ring.index
        (out, lse), residuals = schedule_forward(ring, cfg, q_parts[r], k_parts[r], v_parts[r])
        return (out, lse, *schedule_backward(ring, cfg, residuals, dout_parts[r]))
    return run_ranks(world, rank_fn)
