"""`twinflash compare --model HF_DIR`: the HF directory converted for the run, and the report's Hugging Face section
(compare/harness/hf_rows.py, compare/report/hf.py): transformers' Llama with our ring beside our torch model, on the
same weights, whose disagreement fails the report. The run on CPU (2 gloo ranks, the torch backend) and the section's
verdict, with a negative control that a disagreement beyond the tolerance fails it."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hf_fixtures import make_ring_hf_checkpoint
from test_compare_report import make_report

from compare.harness.hf_rows import AGREEMENT_TOLERANCE, compare_rows, plan_hf_rows
from compare.harness.plan import CompareSettings
from compare.report.hf import hf_section
from compare.report.render import render_markdown
from compare.report.write import validate_report
from weights import is_hf_checkpoint

ROOT = Path(__file__).resolve().parents[1]
SEQ = 64


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf-llama")
    make_ring_hf_checkpoint(directory, vocab_size=256)  # byte-token text: the checks train on it
    return directory


def _row(kind: str, loss: float, grad_norm: float, tokens_per_s: float, dtype: str = "fp32") -> dict:
    return {"kind": kind, "model": kind, "seq_len": SEQ, "batch": 1, "devices": 2, "dtype": dtype, "step_s": 0.5,
            "tokens_per_s": tokens_per_s, "peak_memory_bytes": 2**30, "loss": loss, "grad_norm": grad_norm}


def _report_with(section: dict) -> dict:
    """test_compare_report's GPU report with this HF section (and the plots list write_report fills in)."""
    return make_report() | {"hf": section, "plots": []}


def _record(rows: list[dict], status: str = "ok", message: str | None = None) -> dict:
    return {"seq_len": SEQ, "devices": 2, "dtype": "fp32", "status": status, "message": message, "versions": {},
            "rows": compare_rows(rows)}


# ---------------------------------------------------------------------------------------------------------------
# The run: 2 gloo ranks, torch only, one length; the float32 checks, the benchmark point and the HF rows
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_compare_takes_an_hf_directory_and_reports_hf_beside_ours(hf_dir, tmp_path):
    out = tmp_path / "report"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, "-m", "compare.cli", "compare", "--model", str(hf_dir), "--backends",
                           "torch", "--seq-lens", str(SEQ), "--devices", "2", "--device-counts", "2", "--ablation",
                           "ours", "--noise-floor-steps", "0", "--out", str(out)],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    section = report["hf"]
    assert section["passed"] and section["note"] is None
    [measurement] = section["measurements"]
    assert (measurement["status"], measurement["seq_len"], measurement["devices"]) == ("ok", SEQ, 2)
    rows = {row["kind"]: row for row in measurement["rows"]}
    assert set(rows) == {"hf", "ours"} and rows["hf"]["agrees"] and rows["hf"]["tokens_per_s"] > 0
    assert rows["hf"]["loss_rel_diff_vs_ours"] <= AGREEMENT_TOLERANCE["fp32"]
    assert 1 < rows["ours"]["loss"] < 20  # random weights over 256 tokens, ln(256) ~ 5.5: not zeros or NaN
    assert rows["hf"]["speed_vs_compare_point"] is None  # CPU: no speed ratio
    assert "Hugging Face transformers with our ring" in (out / "report.md").read_text()
    assert "HF transformers with our ring: S=64: agrees" in done.stderr
    # converted once for the run (every job read the conversion; the "ours" row, which read it, agrees with HF's
    # model, which read the HF directory)
    made = json.loads((out / "work" / "weights.json").read_text())
    assert made["model"] == str(hf_dir) and made["converted_s"] > 0


# ---------------------------------------------------------------------------------------------------------------
# The section's verdict and rendering
# ---------------------------------------------------------------------------------------------------------------

def test_agreement_within_tolerance_passes_and_beyond_fails():
    """The negative control: a loss 10x the float32 tolerance away from ours fails the section and the report."""
    close = hf_section([_record([_row("hf", 5.0 * (1 + 1e-7), 2.0, 40.0), _row("ours", 5.0, 2.0, 80.0)])], [],
                       None, "cpu")
    assert close["passed"] and not close["failures"]
    far = hf_section([_record([_row("hf", 5.0 * (1 + 10 * AGREEMENT_TOLERANCE["fp32"]), 2.0, 40.0),
                               _row("ours", 5.0, 2.0, 80.0)])], [], None, "cpu")
    assert not far["passed"] and far["failures"] == ["S=64: hf disagrees with ours beyond its tolerance"]
    report = _report_with(far)
    validate_report(report)
    assert "NO" in render_markdown(report) and "hf disagrees with ours" in render_markdown(report)


