"""`twinflash compare --schemes ring,ulysses,hybrid` (issue 37's scheme axis): each scheme besides the ring gets the
float32 check against the reference on all devices and a benchmark point of our kernels at the most devices per
length, trained as `twinflash train --sp-scheme` does; the report's scheme section shows them beside the ring's
point, and every other section keeps the ring alone. The plan, its bad input, the section, and one run on CPU."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from compare.cli import build_parser
from compare.harness import plan as P
from compare.report.fields import sorted_points
from compare.report.render import render_markdown
from compare.report.write import validate_report
from test_compare_report import make_report
from weights import BadInputError

ROOT = Path(__file__).resolve().parents[1]


def _settings(argv: list[str]) -> P.CompareSettings:
    """The settings of a CPU run with these arguments, its weights the tiny preset's (as `prepare_weights` sets)."""
    return dataclasses.replace(P.plan_settings(build_parser().parse_args(["compare", *argv]), 0), weights="tiny")


def test_each_scheme_gets_a_check_and_a_point_at_the_most_devices():
    settings = _settings(["--schemes", "hybrid,ulysses", "--backends", "torch", "--seq-lens", "64,128"])
    assert settings.schemes == ("ring", "hybrid", "ulysses") and settings.ulysses_degree == 2  # devices / 2
    jobs = {job.id: job for job in P.plan_jobs(settings, "tiny", Path("traces"))}
    for scheme, degree in (("ulysses", None), ("hybrid", 2)):
        check = jobs[f"torch-{scheme}-equivalence"]
        assert (check.kind, check.devices, check.dtype, check.scheme, check.ulysses_degree) == (
            "equivalence", 4, "fp32", scheme, degree)
        train = check.settings()
        assert (train.sp_scheme, train.ulysses_degree, train.mesh.sp) == (scheme, degree, 4)
        for seq_len in (64, 128):
            point = jobs[f"torch-s{seq_len}-d4-ours-{scheme}"]
            assert (point.kind, point.attention, point.fp8) == ("bench", "ours", False)
            assert point.settings().sp_scheme == scheme
    assert not any(job.scheme != "ring" for job in jobs.values() if job.devices != 4)
    assert jobs["torch-s64-d4-ours"].scheme == "ring"


@pytest.mark.parametrize("argv, line", [
    (["--schemes", "ulysses", "--devices", "8"], "Ulysses degree 8 must divide the 4 query heads; degrees that work "
                                                 "for 4 query and 2 KV heads: 1, 2, 4"),
    (["--schemes", "hybrid", "--devices", "2"], "hybrid Ulysses degree 1 over sp=2 must divide sp and lie strictly "
                                                "between 1 and sp (sp=2 has none: take the ring or the ulysses "
                                                "scheme)"),
    (["--ulysses-degree", "2"], "--ulysses-degree is the hybrid scheme's: add hybrid to --schemes"),
    (["--schemes", "hybrid", "--ulysses-degree", "4"], "hybrid Ulysses degree 4 over sp=4 must divide sp and lie "
                                                       "strictly between 1 and sp (one of 2)"),
])
def test_schemes_the_devices_or_heads_cannot_take_are_refused_in_one_line(argv, line):
    with pytest.raises(BadInputError) as raised:
        _settings(argv)
    assert str(raised.value) == line


def _scheme_point(point: dict, scheme: str, tokens_per_s: float) -> dict:
    return dict(point, scheme=scheme, ulysses_degree=2 if scheme == "hybrid" else None, tokens_per_s=tokens_per_s)


def test_the_scheme_section_beside_the_ring_and_the_other_sections_without_it():
    report = make_report() | {"plots": []}
    ring = next(p for p in report["benchmark"]["points"]
                if (p["backend"], p["attention"], p["seq_len"], p["devices"]) == ("torch", "ours", 256, 4))
    report["settings"] = dict(report["settings"], schemes=["ring", "ulysses", "hybrid"], ulysses_degree=2)
    report["benchmark"]["points"] += [_scheme_point(ring, "ulysses", 2 * ring["tokens_per_s"]),
                                      _scheme_point(ring, "hybrid", ring["tokens_per_s"] / 2)]
    validate_report(report)
    assert all(p.get("scheme", "ring") == "ring" for p in sorted_points(report))
    assert len(sorted_points(report, schemes=True)) == len(report["benchmark"]["points"])
    text = render_markdown(report)
    section = text.split("## Sequence-parallel schemes", 1)[1].split("\n## ", 1)[0]
    assert "| torch | 256 | ulysses |" in section and "| 2×" in section and "| 0.5×" in section
    assert "hybrid U=2" in section and "sequence-parallel schemes | ring, ulysses, hybrid (hybrid U=2)" in text
    summary = text.split("## Sequence-parallel schemes", 1)[0]
    assert "ulysses" not in summary.split("## Setup", 1)[0]  # the summary: the ring alone


def test_a_run_of_the_ring_alone_has_no_scheme_section():
    report = make_report() | {"plots": []}
    assert "Sequence-parallel schemes" not in render_markdown(report)


@pytest.mark.slow
def test_compare_checks_and_benchmarks_ulysses_beside_the_ring(tmp_path):
    """Torch on 2 gloo ranks: Ulysses' float32 check passes against the reference, its point runs beside the ring's."""
    out = tmp_path / "report"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, "-m", "compare.cli", "compare", "--backends", "torch", "--schemes",
                           "ring,ulysses", "--seq-lens", "64", "--devices", "2", "--device-counts", "2", "--ablation",
                           "ours", "--noise-floor-steps", "0", "--out", str(out)],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    checks = {c["name"]: c["passed"] for c in report["equivalence"]["comparisons"]}
    assert checks == {"torch vs reference": True, "torch ulysses vs reference": True}
    points = {(p["scheme"], p["devices"]): p for p in report["benchmark"]["points"]}
    assert points[("ulysses", 2)]["status"] == points[("ring", 2)]["status"] == "ok"
    assert points[("ulysses", 2)]["comm_bytes"] != points[("ring", 2)]["comm_bytes"]  # all-to-alls, not the ring's
    assert "## Sequence-parallel schemes" in (out / "report.md").read_text()
