"""The bf16 noise floor of `twinflash compare` (compare/harness/noise_floor.py, compare/report/noise_floor.py): the
per-step arithmetic on hand-made loss lists, the verdict and its edge cases, the section in the report (schema,
both renderings, the plot), the default optimizer settings by model size, the runs as curve jobs of the compare run
(their settings are `twinflash train`'s for the same arguments), and (slow) real tiny bf16 trainings run by the
compare workers: a curve job's losses are the `twinflash train` command's, and the negative control (one weight
scaled by 1 % in one backend pushes the ratio far above the limit)."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os

import pytest

from compare.cli import build_parser
from compare.cli import main as cli_main
from compare.commands.train import settings_from_args
from compare.harness import jobs as J
from compare.harness import noise_floor as N
from compare.harness.launches import CPU_XLA_FLAGS, run_jobs
from compare.harness.perturb import Perturbation
from compare.harness.plan import CompareSettings
from compare.report.render import render_html, render_markdown
from compare.report.write import validate_report, write_report
from test_compare_report import make_report
from weights import PRESETS
from weights.schedule import OptimizerConfig, default_optimizer, default_warmup_steps


def _settings(**fields) -> CompareSettings:
    """The compare settings the noise floor reads, the rest at neutral values."""
    return CompareSettings(model="tiny", seq_lens=(128,), device_counts=(1,), steps=2,
                           attention_ablation=("ours",), activation_checkpointing="off", check_seq_len=128,
                           check_layers=2, bench=True, notes=(), perturb=None, **fields)


def _record(name, losses, status="ok"):
    backend, attention = name.split("-")
    kernel = {"ours": {"torch": "triton", "jax": "pallas"}[backend], "vendor": "cudnn"}.get(attention, attention)
    return {"name": name, "backend": backend, "attention": attention, "kernel": kernel, "status": status,
            "message": None if status == "ok" else "stopped", "losses": losses, "seconds": 12.0}


def _floor(steps=3):
    return {"seq_len": 8192, "devices": 2, "steps": steps, "runs": []}


def test_relative_differences_by_hand():
    diffs = N.relative_differences([10.0, 5.0, 4.0, math.nan], [10.0, 4.0, 4.4, 3.0])
    assert diffs[:3] == pytest.approx([0.0, 1 / 4.5, 0.4 / 4.2], rel=1e-12)
    assert diffs[3] == math.inf  # a non-finite loss is an infinite difference, never a silent 0
    assert N.relative_differences([1.0, 2.0, 3.0], [1.0]) == [0.0]  # steps both runs have


def test_pair_statistics_by_hand():
    pair = N.compare_curves("p", "floor", "a", "b", {"a": [10.0, 5.0, 4.0], "b": [10.0, 4.0, 4.4]})
    assert (pair["steps"], pair["max"], pair["final"]) == (3, pytest.approx(1 / 4.5), pytest.approx(0.4 / 4.2))
    assert pair["mean"] == pytest.approx((1 / 4.5 + 0.4 / 4.2) / 3)


def _section(losses: dict[str, list[float]], status=None):
    records = [_record(name, curve, (status or {}).get(name, "ok")) for name, curve in losses.items()]
    return N.noise_floor_section(_floor(), records, PRESETS["llama3.2-1b"])


def test_all_six_pairs_and_the_smaller_floor_and_says_why():
    base = [10.0, 8.0, 6.0]
    section = _section({"torch-ours": base, "torch-vendor": [10.0, 8.08, 6.06],  # floor mean 2/3 %
                        "jax-ours": [10.0, 8.16, 6.12], "jax-vendor": base})  # jax floor mean 4/3 %
    assert [p["kind"] for p in section["pairs"]] == ["floor", "floor", "cross", "vendor cross", "mixed", "mixed"]
    assert {frozenset((p["a"], p["b"])) for p in section["pairs"]} == {
        frozenset((a, b)) for a in ("torch-ours", "torch-vendor", "jax-ours", "jax-vendor")
        for b in ("torch-ours", "torch-vendor", "jax-ours", "jax-vendor") if a < b}
    floors = {p["name"]: p["mean"] for p in section["pairs"] if p["kind"] == "floor"}
    assert section["floor_pair"] == min(floors, key=floors.get) and section["floor_pair"].startswith("torch")
    cross = section["pairs"][2]["mean"]
    assert section["ratio"] == pytest.approx(cross / min(floors.values()))
    # jax-ours is 4/3 % from two runs but only 2/3 % from torch-vendor: not 3x the floor from all three
    assert section["outliers"] == [] and section["consistent"] is False  # ratio 2 > 1.5
    assert section["why"] == N.RATIO_LIMIT[1] and section["ratio_limit"] == 1.5 and section["floor_why"] == N.FLOOR_WHY
    assert section["optimizer"] == {"lr": 2e-4, "warmup_steps": 3, "min_lr_ratio": 0.1}  # 3 steps: all warmup


def _curve(relative: float, steps: int = 50) -> list[float]:
    """A loss curve from 10 down to 2.44, every step off by `relative` from the common one."""
    return [(10.0 - 7.56 * i / (steps - 1)) * (1 + relative) for i in range(steps)]


def test_issue_33_numbers_name_the_broken_run_where_the_larger_floor_said_consistent():
    """The 4xH200 compare of issue 33: torch ours vs cuDNN 0.05 %, JAX ours vs JAX cuDNN 4.7 %, torch vs JAX 4.6 %.
    The larger floor made that "consistent, ratio 0.97"; the smaller floor names jax-ours."""
    section = _section({"torch-ours": _curve(0.0), "torch-vendor": _curve(0.0005), "jax-ours": _curve(0.047),
                        "jax-vendor": _curve(0.0003)})
    floors = [p["mean"] for p in section["pairs"] if p["kind"] == "floor"]
    assert section["pairs"][2]["mean"] / max(floors) < N.RATIO_LIMIT[0]  # what the larger floor would have said
    assert section["outliers"] == ["jax-ours"] and section["consistent"] is False
    assert section["verdict"].startswith("jax-ours differs from the other three runs")
    assert section["ratio"] > 50 and "above 1.5" in section["verdict"]
    report = {**make_report(), "plots": []}
    report["equivalence"]["bf16"] = section
    validate_report(report)
    from compare.report.noise_floor import figure

    assert "jax-ours differs from the other three runs" in figure(report).get_suptitle()
    text = render_markdown(report)
    assert "| jax-ours (outlier) |" in text and section["verdict"] in text and section["floor_why"] in text


def test_the_vendor_runs_cross_difference_floors_the_floor_and_three_agreeing_runs_name_none():
    """Two kernels that agree closely in each backend (tiny floors) while the frameworks drift apart by bf16 noise:
    the floor is the vendor runs' cross difference, and torch vs JAX with ours is consistent with it."""
    section = _section({"torch-ours": _curve(0.0), "torch-vendor": _curve(0.0001), "jax-ours": _curve(0.003),
                        "jax-vendor": _curve(0.0032)})
    assert section["floor_pair"] == "torch vs jax, the vendor kernels"
    assert section["outliers"] == [] and section["consistent"], section["verdict"]
    # negative control: the same runs with torch-vendor's own floor as the floor would call it broken
    floors = [p["mean"] for p in section["pairs"] if p["kind"] == "floor"]
    assert section["pairs"][2]["mean"] / min(floors) > 10


