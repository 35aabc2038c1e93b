"""Both backends' Llama against Hugging Face transformers on converted checkpoints, and against each other.

Tolerances: fp32 logits within 1e-4 max-abs (the issue's bound). Both sides compute the same float32 operations in a
different order (einsum vs matmul grouping, RoPE angles from float64-derived frequencies), which moves logits of
magnitude ~1 by ~1e-6; 1e-4 leaves two orders of margin yet a wrong rotary layout or swapped q/k moves them by 1e-2+
(the negative controls below assert that).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_fixtures import VARIANTS, make_hf_checkpoint, rewrite_config_as_transformers4

from jax_impl.model import load_model as load_jax_model
from jax_impl.model import parameter_dict
from torch_impl.model import load_model as load_torch_model
from weights import ConvertedCheckpoint, convert_hf_checkpoint, open_weights
from weights.checkpoint import SafetensorsFiles

LOGIT_ATOL = 1e-4
SEQ_LEN = 48  # past the llama3 scaling's original context (16) so scaled frequencies matter


def _tokens(vocab: int, batch: int = 2, seq_len: int = SEQ_LEN, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (batch, seq_len))


def _torch_logits(directory, tokens, dtype="fp32") -> np.ndarray:
    with torch.no_grad():
        return load_torch_model(directory, dtype=dtype)(torch.from_numpy(tokens)).numpy()


def _jax_logits(directory, tokens, dtype="fp32") -> np.ndarray:
    return np.asarray(load_jax_model(directory, dtype=dtype)(jnp.asarray(tokens)))


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def converted(request, tmp_path_factory):
    """(variant, HF model, converted dir, HF reference logits)."""
    root = tmp_path_factory.mktemp(request.param)
    hf_model = make_hf_checkpoint(root / "hf", request.param)
    convert_hf_checkpoint(root / "hf", root / "converted")
    tokens = _tokens(hf_model.config.vocab_size)
    with torch.no_grad():
        reference = hf_model(torch.from_numpy(tokens)).logits.numpy()
    return request.param, root / "converted", tokens, reference


def test_torch_matches_transformers(converted):
    _, directory, tokens, reference = converted
    np.testing.assert_allclose(_torch_logits(directory, tokens), reference, rtol=0, atol=LOGIT_ATOL)


def test_jax_matches_transformers(converted):
    _, directory, tokens, reference = converted
    np.testing.assert_allclose(_jax_logits(directory, tokens), reference, rtol=0, atol=LOGIT_ATOL)


def test_torch_matches_jax(converted):
    _, directory, tokens, _ = converted
    np.testing.assert_allclose(_torch_logits(directory, tokens), _jax_logits(directory, tokens),
                               rtol=0, atol=LOGIT_ATOL)


def _as_bits(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array).view(np.uint32)


def test_backends_load_bit_identical_parameters(converted):
    _, directory, _, _ = converted
    checkpoint = ConvertedCheckpoint(directory)
    torch_params = {n: p.detach().numpy() for n, p in load_torch_model(directory).named_parameters()}
    jax_params = {n: np.asarray(p) for n, p in parameter_dict(load_jax_model(directory)).items()}
    assert sorted(torch_params) == sorted(jax_params) == sorted(checkpoint.names())
    for name in checkpoint.names():
        expected = _as_bits(checkpoint.tensor(name))
        assert np.array_equal(_as_bits(torch_params[name]), expected), name
        assert np.array_equal(_as_bits(jax_params[name]), expected), name


def _interleave_rotary_rows(weight: np.ndarray, head_dim: int) -> np.ndarray:
    """Reorders q/k projection rows from rotate-half pairing (i, i + D/2) to Meta's interleaved (2i, 2i + 1)."""
    heads = weight.shape[0] // head_dim
    per_head = weight.reshape(heads, 2, head_dim // 2, -1)
    return per_head.transpose(0, 2, 1, 3).reshape(weight.shape)


def _rewrite_tensors(directory, change) -> None:
    files = SafetensorsFiles(directory)
    tensors = {n: files.tensor(n) for n in files.names()}
    change(tensors)
    from safetensors.numpy import save_file
    save_file(tensors, str(directory / "model.safetensors"))


@pytest.mark.parametrize("corruption", ["interleaved_rotary_layout", "swapped_q_and_k"])
def test_negative_control_wrong_layout_fails_the_comparison(tmp_path, corruption):
    """The HF comparison above must be able to fail: a checkpoint converted with a wrong rotary layout (the
    classic Meta-vs-HF permutation bug), or with q and k projections swapped, is far outside the tolerance."""
    variant = "mha" if corruption == "swapped_q_and_k" else "gqa_llama3"  # q and k have one shape only in MHA
    hf_model = make_hf_checkpoint(tmp_path / "hf", variant)
    convert_hf_checkpoint(tmp_path / "hf", tmp_path / "converted")
    head_dim = hf_model.config.head_dim

    def corrupt(tensors):
        for name in list(tensors):
            if corruption == "interleaved_rotary_layout" and name.endswith(("wq.weight", "wk.weight")):
                tensors[name] = _interleave_rotary_rows(tensors[name], head_dim)
            if corruption == "swapped_q_and_k" and name.endswith("wq.weight"):
                k_name = name.replace("wq", "wk")
                tensors[name], tensors[k_name] = tensors[k_name], tensors[name]

    _rewrite_tensors(tmp_path / "converted", corrupt)
    tokens = _tokens(hf_model.config.vocab_size)
    with torch.no_grad():
        reference = hf_model(torch.from_numpy(tokens)).logits.numpy()
    for logits in (_torch_logits(tmp_path / "converted", tokens), _jax_logits(tmp_path / "converted", tokens)):
        assert np.abs(logits - reference).max() > 10 * LOGIT_ATOL


def test_transformers4_config_spelling_converts_the_same(tmp_path):
    make_hf_checkpoint(tmp_path / "hf", "gqa_llama3")
    convert_hf_checkpoint(tmp_path / "hf", tmp_path / "new")
    rewrite_config_as_transformers4(tmp_path / "hf")
    convert_hf_checkpoint(tmp_path / "hf", tmp_path / "old")
    assert ConvertedCheckpoint(tmp_path / "old").config == ConvertedCheckpoint(tmp_path / "new").config


def _relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


# bf16 keeps 8 significant bits (unit roundoff 2^-9 ~ 2e-3). A 2-layer forward rounds weights, every matmul output,
# the residual stream and the RoPE tables: a few dozen roundings along any path, which measured ~4e-3 relative here;
# 2e-2 bounds that with margin while a different model (the negative control) is off by order 1.
BF16_RELATIVE_TOL = 2e-2


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_bf16_forward_tracks_fp32(tmp_path, backend):
    make_hf_checkpoint(tmp_path / "hf", "gqa_llama3")
    make_hf_checkpoint(tmp_path / "hf_other", "gqa_llama3", seed=7)
    convert_hf_checkpoint(tmp_path / "hf", tmp_path / "converted")
    convert_hf_checkpoint(tmp_path / "hf_other", tmp_path / "other")
    logits = _torch_logits if backend == "torch" else _jax_logits
    tokens = _tokens(97)
    fp32 = logits(tmp_path / "converted", tokens)
    assert _relative_error(logits(tmp_path / "converted", tokens, "bf16"), fp32) < BF16_RELATIVE_TOL
    assert _relative_error(logits(tmp_path / "other", tokens, "bf16"), fp32) > 10 * BF16_RELATIVE_TOL


def test_preset_random_weights_identical_in_both_backends():
    """A preset's random weights are made once, in numpy, so both backends compute the same logits."""
    tokens = _tokens(256, batch=1, seq_len=32)
    with torch.no_grad():
        torch_logits = load_torch_model("tiny", seed=3)(torch.from_numpy(tokens)).numpy()
    jax_logits = np.asarray(load_jax_model("tiny", seed=3)(jnp.asarray(tokens)))
    np.testing.assert_allclose(torch_logits, jax_logits, rtol=0, atol=LOGIT_ATOL)
    assert not np.array_equal(open_weights("tiny", seed=3).tensor("layers.0.attention.wq.weight"),
                              open_weights("tiny", seed=4).tensor("layers.0.attention.wq.weight"))
