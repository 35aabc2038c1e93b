"""The fast path in `twinflash compare`'s report (report.json's equivalence.fast_path, made by
compare/harness/fastpath.py): its blocks of the report's document model (`blocks`, rendered to Markdown and HTML by
compare/report/render.py): what was run and against what, the rules with their reasons, the attention's errors per
backend, device count and tensor (ours beside the vendor's), and the bf16 step's worst parameters per backend.
"""

from __future__ import annotations

from compare.report.fields import WORST_PARAMETERS, fmt, fmt_seq
_STATISTICS = ("max_abs", "relative", "norm_bias")


def _verdict(passed: bool) -> str:
    return "PASS" if passed else "FAIL"


def _where(entry: dict) -> str:
    return (f"{entry['backend']} on {entry['devices']} device(s) ({entry['mesh']}): ours ({entry['ours_kernel']}) "
            f"vs {entry['vendor']} ({entry['vendor_kernel']})")


def blocks(report: dict) -> list[tuple]:
    """The section's headings, paragraphs and tables; [] for a report without it (made before the fast path)."""
    fast = report["equivalence"].get("fast_path")
    if fast is None:
        return []
    doc = [("h", 3, f"bf16 fast path: {_verdict(fast['passed'])}"),
           ("p", [f"The code the benchmark times, checked. Attention: the model's attention function as the points "
                  f"call it (the ring over each kernel in bf16, the run's ring variant and layout, the mesh of each "
                  f"device count) on random q, k, v and output gradient (seed {fast['seed']}, standard normal "
                  f"rounded to bf16) at the model's head shapes ({fast['heads']} heads, {fast['kv_heads']} KV heads, "
                  f"head_dim {fast['head_dim']}), S={fmt_seq(fast['seq_len'])}, batch {fast['batch']}, against "
                  "causal attention in float64 on one device on the same values. bf16 step: the gradients of one "
                  f"bf16 training step ({fast['layers']} layers, the float32 check's first batch) with each kernel, "
                  f"each parameter's distance ||g - g_fp32|| / ||g_fp32|| to the float32 step's ({fast['reference']})."
                  f" Rule: ours <= {fast['ratio']:g} x vendor + atol; why {fast['ratio']:g}: {fast['ratio_why']}."]),
           ("table", ["statistic", "absolute term (ceiling)", "why"], [[r["statistic"].replace("_", " "), fmt(r["atol"], "sig"),
                                                     r["why"]] for r in fast["rules"]])]
    if fast["failures"]:
        doc += [("p", [("b", "Failing:")]), ("list", [[line] for line in fast["failures"]])]
    rows = []
    for entry in fast["attention"]:
        checks = {(c["tensor"], c["statistic"]): c for c in entry["checks"]}
        for tensor in dict.fromkeys(c["tensor"] for c in entry["checks"]):
            cells = [f"{fmt(checks[tensor, s]['ours'], 'sig')} / {fmt(checks[tensor, s]['vendor'], 'sig')}"
                     for s in _STATISTICS]
            passed = all(c["passed"] for c in entry["checks"] if c["tensor"] == tensor)  # the vendor's ceiling too
            rows.append([entry["backend"], str(entry["devices"]), entry["ours_kernel"], entry["vendor_kernel"],
                         tensor, *cells, _verdict(passed)])
    doc += [("p", ["Attention errors against float64, ours / vendor:"]),
            ("table", ["backend", "devices", "ours", "vendor", "tensor", "max-abs", "relative", "norm bias",
                       "verdict"], rows)]
    for entry in fast["steps"]:
        doc.append(("p", [("b", f"bf16 step, {_where(entry)}: {_verdict(entry['passed'])}")]))
        ranked = sorted(entry["checks"], key=lambda c: c["ours"] / c["bound"], reverse=True)
        shown = ranked[:WORST_PARAMETERS] + [c for c in ranked[WORST_PARAMETERS:] if not c["passed"]]
        if shown:
            doc.append(("p", [f"{len(ranked)} parameters, {sum(not c['passed'] for c in ranked)} failing; the "
                              f"{min(len(ranked), WORST_PARAMETERS)} nearest their bound, and every failing one:"]))
            doc.append(("table", ["parameter", "ours", "vendor", "bound", "ours / bound", "verdict"],
                        [[c["name"], fmt(c["ours"], "sig"), fmt(c["vendor"], "sig"), fmt(c["bound"], "sig"),
                          fmt(c["ours"] / c["bound"], "sig"), _verdict(c["passed"])] for c in shown]))
    return doc