def test_identical_floor_runs_use_the_minimum_floor():
    """Runs that agree bit for bit give a zero floor: the ratio divides by FLOOR_MIN, not by zero, and a run a few
    float32 roundings off is no outlier."""
    same = [10.0, 8.0, 6.0]
    section = _section({"torch-ours": same, "torch-vendor": same, "jax-ours": [10.0, 8.0000016, 6.0000012],
                        "jax-vendor": same})
    cross = next(p for p in section["pairs"] if p["kind"] == "cross")
    assert section["floor"] == 0.0 and 0 < cross["mean"] < N.FLOOR_MIN
    assert section["ratio"] == pytest.approx(cross["mean"] / N.FLOOR_MIN) and section["consistent"]


def test_missing_runs_give_no_ratio():
    section = _section({"torch-ours": [10.0, 8.0, 6.0], "torch-vendor": [10.0, 8.0], "jax-ours": [10.0, 8.0, 6.0],
                        "jax-vendor": [10.0]}, status={"torch-vendor": "timeout", "jax-vendor": "oom"})
    assert [p["kind"] for p in section["pairs"]] == ["cross"]
    assert section["ratio"] is None and section["consistent"] is None and section["outliers"] == []
    assert section["verdict"].startswith("not measured: a noise floor")


def test_plan_runs_only_in_bf16_train_mode_with_the_platform_defaults():
    args = argparse.Namespace(noise_floor_steps=None, noise_floor_seq_len=None)
    settings = _settings(platform="gpu", mode="train", dtype="bf16", devices=4, backends=("torch", "jax"))
    floor = N.plan(args, settings)
    assert (floor["seq_len"], floor["steps"], floor["devices"]) == (8192, 50, 2)
    assert [(r.name, r.kernel) for r in floor["runs"]] == [("torch-ours", "triton"), ("torch-vendor", "sdpa_cudnn"),
                                                           ("jax-ours", "pallas"), ("jax-vendor", "cudnn")]
    cpu = N.plan(args, dataclasses.replace(settings, platform="cpu", devices=1, backends=("torch",)))
    assert cpu["devices"] == 1 and [r.name for r in cpu["runs"]] == ["torch-ours", "torch-reference"]
    for changed in ({"dtype": "fp32"}, {"mode": "forward"}):
        assert N.plan(args, dataclasses.replace(settings, **changed)) is None
    assert N.plan(argparse.Namespace(**{**vars(args), "noise_floor_steps": 0}), settings) is None
    assert N.plan_jobs(None, settings, "tiny") == []


