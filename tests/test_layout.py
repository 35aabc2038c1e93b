"""Token layouts across devices, mesh parsing, the sharding table, the training data and the LR schedule."""

from __future__ import annotations

import numpy as np
import pytest

from weights import PRESETS, parameter_shapes
from weights.data import decode_bytes, encode_bytes, random_batches, text_batches
from weights.errors import BadInputError
from weights.layout import LayoutError, gather_sequence, layout_order, rank_positions, shard_sequence
from weights.parallel import MESH_AXES, MeshShape, parameter_shard_axes, parameter_sharding, sharded_dim
from weights.schedule import OptimizerConfig


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "zigzag_stripes"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_layout_partitions_the_sequence(layout, world):
    seq_len = 48
    held = [rank_positions(seq_len, world, r, layout) for r in range(world)]
    assert sorted(np.concatenate(held).tolist()) == list(range(seq_len))
    for positions in held:
        assert np.all(np.diff(positions) > 0)  # increasing: causal masking within a rank is lower-triangular
    x = np.arange(2 * seq_len).reshape(2, seq_len)
    assert np.array_equal(gather_sequence(shard_sequence(x, world, layout), layout), x)


def test_zigzag_pairs_early_and_late_chunks():
    assert rank_positions(16, 4, 0, "zigzag").tolist() == [0, 1, 14, 15]
    assert rank_positions(16, 4, 3, "zigzag").tolist() == [6, 7, 8, 9]
    # stripes of gcd(48 / 8, 128) = 2 tokens in 3 groups of 8 stripes; rank 1 holds stripes 1 and 6 of each
    assert rank_positions(48, 4, 1, "zigzag_stripes").tolist() == [2, 3, 12, 13, 18, 19, 28, 29, 34, 35, 44, 45]
    assert rank_positions(4096, 2, 0, "zigzag_stripes")[126:130].tolist() == [126, 127, 384, 385]  # tile stripes
    # causal work per rank (sum of visible keys) is balanced in zigzag, not in contiguous
    work = {layout: [int((rank_positions(64, 4, r, layout) + 1).sum()) for r in range(4)]
            for layout in ("zigzag", "contiguous")}
    assert len(set(work["zigzag"])) == 1 and len(set(work["contiguous"])) == 4


def test_wrong_layout_does_not_gather_back():
    x = np.arange(32)[None]
    assert not np.array_equal(gather_sequence(shard_sequence(x, 4, "zigzag"), "contiguous"), x)
    assert not np.array_equal(layout_order(32, 4, "zigzag"), np.arange(32))


def test_unsplittable_lengths_name_the_lengths_that_work():
    with pytest.raises(LayoutError, match="multiple of 8 .e.g. 96 or 104"):
        rank_positions(100, 4, 0, "zigzag")
    with pytest.raises(LayoutError, match="unknown layout"):
        rank_positions(8, 2, 0, "diagonal")


def test_mesh_parsing_and_device_check():
    assert MeshShape.parse("fsdp=2,sp=2") == MeshShape(2, 2)
    assert MeshShape.parse("sp=4") == MeshShape(1, 4)
    for bad in ("tp=2", "fsdp=0", "fsdp=2,fsdp=2", "fsdp"):
        with pytest.raises(BadInputError, match="bad mesh"):
            MeshShape.parse(bad)
    with pytest.raises(BadInputError, match="needs 4 devices, but 2"):
        MeshShape(2, 2).check_devices(2)


def test_every_parameter_has_a_sharding_rule_of_its_rank():
    """Each rule has one entry per dim, None or mesh axes, and splits exactly one dim over the one set of axes both
    backends shard over (all of them: FSDP2 over the flattened mesh, JAX's PartitionSpec(("fsdp", "sp"), ...))."""
    assert parameter_shard_axes() == MESH_AXES
    for config in PRESETS.values():
        for name, shape in parameter_shapes(config).items():
            assert len(parameter_sharding(name)) == len(shape), name
            assert all(axes is None or isinstance(axes, tuple) for axes in parameter_sharding(name)), name
            assert parameter_sharding(name)[sharded_dim(name)] == MESH_AXES, name


def test_text_data_is_real_deterministic_bytes():
    batches = text_batches(steps=3, batch=2, seq_len=64, vocab_size=256, seed=1)
    assert batches.shape == (3, 2, 64) and batches.max() < 256
    assert np.array_equal(batches, text_batches(steps=3, batch=2, seq_len=64, vocab_size=256, seed=1))
    printable = (batches >= 32) & (batches < 127) | (batches == 10)
    assert printable.mean() > 0.95  # Python source text, not noise
    assert decode_bytes(encode_bytes("héllo")) == "héllo"
    with pytest.raises(BadInputError, match="vocabulary of at least 256"):
        text_batches(1, 1, 8, vocab_size=100)
    assert random_batches(2, 1, 8, vocab_size=10).max() < 10


def test_learning_rate_warms_up_then_decays():
    schedule = OptimizerConfig(lr=1.0, warmup_steps=4, total_steps=20, min_lr_ratio=0.1)
    rates = [schedule.learning_rate(s) for s in range(20)]
    assert rates[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(rates[4:], rates[5:])) and rates[-1] > 0.1
    assert schedule.learning_rate(20) == pytest.approx(0.1)
