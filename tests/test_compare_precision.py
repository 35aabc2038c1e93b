"""The precision axis of `twinflash compare --mode train --precisions bf16,fp8`: the plan (every benchmark point
once per precision, the FP8 jobs training as `twinflash train --fp8`, the bf16 ids unchanged, torch's FP8 jobs
skipped with the install line without torchao, the noise floor's runs of our kernels also in FP8), bad input (fp8
without a bf16 --dtype or train mode, tokens per device FP8 GEMMs cannot take: one line, exit 2), the report's
precision section and plots (MFU against both peaks, the fp8 / bf16 speed on GPUs, nothing ranked on CPU; a
bf16-only run has none of it: the negative control), the loss curves measured against the bf16 noise floor
(FP8 within it and beyond it, torch's FP8 run against JAX's), and end to end on CPU (slow): both backends' FP8
jobs really ran FP8 (their losses differ from bf16's) and the report carries both precisions."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from compare.cli import build_parser
from compare.cli import main as cli_main
from compare.harness import noise_floor as N
from compare.harness import plan as P
from compare.report.precision import precision_section
from compare.report.render import render_markdown
from compare.report.write import validate_report, write_report
from weights import PRESETS
from weights.flops import PEAK_FLOPS_PER_DEVICE, PEAK_FP8_FLOPS_PER_DEVICE

ROOT = Path(__file__).resolve().parent.parent
FP8_PLOTS = {"plots/precision.png", "plots/precision_curves.png"}


def _planned(tmp_path, argv: list[str], gpus: int = 0):
    args = build_parser().parse_args(["compare", *argv])
    settings = dataclasses.replace(P.plan_settings(args, gpus, 150e9 if gpus else None), weights="tiny")
    floor = N.plan(args, settings)
    return settings, P.plan_jobs(settings, "tiny", tmp_path) + N.plan_jobs(floor, settings, "tiny")


def test_precision_is_an_axis_of_the_benchmark_points(tmp_path):
    argv = ["--dtype", "bf16", "--seq-lens", "64,128", "--devices", "2", "--ablation", "ours,reference"]
    plain, plain_jobs = _planned(tmp_path, argv)
    settings, jobs = _planned(tmp_path, [*argv, "--precisions", "bf16,fp8"])
    assert plain.precisions == ("bf16",) and settings.precisions == ("bf16", "fp8")
    bench = {j.id: j for j in jobs if j.kind == "bench"}
    bf16 = {j.id for j in plain_jobs if j.kind == "bench"}
    assert bf16 == {i for i in bench if not i.endswith("-fp8")}  # the bf16 ids as without the axis
    assert {i for i in bench if i.endswith("-fp8")} == {f"{i}-fp8" for i in bf16}
    assert "torch-s64-d2-ours-fp8" in bench and "jax-s128-d1-ours-fp8" in bench
    for job_id, job in bench.items():
        assert job.fp8 == job_id.endswith("-fp8") == job.settings().fp8  # trains as `twinflash train --fp8`
        assert job.settings().dtype == "bf16"
    assert not any(j.settings().fp8 for j in jobs if j.kind == "equivalence")  # the fp32 check stays as it is
    curves = {j.id: j for j in jobs if j.kind == "curve"}
    plain_curves = {j.id for j in plain_jobs if j.kind == "curve"}
    assert set(curves) == plain_curves | {"noise-floor-torch-ours-fp8", "noise-floor-jax-ours-fp8"}
    for backend in ("torch", "jax"):
        ours, fp8 = curves[f"noise-floor-{backend}-ours"], curves[f"noise-floor-{backend}-ours-fp8"]
        assert dataclasses.replace(ours, id=fp8.id, fp8=True) == fp8  # the same training but its linears
        assert fp8.settings().fp8 and not ours.settings().fp8


def test_torch_fp8_without_torchao_is_skipped_with_the_install_line(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    _, jobs = _planned(tmp_path, ["--dtype", "bf16", "--seq-lens", "64", "--precisions", "bf16,fp8"])
    skipped = {j.id: j.skip for j in jobs if j.skip}
    fp8_torch = {j.id for j in jobs if j.fp8 and j.backend == "torch"}
    assert fp8_torch and set(skipped) == fp8_torch | {j.id for j in jobs if j.attention == "vendor"}
    assert all('pip install -e ".[fp8]"' in skipped[i] for i in fp8_torch if "vendor" not in i)  # vendor: no GPU
    assert all(j.skip is None for j in jobs if j.fp8 and j.backend == "jax" and j.attention != "vendor")


@pytest.mark.parametrize("args, message", [
    (["--precisions", "bf16,fp8"], "--dtype bf16"),  # the CPU default dtype is fp32
    (["--precisions", "fp8", "--dtype", "bf16", "--mode", "forward"], "--mode train"),
    (["--precisions", "bf16,fp8", "--dtype", "bf16", "--seq-lens", "40", "--device-counts", "1"], "multiple of 16"),
    (["--precisions", "bf16,fp9"], "--precisions"),
])
def test_bad_precisions_are_one_line_and_exit_2(tmp_path, capsys, args, message):
    out = tmp_path / "report"
    assert cli_main(["compare", *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("twinflash: error:") and "\n" not in err and message in err
    assert not out.exists()


def _point(backend, precision, step_s, platform="gpu", status="ok"):
    tokens = 8192 / step_s
    tflops = tokens * 6e9 / 1e12
    return {"backend": backend, "seq_len": 8192, "devices": 1, "attention": "ours",
            "kernel": {"torch": "triton", "jax": "pallas"}[backend], "precision": precision, "status": status,
            "message": None if status == "ok" else "needs torchao", "trace": None, "step_s": step_s,
            "forward_s": step_s / 3, "backward_s": step_s * 2 / 3, "comm_s": None, "comm_exposed_s": None,
            "comm_bytes": None, "comm_bandwidth_gbps": None, "tokens_per_s": tokens, "tflops_per_device": tflops,
            "mfu": tflops * 1e12 / PEAK_FLOPS_PER_DEVICE if platform == "gpu" else None,
            "peak_memory_bytes": (30 if precision == "bf16" else 28) * 2**30, "scaling_efficiency": None,
            "time_to_tokens_s": 1e9 / tokens, **({} if status == "ok" else dict.fromkeys(
                ("step_s", "forward_s", "backward_s", "tokens_per_s", "tflops_per_device", "mfu",
                 "peak_memory_bytes", "time_to_tokens_s")))}


def _report(precisions: list[str], platform: str = "gpu") -> dict:
    points = [_point(b, "bf16", 1.0, platform) for b in ("torch", "jax")]
    if "fp8" in precisions:
        points += [_point("torch", "fp8", 0.8, platform), _point("jax", "fp8", 0.9, platform, "skipped")]
    report = {
        "format": "twinflash-compare/1", "command": "twinflash compare --precisions bf16,fp8",
        "created": "2026-11-23T08:00:00+00:00", "passed": True,
        "settings": {"model": "llama3.2-1b", "mode": "train", "seq_lens": [8192], "device_counts": [1],
                     "devices": 1, "steps": 3, "dtype": "bf16", "backends": ["torch", "jax"],
                     "attention_ablation": ["ours"], "time_to_tokens": 1e9, "precisions": precisions},
        "environment": {"platform": platform, "devices": ["NVIDIA H200"], "driver": None, "python": "3.12",
                        "libraries": dict.fromkeys(("torch", "triton", "jax", "jaxlib", "flax", "numpy")),
                        "git_commit": None, "hostname": "ci", "cpu_count": 16},
        "model": {"name": "llama3.2-1b", "num_params": 1_235_814_400, "layers": 16, "hidden": 2048, "heads": 32,
                  "kv_heads": 8, "head_dim": 64, "vocab": 128256},
        "flops": {"formula": "6 N", "peak_flops_per_device": PEAK_FLOPS_PER_DEVICE if platform == "gpu" else None},
        "equivalence": {"seq_len": 2048, "devices": 1, "layers": 2, "dtype": "fp32", "reference": "plain math",
                        "passed": True, "comparisons": [], "loss_curves": {}},
        "benchmark": {"points": points}, "peers": [], "jobs": []}
    floor = {"seq_len": 8192, "devices": 1, "steps": 4}
    curves = [{"name": f"{b}-ours{'-fp8' if p == 'fp8' else ''}", "backend": b, "attention": "ours",
               "kernel": "triton" if b == "torch" else "pallas", "status": "ok", "message": None,
               "losses": [5.5, 5.0, 4.6, 4.3] if p == "bf16" else [5.5, 5.02, 4.61, 4.33], "seconds": 12.0,
               "precision": p} for b in ("torch", "jax") for p in precisions]
    report["precision"] = precision_section(report, floor, curves)
    return report


def test_the_precision_section_compares_bf16_and_fp8_per_point(tmp_path):
    report = _report(["bf16", "fp8"])
    section = report["precision"]
    rows = {(r["backend"], r["precision"]): r for r in section["rows"]}
    assert set(rows) == {(b, p) for b in ("torch", "jax") for p in ("bf16", "fp8")}
    fp8 = rows["torch", "fp8"]
    assert fp8["speed_vs_bf16"] == pytest.approx(1.0 / 0.8)  # step 1.0 s -> 0.8 s
    assert fp8["mfu"] == pytest.approx(fp8["mfu_fp8_peak"] * PEAK_FP8_FLOPS_PER_DEVICE / PEAK_FLOPS_PER_DEVICE)
    assert rows["torch", "bf16"]["speed_vs_bf16"] is None and rows["jax", "fp8"]["status"] == "skipped"
    assert {p["name"] for p in section["curves"]["pairs"]} == {"torch: fp8 vs bf16", "jax: fp8 vs bf16",
                                                               "torch vs jax, fp8"}
    assert section["curves"]["floor"] is None  # no bf16 floor in this report: no ratios, no verdict
    assert all(p["ratio"] is None and p["within_floor"] is None for p in section["curves"]["pairs"])
    write_report(report, tmp_path)
    data = json.loads((tmp_path / "report.json").read_text())
    validate_report(data)
    assert FP8_PLOTS <= set(data["plots"])
    md = (tmp_path / "report.md").read_text()
    precision = md.split("## Precision: bf16 vs FP8")[1].split("## ")[0]
    assert "MFU (FP8 peak)" in precision and "1.25×" in precision and "needs torchao" in precision
    assert "plots/precision.png" in precision and "plots/precision_curves.png" in md
    curves_md = md.split("### Loss curves, bf16 vs FP8")[1].split("\n## ")[0]
    assert "the pairs are shown without a verdict" in curves_md and "within the bf16 noise floor" not in curves_md
    assert "fp8" not in md.split("## Benchmark")[1].split("## Precision")[0]  # the benchmark table shows bf16 alone


def test_a_cpu_run_ranks_no_precision_and_a_bf16_run_has_no_precision_section(tmp_path):
    cpu = _report(["bf16", "fp8"], platform="cpu")
    assert all(r["mfu"] is None and r["mfu_fp8_peak"] is None and r["speed_vs_bf16"] is None
               for r in cpu["precision"]["rows"])
    md = render_markdown({**cpu, "plots": []})
    assert "## Precision" in md and "MFU (FP8 peak)" not in md and "fp8 / bf16 speed" not in md
    bf16 = _report(["bf16"])  # the negative control: no fp8 asked for, no fp8 rows or plots
    assert bf16["precision"] is None
    write_report(copy.deepcopy(bf16), tmp_path)
    data = json.loads((tmp_path / "report.json").read_text())
    assert not FP8_PLOTS & set(data["plots"]) and "Precision" not in (tmp_path / "report.md").read_text()


def _curve_record(name: str, losses: list[float], precision: str = "bf16") -> dict:
    backend, attention = name.split("-")[:2]
    return {"name": name, "backend": backend, "attention": attention, "kernel": attention, "status": "ok",
            "message": None, "losses": losses, "seconds": 1.0, "precision": precision}


@pytest.mark.parametrize("fp8_offset, within", [(0.001, True), (0.01, False)])
def test_the_fp8_curves_are_measured_against_the_bf16_noise_floor(fp8_offset, within, tmp_path):
    """The bf16 floor here is 0.1 % (every bf16 run 0.1 % from two others): FP8 runs 0.1 % from bf16 are within it
    (ratio 1), 1 % beyond it (ratio 10, the negative control); torch's FP8 run against JAX's, 0.1 % apart as their
    bf16 runs are, is within it either way (ratio 1)."""
    steps = 20
    curve = [10.0 - 0.3 * i for i in range(steps)]

    def off(relative: float, losses: list[float] = curve) -> list[float]:
        return [x * (1 + relative) for x in losses]

    bf16 = {"torch-ours": curve, "torch-vendor": off(0.001), "jax-ours": off(0.001), "jax-vendor": curve}
    floor = {"seq_len": 8192, "devices": 2, "steps": steps}
    report = _report(["bf16", "fp8"])
    report["equivalence"]["bf16"] = N.noise_floor_section(
        floor, [{k: v for k, v in _curve_record(n, c).items() if k != "precision"} for n, c in bf16.items()],
        PRESETS["llama3.2-1b"])
    assert report["equivalence"]["bf16"]["floor"] == pytest.approx(0.001, rel=1e-3)
    curves = [_curve_record(n, bf16[n]) for n in ("torch-ours", "jax-ours")]
    curves += [_curve_record("torch-ours-fp8", off(fp8_offset), "fp8"),
               _curve_record("jax-ours-fp8", off(fp8_offset, bf16["jax-ours"]), "fp8")]
    section = precision_section(report, floor, curves)["curves"]
    pairs = {p["name"]: p for p in section["pairs"]}
    assert set(pairs) == {"torch: fp8 vs bf16", "jax: fp8 vs bf16", "torch vs jax, fp8"}
    assert section["ratio_limit"] == N.RATIO_LIMIT[0]
    assert pairs["torch: fp8 vs bf16"]["ratio"] == pytest.approx(fp8_offset / 0.001, rel=0.01)
    assert [pairs[f"{b}: fp8 vs bf16"]["within_floor"] for b in ("torch", "jax")] == [within, within]
    cross = pairs["torch vs jax, fp8"]
    assert cross["ratio"] == pytest.approx(1.0, rel=0.01) and cross["within_floor"] is True
    report["precision"] = {**report["precision"], "curves": section}
    write_report(report, tmp_path)
    validate_report(json.loads((tmp_path / "report.json").read_text()))
    md = (tmp_path / "report.md").read_text().split("### Loss curves, bf16 vs FP8")[1]
    assert "Against the bf16 noise floor (0.1 %" in md
    summary = (tmp_path / "report.md").read_text().split("## Summary")[1].split("\n## ")[0]
    assert f"| FP8 loss curve, torch: fp8 vs bf16 | {'PASS' if within else 'FAIL'} |" in summary
    assert "| FP8 loss curve, torch vs jax, fp8 | PASS |" in summary
    verdict = "within the bf16 noise floor (at most 1.5)" if within else "beyond the bf16 noise floor (above 1.5)"
    assert md.count(verdict) == (3 if within else 2) and "| torch vs jax, fp8 |" in md


@pytest.mark.slow
def test_both_backends_train_fp8_points_and_curves_end_to_end(tmp_path):
    out = tmp_path / "report"
    run = subprocess.run([sys.executable, "-m", "compare.cli", "compare", "--dtype", "bf16", "--precisions",
                          "bf16,fp8", "--seq-lens", "32", "--devices", "1", "--ablation", "ours", "--steps", "1",
                          "--noise-floor-steps", "2", "--noise-floor-seq-len", "32", "--check-layers", "1", "--out",
                          str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    validate_report(report)
    rows = report["precision"]["rows"]
    assert {(r["backend"], r["precision"], r["status"]) for r in rows} == {
        (b, p, "ok") for b in ("torch", "jax") for p in ("bf16", "fp8")}
    assert all(r["tokens_per_s"] > 0 and r["peak_memory_bytes"] > 0 and r["speed_vs_bf16"] is None for r in rows)
    assert FP8_PLOTS <= set(report["plots"])
    runs = {r["name"]: r["losses"] for r in report["precision"]["curves"]["runs"]}
    assert set(runs) == {"torch-ours", "torch-ours-fp8", "jax-ours", "jax-ours-fp8"}
    for backend in ("torch", "jax"):
        bf16, fp8 = runs[f"{backend}-ours"], runs[f"{backend}-ours-fp8"]
        assert len(bf16) == len(fp8) == 2
        assert bf16 != fp8  # the FP8 job really quantised (the negative control of the flag reaching the worker)
        # FP8's rounding (3 mantissa bits, per-tensor scales) moves 2 steps of the tiny model's loss by ~0.1 %;
        # 2 % (issue 17's bound for 50 steps) leaves room while a wrong scale moves the loss by far more
        assert all(abs(a - b) / a < 0.02 for a, b in zip(bf16, fp8))
    assert {r["name"] for r in report["equivalence"]["bf16"]["runs"]} == {
        "torch-ours", "torch-reference", "jax-ours", "jax-reference"}  # the floor keeps its own runs
