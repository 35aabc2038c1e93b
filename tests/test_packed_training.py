"""`twinflash train --data text --pack` (issue 38's data stage): the corpus's files as packed documents with their
boundaries, the targets that never cross one, RoPE positions restarting per document, the FLOPs MFU credits, both
models' packed forward against the documents run one at a time, and packed training end to end in both backends
(CPU: torch over 2 gloo processes, JAX over 2 emulated devices, the zigzag_stripes ring on the reference pair
attention) against one process and against each other.

Tolerances:
  FP32_TOL (model logits, packed vs one at a time): the same float32 math; only the attention's reductions run
    over the whole packed row (masked entries add exact zeros) and RoPE angles are the same (positions restart):
    observed <= 2e-6.
  LOSS_RTOL (losses per step, 2-way sequence parallel vs one process, torch vs JAX): tests/test_train_torch.py's
    1e-5, the same float32 math summed in another order.
"""

from __future__ import annotations

import json
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from compare.commands.train import main
from jax_impl.model import load_model as load_jax_model
from torch_impl.model import load_model as load_torch_model
from weights import preset
from weights.data import BYTE_VOCAB, packed_text_batches, text_batches
from weights.documents import causal_pairs, document_offsets, segment_ids_from_lengths
from weights.flops import batch_model_flops, matmul_parameters
from weights.training import IGNORE_INDEX, next_token_targets, valid_target_count

FP32_TOL = dict(rtol=1e-5, atol=1e-5)  # module docstring
LOSS_RTOL = 1e-5  # module docstring
STEPS = 3
COMMON = ["--model", "tiny", "--seq-len", "256", "--steps", str(STEPS), "--batch", "4", "--attention-backend",
          "reference", "--data", "text"]
LENGTHS = [1, 20, 7, 35, 1]  # one packed row of 64 tokens: single tokens, odd lengths


def test_packed_batches_are_the_text_batches_with_their_files():
    tokens, ids = packed_text_batches(2, 2, 4096, BYTE_VOCAB, seed=3)
    np.testing.assert_array_equal(tokens, text_batches(2, 2, 4096, BYTE_VOCAB, seed=3))
    assert ids.dtype == np.int32 and np.all(ids[..., 0] == 0) and np.all(np.diff(ids, axis=-1) >= 0)
    assert ids.max() > 0  # a window of 4096 bytes of stdlib sources holds more than one file


def test_targets_never_cross_a_document_and_positions_restart():
    ids = segment_ids_from_lengths(LENGTHS)[None]
    tokens = np.arange(64)[None]
    targets = next_token_targets(tokens, ids)
    ends = np.cumsum(LENGTHS) - 1
    assert np.all(targets[0, ends] == IGNORE_INDEX)
    assert np.all(np.delete(targets[0], ends) == np.delete(tokens[0] + 1, ends))
    assert valid_target_count(1, 64, ids) == 64 - len(LENGTHS)
    assert document_offsets(ids)[0, :22].tolist() == [0] + list(range(20)) + [0]


def test_mfu_credits_the_attention_within_documents():
    """One document is the unpacked count; two halves do half its attention, the matmuls unchanged."""
    config = preset("llama3.2-1b")
    unpacked = batch_model_flops(config, 1, 32768)
    one_document = segment_ids_from_lengths([32768])[None]
    assert batch_model_flops(config, 1, 32768, one_document) == pytest.approx(unpacked)
    attention = unpacked - 6 * matmul_parameters(config) * 32768
    halves = segment_ids_from_lengths([16384, 16384])[None]
    assert causal_pairs(halves)[0] == pytest.approx(causal_pairs(one_document)[0] / 2)
    assert batch_model_flops(config, 1, 32768, halves) == pytest.approx(unpacked - attention / 2)


def _documents_one_at_a_time(forward, tokens):
    """float64 logits [1, S, vocab] of each document of LENGTHS run alone (positions from 0), put back in place."""
    parts, start = [], 0
    for length in LENGTHS:
        parts.append(np.asarray(forward(tokens[:, start:start + length], None, None), np.float64))
        start += length
    return np.concatenate(parts, axis=1)


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_packed_forward_is_the_documents_one_at_a_time(backend):
    """Both models, fp32, plain-math attention: a packed row with its segment ids and restarting positions gives
    each document's logits as it gives them alone; the negative control (no segment ids) does not."""
    tokens = np.random.default_rng(0).integers(0, 256, (1, 64))
    ids = segment_ids_from_lengths(LENGTHS)[None]
    positions = document_offsets(ids)
    if backend == "torch":
        model = load_torch_model("tiny")

        def forward(t, p, s):
            with torch.no_grad():
                return model(*(None if x is None else torch.from_numpy(x) for x in (t, p, s))).numpy()
    else:
        model = load_jax_model("tiny")

        def forward(t, p, s):
            return model(*(None if x is None else jnp.asarray(x) for x in (t, p, s)))
    expected = _documents_one_at_a_time(forward, tokens)
    np.testing.assert_allclose(np.asarray(forward(tokens, positions, ids.astype(np.int32))), expected, **FP32_TOL)
    unmasked = np.asarray(forward(tokens, positions, None), np.float64)
    assert np.max(np.abs(unmasked - expected)) > 1e-2


def _train(out, backend, *extra) -> np.ndarray:
    """The losses of one `twinflash train` run in a fresh interpreter (torch starts torchrun itself)."""
    command = [sys.executable, "-m", "compare.commands.train", "--backend", backend, *COMMON, "--out", str(out),
               *extra]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return np.array([json.loads(line)["loss"] for line in (out / "train.jsonl").read_text().splitlines()])


@pytest.mark.slow
def test_packed_training_agrees_across_backends_and_meshes(tmp_path):
    """3 steps of 4 sequences of 256 tokens: two of them hold a boundary between stdlib files (the first files in
    sorted order are the corpus of so short a run; at 64 tokens none would)."""
    torch_sp2 = _train(tmp_path / "torch-sp2", "torch", "--pack", "--mesh", "fsdp=1,sp=2")
    torch_one = _train(tmp_path / "torch-one", "torch", "--pack", "--mesh", "fsdp=1,sp=1")
    jax_sp2 = _train(tmp_path / "jax-sp2", "jax", "--pack", "--mesh", "fsdp=1,sp=2", "--ring-variant", "allgather")
    assert len(torch_sp2) == STEPS
    np.testing.assert_allclose(torch_sp2, torch_one, rtol=LOSS_RTOL)
    np.testing.assert_allclose(jax_sp2, torch_one, rtol=LOSS_RTOL)
    unpacked = _train(tmp_path / "torch-unpacked", "torch", "--mesh", "fsdp=1,sp=2")
    assert np.max(np.abs(unpacked - torch_one)) > 1e-3  # negative control: packing changes what is learned


@pytest.mark.parametrize("extra, message", [
    (["--data", "random"], "--pack packs the text corpus's files as documents: it needs --data text"),
])
def test_pack_refuses_what_it_cannot_pack(capsys, extra, message):
    assert main(["--backend", "torch", "--model", "tiny", "--seq-len", "64", "--steps", "1", "--pack", *extra]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"twinflash: error: {message}"]
