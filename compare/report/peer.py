"""The live training peer's section of `twinflash compare` (report.json's "training_peer"; null in reports made before
it): per context length, PyTorch's own context parallelism with cuDNN SDPA as the attention of our torch training step,
beside that step with our ring and our JAX step, measured in the run on its GPUs (the method of
compare/harness/peer_rows.py, `twinflash bench train-peer`'s too); whether each row agrees with our torch row (the
first step's loss and gradient norm within `hf_rows.AGREEMENT_TOLERANCE`), and ours over each row's tokens/s against
issue 40's goal (ours at 1.1x the peer in both backends). Owns the section's dict (`peer_section`) and its blocks of the
report's document model (`blocks`, rendered by compare/report/render.py). A disagreement fails the report; a
measurement that did not run (out of memory, a time limit) is shown and fails nothing; on CPU the section says why
nothing was measured.
"""

from __future__ import annotations

from compare.harness.hf_rows import AGREEMENT_TOLERANCE
from compare.harness.peer_rows import METHOD
from compare.report.fields import DASH, finite, fmt, fmt_seq

GOAL = 1.1  # ours over the peer's tokens/s, both backends (issue 40)


def peer_section(records: list[dict], note: str | None) -> dict:
    """report.json's "training_peer" from `compare.harness.peer_rows.run_peer_rows`' records and the note saying why
    none was measured."""
    disagreeing = [f"S={fmt_seq(m['seq_len'])}: {row['model']}" for m in records for row in m["rows"]
                   if row.get("agrees") is False]
    return {"method": METHOD, "tolerance": AGREEMENT_TOLERANCE["bf16"], "goal": GOAL, "note": note,
            "measurements": records, "passed": not disagreeing,
            "failures": [f"{d} disagrees with our torch row beyond its tolerance" for d in disagreeing]}


def blocks(report: dict) -> list[tuple]:
    """The section's heading, method, table and notes; [] without the section."""
    section = report.get("training_peer")
    if not section:
        return []
    doc = [("h", 2, "The live training peer: PyTorch's context parallelism in our training step"),
           ("p", [section["method"]])]
    if section["note"]:
        return doc + [("p", [section["note"]])]
    headers = ["S", "devices", "row", "step", "tokens/s", "MFU", "peak memory per device", "loss", "agrees",
               "ours (torch) / this"]
    rows, notes = [], []
    for m in section["measurements"]:
        if m["status"] != "ok" or not m["rows"]:
            rows.append([fmt_seq(m["seq_len"]), str(m["devices"]), ("span", len(headers) - 2, m["status"].upper())])
        for r in m["rows"]:
            ratio = 1 / r["speed_vs_ours"] if finite(r.get("speed_vs_ours")) else None
            rows.append([fmt_seq(m["seq_len"]), str(m["devices"]), r["model"], fmt(r["step_s"], "seconds"),
                         fmt(r["tokens_per_s"], "count"), f"{r['mfu']:.1%}", fmt(r["peak_memory_bytes"], "bytes"),
                         f"{r['loss']:.6g}", ("b", {True: "yes", False: "NO", None: DASH}[r["agrees"]]),
                         f"{ratio:.3g}×" if ratio is not None else DASH])
        if m["message"]:
            notes.append([f"S={fmt_seq(m['seq_len'])} on {m['devices']} GPUs: {m['message']}"])
    doc += [("p", [f"Agreement: the first step's loss and gradient norm of each row within a relative "
                   f"{section['tolerance']:.0e} of our torch row's. Goal: ours at {section['goal']}× the peer's "
                   f"tokens/s in both backends (the peer's row's ratio; ours (torch) / ours (JAX) beside it)."]),
            ("table", headers, rows)]
    return doc + ([("p", ["Notes:"]), ("list", notes)] if notes else [])
