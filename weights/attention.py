"""What both backends' attention share, framework-neutral: the shape rules of an attention call (the pair kernels
and the ring), the ring's variants and the work of each of its steps, and the bytes a ring call sends. Beside
`weights/layout.py`, which says which positions each device holds; the rings of `torch_impl/ring_attention.py`
and `jax_impl/ring_attention.py` (twins) and the ring benchmark read all of it from here.

Ring variants:
  ring       K/V blocks are passed around the ring (P - 1 hops), sends overlapped with compute; the backward passes
             them again with float32 dK/dV accumulators that travel with their block and come home (P hops).
  allgather  K/V are all-gathered once and each query run attends to its key prefix; the backward gathers K/V
             again and reduce-scatters float32 dK/dV.

Causal work of a ring step, local queries of rank r against the K/V block of rank j (`ring_block`):
  j == r      causal block (local positions increase, so the ordinary lower-triangular mask is right)
  contiguous  j < r full block; j > r nothing
  zigzag      j < r all local queries vs the FIRST half of the received K/V (its early chunk), full;
              j > r the SECOND half of the local queries (the late chunk) vs all received K/V, full;
              both are half a block, so every device is equally busy.
Non-causal attention is a full block at every step.
"""

from __future__ import annotations

import dataclasses

from weights.layout import LAYOUTS, LayoutError, check_split

VARIANTS = ("ring", "allgather")
SOURCES = ("same", "earlier", "later")  # the rank a ring step's K/V block comes from, against the local rank
BLOCK_LAYOUTS = ("contiguous", "zigzag")  # the layouts whose steps `ring_block` tells as slices
FLOAT32_BYTES = 4  # the ring's dK/dV accumulators travel in float32 whatever the compute dtype


def check_attention_shapes(q_shape: tuple, k_shape: tuple, v_shape: tuple) -> None:
    """The shape rules of one attention call, q [B, Sq, H, D] and k/v [B, Sk, Hkv, D] (both backends' kernels):
    ValueError naming the mismatch. Backend limits (head dims, dtypes, devices) stay with each backend."""
    for name, shape in (("q", q_shape), ("k", k_shape), ("v", v_shape)):
        if len(shape) != 4:
            raise ValueError(f"{name} must be 4-D [batch, seq, heads, head_dim], got shape {tuple(shape)}")
    if tuple(k_shape) != tuple(v_shape):
        raise ValueError(f"k and v must have the same shape, got {tuple(k_shape)} and {tuple(v_shape)}")
    batch, seq_q, heads, head_dim = q_shape
    if k_shape[0] != batch:
        raise ValueError(f"batch size mismatch: q has batch {batch}, k/v have {k_shape[0]}")
    if k_shape[3] != head_dim:
        raise ValueError(f"head_dim mismatch: q has head_dim {head_dim}, k/v have {k_shape[3]}")
    if min(batch, seq_q, heads, k_shape[1], k_shape[2]) < 1:
        raise ValueError(f"empty input: batch, sequence lengths and heads must be >= 1, got q shape "
                         f"{tuple(q_shape)} and k/v shape {tuple(k_shape)}")
    if heads % k_shape[2]:
        raise ValueError(f"q heads ({heads}) must be a multiple of k/v heads ({k_shape[2]}): grouped-query "
                         "attention needs a whole multiple of KV heads")


def check_config_family(config, *, uses_hopper: bool, hopper_config: type, portable_config: type,
                        backend: str) -> None:
    """`config=` of either backend's flash attention must be the config class of the kernel family serving the call
    (the Hopper family when `uses_hopper`, else the portable one); the other family's is a ValueError naming both."""
    serving, family, other = ((hopper_config, "hopper", "portable") if uses_hopper
                              else (portable_config, "portable", "hopper"))
    if not isinstance(config, serving):
        raise ValueError(f"config is a {type(config).__name__}, the {other} family's, but the {family} family serves "
                         f"this call (backend={backend!r}); pass a {serving.__name__} or None")


