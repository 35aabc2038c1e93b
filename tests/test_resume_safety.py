"""Resume safety (issue 15, item 4), both backends: --resume without a checkpoint is an error naming the directory;
one backend refuses the other's checkpoints; every checkpoint carries a manifest of checksums, a corrupt or
incomplete newest checkpoint is passed over for the newest valid one with one warning (an error when none is
valid, never an unpickling hint), and the resumed run then saves its own steps under those names.

Training runs in this process on one device (tests/test_non_finite.py's `train`), 2 steps of the tiny preset.
"""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest

from test_non_finite import CHECKPOINTING, STEPS, token_batches, train, train_settings
from weights import CheckpointError, preset
from weights.checkpoint_integrity import MANIFEST, SET_ASIDE_PREFIX, checkpoint_problem
from weights.training import checkpoint_to_resume, run_metadata

BACKENDS = ["torch", "jax"]
OTHER = {"torch": "jax", "jax": "torch"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{backend: checkpoint directory after STEPS steps, a checkpoint after every step} (a pristine copy: tests
    copy it before damaging it)."""
    monkeypatch = pytest.MonkeyPatch()
    try:
        return {backend: _trained(backend, tmp_path_factory.mktemp(backend) / "ckpt", monkeypatch)
                for backend in BACKENDS}
    finally:
        monkeypatch.undo()


def _trained(backend, ckpt_dir, monkeypatch):
    settings = train_settings(backend, "tiny", ckpt_dir=ckpt_dir, ckpt_every=1, keep=10)
    train(backend, settings, token_batches(with_poison=False), monkeypatch)
    return ckpt_dir


def _copy(source, target):
    shutil.copytree(source, target)
    return target


def _resume(backend, ckpt_dir, warnings=None, **fields):
    """Where a run of `backend` in `ckpt_dir` starts (`weights.training.checkpoint_to_resume`), with --resume
    unless `fields` say otherwise."""
    settings = train_settings(backend, "tiny", ckpt_dir=ckpt_dir, ckpt_every=1, **{"resume": True, **fields})
    checkpointing = CHECKPOINTING[backend]
    return checkpoint_to_resume(settings, run_metadata(settings, _config()), checkpointing.completed_checkpoints,
                                checkpointing.read_metadata, warn=None if warnings is None else warnings.append)


def _config():
    return preset("tiny")


def _largest_file(directory):
    return max((p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST), key=lambda p: p.stat().st_size)


def _scribble(path) -> None:
    """Random bytes over the middle of `path` (its tensor data), the size unchanged."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = np.random.default_rng(0).integers(0, 256, 64, dtype=np.uint8).tobytes()
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_without_a_checkpoint_is_an_error_naming_the_directory(backend, tmp_path, saved):
    with pytest.raises(CheckpointError) as refused:
        _resume(backend, tmp_path / "empty")
    assert str(refused.value) == f"--resume: no {backend} training checkpoint in {tmp_path / 'empty'}"
    assert _resume(backend, saved[backend]).step == STEPS  # negative control


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_backend_refuses_the_other_backends_checkpoints(backend, saved):
    other = saved[OTHER[backend]]
    newest = CHECKPOINTING[OTHER[backend]].step_dir_name(STEPS)
    for resume in (True, False):  # with --resume, and a fresh run pointed at that directory
        with pytest.raises(CheckpointError) as refused:
            _resume(backend, other, resume=resume)
        assert str(refused.value) == (f"{other} holds {OTHER[backend]} training checkpoints ({newest}), this run is "
                                      f"a {backend} run; choose another --ckpt-dir or --backend {OTHER[backend]}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_mismatch_names_both_sides(backend, saved):
    with pytest.raises(CheckpointError, match=r"another data stream \(seq_len 16 -> 32\)"):
        _resume(backend, saved[backend], seq_len=32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_checkpoint_has_a_manifest_that_catches_random_bytes(backend, saved, tmp_path):
    ckpt = _copy(saved[backend], tmp_path / "ckpt")
    steps = CHECKPOINTING[backend].completed_checkpoints(ckpt)
    assert len(steps) == STEPS and all(checkpoint_problem(p) is None for p in steps)  # negative control
    shard = _largest_file(steps[-1])
    _scribble(shard)
    assert checkpoint_problem(steps[-1]) == (f"corrupt ({shard.relative_to(steps[-1])} does not match its "
                                             "checksum)")


def test_without_checksums_only_sizes_are_compared(saved, tmp_path):
    """What a torch worker checks after its launcher verified the checksums: a same-size scribble passes, a
    truncated file does not (the full check catches both)."""
    ckpt = _copy(saved["torch"], tmp_path / "ckpt")
    newest = CHECKPOINTING["torch"].completed_checkpoints(ckpt)[-1]
    shard = _largest_file(newest)
    _scribble(shard)
    assert checkpoint_problem(newest, checksums=False) is None
    assert checkpoint_problem(newest).startswith("corrupt")
    shard.write_bytes(shard.read_bytes()[:-1])
    assert checkpoint_problem(newest, checksums=False).startswith("corrupt")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("damage", ["corrupt", "incomplete"])
def test_a_damaged_newest_checkpoint_falls_back_with_one_warning(backend, damage, saved, tmp_path):
    checkpointing = CHECKPOINTING[backend]
    ckpt = _copy(saved[backend], tmp_path / "ckpt")
    newest = checkpointing.completed_checkpoints(ckpt)[-1]
    if damage == "corrupt":
        _scribble(_largest_file(newest))
    else:
        (newest / MANIFEST).unlink()
    warnings: list[str] = []
    resume = _resume(backend, ckpt, warnings)
    assert (resume.path.name, resume.step, resume.passed_over) == (checkpointing.step_dir_name(STEPS - 1),
                                                                   STEPS - 1, (newest,))
    assert len(warnings) == 1 and warnings[0].startswith(f"twinflash: warning: checkpoint {newest} is {damage} (")
    assert warnings[0].endswith(f"resuming from the newest valid one, {checkpointing.step_dir_name(STEPS - 1)}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_valid_checkpoint_is_one_error_without_an_unpickling_hint(backend, saved, tmp_path):
    ckpt = _copy(saved[backend], tmp_path / "ckpt")
    for path in CHECKPOINTING[backend].completed_checkpoints(ckpt):
        _scribble(_largest_file(path))
    with pytest.raises(CheckpointError) as refused:
        _resume(backend, ckpt)
    message = str(refused.value)
    assert "\n" not in message and "weights_only" not in message
    assert message.startswith(f"no valid checkpoint to resume from in {ckpt}: the newest, "
                              f"{CHECKPOINTING[backend].step_dir_name(STEPS)}, is corrupt (")
    assert message.endswith("and so are the older ones")


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_resumed_run_sets_the_damaged_checkpoint_aside_and_saves_again(backend, saved, tmp_path, monkeypatch,
                                                                           capfd):
    checkpointing = CHECKPOINTING[backend]
    ckpt = _copy(saved[backend], tmp_path / "ckpt")
    newest = checkpointing.completed_checkpoints(ckpt)[-1]
    _scribble(_largest_file(newest))
    settings = train_settings(backend, "tiny", ckpt_dir=ckpt, ckpt_every=1, keep=10, resume=True)
    records = train(backend, settings, token_batches(with_poison=False), monkeypatch)
    assert [r["step"] for r in records] == [STEPS - 1] and math.isfinite(records[0]["loss"])
    assert (ckpt / f"{SET_ASIDE_PREFIX}{newest.name}").is_dir()
    assert [checkpoint_problem(p) for p in checkpointing.completed_checkpoints(ckpt)] == [None] * STEPS
    assert sum("twinflash: warning: checkpoint" in line for line in capfd.readouterr().err.splitlines()) == 1
