"""Packed documents on the device, JAX: the key spans and query spans of `weights/documents.py`'s contract computed
from segment ids and positions with `jnp.searchsorted` (jittable: the ids may be traced), which the kernels, the
reference attention and the ring take. Twin of `torch_impl/documents.py`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from weights.documents import check_segment_ids


class Spans(NamedTuple):
    """One run [start, end) per row (int32 [B, rows] each, non-decreasing): the keys each query row of a call sees
    (key spans), or the query rows that see each key (query spans)."""

    start: jax.Array
    end: jax.Array


def checked_segment_ids(segment_ids, batch: int, seq_len: int) -> jax.Array:
    """`segment_ids` as int32, after `weights.documents.check_segment_ids` (its value rule only where the ids are
    concrete: under `jax.jit` they are traced, and their shape and dtype are checked alone)."""
    if not hasattr(segment_ids, "shape") or not hasattr(segment_ids, "dtype"):
        raise ValueError(f"segment_ids must be an array, got {type(segment_ids).__name__}")
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ValueError(f"segment_ids must be integers, got {segment_ids.dtype}")
    if isinstance(segment_ids, jax.core.Tracer):
        check_segment_ids(np.zeros(segment_ids.shape, np.int32), batch, seq_len)
    else:
        check_segment_ids(np.asarray(segment_ids), batch, seq_len)
    return jnp.asarray(segment_ids, jnp.int32)


def _searchsorted(sorted_rows: jax.Array, values: jax.Array, side: str) -> jax.Array:
    """Row by row, int32: where each of values[b] goes in sorted_rows[b]."""
    def row(sorted_row, value_row):
        return jnp.searchsorted(sorted_row, value_row, side=side).astype(jnp.int32)
    return jax.vmap(row)(sorted_rows, values)


def key_spans(q_segments: jax.Array, q_positions, k_segments: jax.Array, k_positions, *, causal: bool) -> Spans:
    """`weights.documents.key_spans` on the device: segments int32 [B, S], positions [S] shared by the batch."""
    start = _searchsorted(k_segments, q_segments, "left")
    end = _searchsorted(k_segments, q_segments, "right")
    if causal:
        limit = jnp.searchsorted(jnp.asarray(k_positions), jnp.asarray(q_positions), side="right")
        end = jnp.minimum(end, limit.astype(jnp.int32)[None])
    return Spans(start, end)


def document_spans(segment_ids: jax.Array, *, causal: bool) -> Spans:
    """The key spans of self-attention over one packed sequence (queries and keys the same tokens)."""
    positions = jnp.arange(segment_ids.shape[1], dtype=jnp.int32)
    return key_spans(segment_ids, positions, segment_ids, positions, causal=causal)


def causally_limited(spans: Spans, seq_k: int) -> Spans:
    """`spans` cut at the causal limit of a call with Sq != Sk aligned bottom-right: query i sees no key past
    i + Sk - Sq (the pair functions' `causal=True` beside spans)."""
    seq_q = spans.start.shape[1]
    limit = jnp.arange(seq_q, dtype=jnp.int32) + (seq_k - seq_q + 1)
    return Spans(spans.start, jnp.minimum(spans.end, limit[None]))


def query_spans(spans: Spans, seq_k: int) -> Spans:
    """`weights.documents.query_spans` on the device: the run of query rows that see each key, int32 [B, Sk]."""
    keys = jnp.broadcast_to(jnp.arange(seq_k, dtype=jnp.int32), (spans.start.shape[0], seq_k))
    return Spans(_searchsorted(spans.end, keys, "right"), _searchsorted(spans.start, keys, "right"))


def visible_keys(spans: Spans, seq_k: int) -> jax.Array:
    """bool [B, Sq, Sk]: the pairs that attend (the reference attention's mask)."""
    keys = jnp.arange(seq_k)
    return (keys >= spans.start[..., None]) & (keys < spans.end[..., None])
