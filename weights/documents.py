"""Packed documents (document masking): the one contract of both backends' kernels, rings, models and data, in
numpy. `torch_impl/documents.py` and `jax_impl/documents.py` (twins) compute the same spans on the device; the
functions here are the definition they are tested against, the checks of bad input (and the refusal of the kernels
that take no documents, `documents_refusal`), and the measure of the work the kernels do (which the layout's balance
is judged by).

Documents are SEGMENT IDS: int32 [B, S], the document of each token in position order, non-decreasing along the
sequence (a document is a run of equal ids; ids need not start at 0 nor be consecutive). Query i sees key j iff
both are in one document and, when causal, j's position is not after i's. Every token sees itself under either
mask, so every row of a self-attention call has a finite lse; a ring step's or a kernel pair's partial may see no
key (lse -inf, out 0), as without documents.

Kernel level, KEY SPANS: for each query row of one kernel call, the keys it sees are one contiguous run of the
call's key rows, [key_start[i], key_end[i]) (int32 [B, Sq] each), because the call's keys are in increasing
position order (every layout's local order is, `weights.layout`), so a document's keys are a run of them and the
causal limit is a prefix. Both bounds are non-decreasing in i. The spans come from segment ids and positions of
queries and keys (`key_spans`): key_start = keys of earlier documents; key_end = keys of this document and earlier
ones, cut at the keys past the query's position when causal. The kernels take the spans instead of a causal flag,
so one kernel serves a plain call, every step of a ring in any layout, and an all-gathered ring.

Block skipping: a query block visits the key blocks between its first row's key_start and its last row's key_end
(`tiles_visited`); the tiles every row sees whole (between the last row's start and the first row's end) run
unmasked, the rest masked; nothing else is loaded. The dK/dV kernel walks query blocks per key block the same way
from QUERY SPANS (`query_spans`: the rows that see key j are a run too, since both span bounds are monotone). A
visited tile without a pair (`tile_pairs` is the exact table) is possible only where a query block's rows skip a
document, which happens in a ring where a document of fewer tokens than devices has none on this device.

Balance: the work of a device is the number of tiles it visits, summed over its ring steps (`ring_work`). With
documents, zigzag's pairing of an early and a late chunk no longer evens it: work follows each token's offset in
its document, not its position. The `zigzag_stripes` layout (`weights.layout`) deals the sequence out in stripes of
one tile, zigzag-wise in groups of 2P, so a long document's work is spread over the devices tile by tile, while a
short one stays whole on one device, its tiles as full as zigzag's (dealing single tokens, as Striped Attention
does, balances as well but multiplies the tiles of short documents by up to P). `ring_work` gives the work per device
of any layout and documents, which is how the layouts are compared (`compare/bench/document_balance.py` on the
corpus's documents and on short ones; weights/README.md has the numbers).
"""

from __future__ import annotations

import numpy as np

from weights.layout import rank_positions


def check_segment_ids(segment_ids: np.ndarray, batch: int, seq_len: int) -> None:
    """ValueError unless `segment_ids` is an integer [batch, seq_len] array, non-decreasing along the sequence."""
    ids = np.asarray(segment_ids)
    if ids.shape != (batch, seq_len):
        raise ValueError(f"segment_ids must have shape [batch, seq] = {(batch, seq_len)}, got {ids.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"segment_ids must be integers, got {ids.dtype}")
    decreasing = np.flatnonzero((np.diff(ids, axis=1) < 0).any(axis=0))
    if decreasing.size:
        raise ValueError(f"segment_ids must be non-decreasing along the sequence (documents are contiguous runs in "
                         f"position order); they decrease after position {int(decreasing[0])}")


def documents_refusal(backend: str, document_backends: tuple[str, ...]) -> str:
    """The error of a kernel backend asked to attend packed documents that it cannot (the vendors' kernels, the
    one-kernel backward forms), naming the backends of its framework that can. One wording for both backends."""
    return (f"backend {backend!r} does not take documents; these do: "
            + ", ".join(repr(name) for name in document_backends))


def document_offsets(segment_ids: np.ndarray) -> np.ndarray:
    """int64 [B, S]: each token's offset in its document (the RoPE position of a packed token)."""
    ids = np.asarray(segment_ids)
    positions = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
    starts = np.concatenate([np.ones((ids.shape[0], 1), bool), ids[:, 1:] != ids[:, :-1]], axis=1)
    return positions - np.maximum.accumulate(np.where(starts, positions, 0), axis=1)


def causal_pairs(segment_ids: np.ndarray) -> np.ndarray:
    """float64 [B]: the causal attention of each packed sequence counted as FlashAttention counts one sequence,
    half its square: the sum of L^2 / 2 over its documents' lengths L (S^2 / 2 for one document). What MFU credits
    (`weights.flops.model_flops_per_token`): the attention really done, not the whole sequence's triangle."""
    ids = np.asarray(segment_ids)
    starts = np.concatenate([np.ones((ids.shape[0], 1), bool), ids[:, 1:] != ids[:, :-1]], axis=1)
    pairs = []
    for row in starts:
        bounds = np.append(np.flatnonzero(row), row.size)
        pairs.append(float(np.sum(np.diff(bounds).astype(np.float64) ** 2) / 2))
    return np.asarray(pairs)


def segment_ids_from_lengths(lengths: list[int]) -> np.ndarray:
    """int32 [sum(lengths)]: document i's id repeated over its length, documents in order."""
    return np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)


