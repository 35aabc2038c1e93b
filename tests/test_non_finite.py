"""Non-finite values during the work (issue 15): an empty token batch is refused, the reference attention never
hides a NaN (`twinflash run` on a checkpoint with one NaN weight gives NaN), and a training step with a non-finite
loss or grad norm stops the run without saving it, or with --skip-non-finite-steps is skipped; both backends.

Training runs in this process on one device (torch: a one-rank gloo group), on batches made here: the NaN sits in
the embedding row of one token id, so only a batch holding that id makes the step non-finite.
"""

from __future__ import annotations

import math
import socket

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from compare.cli import main as cli_main
from jax_impl import checkpointing as jax_checkpointing
from jax_impl.attention import reference_attention as jax_reference_attention
from jax_impl.train import run_training as jax_run_training
from torch_impl import checkpointing as torch_checkpointing
from torch_impl.attention import reference_attention as torch_reference_attention
from torch_impl.train import run_training as torch_run_training
from weights import RandomWeights, preset, write_converted_checkpoint
from weights.checkpoint_integrity import checkpoint_problem
from weights.parallel import MeshShape
from weights.settings import TrainSettings
from weights.training import NonFiniteStepError

POISON = 255  # token id whose embedding row is NaN in the poisoned checkpoint
SEQ_LEN, BATCH, STEPS = 16, 1, 4
BAD_STEP = 2  # the only batch holding POISON


def _tiny_checkpoint(directory, poison: dict[str, tuple]):
    """A converted tiny checkpoint (seed 1) with NaN at each {name: index}."""
    source = RandomWeights(preset("tiny"), seed=1)
    tensors = dict(source)
    for name, index in poison.items():
        tensors[name] = tensors[name].copy()
        tensors[name][index] = np.nan
    write_converted_checkpoint(tensors, source.config, directory)
    return directory


# --- run: empty batches, NaN weights ---------------------------------------------------------------------------

def test_run_refuses_an_empty_token_batch(tmp_path, capsys):
    for shape, refused in (((0, 64), True), ((1, 64), False)):  # negative control: one sequence runs
        path = tmp_path / f"tokens_{shape[0]}.npy"
        np.save(path, np.zeros(shape, np.int64))
        code = cli_main(["run", "--backend", "torch", "--model", "tiny", "--tokens", str(path)])
        captured = capsys.readouterr()
        if refused:
            assert code == 2 and captured.out == ""
            assert captured.err.strip().splitlines() == [
                f"twinflash: error: {path}: tokens must have shape [batch >= 1, seq_len >= 2], got [0, 64]"]
        else:
            assert code == 0 and "loss" in captured.out


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_reference_attention_passes_nan_through_and_zeroes_rows_without_keys(backend):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(shape, np.float32) for shape in ((1, 6, 2, 8), (1, 4, 1, 8), (1, 4, 1, 8)))
    attention = (lambda *xs: torch_reference_attention(*map(torch.from_numpy, xs), return_lse=True)) \
        if backend == "torch" else (lambda *xs: jax_reference_attention(*map(jnp.asarray, xs), return_lse=True))
    out, lse = (np.asarray(x) for x in attention(q, k, v))
    # Sq=6 > Sk=4: queries 0 and 1 see no key (output 0, lse -inf); the rest are finite (negative control)
    assert np.all(out[:, :2] == 0) and np.all(np.isneginf(lse[..., :2]))
    assert np.all(np.isfinite(out[:, 2:])) and np.all(np.isfinite(lse[..., 2:]))
    clean = out
    q[0, 4, 0, 0] = np.nan  # query 4, head 0: its scores are all NaN (.nan_to_num(0.0) made its output 0)
    out, lse = (np.asarray(x) for x in attention(q, k, v))
    assert np.all(np.isnan(out[0, 4, 0])) and np.isnan(lse[0, 0, 4])
    others = np.ones(out.shape, bool)
    others[0, 4, 0] = False
    np.testing.assert_array_equal(out[others], clean[others])  # rows without keys still 0, the rest unchanged


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_run_gives_nan_for_a_checkpoint_with_one_nan_weight(backend, tmp_path, capsys):
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 255, (1, 16)))

    def loss(model) -> float:
        assert cli_main(["run", "--backend", backend, "--model", str(model), "--tokens", str(tokens)]) == 0
        line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("loss"))
        return float(line.split()[1])

    # one NaN in a query projection: every score of head 0 is NaN, which .nan_to_num(0.0) turned into a finite loss
    assert math.isnan(loss(_tiny_checkpoint(tmp_path / "nan", {"layers.0.attention.wq.weight": (0, 0)})))
    assert math.isfinite(loss(_tiny_checkpoint(tmp_path / "clean", {})))  # negative control


