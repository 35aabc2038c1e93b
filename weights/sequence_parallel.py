"""The sequence-parallel schemes both backends run over the `sp` devices, framework-neutral: ring, Ulysses
(all-to-all) and their hybrid; their degrees and checks, which KV heads each device of a Ulysses group receives,
the token order after the all-to-all, and the bytes each scheme sends. Read by torch_impl/ulysses.py and
jax_impl/ulysses.py (twins), both backends' parallel.py, `twinflash train` and `bench ring`.

Schemes over P = U x R sp devices, sp device s = r * U + u (u inner: a Ulysses group is U adjacent ranks, which stay
inside a node when U divides the GPUs per node):
  ring     U = 1, R = P: `weights.attention`'s ring; K/V blocks go around the P devices.
  ulysses  U = P, R = 1: an all-to-all turns each device's S / P tokens of all H heads into all S tokens of H / U
           heads; each device runs the flash kernel on the whole sequence of its heads, and an all-to-all turns the
           output back (DeepSpeed-Ulysses).
  hybrid   1 < U < P: the all-to-all inside each group of U adjacent devices, then the ring over the R devices of one
           u (one per group), on the group's tokens of H / U heads (USP's, TransformerEngine's "a2a+p2p").

Token order. The sp devices hold the sequence in a ring layout over P (`weights.layout`, the training's
`RING_LAYOUT`). The U devices of group r together hold exactly the positions the same layout gives device r of a
ring of R: zigzag over P gives device s the chunks s and 2P-1-s of S / 2P tokens, so group r holds the chunks rU to
rU+U-1 and their mirror images, i.e. the chunks r and 2R-1-r of S / 2R tokens (contiguous: chunk r of S / R). After
the all-to-all a device holds the group's chunks in device order (zigzag: u's early chunk, u's late chunk, u+1's
early chunk, ...); `gathered_chunk_order` puts them in increasing position order, which is the order the ring over R
takes (`weights.layout.rank_positions`) and the order a causal kernel needs. The permutation is the same on every
device, for every group and every R (tests/test_ulysses_scheme.py checks it against `rank_positions`), so no device
needs its rank to apply it.
Only these two layouts (`GATHERED_LAYOUTS`): with U > 1 both backends refuse zigzag_stripes in one ValueError line
(`check_gathered_layout`), as a group's stripes over P are not the stripes of a ring over R; packed training runs
Ulysses and the hybrid in zigzag (`weights.parallel.scheme_layout`), Ulysses being balanced by heads whatever the
documents.

KV heads (query head h reads KV head h // (H / Hkv)). Device u of a group runs the query heads [u H/U, (u+1) H/U)
and receives the KV heads those read (`kv_head_slots`):
  Hkv a multiple of U   Hkv / U KV heads, split like the query heads: K/V cross the wire once.
  U a multiple of Hkv   its query heads all read one KV head: each KV head goes to the U / Hkv devices of its query
                        heads, i.e. K/V are repeated U / Hkv times before the all-to-all, and no more.
  otherwise refused     a device's query heads would read KV heads shared with another device's in a grouping the
                        GQA kernels cannot take; one ValueError line names the degrees that work.

Bytes one device sends in one attention call (`sequence_parallel_bytes_sent`), L = S / P local tokens of batch B,
head dim D, b bytes per element, Hw = max(Hkv, U) the KV heads of one device's all-to-all buffer:
  all-to-all  (U - 1) / U x B L D b x (2 H + 2 Hw) per forward (q, k and v in; out back), and as much in the
              backward (dout in; dq, dk and dv back, in the compute dtype).
  ring        `weights.attention.ring_bytes_sent` over R devices of the group's K/V: 2 B (U L) (Hw / U) D elements.
A rerun forward (activation checkpointing) repeats the all-to-alls and, with "full" checkpointing, the ring's forward.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from weights.attention import ring_bytes_sent
from weights.errors import BadInputError
from weights.layout import chunks_per_rank, rank_positions

SCHEMES = ("ring", "ulysses", "hybrid")


@dataclasses.dataclass(frozen=True)
class SchemeDegrees:
    """A scheme over `ulysses` x `ring` sp devices (module docstring)."""

    scheme: str
    ulysses: int
    ring: int

    @property
    def sp(self) -> int:
        return self.ulysses * self.ring

    def __str__(self) -> str:
        if self.scheme == "hybrid":
            return f"hybrid U={self.ulysses} x R={self.ring}"
        return f"{self.scheme} over {self.sp}"


def scheme_degrees(scheme: str, sp: int, ulysses_degree: int | None = None) -> SchemeDegrees:
    """The degrees of `scheme` over `sp` devices; `ulysses_degree` is the hybrid's U (ring: 1, ulysses: sp, which
    may be given or left out). BadInputError (a ValueError) naming what works otherwise."""
    if scheme not in SCHEMES:
        raise BadInputError(f"sequence-parallel scheme must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    fixed = {"ring": 1, "ulysses": sp}.get(scheme)
    if fixed is not None:
        if ulysses_degree not in (None, fixed):
            raise BadInputError(f"the {scheme} scheme over sp={sp} has Ulysses degree {fixed}, got {ulysses_degree} "
                                "(a degree in between is the hybrid scheme's)")
        return SchemeDegrees(scheme, fixed, sp // fixed)
    if ulysses_degree is None:
        raise BadInputError("the hybrid scheme needs its Ulysses degree U (--ulysses-degree)")
    divisors = [u for u in range(2, sp) if sp % u == 0]
    if ulysses_degree not in divisors:
        works = (f"one of {', '.join(map(str, divisors))}" if divisors else
                 f"sp={sp} has none: take the ring or the ulysses scheme")
        raise BadInputError(f"hybrid Ulysses degree {ulysses_degree} over sp={sp} must divide sp and lie strictly "
                            f"between 1 and sp ({works})")
    return SchemeDegrees(scheme, ulysses_degree, sp // ulysses_degree)


def check_heads(ulysses_degree: int, heads: int, kv_heads: int) -> None:
    """BadInputError unless `heads` query and `kv_heads` KV heads split over `ulysses_degree` devices (module
    docstring: U divides H, and Hkv is a multiple of U or U one of Hkv), naming the degrees that would."""
    def fits(u: int) -> bool:
        return heads % u == 0 and (kv_heads % u == 0 or u % kv_heads == 0)

    if fits(ulysses_degree):
        return
    works = ", ".join(str(u) for u in range(1, heads + 1) if fits(u))
    rule = (f"must divide the {heads} query heads" if heads % ulysses_degree else
            f"and the {kv_heads} KV heads must be multiples one of the other (each device's query heads then read "
            "whole KV heads of their own)")
    raise BadInputError(f"Ulysses degree {ulysses_degree} {rule}; degrees that work for {heads} query and "
                        f"{kv_heads} KV heads: {works}")


def kv_head_slots(heads: int, kv_heads: int, ulysses_degree: int) -> np.ndarray:
    """int64 [max(Hkv, U)]: the KV head in each head slot of a device's K/V all-to-all buffer; device u receives
    the slots [u n, (u + 1) n), n = max(Hkv, U) / U, which are the KV heads its query heads read. The identity when
    Hkv is a multiple of U; each KV head U / Hkv times in a row when U is a multiple of Hkv."""
    check_heads(ulysses_degree, heads, kv_heads)
    return np.arange(max(kv_heads, ulysses_degree), dtype=np.int64) * kv_heads // max(kv_heads, ulysses_degree)


GATHERED_LAYOUTS = ("contiguous", "zigzag")  # the layouts `gathered_chunk_order` puts in position order


def check_gathered_layout(layout: str) -> None:
    """Raises ValueError (one line, both backends' `sequence_parallel_attention` with U > 1) unless `layout` is one of
    GATHERED_LAYOUTS: zigzag_stripes is refused, since a group's stripes over P are not the stripes of a ring over R
    and `gathered_chunk_order` knows zigzag's two chunks per device, not one per stripe."""
    if layout not in GATHERED_LAYOUTS:
        raise ValueError(f"sequence_parallel_attention with a Ulysses degree above 1 takes the "
                         f"{' or '.join(GATHERED_LAYOUTS)} layout, got {layout!r}: a group's stripes over P are not "
                         "the stripes of a ring over R")


def gathered_chunk_order(ulysses_degree: int, layout: str) -> tuple[int, ...]:
    """The layout's chunks after the all-to-all (each device's chunks in its local order, device after device), in
    increasing position order: element i is the index of the chunk that goes i-th (module docstring)."""
    per_device = chunks_per_rank(layout)
    seq_len = ulysses_degree * per_device  # one token per chunk: positions stand for chunks
    gathered = np.concatenate([rank_positions(seq_len, ulysses_degree, u, layout) for u in range(ulysses_degree)])
    return tuple(int(i) for i in np.argsort(gathered))


def sequence_parallel_bytes_sent(degrees: SchemeDegrees, *, batch: int, local_tokens: int, heads: int,
                                 kv_heads: int, head_dim: int, compute_bytes: int, variant: str, backward: bool,
                                 exchange_forwards: int = 1, ring_forwards: int = 1) -> int:
    """Bytes one device sends in one attention call of `degrees`' scheme, from the shapes (module docstring): the
    all-to-alls `exchange_forwards` times forward (plus once backward), the ring over R `ring_forwards` times."""
    u, ring = degrees.ulysses, degrees.ring
    wire_kv = max(kv_heads, u)
    sent = 0
    if u > 1:
        check_heads(u, heads, kv_heads)
        per_pass = (u - 1) * batch * local_tokens * head_dim * compute_bytes * (2 * heads + 2 * wire_kv) // u
        sent += per_pass * (exchange_forwards + backward)
    group_kv_elements = 2 * batch * (u * local_tokens) * (wire_kv // u if u > 1 else kv_heads) * head_dim
    return sent + ring_bytes_sent(group_kv_elements, ring, compute_bytes=compute_bytes, variant=variant,
                                  backward=backward, forward_passes=ring_forwards)
