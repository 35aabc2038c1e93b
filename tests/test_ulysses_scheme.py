"""The shared maths of the sequence-parallel schemes (`weights/sequence_parallel.py`), numpy only: the token order
after the all-to-all is the ring layout's over R for every group and every R, each device's KV head slots are the KV
heads its query heads read, the degrees and head counts refused by name, and the traffic formula against the ring's
own and against a count of what each device sends."""

from __future__ import annotations

import numpy as np
import pytest

from weights import preset
from weights.attention import ring_bytes_sent
from weights.errors import BadInputError
from weights.layout import rank_positions
from weights.parallel import MeshShape, step_comm_bytes
from weights.sequence_parallel import (SchemeDegrees, check_heads, gathered_chunk_order, kv_head_slots,
                                       scheme_degrees, sequence_parallel_bytes_sent)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("ulysses, ring", [(2, 1), (4, 1), (8, 1), (2, 2), (2, 4), (4, 2), (3, 2)])
def test_gathered_chunks_in_that_order_are_the_ring_layouts_positions(layout, ulysses, ring):
    """Group r's devices' positions (layout over P = U R), concatenated in device order and reordered chunk by chunk,
    are exactly device r's positions in the layout over R: what the hybrid's ring and a causal kernel need."""
    sp, chunk = ulysses * ring, 3
    seq_len = sp * chunk * (2 if layout == "zigzag" else 1)
    order = gathered_chunk_order(ulysses, layout)
    for r in range(ring):
        gathered = np.concatenate([rank_positions(seq_len, sp, r * ulysses + u, layout) for u in range(ulysses)])
        chunks = np.split(gathered, len(order))
        assert np.array_equal(np.concatenate([chunks[i] for i in order]), rank_positions(seq_len, ring, r, layout))


def test_zigzag_order_takes_early_chunks_forwards_and_late_chunks_backwards():
    assert gathered_chunk_order(4, "zigzag") == (0, 2, 4, 6, 7, 5, 3, 1)
    assert gathered_chunk_order(4, "contiguous") == (0, 1, 2, 3)


@pytest.mark.parametrize("heads, kv_heads, ulysses", [(8, 8, 4), (8, 4, 4), (8, 2, 4), (8, 1, 4), (32, 8, 2),
                                                     (32, 8, 8), (32, 8, 16), (12, 6, 3)])
