"""The sequence-parallel scheme section of `twinflash compare --schemes ring,ulysses,hybrid`: per backend and context
length, at the most devices, our kernels under each scheme (the ring's point beside Ulysses' and the hybrid's, the
same weights, tokens and step): step time, tokens/s, MFU, the bytes each device sends per step and the exposed
communication, peak memory, and on GPUs each scheme's speed over the ring's. Each scheme's float32 check is in the
equivalence section ("<backend> <scheme> vs reference"). Owns the section's blocks of the report's document model
(`blocks`, rendered by compare/report/render.py); the points are the benchmark's (`scheme` names theirs).
"""

from __future__ import annotations

from compare.report.fields import DASH, STATUS_LABELS, finite, fmt, fmt_seq, on_cpu, sorted_points

SCHEME_ORDER = ("ring", "ulysses", "hybrid")


def _label(p: dict) -> str:
    scheme = p.get("scheme", "ring")
    return f"hybrid U={p['ulysses_degree']}" if scheme == "hybrid" else scheme


def blocks(report: dict) -> list[tuple]:
    """The section's heading, table and notes; [] for a run of the ring alone."""
    schemes = report["settings"].get("schemes", ["ring"])
    if len(schemes) < 2:
        return []
    gpu = not on_cpu(report)
    points = [p for p in sorted_points(report, schemes=True) if p["attention"] == "ours"
              and p.get("precision") != "fp8"]
    top = max((p["devices"] for p in points if p.get("scheme", "ring") != "ring"), default=None)
    cells: dict[tuple, dict[str, dict]] = {}
    for p in points:
        if p["devices"] == top:
            cells.setdefault((p["backend"], p["seq_len"]), {})[p.get("scheme", "ring")] = p
    headers = ["backend", "S", "scheme", "step", "tokens/s"] + (["MFU"] if gpu else [])
    headers += ["bytes sent per device", "exposed comm", "peak memory per device"] + (["speed vs ring"] if gpu else [])
    rows, notes = [], []
    for (backend, seq), by_scheme in cells.items():
        ring = by_scheme.get("ring")
        for scheme in (s for s in SCHEME_ORDER if s in by_scheme):
            p = by_scheme[scheme]
            label = STATUS_LABELS.get(p["status"])
            values = [("step_s", "seconds"), ("tokens_per_s", "count")] + ([("mfu", "percent")] if gpu else [])
            values += [("comm_bytes", "bytes"), ("comm_exposed_s", "seconds"), ("peak_memory_bytes", "bytes")]
            row = [backend, fmt_seq(seq), _label(p)] + [label or fmt(p.get(key), kind) for key, kind in values]
            if gpu:
                ok = (ring is not None and p["status"] == ring["status"] == "ok"
                      and finite(p["tokens_per_s"]) and finite(ring["tokens_per_s"]))
                row.append(f"{p['tokens_per_s'] / ring['tokens_per_s']:.3g}×" if ok else DASH)
            rows.append(row)
            if p["message"]:
                notes.append([f"{backend} {_label(p)} S={fmt_seq(seq)}: {p['message']}"])
    intro = (f"Our kernels under each sequence-parallel scheme on {top} device(s): the ring (K/V blocks passed "
             "around), Ulysses (heads exchanged by all-to-all, each device then attends whole sequences of its "
             "heads) and the hybrid (Ulysses over U adjacent devices, the ring across the groups). Bytes sent "
             "per device are counted from the shapes (weights.parallel.step_comm_bytes); each scheme's float32 "
             "check is in the equivalence section.")
    if not gpu:
        intro += " CPU run: no MFU and no speed ratio (the timings rank nothing)."
    doc = [("h", 2, "Sequence-parallel schemes"), ("p", [intro]), ("table", headers, rows)]
    return doc + ([("p", ["Notes:"]), ("list", notes)] if notes else [])
