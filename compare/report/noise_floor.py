"""The bf16 noise floor in `twinflash compare`'s report (report.json's equivalence.bf16, made by
compare/harness/noise_floor.py): its blocks of the report's document model (`blocks`, rendered to Markdown and HTML
by compare/report/render.py: the verdict naming any outlier run, the floor and why, the matrix of the six pairs' mean
differences, the pairs and the runs) and its plot (`figure`: every run's loss per step, and each pair's relative
difference per step; linear axes from 0, so that a spike and the size of a difference read at a glance; the title
is the verdict).
"""

from __future__ import annotations

import math
import textwrap

from matplotlib.figure import Figure

from compare.report.fields import STATUS_LABELS, finite, fmt_seq

PLOT = "noise_floor"
_COLORS = {"torch": "#ee4c2c", "jax": "#1a73e8"}
_PAIR_STYLES = {"floor": ":", "cross": "-", "vendor cross": "-.", "mixed": "--"}


def _section(report: dict) -> dict | None:
    return report["equivalence"].get("bf16")


def _percent(value) -> str:
    return f"{value * 100:.3g} %" if finite(value) else "–" if value is None else str(value)


_KINDS = {"floor": "noise floor", "cross": "torch vs JAX", "vendor cross": "torch vs JAX, vendor", "mixed": "mixed"}


def _matrix(bf16: dict) -> list[tuple]:
    """The mean relative difference of every pair of runs, as a matrix (the outliers' rows marked)."""
    names = [r["name"] for r in bf16["runs"] if any(r["name"] in (p["a"], p["b"]) for p in bf16["pairs"])]
    if len(names) < 3:
        return []
    means = {frozenset((p["a"], p["b"])): p["mean"] for p in bf16["pairs"]}
    rows = [[f"{a} (outlier)" if a in bf16.get("outliers", []) else a]
            + ["–" if a == b else _percent(means.get(frozenset((a, b)))) for b in names] for a in names]
    return [("p", ["Mean relative difference per step of every pair of runs:"]), ("table", ["run", *names], rows)]


def blocks(report: dict) -> list[tuple]:
    """The section's headings, paragraphs and tables; [] when the report has no bf16 section."""
    bf16 = _section(report)
    if bf16 is None:
        return []
    opt = bf16["optimizer"]
    doc = [("h", 3, "bf16: torch vs JAX beside a measured noise floor"),
           ("p", [f"{bf16['steps']} training steps of text (seed {bf16['seed']}) at S={fmt_seq(bf16['seq_len'])}, "
                  f"fsdp=1 × sp={bf16['devices']}, bf16, each run a job of this compare run that trains as "
                  f"`twinflash train --data text` does, with its default optimizer "
                  f"(peak lr {opt['lr']:g}, {opt['warmup_steps']} warmup steps, cosine to "
                  f"{opt['min_lr_ratio']:g} × the peak), the same weights and batches. Noise floor: one backend "
                  "trained twice with two correct attention kernels; relative difference per step "
                  "|a − b| / mean(|a|, |b|)."]),
           ("p", [("b", f"Verdict: {bf16['verdict']}"), "."])]
    if bf16["floor_pair"]:
        doc.append(("p", [f"Floor: {_percent(bf16['floor'])} ({bf16['floor_pair']}; floors below "
                          f"{_percent(bf16['floor_min'])} count as that), {bf16['floor_why']}. Ratio = mean "
                          f"torch-vs-JAX difference / floor; why {bf16['ratio_limit']:g}: {bf16['why']}. Outliers: "
                          f"{bf16['outlier_why']}."]))
    doc += _matrix(bf16)
    doc.append(("table", ["pair", "kind", "steps", "max", "mean", "final"],
                [[p["name"], _KINDS[p["kind"]], str(p["steps"]), _percent(p["max"]), _percent(p["mean"]),
                  _percent(p["final"])] for p in bf16["pairs"]]))
    doc.append(("table", ["run", "kernel", "status", "first loss", "final loss", "steps", "wall time"],
                [[r["name"], r["kernel"], STATUS_LABELS.get(r["status"], r["status"].upper()),
                  f"{r['losses'][0]:.4f}" if r["losses"] else "–", f"{r['losses'][-1]:.4f}" if r["losses"] else "–",
                  str(len(r["losses"])), f"{r['seconds']:.0f} s"] for r in bf16["runs"]]))
    notes = [[f"{r['name']}: {r['message']}"] for r in bf16["runs"] if r["message"]]
    if notes:
        doc += [("p", ["Runs that did not finish:"]), ("list", notes)]
    if f"plots/{PLOT}.png" in report.get("plots", []):
        doc.append(("img", "bf16 noise floor", f"plots/{PLOT}.png"))
    return doc


def figure(report: dict) -> Figure | None:
    """Loss per step of every run (left) and each pair's relative difference per step (right); None without data."""
    bf16 = _section(report)
    runs = [r for r in (bf16 or {}).get("runs", []) if r["losses"]]
    if not runs:
        return None
    fig = Figure(figsize=(12.8, 4.2), dpi=100, layout="constrained")
    curves, diffs = fig.subplots(1, 2)
    for run in runs:
        ys = [v if math.isfinite(v) else math.nan for v in run["losses"]]
        curves.plot(range(len(ys)), ys, "-" if run["attention"] == "ours" else "--", color=_COLORS.get(run["backend"]),
                    label=f"{run['name']} ({run['kernel']})")
    curves.set(xlabel="step", ylabel="loss", title="bf16 loss per step", xlim=(0, None), ylim=(0, None))
    for pair in bf16["pairs"]:
        ys = [100 * v if math.isfinite(v) else math.nan for v in pair["relative_differences"]]
        diffs.plot(range(len(ys)), ys, linestyle=_PAIR_STYLES[pair["kind"]], label=pair["name"])
    diffs.set(xlabel="step", ylabel="relative difference (%)", title="Per-step loss difference",
              xlim=(0, None), ylim=(0, None))
    for ax in (curves, diffs):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle("\n".join(textwrap.wrap(f"bf16 noise floor: {bf16['verdict']}", 150)))
    return fig