def test_each_run_is_a_curve_job_with_the_settings_of_twinflash_train():
    """A curve job's training description is the one `twinflash train --data text --seed 0 --mesh fsdp=1,sp=2
    --dtype bf16` builds (model, batches' shape, mesh, default optimizer, kernel, compiled step); --perturb marks
    both runs of its backend and neither of the other's."""
    args = argparse.Namespace(noise_floor_steps=None, noise_floor_seq_len=None)
    settings = dataclasses.replace(_settings(platform="gpu", mode="train", dtype="bf16", devices=4,
                                             backends=("torch", "jax")), perturb=Perturbation("jax", "norm.weight"))
    jobs = N.plan_jobs(N.plan(args, settings), settings, "tiny")
    assert [j.id for j in jobs] == [f"noise-floor-{b}-{a}" for b in ("torch", "jax") for a in ("ours", "vendor")]
    assert {(j.kind, j.devices, j.seq_len, j.steps, j.dtype, j.mode) for j in jobs} == {
        ("curve", 2, 8192, 50, "bf16", "train")}
    assert [j.perturb for j in jobs] == [None, None, "norm.weight", "norm.weight"]
    for job in jobs:
        train = build_parser().parse_args(
            ["train", "--backend", job.backend, "--attention-backend", job.attention_backend, "--model", "tiny",
             "--seq-len", "8192", "--steps", "50", "--mesh", "fsdp=1,sp=2", "--dtype", "bf16", "--data", "text",
             "--seed", "0"])
        assert job.settings() == settings_from_args(train, 2)
        record = N.run_record(job, {"status": "ok", "losses": [1.0] * 50, "seconds": 3.0, "setup": {}})
        assert (record["name"], record["status"], record["seconds"]) == (job.id.removeprefix("noise-floor-"), "ok", 3.0)
    short = N.run_record(jobs[0], {"status": "ok", "losses": [1.0] * 3, "seconds": 3.0})
    assert short["status"] == "error" and "3 of 50 steps" in short["message"]  # never a silent short curve
    failed = N.run_record(jobs[0], {"status": "oom", "message": "CUDA out of memory (log: work/logs/torch-2.log)"})
    assert failed["status"] == "oom" and failed["losses"] == [] and "0 of 50 steps" in failed["message"]


