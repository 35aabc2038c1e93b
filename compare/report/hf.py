"""The Hugging Face section of `twinflash compare --model HF_DIR` (report.json's "hf", null for a preset or a
converted directory): per context length, transformers' LlamaForCausalLM with our ring ("twin_ring") and our own
torch model in the same eager step (the method of compare/harness/hf_rows.py, `twinflash bench hf`'s too), whether
HF's model agrees with ours (the first step's full-sequence loss and gradient norm within `hf_rows.AGREEMENT_TOLERANCE`
of the dtype), and on GPUs HF's tokens/s against ours in that step and against the compare's own torch point of the same
length and devices (`twinflash train`'s compiled step, FSDP2, fused AdamW). Owns the section's dict (`hf_section`)
and its blocks of the report's document model (`blocks`, rendered by compare/report/render.py). A disagreement
fails the report; a measurement that did not run (out of memory, a time limit) is shown, as a benchmark point's
failure is, and fails nothing.
"""

from __future__ import annotations

from compare.harness.hf_rows import AGREEMENT_TOLERANCE, METHOD
from compare.report.fields import DASH, finite, fmt, fmt_seq, on_cpu


def hf_section(records: list[dict], points: list[dict], note: str | None, platform: str) -> dict | None:
    """report.json's "hf" from `compare.harness.hf_rows.run_hf_rows`' records, the report's benchmark points and
    the note saying why no row was measured; None when the run's model is no HF checkpoint (no records, no note)."""
    if not records and note is None:
        return None
    torch_points = {(p["seq_len"], p["devices"]): p for p in points
                    if p["backend"] == "torch" and p["attention"] == "ours" and p.get("precision") != "fp8"}
    measurements = []
    for record in records:
        point = torch_points.get((record["seq_len"], record["devices"]))
        rows = []
        for row in record["rows"]:
            ratio = None
            if platform == "gpu" and point and point["status"] == "ok" and finite(point["tokens_per_s"]):
                ratio = row["tokens_per_s"] / point["tokens_per_s"]
            rows.append(dict(row, speed_vs_compare_point=ratio))
        measurements.append(dict(record, rows=rows))
    disagreeing = [f"S={fmt_seq(m['seq_len'])}: {row['model']}" for m in measurements for row in m["rows"]
                   if row.get("agrees") is False]
    return {"method": METHOD, "tolerance": AGREEMENT_TOLERANCE, "note": note, "measurements": measurements,
            "passed": not disagreeing, "failures": [f"{d} disagrees with ours beyond its tolerance"
                                                    for d in disagreeing]}


def blocks(report: dict) -> list[tuple]:
    """The section's heading, method, table and notes; [] without an HF section."""
    section = report.get("hf")
    if not section:
        return []
    doc = [("h", 2, "Hugging Face transformers with our ring"), ("p", [section["method"]])]
    if section["note"]:
        return doc + [("p", [section["note"]])]
    gpu = not on_cpu(report)
    headers = ["S", "devices", "model", "step", "tokens/s", "peak memory per device", "loss", "loss rel. diff",
               "grad norm rel. diff", "agrees"]
    headers += ["speed vs ours (same step)", "speed vs compare's torch point"] if gpu else []
    rows, notes = [], []
    for m in section["measurements"]:
        if m["status"] != "ok" or not m["rows"]:
            span = len(headers) - 2
            rows.append([fmt_seq(m["seq_len"]), str(m["devices"]), ("span", span, m["status"].upper())])
        for r in m["rows"]:
            row = [fmt_seq(m["seq_len"]), str(m["devices"]), r["model"], fmt(r["step_s"], "seconds"),
                   fmt(r["tokens_per_s"], "count"), fmt(r["peak_memory_bytes"], "bytes"), f"{r['loss']:.6g}",
                   fmt(r["loss_rel_diff_vs_ours"], "sig"), fmt(r["grad_norm_rel_diff_vs_ours"], "sig"),
                   ("b", {True: "yes", False: "NO", None: DASH}[r["agrees"]])]
            if gpu:
                row += [f"{r['speed_vs_ours']:.3g}×" if finite(r["speed_vs_ours"]) else DASH,
                        f"{r['speed_vs_compare_point']:.3g}×" if finite(r["speed_vs_compare_point"]) else DASH]
            rows.append(row)
        if m["message"]:
            notes.append([f"S={fmt_seq(m['seq_len'])} on {m['devices']} device(s): {m['message']}"])
    tolerance = ", ".join(f"{dtype} {value:.0e}" for dtype, value in section["tolerance"].items())
    doc += [("p", [f"Agreement: the first step's full-sequence loss and gradient norm of each row within a relative "
                   f"{tolerance} of ours (compare/harness/hf_rows.py says why)."
                   + ("" if gpu else " CPU run: no speed ratio (the timings rank nothing).")]),
            ("table", headers, rows)]
    return doc + ([("p", ["Notes:"]), ("list", notes)] if notes else [])