def test_each_device_receives_the_kv_heads_its_query_heads_read(heads, kv_heads, ulysses):
    slots = kv_head_slots(heads, kv_heads, ulysses)
    assert len(slots) == max(kv_heads, ulysses)  # repeated only as far as U exceeds Hkv
    per_device = len(slots) // ulysses
    group = heads // kv_heads
    for u in range(ulysses):
        mine = slots[u * per_device:(u + 1) * per_device]
        query_heads = np.arange(u * heads // ulysses, (u + 1) * heads // ulysses)
        read = query_heads // group
        assert list(mine) == sorted(set(read))  # the KV heads they read, each once
        local_group = len(query_heads) // len(mine)  # the device's GQA: local query head i reads local KV i // g
        assert list(mine[np.arange(len(query_heads)) // local_group]) == list(read)


@pytest.mark.parametrize("scheme, sp, degree, message", [
    ("tree", 4, None, "must be one of ring, ulysses, hybrid, got 'tree'"),
    ("hybrid", 4, None, "needs its Ulysses degree U"),
    ("hybrid", 8, 3, r"degree 3 over sp=8 must divide sp and lie strictly between 1 and sp \(one of 2, 4\)"),
    ("hybrid", 2, 2, r"sp=2 has none: take the ring or the ulysses scheme"),
    ("ulysses", 4, 2, "the ulysses scheme over sp=4 has Ulysses degree 4, got 2"),
    ("ring", 4, 2, "the ring scheme over sp=4 has Ulysses degree 1, got 2"),
])
def test_bad_schemes_and_degrees_are_one_line_errors(scheme, sp, degree, message):
    with pytest.raises(BadInputError, match=message):
        scheme_degrees(scheme, sp, degree)


def test_degrees_of_each_scheme():
    assert scheme_degrees("ring", 8) == SchemeDegrees("ring", 1, 8)
    assert scheme_degrees("ulysses", 8) == scheme_degrees("ulysses", 8, 8) == SchemeDegrees("ulysses", 8, 1)
    assert scheme_degrees("hybrid", 8, 4) == SchemeDegrees("hybrid", 4, 2)
    assert str(scheme_degrees("hybrid", 8, 4)) == "hybrid U=4 x R=2" and scheme_degrees("hybrid", 8, 4).sp == 8


@pytest.mark.parametrize("heads, kv_heads, ulysses, message", [
    (6, 6, 4, "Ulysses degree 4 must divide the 6 query heads; degrees that work for 6 query and 6 KV heads: 1, 2, "
              "3, 6"),
    (12, 6, 4, "Ulysses degree 4 and the 6 KV heads must be multiples one of the other"),
    (24, 6, 4, r"degrees that work for 24 query and 6 KV heads: 1, 2, 3, 6, 12, 24"),
])
def test_heads_a_degree_cannot_split_are_refused(heads, kv_heads, ulysses, message):
    with pytest.raises(BadInputError, match=message):
        check_heads(ulysses, heads, kv_heads)


SHAPES = dict(batch=2, local_tokens=64, heads=32, kv_heads=8, head_dim=128, compute_bytes=2)


@pytest.mark.parametrize("variant", ["ring", "allgather"])
def test_the_ring_scheme_sends_what_the_ring_sends(variant):
    for backward in (False, True):
        expected = ring_bytes_sent(2 * 2 * 64 * 8 * 128, 4, compute_bytes=2, variant=variant, backward=backward)
        assert sequence_parallel_bytes_sent(scheme_degrees("ring", 4), variant=variant, backward=backward,
                                            **SHAPES) == expected


@pytest.mark.parametrize("kv_heads", [1, 4, 8, 32])
def test_ulysses_bytes_count_each_all_to_all(kv_heads):
    """Ulysses over 4: each all-to-all keeps 1/4 of its operand and sends the rest; forward q, k, v (K/V with
    max(Hkv, U) heads) and out, backward as many; a rerun forward repeats the forward's."""
    shapes = dict(SHAPES, kv_heads=kv_heads)
    u, elements = 4, SHAPES["batch"] * SHAPES["local_tokens"] * SHAPES["head_dim"]
    operands = [SHAPES["heads"], max(kv_heads, u), max(kv_heads, u), SHAPES["heads"]]  # heads of q, k, v, out
    forward = sum(n * elements * 2 * (u - 1) // u for n in operands)
    degrees = scheme_degrees("ulysses", u)
    assert sequence_parallel_bytes_sent(degrees, variant="ring", backward=False, **shapes) == forward
    assert sequence_parallel_bytes_sent(degrees, variant="ring", backward=True, **shapes) == 2 * forward
    assert sequence_parallel_bytes_sent(degrees, variant="ring", backward=True, exchange_forwards=2,
                                        **shapes) == 3 * forward


def test_hybrid_bytes_are_its_all_to_alls_plus_the_ring_of_the_groups_tokens():
    degrees = scheme_degrees("hybrid", 8, 2)
    ulysses_only = sequence_parallel_bytes_sent(SchemeDegrees("ulysses", 2, 1), variant="ring", backward=True,
                                                **SHAPES)
    group_kv = 2 * 2 * (2 * 64) * (8 // 2) * 128  # K and V: the group's tokens, this device's KV heads
    ring = ring_bytes_sent(group_kv, 4, compute_bytes=2, variant="ring", backward=True)
    assert sequence_parallel_bytes_sent(degrees, variant="ring", backward=True, **SHAPES) == ulysses_only + ring


@pytest.mark.parametrize("remat, exchange_forwards, ring_forwards", [("off", 1, 1), ("save-attention", 2, 1),
                                                                     ("full", 2, 2)])
def test_a_steps_attention_bytes_follow_the_scheme_and_the_checkpointing(remat, exchange_forwards, ring_forwards):
    """`step_comm_bytes` of a hybrid step: every layer's call; checkpointing reruns the all-to-alls (the layer's
    rerun needs the exchanged q/k/v and out) and, with "full", the ring's forward too."""
    config = preset("llama3.2-1b")
    mesh = MeshShape(fsdp=2, sp=4)
    step = step_comm_bytes(config, seq_len=8192, batch=2, mesh=mesh, compute_bytes=2, train=True, remat=remat,
                           parameter_gathers=1, gradient_bytes=4, sp_scheme="hybrid", ulysses_degree=2)
    per_layer = sequence_parallel_bytes_sent(
        scheme_degrees("hybrid", 4, 2), batch=1, local_tokens=2048, heads=config.num_heads,
        kv_heads=config.num_kv_heads, head_dim=config.head_dim, compute_bytes=2, variant="ring", backward=True,
        exchange_forwards=exchange_forwards, ring_forwards=ring_forwards)
    assert step["attention"] == config.num_layers * per_layer
    ring = step_comm_bytes(config, seq_len=8192, batch=2, mesh=mesh, compute_bytes=2, train=True, remat=remat,
                           parameter_gathers=1, gradient_bytes=4)
    assert ring["parameters"] == step["parameters"] and ring["attention"] != step["attention"]
