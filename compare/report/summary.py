"""The first screen of `twinflash compare`'s report: its blocks of the report's document model (`blocks`, rendered to
Markdown and HTML by compare/report/render.py), which answer the run's question before the details do:

- speed: per context length and device count, each backend's tokens/s, MFU and peak memory per device with our
  kernels (attention "ours", the kernel named), and on GPUs the ratio of the second backend to the first (JAX /
  torch; MFU's ratio is the throughput's, both backends doing the same FLOPs per token). A point that did not run
  shows its status once, in one cell spanning its backend's columns;
- one line per verdict: each float32 equivalence comparison (its closest check to its tolerance, or its failures),
  the bf16 fast path per backend, the bf16 noise floor (naming an outlier run), and with FP8 each pair of the
  precision section's loss curves against that floor;
- the headline plot (throughput).

A CPU run shows no ratio: its timings measure interpreters and rank nothing.
"""

from __future__ import annotations

from compare.report.fields import DASH, STATUS_LABELS, finite, fmt, fmt_seq, on_cpu, sorted_points

HEADLINE_PLOT = "throughput"
METRICS = (("tokens_per_s", "tokens/s", "count"), ("mfu", "MFU", "percent"),
           ("peak_memory_bytes", "peak memory", "bytes"))


def _verdict(passed: bool | None) -> str:
    return "NOT MEASURED" if passed is None else "PASS" if passed else "FAIL"


def span(columns: int, text: str) -> tuple:
    """A table cell spanning `columns` columns (HTML colspan; Markdown: the text, then empty cells)."""
    return ("span", columns, text)


def _ratio(a: dict | None, b: dict | None, key: str) -> str:
    if not (a and b and a["status"] == b["status"] == "ok" and finite(a[key]) and finite(b[key]) and a[key]):
        return DASH
    return f"{b[key] / a[key]:.3g}×"


def _speed(report: dict) -> list[tuple]:
    ours = [p for p in sorted_points(report) if p["attention"] == "ours"]
    backends = [b for b in report["settings"]["backends"] if any(p["backend"] == b for p in ours)]
    if not backends:
        return [("p", ["No benchmark point of our kernels."])]
    at = {(p["backend"], p["seq_len"], p["devices"]): p for p in ours}
    shapes = sorted({(p["seq_len"], p["devices"]) for p in ours})
    ratios = len(backends) == 2 and not on_cpu(report)
    metrics = [m for m in METRICS if not (on_cpu(report) and m[0] == "mfu")]
    headers = ["S", "devices"] + [f"{b} {label}" for b in backends for _, label, _ in metrics]
    if ratios:
        first, second = backends
        headers += [f"{second} / {first} tokens/s (= MFU)", f"{second} / {first} peak memory"]
    rows = []
    for seq, devices in shapes:
        row = [fmt_seq(seq), str(devices)]
        for backend in backends:
            p = at.get((backend, seq, devices))
            if p is None:
                row.append(span(len(metrics), "not in this run"))
            elif p["status"] != "ok":
                row.append(span(len(metrics), STATUS_LABELS.get(p["status"], p["status"].upper())))
            else:
                row += [fmt(p[key], kind) for key, _, kind in metrics]
        if ratios:
            a, b = (at.get((backend, seq, devices)) for backend in backends)
            row += [_ratio(a, b, "tokens_per_s"), _ratio(a, b, "peak_memory_bytes")]
        rows.append(row)
    kernels = "; ".join(f"{b} {', '.join(sorted({p['kernel'] for p in ours if p['backend'] == b}))}"
                        for b in backends)
    what = "training step" if report["settings"]["mode"] == "train" else "forward"
    dtype = report["settings"]["dtype"]
    why = (f"; ratio {backends[1]} / {backends[0]}: MFU's ratio is the throughput's (the same FLOPs per token)"
           if ratios else "; a CPU run ranks nothing: no ratio" if on_cpu(report) else "")
    return [("p", [f"Our kernels ({kernels}), median {what} in {dtype}, peak memory per device{why}. Every point, "
                   "the vendor's and the reference attention's too, is in the benchmark section below."]),
            ("table", headers, rows)]


