"""Which token positions each device holds when a sequence is split over P devices: the one definition used by
both ring attentions, by the models' RoPE positions, and by the helpers that shard a sequence and gather it back.

Layouts:
  contiguous  the sequence in P equal chunks; rank r holds chunk r.
  zigzag      the sequence in 2P equal chunks; rank r holds chunk r followed by chunk 2P-1-r. Under a causal mask
              every rank then does the same amount of work (an early chunk paired with a late one), which is why
              it is the default for causal attention.
  zigzag_stripes  zigzag over stripes: the sequence in stripes of `stripe_tokens` (a kernel tile, 128, where the
              length allows), dealt in groups of 2P, rank r holding stripes r and 2P-1-r of every group. Packed
              documents then spread over the ranks tile by tile, so their work stays even for any document lengths,
              where zigzag's pairing of two chunks does not (work follows each token's offset in its document, not
              its position; `weights/documents.py`'s `ring_work`); a stripe of a whole tile
              keeps the kernels' tiles as full as zigzag's. The rings run it on key spans (a sequence without
              documents is one document).

A rank's local tokens are always in increasing position order, so causal masking inside one rank's block is the
ordinary lower-triangular mask. Lengths that do not split evenly are refused with a message naming the lengths
that work (padding would change what a causal model computes at the end of the sequence).
"""

from __future__ import annotations

import math

import numpy as np

from weights.errors import BadInputError

LAYOUTS = ("contiguous", "zigzag", "zigzag_stripes")
STRIPE_TOKENS = 128  # zigzag_stripes' stripe: the portable kernels' tile edge on the GPU


class LayoutError(BadInputError):
    """A sequence length or device count the layout cannot take."""


def chunks_per_rank(layout: str) -> int:
    if layout not in LAYOUTS:
        raise LayoutError(f"unknown layout {layout!r} (choices: {', '.join(LAYOUTS)})")
    return 1 if layout == "contiguous" else 2


def check_split(seq_len: int, world: int, layout: str) -> None:
    """Raises LayoutError unless `seq_len` tokens split over `world` ranks in `layout`."""
    if world < 1:
        raise LayoutError(f"device count must be >= 1, got {world}")
    multiple = world * chunks_per_rank(layout)
    if seq_len < 1 or seq_len % multiple:
        lower = (seq_len // multiple) * multiple
        options = f"{lower} or {lower + multiple}" if lower else f"{multiple}"
        raise LayoutError(f"sequence length {seq_len} does not split into the {layout} layout over {world} devices: "
                          f"it must be a multiple of {multiple} (e.g. {options})")


def rank_positions(seq_len: int, world: int, rank: int, layout: str) -> np.ndarray:
    """int64 [seq_len // world]: the global positions rank `rank` holds, in local order."""
    check_split(seq_len, world, layout)
    if not 0 <= rank < world:
        raise LayoutError(f"rank {rank} out of range for {world} devices")
    if layout == "contiguous":
        local = seq_len // world
        return np.arange(rank * local, (rank + 1) * local, dtype=np.int64)
    chunk = stripe_tokens(seq_len, world) if layout == "zigzag_stripes" else seq_len // (2 * world)
    group = np.arange(chunk, dtype=np.int64)
    starts = np.arange(0, seq_len, 2 * world * chunk)[:, None] + np.array([rank, 2 * world - 1 - rank]) * chunk
    return (starts[..., None] + group).reshape(-1)


def stripe_tokens(seq_len: int, world: int) -> int:
    """zigzag_stripes' stripe length: STRIPE_TOKENS where it divides the seq_len / 2P tokens of a rank's half,
    else their largest common divisor (down to single tokens, which balance as well and fill tiles less)."""
    return math.gcd(seq_len // (2 * world), STRIPE_TOKENS)


def position_runs(seq_len: int, world: int, rank: int, layout: str) -> tuple[tuple[slice, int], ...]:
    """(local rows, end position + 1) of each run of consecutive positions among rank `rank`'s tokens: one run for
    contiguous, two for zigzag, two per group of stripes for zigzag_stripes (which the rings run on key spans
    instead). An all-gathered ring computes each run against the key prefix up to its end."""
    positions = rank_positions(seq_len, world, rank, layout)
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    starts, ends = np.concatenate([[0], breaks]), np.concatenate([breaks, [positions.size]])
    return tuple((slice(int(s), int(e)), int(positions[e - 1]) + 1) for s, e in zip(starts, ends))


def layout_order(seq_len: int, world: int, layout: str) -> np.ndarray:
    """int64 [seq_len]: rank 0's positions, then rank 1's, ...; `x[..., order, ...]` reorders a full sequence so
    that consecutive equal parts belong to consecutive ranks, and `inverse_order` undoes it."""
    return np.concatenate([rank_positions(seq_len, world, r, layout) for r in range(world)])


def inverse_order(order: np.ndarray) -> np.ndarray:
    inverse = np.empty_like(order)
    inverse[order] = np.arange(order.size, dtype=order.dtype)
    return inverse


def shard_sequence(x: np.ndarray, world: int, layout: str, axis: int = 1) -> list[np.ndarray]:
    """Splits a full sequence along `axis` into each rank's local part."""
    order = layout_order(x.shape[axis], world, layout)
    return np.split(np.take(x, order, axis=axis), world, axis=axis)


def gather_sequence(parts: list[np.ndarray], layout: str, axis: int = 1) -> np.ndarray:
    """Inverse of `shard_sequence`: concatenates the ranks' parts and restores position order."""
    joined = np.concatenate(parts, axis=axis)
    order = layout_order(joined.shape[axis], len(parts), layout)
    return np.take(joined, inverse_order(order), axis=axis)