def key_spans(q_segments: np.ndarray, q_positions: np.ndarray, k_segments: np.ndarray, k_positions: np.ndarray,
              *, causal: bool) -> tuple[np.ndarray, np.ndarray]:
    """(key_start, key_end) int32 [B, Sq]: the keys each query sees (module docstring). Segments are [B, S],
    positions [S] (shared by the batch), both increasing along the call's rows."""
    starts, ends = [], []
    for q_ids, k_ids in zip(np.asarray(q_segments), np.asarray(k_segments)):
        starts.append(np.searchsorted(k_ids, q_ids, side="left"))
        end = np.searchsorted(k_ids, q_ids, side="right")
        if causal:
            end = np.minimum(end, np.searchsorted(k_positions, q_positions, side="right"))
        ends.append(end)
    return np.asarray(starts, np.int32), np.asarray(ends, np.int32)


def query_spans(key_start: np.ndarray, key_end: np.ndarray, seq_k: int) -> tuple[np.ndarray, np.ndarray]:
    """(query_start, query_end) int32 [B, Sk]: the run of query rows that see each key, from the key spans (both
    non-decreasing): rows before query_start end at or before the key, rows from query_end on start after it."""
    keys = np.arange(seq_k)
    starts = [np.searchsorted(end, keys, side="right") for end in key_end]
    ends = [np.searchsorted(start, keys, side="right") for start in key_start]
    return np.asarray(starts, np.int32), np.asarray(ends, np.int32)


def visible(key_start: np.ndarray, key_end: np.ndarray, seq_k: int) -> np.ndarray:
    """bool [B, Sq, Sk]: which (query, key) pairs attend."""
    keys = np.arange(seq_k)
    return (keys >= key_start[..., None]) & (keys < key_end[..., None])


def _blocks(n: int, block: int) -> np.ndarray:
    return np.arange(0, n, block)


def tile_pairs(key_start: np.ndarray, key_end: np.ndarray, seq_k: int, block_q: int, block_k: int) -> np.ndarray:
    """bool [B, Sq / block_q, Sk / block_k] (blocks rounded up): the exact block-skip table, which tiles hold at
    least one attending pair (each row marks the key blocks its span touches; no [Sq, Sk] mask is built)."""
    batch, seq_q = key_start.shape
    touched = np.zeros((batch, -(-seq_q // block_q), -(-seq_k // block_k) + 1), np.int64)
    rows, cols = np.nonzero(key_end > key_start)
    first, last = key_start[rows, cols] // block_k, (key_end[rows, cols] - 1) // block_k
    np.add.at(touched, (rows, cols // block_q, first), 1)
    np.add.at(touched, (rows, cols // block_q, last + 1), -1)
    return np.cumsum(touched, axis=2)[:, :, :-1] > 0


def tiles_visited(key_start: np.ndarray, key_end: np.ndarray, seq_k: int, block_q: int, block_k: int) -> np.ndarray:
    """bool [B, Sq / block_q, Sk / block_k]: the tiles the kernels visit, those between the first row's key_start
    and the last row's key_end of each query block (none when every row of the block sees nothing)."""
    seq_q = key_start.shape[1]
    cols = _blocks(seq_k, block_k)
    visited = np.zeros((key_start.shape[0], len(_blocks(seq_q, block_q)), len(cols)), bool)
    for index, row0 in enumerate(_blocks(seq_q, block_q)):
        rows = slice(row0, min(row0 + block_q, seq_q))
        first, last = key_start[:, rows].min(axis=1), key_end[:, rows].max(axis=1)
        visited[:, index] = ((cols[None, :] + block_k > first[:, None]) & (cols[None, :] < last[:, None])
                             & (last > first)[:, None])
    return visited


def ring_work(segment_ids: np.ndarray, world: int, layout: str, *, causal: bool = True,
              block: int = 128) -> dict[str, np.ndarray]:
    """Per device of a ring over `world` devices in `layout`, summed over its steps (the kernel calls of its local
    queries against every device's keys, whichever variant): "pairs" (attending pairs), "tiles" (tiles holding a
    pair, `tile_pairs`) and "visited" (tiles the kernels visit, `tiles_visited`), int64 [world] each, for
    block x block tiles."""
    ids = np.asarray(segment_ids)
    seq_len = ids.shape[1]
    positions = [rank_positions(seq_len, world, r, layout) for r in range(world)]
    work = {name: np.zeros(world, np.int64) for name in ("pairs", "tiles", "visited")}
    for rank in range(world):
        for source in range(world):
            start, end = key_spans(ids[:, positions[rank]], positions[rank], ids[:, positions[source]],
                                   positions[source], causal=causal)
            keys = positions[source].size
            work["pairs"][rank] += int(np.maximum(end - start, 0).sum())
            work["tiles"][rank] += int(tile_pairs(start, end, keys, block, block).sum())
            work["visited"][rank] += int(tiles_visited(start, end, keys, block, block).sum())
    return work
