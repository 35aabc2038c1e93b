"""The bf16 noise floor in `twinflash compare`'s report (report.json's equivalence.bf16, made by
compare/harness/noise_floor.py): its blocks of the report's document model (`blocks`, rendered to Markdown and HTML
by compare/report/render.py) and its plot (`figure`: every run's loss per step, and each pair's relative difference
per step; linear axes from 0, so that a spike and the size of a difference read at a glance).
"""

from __future__ import annotations

import math

from matplotlib.figure import Figure

from compare.report.fields import STATUS_LABELS, finite, fmt_seq

PLOT = "noise_floor"
_COLORS = {"torch": "#ee4c2c", "jax": "#1a73e8"}
_PAIR_STYLES = {"floor": ":", "cross": "-"}


def _section(report: dict) -> dict | None:
    return report["equivalence"].get("bf16")


def _percent(value) -> str:
    return f"{value * 100:.3g} %" if finite(value) else "–" if value is None else str(value)


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
           ("p", [("b", f"Verdict: {bf16['verdict']}"),
                  (f" (ratio = mean torch-vs-JAX difference / mean noise floor, the larger floor: "
                   f"{bf16['floor_pair']}; floors below {_percent(bf16['floor_min'])} count as that). "
                   if bf16["floor_pair"] else " "), f"Why {bf16['ratio_limit']:g}: {bf16['why']}."])]
    doc.append(("table", ["pair", "kind", "steps", "max", "mean", "final"],
                [[p["name"], "noise floor" if p["kind"] == "floor" else "torch vs JAX", str(p["steps"]),
                  _percent(p["max"]), _percent(p["mean"]), _percent(p["final"])] for p in bf16["pairs"]]))
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
        diffs.plot(range(len(ys)), ys, _PAIR_STYLES[pair["kind"]], label=pair["name"])
    diffs.set(xlabel="step", ylabel="relative difference (%)", title="Per-step loss difference",
              xlim=(0, None), ylim=(0, None))
    for ax in (curves, diffs):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"bf16 noise floor: {bf16['verdict']}")
    return fig
