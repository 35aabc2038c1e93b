"""The packed-documents contract (`weights/documents.py`) against its definition written out pair by pair, and both
backends' device twins (`torch_impl/documents.py`, `jax_impl/documents.py`) against it: key spans from segment ids and
positions in every layout, query spans, the block-skip tables, RoPE offsets, bad segment ids."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jax_impl import documents as jax_documents
from torch_impl import documents as torch_documents
from weights.documents import (check_segment_ids, document_offsets, key_spans, query_spans, segment_ids_from_lengths,
                               tile_pairs, tiles_visited, visible)
from weights.layout import LAYOUTS, rank_positions

LENGTHS = [[1, 20, 33, 1, 9, 1], [40, 25], [65]]  # three rows of 65 tokens: single tokens, odd lengths, one document


def _segment_ids() -> np.ndarray:
    return np.stack([segment_ids_from_lengths(row) for row in LENGTHS])


def _pairwise(q_ids, q_pos, k_ids, k_pos, causal):
    """The definition, pair by pair: same document and, when causal, the key not after the query."""
    same = q_ids[:, :, None] == k_ids[:, None, :]
    return same & (k_pos[None, None, :] <= q_pos[None, :, None]) if causal else same


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_key_spans_are_the_pairwise_rule_for_every_ring_pair(layout, causal):
    ids = _segment_ids()[:, :64]  # 64 tokens split over 4 devices in every layout
    positions = [rank_positions(64, 4, r, layout) for r in range(4)]
    for rank in range(4):
        for source in range(4):
            q_ids, k_ids = ids[:, positions[rank]], ids[:, positions[source]]
            start, end = key_spans(q_ids, positions[rank], k_ids, positions[source], causal=causal)
            want = _pairwise(q_ids, positions[rank], k_ids, positions[source], causal)
            np.testing.assert_array_equal(visible(start, end, k_ids.shape[1]), want)
            np.testing.assert_array_equal(np.diff(start, axis=1) >= 0, True)  # monotone, as the kernels assume
            np.testing.assert_array_equal(np.diff(end, axis=1) >= 0, True)


def test_every_token_sees_itself():
    ids = _segment_ids()
    start, end = key_spans(ids, np.arange(65), ids, np.arange(65), causal=True)
    rows = np.arange(65)
    assert np.all((start <= rows) & (rows < end))


def test_query_spans_are_the_transpose():
    ids = _segment_ids()
    start, end = key_spans(ids, np.arange(65), ids, np.arange(65), causal=True)
    q_start, q_end = query_spans(start, end, 65)
    np.testing.assert_array_equal(visible(q_start, q_end, 65), visible(start, end, 65).transpose(0, 2, 1))


def test_tiles_visited_cover_every_pair_and_equal_them_for_one_sequence():
    ids = _segment_ids()
    start, end = key_spans(ids, np.arange(65), ids, np.arange(65), causal=True)
    pairs, visited = tile_pairs(start, end, 65, 16, 8), tiles_visited(start, end, 65, 16, 8)
    mask = visible(start, end, 65)
    brute_force = np.logical_or.reduceat(np.logical_or.reduceat(mask, np.arange(0, 65, 16), 1), np.arange(0, 65, 8), 2)
    np.testing.assert_array_equal(pairs, brute_force)
    np.testing.assert_array_equal(pairs, visited)  # a query block's own tokens hold every document it meets
    assert visited[0].sum() < visited[2].sum()  # documents skip tiles that one long document needs


def test_document_offsets_restart_per_document():
    offsets = document_offsets(np.array([[3, 3, 3, 5, 6, 6]]))
    assert offsets.tolist() == [[0, 1, 2, 0, 0, 1]]


@pytest.mark.parametrize("ids, message", [
    (np.array([[0, 1, 1, 0]]), "non-decreasing .* after position 2"),
    (np.zeros((2, 4), np.int32), r"shape \[batch, seq\] = \(1, 4\)"),
    (np.zeros((1, 4)), "must be integers"),
])
def test_bad_segment_ids(ids, message):
    with pytest.raises(ValueError, match=message):
        check_segment_ids(ids, 1, 4)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_device_twins_compute_the_contract(causal):
    ids = _segment_ids()
    q_pos, k_pos = rank_positions(48, 4, 1, "zigzag_stripes"), rank_positions(48, 4, 3, "zigzag_stripes")
    q_ids, k_ids = ids[:, q_pos], ids[:, k_pos]
    want = key_spans(q_ids, q_pos, k_ids, k_pos, causal=causal)
    want_queries = query_spans(*want, k_pos.size)
    for module, array in ((torch_documents, torch.from_numpy), (jax_documents, jnp.asarray)):
        spans = module.key_spans(array(q_ids.astype(np.int32)), array(q_pos.astype(np.int32)),
                                 array(k_ids.astype(np.int32)), array(k_pos.astype(np.int32)), causal=causal)
        for got, expected in zip((*spans, *module.query_spans(spans, k_pos.size)), (*want, *want_queries)):
            np.testing.assert_array_equal(np.asarray(got), expected, err_msg=module.__name__)
