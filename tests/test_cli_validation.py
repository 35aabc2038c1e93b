"""Bad paths and values are refused at the door: every output location (train --out/--ckpt-dir/--export, run
--dump-logits, convert OUT_DIR, export HF_DIR, compare --out) and every numeric or list option is checked before
any weights are loaded or any worker starts, as one line `twinflash: error: ...` and exit 2, nothing written; file
system errors on a path end the same way; written files get the user's umask; `twinflash bench` alone lists the
benchmarks. All in this process, no backend work: the commands' first steps of real work are replaced by a
sentinel that fails the test if bad input gets that far.
"""

from __future__ import annotations

import dataclasses
import os
import stat

import pytest

from compare.args import with_error_contract
from compare.cli import main
from weights import PRESETS, RandomWeights, write_converted_checkpoint
from weights.atomic import write_text_atomically


class WorkStarted(Exception):
    """Raised by the sentinels: bad input got past the door."""


def _work(*args, **kwargs):
    raise WorkStarted


@pytest.fixture
def door(monkeypatch):
    """Replaces the first real work of each command (loading weights or tokens, planning, launching workers,
    converting) with a sentinel."""
    import weights
    from compare.commands import run, train
    from compare.commands import compare as command

    for module, name in ((train, "open_weights"), (train, "hand_off"), (train, "check_run"),
                         (run, "open_weights"), (command, "plan_settings"),
                         (weights, "convert_hf_checkpoint"), (weights, "export_hf_checkpoint")):
        monkeypatch.setattr(module, name, _work)


def _bad(capsys, argv, *fragments) -> str:
    """Runs the CLI expecting exit 2 and one stderr line `twinflash: error: ...` holding every fragment."""
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("twinflash: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


TRAIN = ["train", "--backend", "torch", "--seq-len", "64", "--steps", "2"]

BAD_VALUES = [
    (TRAIN + ["--lr", "nan"], "--lr", "finite"),
    (TRAIN + ["--lr", "inf"], "--lr", "finite"),
    (TRAIN + ["--lr", "0"], "--lr", "> 0"),
    (TRAIN + ["--grad-clip", "nan"], "--grad-clip", "finite"),
    (TRAIN + ["--grad-clip", "-1"], "--grad-clip", "> 0"),
    (TRAIN + ["--weight-decay", "-0.1"], "--weight-decay", ">= 0"),
    (TRAIN + ["--weight-decay", "inf"], "--weight-decay", "finite"),
    (TRAIN + ["--warmup-steps", "-1"], "--warmup-steps", ">= 0"),
    (TRAIN + ["--warmup-steps", "1.5"], "--warmup-steps", "integer"),
    (TRAIN + ["--keep", "0"], "--keep", ">= 1"),
    (TRAIN + ["--ckpt-every", "0"], "--ckpt-every", ">= 1"),
    (TRAIN + ["--batch", "0"], "--batch", ">= 1"),
    (TRAIN + ["--seed", "-1"], "--seed", "0.."),
    (["train", "--seq-len", "0", "--steps", "2"], "--seq-len", ">= 2"),
    (["train", "--seq-len", "64", "--steps", "0"], "--steps", ">= 1"),
    (["compare", "--check-layers", "0"], "--check-layers", ">= 1"),
    (["compare", "--check-seq-len", "0"], "--check-seq-len", ">= 2"),
    (["compare", "--devices", "0"], "--devices", ">= 1"),
    (["compare", "--steps", "0"], "--steps", ">= 1"),
    (["compare", "--job-timeout-s", "nan"], "--job-timeout-s", "finite"),
    (["compare", "--time-limit-s", "0"], "--time-limit-s", "> 0"),
    (["compare", "--backends", "torch,torch"], "--backends", "torch given twice"),
    (["compare", "--backends", "torch,"], "--backends", "comma-separated"),
    (["compare", "--ablation", "ours,ours"], "--ablation", "ours given twice"),
    (["compare", "--seq-lens", "128,128"], "--seq-lens", "128 given twice"),
    (["compare", "--seq-lens", "0,128"], "--seq-lens", ">= 1"),
    (["compare", "--device-counts", "1,2,1"], "--device-counts", "1 given twice"),
    (["run", "--seq-len", "1"], "--seq-len", ">= 2"),
    (["run", "--batch", "0"], "--batch", ">= 1"),
    (["bench", "kernels", "--kv-heads", "8,8"], "--kv-heads", "8 given twice"),
    (["bench", "ring", "--seq-lens", "32k,32768"], "--seq-lens", "32768 given twice"),
]


@pytest.mark.parametrize("argv, option, cause", BAD_VALUES, ids=[" ".join(a[0][-2:]) for a in BAD_VALUES])
def test_bad_values_are_refused_at_the_door(door, capsys, argv, option, cause):
    _bad(capsys, argv, option, cause)


def test_good_values_pass_the_door(door, tmp_path):
    """Negative control for the sentinels: valid input reaches the work (the sentinel), so a refusal above is the
    door's and not a side effect of the test set-up."""
    argv = TRAIN + ["--lr", "1e-3", "--warmup-steps", "0", "--weight-decay", "0", "--out", tmp_path / "a/b/out",
                    "--ckpt-dir", tmp_path / "ckpt", "--export", tmp_path / "export"]
    for good in (argv, ["compare", "--check-layers", "1", "--backends", "torch", "--out", tmp_path / "report"],
                 ["run", "--seq-len", "2", "--dump-logits", tmp_path / "logits.npy"],
                 ["convert", tmp_path, tmp_path / "converted"], ["export", tmp_path, tmp_path / "hf"]):
        with pytest.raises(WorkStarted):
            main([str(a) for a in good])
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing created by the checks themselves


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "a-file"
    path.write_text("not a directory\n")
    return path


def test_output_locations_are_checked_before_any_work(door, capsys, tmp_path, a_file):
    full = tmp_path / "full"
    (full / "converted").mkdir(parents=True)
    (full / "converted" / "x").write_text("")
    (full / "report").mkdir()
    (full / "report" / "report.md").write_text("")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "train.jsonl").write_text("")
    cases = [
        (TRAIN + ["--out", a_file], "--out", "is a file"),
        (TRAIN + ["--out", a_file / "out"], "--out", "cannot create it", str(a_file)),
        (TRAIN + ["--out", tmp_path / "out"], "train.jsonl exists"),
        (TRAIN + ["--ckpt-dir", a_file], "--ckpt-dir", "is a file"),
        (TRAIN + ["--ckpt-dir", a_file / "deep" / "ckpt"], "--ckpt-dir", "cannot create it"),
        (TRAIN + ["--export", a_file], "--export", "cannot create it"),
        (TRAIN + ["--export", full], "exists and is not empty"),
        (["run", "--dump-logits", a_file], "exists; refusing to overwrite it"),
        (["run", "--dump-logits", a_file / "logits.npy"], "--dump-logits", "is a file"),
        (["run", "--dump-logits", tmp_path / "missing" / "logits.npy"], "--dump-logits", "does not exist"),
        (["convert", tmp_path, a_file], "OUT_DIR", "is a file"),
        (["convert", tmp_path, a_file / "converted"], "OUT_DIR", "cannot create it"),
        (["convert", tmp_path, full], "exists and is not empty"),
        (["export", tmp_path, a_file / "hf"], "HF_DIR", "cannot create it"),
        (["export", tmp_path, full], "exists and is not empty"),
        (["compare", "--out", a_file], "--out", "is a file"),
        (["compare", "--out", full / "report"], "exists and is not empty"),
    ]
    before = sorted(tmp_path.rglob("*"))
    for argv, *fragments in cases:
        _bad(capsys, argv, *fragments)
    assert sorted(tmp_path.rglob("*")) == before
    assert (tmp_path / "out" / "train.jsonl").read_text() == ""  # no step ran