# --- training: stop or skip a non-finite step ------------------------------------------------------------------

@pytest.fixture(scope="module")
def poisoned(tmp_path_factory):
    return _tiny_checkpoint(tmp_path_factory.mktemp("poisoned") / "tiny", {"tok_embeddings.weight": (POISON, 0)})


def token_batches(with_poison: bool) -> np.ndarray:
    """[STEPS, BATCH, SEQ_LEN] tokens below POISON; `with_poison`: batch BAD_STEP holds one POISON."""
    batches = np.random.default_rng(0).integers(0, POISON, (STEPS, BATCH, SEQ_LEN))
    if with_poison:
        batches[BAD_STEP, 0, 5] = POISON
    return batches


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(backend: str, settings: TrainSettings, batches: np.ndarray, monkeypatch) -> list[dict]:
    """Runs `settings` in this process on one device; the per-step records."""
    records: list[dict] = []
    if backend == "torch":
        for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0",
                            "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
            monkeypatch.setenv(name, value)
        torch_run_training(settings, batches, lambda **r: records.append(r))
    else:
        jax_run_training(settings, batches, lambda **r: records.append(r), devices=jax.devices()[:1])
    return records


def train_settings(backend: str, model, **fields) -> TrainSettings:
    fields = {"seq_len": SEQ_LEN, "steps": STEPS, "mesh": MeshShape(), "batch": BATCH,
              "attention_backend": "reference", **fields}
    return TrainSettings(backend=backend, model=str(model), **fields)


CHECKPOINTING = {"torch": torch_checkpointing, "jax": jax_checkpointing}


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_a_non_finite_step_stops_the_run_and_is_not_saved(backend, poisoned, tmp_path, monkeypatch):
    checkpointing = CHECKPOINTING[backend]
    settings = train_settings(backend, poisoned, ckpt_dir=tmp_path / "ckpt", ckpt_every=1, keep=10)
    with pytest.raises(NonFiniteStepError) as stopped:
        train(backend, settings, token_batches(with_poison=True), monkeypatch)
    last_good = tmp_path / "ckpt" / checkpointing.step_dir_name(BAD_STEP)
    assert str(stopped.value) == (
        f"step {BAD_STEP}: non-finite loss nan / grad norm nan; training stopped, the step not saved (last "
        f"checkpoint: {last_good}); rerun with --skip-non-finite-steps to skip such steps")
    kept = checkpointing.completed_checkpoints(tmp_path / "ckpt")
    assert [p.name for p in kept] == [checkpointing.step_dir_name(s) for s in range(1, BAD_STEP + 1)]
    assert [checkpoint_problem(p) for p in kept] == [None] * BAD_STEP  # sealed: a resume may read them
    # negative control: the same weights on batches without the poisoned token train to the end
    clean = train(backend, train_settings(backend, poisoned), token_batches(with_poison=False), monkeypatch)
    assert [r["step"] for r in clean] == list(range(STEPS)) and all(math.isfinite(r["loss"]) for r in clean)


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_skip_non_finite_steps_leaves_the_weights_as_they_were(backend, poisoned, monkeypatch, capfd):
    records = train(backend, train_settings(backend, poisoned, skip_non_finite_steps=True),
                    token_batches(with_poison=True), monkeypatch)
    losses = [r["loss"] for r in records]
    assert [r["step"] for r in records] == list(range(STEPS))
    # the bad step's NaN gradients were not applied: the next step's loss is finite again (applied, they would
    # make every weight NaN)
    assert math.isnan(losses[BAD_STEP]) and all(math.isfinite(x) for i, x in enumerate(losses) if i != BAD_STEP)
    warnings = [line for line in capfd.readouterr().err.splitlines() if "update skipped" in line]
    assert warnings == [f"twinflash: warning: step {BAD_STEP}: non-finite loss nan / grad norm nan; update skipped "
                        "(--skip-non-finite-steps)"]
