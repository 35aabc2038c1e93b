"""Packed documents on the device, PyTorch: the key spans and query spans of `weights/documents.py`'s contract
computed from segment ids and positions with `torch.searchsorted`, which the kernels, the reference attention and
the ring take. Twin of `jax_impl/documents.py`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from weights.documents import check_segment_ids


class Spans(NamedTuple):
    """One run [start, end) per row (int32 [B, rows] each, non-decreasing): the keys each query row of a call sees
    (key spans), or the query rows that see each key (query spans)."""

    start: torch.Tensor
    end: torch.Tensor


def checked_segment_ids(segment_ids, batch: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """`segment_ids` as a contiguous int32 tensor on `device`, after `weights.documents.check_segment_ids` (one
    host copy of the ids: a device sync when they are on a GPU)."""
    if not isinstance(segment_ids, torch.Tensor):
        raise ValueError(f"segment_ids must be a torch.Tensor, got {type(segment_ids).__name__}")
    if segment_ids.dtype.is_floating_point or segment_ids.dtype.is_complex or segment_ids.dtype == torch.bool:
        raise ValueError(f"segment_ids must be integers, got {segment_ids.dtype}")
    check_segment_ids(segment_ids.detach().cpu().numpy(), batch, seq_len)
    return segment_ids.to(device=device, dtype=torch.int32).contiguous()


def key_spans(q_segments: torch.Tensor, q_positions: torch.Tensor, k_segments: torch.Tensor,
              k_positions: torch.Tensor, *, causal: bool) -> Spans:
    """`weights.documents.key_spans` on the device: segments int32 [B, S], positions [S] shared by the batch."""
    k_segments, q_segments = k_segments.contiguous(), q_segments.contiguous()
    start = torch.searchsorted(k_segments, q_segments, right=False)
    end = torch.searchsorted(k_segments, q_segments, right=True)
    if causal:
        limit = torch.searchsorted(k_positions.contiguous(), q_positions.contiguous(), right=True)
        end = torch.minimum(end, limit[None])
    return Spans(start.to(torch.int32), end.to(torch.int32))


def document_spans(segment_ids: torch.Tensor, *, causal: bool) -> Spans:
    """The key spans of self-attention over one packed sequence (queries and keys the same tokens)."""
    positions = torch.arange(segment_ids.shape[1], device=segment_ids.device, dtype=torch.int32)
    return key_spans(segment_ids, positions, segment_ids, positions, causal=causal)


def causally_limited(spans: Spans, seq_k: int) -> Spans:
    """`spans` cut at the causal limit of a call with Sq != Sk aligned bottom-right: query i sees no key past
    i + Sk - Sq (the pair functions' `causal=True` beside spans)."""
    seq_q = spans.start.shape[1]
    limit = torch.arange(seq_q, device=spans.end.device, dtype=torch.int32) + (seq_k - seq_q + 1)
    return Spans(spans.start, torch.minimum(spans.end, limit[None]))


def query_spans(spans: Spans, seq_k: int) -> Spans:
    """`weights.documents.query_spans` on the device: the run of query rows that see each key, int32 [B, Sk]."""
    batch = spans.start.shape[0]
    keys = torch.arange(seq_k, device=spans.start.device, dtype=torch.int32).expand(batch, seq_k).contiguous()
    start = torch.searchsorted(spans.end.contiguous(), keys, right=True)
    end = torch.searchsorted(spans.start.contiguous(), keys, right=True)
    return Spans(start.to(torch.int32), end.to(torch.int32))


def visible_keys(spans: Spans, seq_k: int) -> torch.Tensor:
    """bool [B, Sq, Sk]: the pairs that attend (the reference attention's mask)."""
    keys = torch.arange(seq_k, device=spans.start.device)
    return (keys >= spans.start[..., None]) & (keys < spans.end[..., None])