@pytest.mark.parametrize("args, message", [
    (["--noise-floor-seq-len", "8k,16k"], "--noise-floor-seq-len"),
    (["--noise-floor-seq-len", "127", "--dtype", "bf16"], "127"),  # the ring's zigzag layout cannot split it
    (["--noise-floor-steps", "-1"], "--noise-floor-steps"),
])
def test_bad_noise_floor_input_is_one_line_and_exit_2(tmp_path, capsys, args, message):
    out = tmp_path / "report"
    assert cli_main(["compare", *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("twinflash: error:") and "\n" not in err and message in err
    assert not out.exists()


def test_report_section_schema_renderings_and_plot(tmp_path):
    section = _section({"torch-ours": [10.0, 8.0, 6.0], "torch-vendor": [10.0, 8.08, 6.06],
                        "jax-ours": [10.0, 8.1, 6.1], "jax-vendor": [10.0, 8.1, 6.0]})
    report = {**make_report(), "plots": []}
    report["equivalence"]["bf16"] = section
    validate_report(report)
    write_report(report, tmp_path)
    assert (tmp_path / "plots" / "noise_floor.png").stat().st_size > 0
    for text in ((tmp_path / "report.md").read_text(), (tmp_path / "report.html").read_text()):
        assert "bf16: torch vs JAX beside a measured noise floor" in text and "plots/noise_floor.png" in text
        assert section["verdict"] in text and "torch vs jax, our kernels" in text
    spoiled = copy.deepcopy(report)
    del spoiled["equivalence"]["bf16"]["ratio"]
    with pytest.raises(ValueError, match="ratio"):
        validate_report(spoiled)
    without = {**make_report(), "plots": []}  # reports without the section (fp32 runs, older reports) render as before
    assert "noise floor" not in render_markdown(without) + render_html(without)


def test_default_optimizer_by_model_size():
    lrs = {name: default_optimizer(config.hidden_size, 50).lr for name, config in PRESETS.items()}
    assert lrs == {"tiny": 3e-3, "llama2-7b": 3e-4, "llama3.2-1b": 2e-4, "llama3.2-3b": 2e-4, "llama3.1-8b": 3e-4}
    assert default_optimizer(8192, 50).lr == 1.5e-4  # Llama 3 70B
    assert [default_warmup_steps(s) for s in (3, 50, 1000, 100_000)] == [3, 10, 20, 2000]
    assert default_optimizer(2048, 50, lr=1e-3, warmup_steps=0) == OptimizerConfig(lr=1e-3, warmup_steps=0,
                                                                                     total_steps=50)


PERTURBED = "norm.weight"  # the final norm: every logit scales by 1 %, so the loss moves at every step


def _train_losses(backend: str, steps: int, seq_len: int, out) -> list[float]:
    """The per-step losses of the `twinflash train` command a curve job stands for (ours, on 2 devices)."""
    assert cli_main(["train", "--backend", backend, "--model", "tiny", "--seq-len", str(seq_len), "--steps",
                     str(steps), "--mesh", "fsdp=1,sp=2", "--dtype", "bf16", "--data", "text", "--seed", "0",
                     "--out", str(out)]) == 0
    return [json.loads(line)["loss"] for line in (out / "train.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_curve_jobs_train_as_twinflash_train_and_a_perturbed_run_is_named(tmp_path, monkeypatch):
    """Real tiny bf16 trainings on 2 emulated CPU devices, run as curve jobs by the compare workers (one torchrun
    launch, one JAX process): each backend with ours and with the reference (the floors, as in a compare run), and
    JAX with ours twice more: with the final norm scaled by 1 % (`--perturb jax:norm.weight`) and with our
    attention's output scaled by 10 % in every layer (`--perturb jax:attention-out=1.1`). The verdict must name the
    run with the broken attention (measured 10x the floor from each of the other three runs). Smaller attention
    errors are the fast path's to catch, not the floor's: over these 10 steps out x 1.05 stood 4.6x the floor off,
    out x 1.01 1.2x, and dq scaled by 1.01, 1.1, 2 or 0.1 at most 1.3x (AdamW divides each gradient by its own
    scale, so a scaled dq moves the training through the other layers' gradients alone).
    The clean runs with our kernels must reproduce `twinflash train`'s losses. 10 steps, the CPU default: over 6
    steps with the torch floor alone, the mean of that few chaotic steps put the honest ratio at 1.06 on one CPU and
    at 3.13 on another (an AVX2-only AMD EPYC); with both floors over 10 steps it reads 0.60 there."""
    steps, seq_len = 10, 64
    args = argparse.Namespace(noise_floor_steps=steps, noise_floor_seq_len=seq_len)
    settings = _settings(platform="cpu", mode="train", dtype="bf16", devices=2, backends=("torch", "jax"))
    floor = N.plan(args, settings)
    clean = N.plan_jobs(floor, settings, "tiny")
    (perturbed,) = N.plan_jobs({**floor, "runs": [floor["runs"][2]]},
                               dataclasses.replace(settings, perturb=Perturbation("jax", PERTURBED)), "tiny")
    perturbed = dataclasses.replace(perturbed, id=f"{perturbed.id}-perturbed")
    (attention,) = N.plan_jobs({**floor, "runs": [floor["runs"][2]]}, dataclasses.replace(
        settings, perturb=Perturbation("jax", "attention-out", 1.1)), "tiny")
    attention = dataclasses.replace(attention, id=f"{attention.id}-attention-out")
    assert attention.perturb == "attention-out=1.1"
    work = tmp_path / "work"
    work.mkdir()
    run_jobs(clean + [perturbed, attention], settings, work, timeout_s=900, on_done=lambda job: None)
    records = {job.id: N.run_record(job, J.read_result(work, job.id)) for job in clean + [perturbed, attention]}
    assert all(r["status"] == "ok" and len(r["losses"]) == steps for r in records.values()), records
    # the same settings, batches, weights and step function in another process: the same floats. The compare's JAX
    # process on CPU compiles at XLA's backend optimisation level 0 (launches.CPU_XLA_FLAGS), which rounds
    # differently from the default level (measured: equal first loss, later ones up to 4e-5 relative apart), so the
    # command's JAX child gets that level too (it inherits XLA_FLAGS)
    monkeypatch.setenv("XLA_FLAGS", f"{os.environ.get('XLA_FLAGS', '')} {CPU_XLA_FLAGS}".strip())
    for backend in ("torch", "jax"):
        expected = _train_losses(backend, steps, seq_len, tmp_path / f"train-{backend}")
        assert records[f"noise-floor-{backend}-ours"]["losses"] == expected, backend
    config = PRESETS["tiny"]
    honest = N.noise_floor_section(floor, [records[j.id] for j in clean], config)
    broken = N.noise_floor_section(floor, [records[j.id] for j in clean[:2]] + [
        {**records[perturbed.id], "name": "jax-ours"}], config)
    assert honest["floor"] > 0  # the two kernels differ in bf16: a floor was measured, not FLOOR_MIN
    assert honest["consistent"] and not honest["outliers"], honest["verdict"]  # measured ratio 0.60 (docstring)
    assert broken["ratio"] > 10 and not broken["consistent"], broken["verdict"]  # measured ~18 over 6 steps
    wrong = N.noise_floor_section(floor, [records[j.id] for j in clean if j.id != "noise-floor-jax-ours"] + [
        {**records[attention.id], "name": "jax-ours"}], config)
    assert wrong["outliers"] == ["jax-ours"] and not wrong["consistent"], wrong["verdict"]
    assert wrong["verdict"].startswith("jax-ours differs from the other three runs")