def check_ring_shapes(q_shape: tuple, k_shape: tuple, v_shape: tuple, world: int, layout: str) -> None:
    """The shape rules of ring attention on one device's local q [B, S_local, H, D] and k/v [B, S_local, Hkv, D]
    (both backends'): ValueError naming the mismatch, LayoutError when S_local * world does not split."""
    for name, shape in (("q", q_shape), ("k", k_shape), ("v", v_shape)):
        if len(shape) != 4:
            raise ValueError(f"{name} must be [batch, seq, heads, head_dim], got shape {tuple(shape)}")
    if tuple(k_shape) != tuple(v_shape):
        raise ValueError(f"k and v must have the same shape, got {tuple(k_shape)} and {tuple(v_shape)}")
    if q_shape[0] != k_shape[0] or q_shape[1] != k_shape[1] or q_shape[3] != k_shape[3]:
        raise ValueError(f"q {tuple(q_shape)} and k {tuple(k_shape)} must agree in batch, local sequence length "
                         "and head_dim (ring attention is self-attention over one sharded sequence)")
    if q_shape[2] % k_shape[2]:
        raise ValueError(f"q's {q_shape[2]} heads must be a multiple of k's {k_shape[2]} heads")
    try:
        check_split(q_shape[1] * world, world, layout)
    except LayoutError as err:
        raise LayoutError(f"q has {q_shape[1]} tokens on each of {world} devices, so the {err}") from None


def check_ring_choices(layout: str, variant: str) -> None:
    """ValueError unless `layout` is one of LAYOUTS and `variant` one of VARIANTS."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")


@dataclasses.dataclass(frozen=True)
class RingBlock:
    """The part of one step's pair that has work: local query rows x key columns of the block in hand."""

    rows: slice
    cols: slice
    causal: bool


ALL = slice(None)


def source_of(rank: int, source: int) -> str:
    """Where the K/V block of rank `source` comes from, seen from rank `rank`: one of SOURCES."""
    return "same" if source == rank else "earlier" if source < rank else "later"


def ring_block(causal: bool, layout: str, source: str, local_len: int) -> RingBlock | None:
    """The work of the local queries against a K/V block from the "same", an "earlier" or a "later" rank (the
    table in the module docstring); None when the mask hides all of it."""
    if layout not in BLOCK_LAYOUTS:
        raise ValueError(f"ring_block covers the {' and '.join(BLOCK_LAYOUTS)} layouts; {layout!r} runs on key spans "
                         "(weights/documents.py)")
    if not causal:
        return RingBlock(ALL, ALL, False)
    if source == "same":
        return RingBlock(ALL, ALL, True)
    if layout == "contiguous":
        return RingBlock(ALL, ALL, False) if source == "earlier" else None
    half = local_len // 2
    if source == "earlier":
        return RingBlock(ALL, slice(None, half), False)
    return RingBlock(slice(half, None), ALL, False)


def ring_bytes_sent(local_kv_elements: int, world: int, *, compute_bytes: int, variant: str, backward: bool,
                    forward_passes: int = 1) -> int:
    """Bytes one rank sends in one ring attention call, from the shapes (the one traffic model of the ring).

    `local_kv_elements` counts this rank's K and V together. The forward passes K/V (compute dtype) P - 1 times
    (the allgather variant moves the same bytes), `forward_passes` times (2 when activation checkpointing reruns
    it). The backward passes K/V again, plus float32 dK/dV: the ring variant P times (P - 1 hops, then home), the
    allgather variant's reduce-scatter (P - 1) / P of the P blocks."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    if world < 2:
        return 0
    kv_hops = world - 1
    sent = forward_passes * kv_hops * local_kv_elements * compute_bytes
    if backward:
        gradient_hops = world if variant == "ring" else world - 1
        sent += kv_hops * local_kv_elements * compute_bytes + gradient_hops * local_kv_elements * FLOAT32_BYTES
    return sent