def _closest(checks: list[dict]) -> str:
    """The check nearest its tolerance, as "metric value (tolerance t)"."""
    def share(k: dict) -> float:
        return k["value"] / k["tolerance"] if finite(k["value"]) and finite(k["tolerance"]) and k["tolerance"] else 0

    if not checks:
        return "no check"
    k = max(checks, key=share)
    return f"closest to its tolerance: {k['metric']} {fmt(k['value'], 'sig')} (tolerance {fmt(k['tolerance'], 'sig')})"


def _verdicts(report: dict) -> list[tuple]:
    eq = report["equivalence"]
    rows = []
    for c in eq["comparisons"]:
        failing = [f"{k['metric']} {fmt(k['value'], 'sig')} > {fmt(k['tolerance'], 'sig')}"
                   for k in c["checks"] if not k["passed"]]
        params = sum(not p["passed"] for p in c["parameters"])
        failing += [f"{params} of {len(c['parameters'])} parameters' gradients"] if params else []
        rows.append([f"{eq['dtype']} {c['name']}", _verdict(c["passed"]),
                     "; ".join(failing) if failing else _closest(c["checks"])])
    if eq.get("failures"):
        rows.append([f"{eq['dtype']} equivalence jobs", "FAIL", "; ".join(eq["failures"])])
    if not eq["comparisons"] and not eq.get("failures"):
        rows.append([f"{eq['dtype']} equivalence", DASH, "no comparison was run"])
    fast = eq.get("fast_path")
    if fast is not None:
        entries = fast["attention"] + fast["steps"]
        for backend in dict.fromkeys(e["backend"] for e in entries):
            mine = [e for e in entries if e["backend"] == backend]
            failing = [line for line in fast["failures"] if line.startswith(f"{backend} ")]
            first = mine[0]
            devices = ", ".join(str(d) for d in sorted({e["devices"] for e in mine}))
            rows.append([f"bf16 fast path, {backend}", _verdict(all(e["passed"] for e in mine)),
                         "; ".join(failing) if failing else
                         f"ours ({first['ours_kernel']}) vs {first['vendor']} ({first['vendor_kernel']}) on {devices} "
                         f"device(s): attention against float64, one bf16 step against float32"])
        if not entries:
            rows.append(["bf16 fast path", "FAIL", "; ".join(fast["failures"]) or "no check was run"])
    bf16 = eq.get("bf16")
    if bf16 is not None:
        rows.append(["bf16 noise floor (torch vs JAX training)", _verdict(bf16["consistent"]),
                     bf16["verdict"] + " (reported beside the verdict above, not part of it)"])
    curves = (report.get("precision") or {}).get("curves") or {}
    for pair in curves.get("pairs", []):
        if "within_floor" in pair:  # reports made before the comparison have none
            rows.append([f"FP8 loss curve, {pair['name']}", _verdict(pair["within_floor"]),
                         f"mean difference {fmt(pair['mean'], 'percent')}, {pair['ratio']:.2f} × the bf16 noise floor "
                         f"(within: at most {curves['ratio_limit']:g}; beside the verdict, not part of it)"
                         if pair["ratio"] is not None else "no bf16 noise floor to measure it against"])
    return [("table", ["check", "verdict", "detail"], rows)]


def blocks(report: dict) -> list[tuple]:
    """The summary: speed per context length and device count, the verdicts, the headline plot."""
    plot = f"plots/{HEADLINE_PLOT}.png"
    return ([("h", 2, "Summary")] + _speed(report) + _verdicts(report)
            + ([("img", HEADLINE_PLOT, plot)] if plot in report.get("plots", []) else []))