def test_unwritable_locations_are_refused(door, capsys, tmp_path, monkeypatch):
    """A read-only directory (tests may run as root, for whom chmod does not forbid writing: the permission check
    is what is replaced here), for a directory that exists and for the nearest existing ancestor of one that does
    not."""
    locked = tmp_path / "locked"
    (locked / "existing").mkdir(parents=True)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: not str(path).startswith(str(locked))
                        and real_access(path, mode))
    for argv in (TRAIN + ["--out", locked / "existing"], TRAIN + ["--ckpt-dir", locked / "new" / "ckpt"],
                 TRAIN + ["--export", locked], ["run", "--dump-logits", locked / "x.npy"],
                 ["convert", tmp_path, locked / "out"], ["export", tmp_path, locked / "hf"],
                 ["compare", "--out", locked / "report"]):
        _bad(capsys, argv, "cannot write there", str(locked))
    assert sorted(p.name for p in locked.iterdir()) == ["existing"]


def test_file_system_errors_on_a_path_are_one_line(capsys, a_file):
    """An OSError naming a path (a full disk, a read-only file system, here a path under a file) during the work
    is one line naming it, exit 2; one that names no path is a bug and keeps its traceback."""
    def write_under_a_file():
        write_text_atomically(a_file / "train.jsonl", "{}\n")

    assert with_error_contract(write_under_a_file) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("twinflash: error: ") and str(a_file) in lines[0], lines

    def no_path():
        raise ConnectionResetError("peer went away")

    with pytest.raises(ConnectionResetError):
        with_error_contract(no_path)


def _modes(root) -> set[str]:
    return {f"{'d' if p.is_dir() else 'f'}{stat.S_IMODE(p.stat().st_mode):o}" for p in [root, *root.rglob("*")]}


@pytest.mark.parametrize("umask, directory, file", [(0o022, "d755", "f644"), (0o077, "d700", "f600")])
def test_written_files_follow_the_umask(tmp_path, capsys, umask, directory, file):
    """Atomic writes, converted and exported checkpoints (temporary files and directories are 0600 / 0700 until
    published). The second umask is the negative control: the modes follow the umask, not a fixed 0644."""
    config = dataclasses.replace(PRESETS["tiny"], num_layers=1)
    previous = os.umask(umask)
    try:
        write_text_atomically(tmp_path / "result.json", "{}\n")
        write_converted_checkpoint(dict(RandomWeights(config)), config, tmp_path / "source")
        assert main(["export", str(tmp_path / "source"), str(tmp_path / "hf")]) == 0
        assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "converted")]) == 0
    finally:
        os.umask(previous)
    assert _modes(tmp_path / "result.json") == {file}
    for name in ("source", "hf", "converted"):
        assert _modes(tmp_path / name) == {directory, file}, name
    printed = capsys.readouterr().out
    assert "(1 layer, " in printed, printed  # not "1 layers"


def test_bench_alone_lists_the_benchmarks(capsys):
    _bad(capsys, ["bench"], "twinflash bench kernels", "twinflash bench ring")
