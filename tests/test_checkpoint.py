"""The bridge: config I/O, presets, HF -> converted -> HF round trips, sharded input, sliced reads, random weights."""

from __future__ import annotations

import filecmp
import json

import numpy as np
import pytest
import torch
from hf_fixtures import make_hf_checkpoint

from weights import (PRESETS, BadInputError, CheckpointError, ConvertedCheckpoint, LlamaConfig, RandomWeights,
                     convert_hf_checkpoint, export_hf_checkpoint, open_weights, parameter_shapes,
                     rope_inverse_frequencies)
from weights.checkpoint import SafetensorsFiles, canonical_to_hf


def _same_files(left, right) -> None:
    names = sorted(p.name for p in left.iterdir())
    assert names == sorted(p.name for p in right.iterdir())
    for name in names:
        assert filecmp.cmp(left / name, right / name, shallow=False), name


@pytest.mark.parametrize("variant,dtype,shard", [("gqa_llama3", torch.float32, None), ("tied", torch.bfloat16, None),
                                                 ("mha", torch.float16, "20KB"), ("tied", torch.bfloat16, "30KB")])
def test_hf_round_trip_is_bit_identical(tmp_path, variant, dtype, shard):
    make_hf_checkpoint(tmp_path / "hf", variant, dtype=dtype, max_shard_size=shard)
    convert_hf_checkpoint(tmp_path / "hf", tmp_path / "converted")
    export_hf_checkpoint(tmp_path / "converted", tmp_path / "back")
    _same_files(tmp_path / "hf", tmp_path / "back")


def test_sharded_input_converts_to_the_same_tensors(tmp_path):
    make_hf_checkpoint(tmp_path / "single", "gqa_llama3", seed=5)
    make_hf_checkpoint(tmp_path / "sharded", "gqa_llama3", seed=5, max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    convert_hf_checkpoint(tmp_path / "single", tmp_path / "a")
    convert_hf_checkpoint(tmp_path / "sharded", tmp_path / "b")
    a, b = ConvertedCheckpoint(tmp_path / "a"), ConvertedCheckpoint(tmp_path / "b")
    for name in a.names():
        assert np.array_equal(a.tensor(name), b.tensor(name)), name


def test_converted_tensors_are_the_hf_tensors_renamed(tmp_path):
    make_hf_checkpoint(tmp_path / "hf", "head_dim_24")
    convert_hf_checkpoint(tmp_path / "hf", tmp_path / "converted")
    hf, converted = SafetensorsFiles(tmp_path / "hf"), ConvertedCheckpoint(tmp_path / "converted")
    assert converted.config.head_dim == 24 and converted.config.hidden_size == 64
    for name in converted.names():
        assert np.array_equal(converted.tensor(name), hf.tensor(canonical_to_hf(name)))


def test_reader_slices_without_reading_whole_tensor(tmp_path):
    make_hf_checkpoint(tmp_path / "hf", "gqa_llama3")
    convert_hf_checkpoint(tmp_path / "hf", tmp_path / "converted")
    checkpoint = ConvertedCheckpoint(tmp_path / "converted")
    name = "layers.1.feed_forward.w2.weight"
    whole = checkpoint.tensor(name)
    part = checkpoint.tensor_slice(name, (slice(16, 48), slice(None)))
    assert np.array_equal(part, whole[16:48])
    assert [n for n, _ in checkpoint] == list(parameter_shapes(checkpoint.config))


def test_hf_config_round_trip_both_spellings():
    for config in PRESETS.values():
        hf = config.to_hf_dict()
        assert LlamaConfig.from_hf_dict(hf) == config
        legacy = dict(hf)
        rope = dict(legacy.pop("rope_parameters"))
        legacy["rope_theta"] = rope.pop("rope_theta")
        legacy["rope_scaling"] = None if rope["rope_type"] == "default" else rope
        assert LlamaConfig.from_hf_dict(legacy) == config
        assert LlamaConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


@pytest.mark.parametrize("name,billions", [("llama2-7b", 6.74), ("llama3.2-1b", 1.24), ("llama3.2-3b", 3.21),
                                           ("llama3.1-8b", 8.03)])
def test_presets_have_the_published_parameter_counts(name, billions):
    assert PRESETS[name].num_params / 1e9 == pytest.approx(billions, abs=0.01)


def test_llama3_rope_scaling_matches_transformers():
    from transformers import LlamaConfig as HFConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for name in ("tiny", "llama3.1-8b", "llama3.2-1b"):
        config = PRESETS[name]
        hf_config = HFConfig(**{k: v for k, v in config.to_hf_dict().items() if k != "architectures"})
        expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
        np.testing.assert_allclose(rope_inverse_frequencies(config), expected.numpy(), rtol=1e-6)
        # the tiny preset exercises all three frequency bands: kept, smoothed and divided by `factor`
    ratio = rope_inverse_frequencies(PRESETS["tiny"]) / (1e4 ** -(np.arange(0, 32, 2) / 32))
    assert np.any(np.isclose(ratio, 1)) and np.any(np.isclose(ratio, 1 / 8)) and np.any(~np.isclose(ratio, 1)
                                                                                         & ~np.isclose(ratio, 1 / 8))


def test_random_preset_weights_are_deterministic_and_sliceable():
    first, again = open_weights("tiny", seed=11), open_weights("tiny", seed=11)
    name = "layers.0.feed_forward.w1.weight"
    assert np.array_equal(first.tensor(name), again.tensor(name))
    assert np.array_equal(first.tensor_slice(name, (slice(3, 9),)), first.tensor(name)[3:9])
    assert first.tensor(name).std() == pytest.approx(0.02, rel=0.05)
    assert np.all(first.tensor("norm.weight") == 1)
    assert np.array_equal(first.tensor_slice("norm.weight", (slice(2, 5),)), np.ones(3, np.float32))
    assert not np.array_equal(first.tensor(name), open_weights("tiny", seed=12).tensor(name))


def test_random_weight_slices_across_stream_blocks_match_the_whole_tensor(monkeypatch):
    # small blocks so that slices start, end and cross inside blocks; each block is its own numpy stream
    monkeypatch.setattr(RandomWeights, "ROWS_PER_STREAM", 4)
    source, name = RandomWeights(PRESETS["tiny"], seed=3), "layers.1.attention.wq.weight"
    whole = source.tensor(name)
    for index in [(slice(0, 4),), (slice(3, 9),), (slice(5, 6),), (slice(None),), (slice(2, 11), slice(1, 5)),
                  (slice(0, 8, 2),)]:
        assert np.array_equal(source.tensor_slice(name, index), whole[index]), index
    assert not np.array_equal(whole[0:4], whole[4:8])  # blocks are different streams, not one repeated
    assert whole.std() == pytest.approx(0.02, rel=0.05)


def test_unknown_preset_and_missing_dir_are_named():
    with pytest.raises(BadInputError, match="unknown preset 'llama9'"):
        open_weights("llama9")
    with pytest.raises(CheckpointError, match="missing checkpoint directory"):
        open_weights("/nonexistent/dir")
