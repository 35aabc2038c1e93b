"""`twinflash convert / export / run` through the CLI: the happy paths and every bad input's one-line error, exit 2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from hf_fixtures import make_hf_checkpoint

from compare.cli import main


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("cli") / "hf"
    make_hf_checkpoint(directory, "gqa_llama3")
    return directory


@pytest.fixture(scope="module")
def converted_dir(hf_dir):
    out = hf_dir.parent / "converted"
    assert main(["convert", str(hf_dir), str(out)]) == 0
    return out


def _bad(capsys, argv, *fragments) -> str:
    """Runs the CLI expecting exit 2 and one stderr line holding every fragment."""
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def test_run_dumps_logits_of_the_given_tokens(tmp_path, capsys, converted_dir):
    tokens = np.random.default_rng(0).integers(0, 97, (2, 20))
    np.save(tmp_path / "ids.npy", tokens)
    for backend in ("torch", "jax"):
        out = tmp_path / f"{backend}.npy"
        assert main(["run", "--backend", backend, "--model", str(converted_dir), "--tokens", str(tmp_path / "ids.npy"),
                     "--dump-logits", str(out)]) == 0
        printed = capsys.readouterr().out
        assert "loss" in printed and "perplexity" in printed and "peak memory" in printed and "wall time" in printed
        logits = np.load(out)
        assert logits.dtype == np.float32 and logits.shape == (2, 20, 97)
    np.testing.assert_allclose(np.load(tmp_path / "torch.npy"), np.load(tmp_path / "jax.npy"), atol=1e-4)


def test_missing_directory(capsys, tmp_path):
    _bad(capsys, ["run", "--model", tmp_path / "nope"], "missing checkpoint directory")
    _bad(capsys, ["convert", tmp_path / "nope", tmp_path / "out"], "missing checkpoint directory")
    _bad(capsys, ["export", tmp_path / "nope", tmp_path / "out"], "missing checkpoint directory")
    assert not (tmp_path / "out").exists()


def test_corrupt_config_and_weights(capsys, tmp_path, hf_dir):
    broken = tmp_path / "broken"
    shutil.copytree(hf_dir, broken)
    (broken / "config.json").write_text("{not json")
    _bad(capsys, ["convert", broken, tmp_path / "out"], "corrupt JSON", "config.json")
    shutil.copy(hf_dir / "config.json", broken / "config.json")
    data = (hf_dir / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    _bad(capsys, ["convert", broken, tmp_path / "out"], "model.safetensors")
    assert not (tmp_path / "out").exists()


def test_config_tensor_mismatch_names_tensor_and_both_shapes(capsys, tmp_path, hf_dir):
    wrong = tmp_path / "wrong"
    shutil.copytree(hf_dir, wrong)
    config = json.loads((wrong / "config.json").read_text())
    config["intermediate_size"] = 128
    (wrong / "config.json").write_text(json.dumps(config))
    _bad(capsys, ["convert", wrong, tmp_path / "out"], "model.layers.0.mlp.gate_proj.weight", "[96, 64]", "[128, 64]")


def test_unknown_preset(capsys):
    _bad(capsys, ["run", "--model", "llama9-70b"], "unknown preset 'llama9-70b'", "tiny")


def test_non_llama_config(capsys, tmp_path, hf_dir):
    other = tmp_path / "gpt2"
    shutil.copytree(hf_dir, other)
    config = json.loads((other / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (other / "config.json").write_text(json.dumps(config))
    _bad(capsys, ["convert", other, tmp_path / "out"], "not a Llama config", "gpt2")
    _bad(capsys, ["run", "--model", hf_dir], "not a twinflash-llama/1 checkpoint", "twinflash convert")


def test_token_ids_outside_vocabulary(capsys, tmp_path, converted_dir):
    np.save(tmp_path / "ids.npy", np.array([[1, 2, 97]]))
    _bad(capsys, ["run", "--model", converted_dir, "--tokens", tmp_path / "ids.npy"], "token ids", "[0, 97)")
    np.save(tmp_path / "floats.npy", np.zeros((1, 4)))
    _bad(capsys, ["run", "--model", converted_dir, "--tokens", tmp_path / "floats.npy"], "integers")


def test_pickle_checkpoint_refused(capsys, tmp_path, hf_dir):
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(hf_dir / "config.json", pickled)
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    _bad(capsys, ["convert", pickled, tmp_path / "out"], "pytorch_model.bin", "pickle", "convert it to safetensors")


def test_unknown_backend(capsys):
    _bad(capsys, ["run", "--backend", "mxnet"], "invalid choice: 'mxnet'")


def test_existing_outputs_are_never_overwritten(capsys, tmp_path, hf_dir, converted_dir):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    _bad(capsys, ["convert", hf_dir, out], "exists and is not empty")
    _bad(capsys, ["export", converted_dir, out], "exists and is not empty")
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    logits = tmp_path / "logits.npy"
    logits.write_text("precious")
    _bad(capsys, ["run", "--seq-len", "8", "--dump-logits", logits], "refusing to overwrite")
    assert logits.read_text() == "precious"


def test_console_script_prints_one_line_without_traceback(tmp_path):
    """The installed entry point, in a fresh process: exit 2, one line, no traceback."""
    result = subprocess.run([sys.executable, "-m", "compare.cli", "run", "--model", str(tmp_path / "missing")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"twinflash: error: missing checkpoint directory {tmp_path}/missing"]