def test_gradient_norm_disagreement_fails_too():
    far = hf_section([_record([_row("hf", 5.0, 2.0 * 1.01, 40.0, "bf16"), _row("ours", 5.0, 2.0, 80.0, "bf16")])],
                     [], None, "gpu")
    assert not far["passed"] and AGREEMENT_TOLERANCE["bf16"] < 1e-2


def test_speed_against_the_compare_point_on_gpus_only():
    report = _report_with(None)
    point = next(p for p in report["benchmark"]["points"]
                 if (p["backend"], p["attention"], p["seq_len"], p["devices"]) == ("torch", "ours", 256, 4))
    record = _record([_row("hf", 5.0, 2.0, 0.5 * point["tokens_per_s"]), _row("ours", 5.0, 2.0, point["tokens_per_s"])])
    record.update(seq_len=256, devices=4)
    for platform, expected in (("gpu", 0.5), ("cpu", None)):
        section = hf_section([copy.deepcopy(record)], report["benchmark"]["points"], None, platform)
        assert section["measurements"][0]["rows"][0]["speed_vs_compare_point"] == expected
    report["hf"] = hf_section([record], report["benchmark"]["points"], None, "gpu")
    validate_report(report)
    assert "0.5×" in render_markdown(report)


def test_a_measurement_that_did_not_run_is_shown_and_fails_nothing():
    section = hf_section([_record([], "failed", "the workers exited with 1: CUDA out of memory")], [], None, "gpu")
    assert section["passed"]
    report = _report_with(section)
    validate_report(report)
    text = render_markdown(report)
    assert "FAILED" in text and "CUDA out of memory" in text


def test_an_hf_row_without_ours_has_no_verdict_and_fails_nothing():
    """Ours ran after HF's row in the same launch; when it did not finish, HF's row has nothing to agree with."""
    section = hf_section([_record([_row("hf", 5.0, 2.0, 40.0)], "failed", "the workers exited with 1: OOM")], [],
                         None, "gpu")
    [row] = section["measurements"][0]["rows"]
    assert row["agrees"] is None and row["speed_vs_ours"] is None and section["passed"]
    report = _report_with(section)
    validate_report(report)
    assert "the workers exited with 1: OOM" in render_markdown(report)


def test_no_section_without_an_hf_directory_and_a_note_when_rows_cannot_run():
    assert hf_section([], [], None, "gpu") is None
    settings = CompareSettings(model="hf", mode="forward", seq_lens=(64,), device_counts=(2,), devices=2, steps=1,
                               dtype="fp32", backends=("torch",), attention_ablation=("ours",),
                               activation_checkpointing="off", check_seq_len=64, check_layers=2, bench=True,
                               platform="cpu")
    assert plan_hf_rows(settings, None, False, {}) == ([], None)
    assert plan_hf_rows(settings, "hf", False, {}) == ([], "HF rows not measured: they are training steps "
                                                          "(--mode train)")
    train = settings.__class__(**{**settings.__dict__, "mode": "train"})
    measurements, note = plan_hf_rows(train, "hf", False, {64: "estimated peak 90 GiB > 80 GiB"})
    assert note is None and measurements[0].skip == "estimated peak 90 GiB > 80 GiB"
    assert plan_hf_rows(train, "hf", True, {})[1] == "HF rows not measured: a run spanning nodes has no launch of them"
    section = hf_section([], [], "HF rows not measured: the torch backend is not in --backends", "gpu")
    report = _report_with(section)
    validate_report(report)
    assert "the torch backend is not in --backends" in render_markdown(report)


def test_an_hf_directory_is_told_from_a_converted_one(hf_dir, tmp_path):
    assert is_hf_checkpoint(hf_dir) and not is_hf_checkpoint(tmp_path) and not is_hf_checkpoint("tiny")
