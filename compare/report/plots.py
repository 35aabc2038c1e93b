"""The PNG plots of `twinflash compare`'s report (out_dir/plots/*.png, written by compare/report/write.py's
`write_report`): matplotlib `Figure` objects on the Agg canvas, no pyplot state. `figures(report)` gives
[(name, Figure)] in a fixed order, leaving out a plot that has no data rather than drawing it empty:

- throughput: tokens/s and TFLOP/s per device per context length, one line per backend (benchmark points of
  attention "ours" at the most devices: tokens_per_s, tflops_per_device, seq_len);
- memory: peak memory per device (GiB) per context length, likewise (peak_memory_bytes);
- scaling: tokens/s against device count per backend and context length, with the ideal linear line (needs
  points of attention "ours" on two or more device counts; GPU runs only: CPU timings rank nothing);
- breakdown: step, forward, backward, exposed comm and comm kernels' busy time (ms) as grouped bars per backend and
  context length (step_s, forward_s, backward_s, comm_exposed_s, comm_s at the most devices);
- ablation: step time per attention implementation (ours, vendor, reference), one panel per backend (needs two or
  more implementations measured at the most devices);
- loss_curves: the equivalence run's losses per step (equivalence.loss_curves; train mode only);
- noise_floor: the bf16 runs' losses and their pairs' differences per step (equivalence.bf16;
  compare/report/noise_floor.py);
- precision: bf16 vs FP8 bars per point (precision.rows: tokens/s, peak memory, MFU against the bf16 peak, time
  to the report's token count; MFU on GPUs only), one group per backend, length, devices and kernel;
- precision_curves: the loss per step of our kernels in bf16 and FP8, one panel per backend (precision.curves).

The benchmark plots above show the run's dtype alone; FP8 points appear in the precision plots only.

Every value axis is linear and starts at zero (a bar's length is its value); context lengths are evenly spaced
categories. A benchmark point whose status is not "ok" is labelled (OOM, ERROR, TIMEOUT, UNSUPPORTED, SKIPPED)
where its mark would be.
"""

from __future__ import annotations

import math

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from compare.report import noise_floor
from compare.report.fields import (ATTENTIONS, STATUS_LABELS, finite, fmt_seq, fmt_tokens, max_devices, on_cpu,
                                   sorted_points)

_COLORS = {"torch": "#ee4c2c", "jax": "#1a73e8", "reference": "#6c757d"}
_ATTENTION_COLORS = {"ours": "#2a9d8f", "vendor": "#e9c46a", "reference": "#8d99ae"}


def _figure(panels: int = 1):
    fig = Figure(figsize=(6.4 * panels, 4.2), dpi=100, layout="constrained")
    return fig, list(fig.subplots(1, panels, squeeze=False)[0])


def _categories(ax, xs) -> dict[int, int]:
    """Evenly spaced x positions for the context lengths `xs`, labelled; {length: position}."""
    ticks = sorted(set(xs))
    ax.set_xticks(range(len(ticks)), [fmt_seq(t) for t in ticks])
    ax.set_xlim(-0.5, len(ticks) - 0.5)
    return {t: i for i, t in enumerate(ticks)}


def _from_zero(ax) -> None:
    ax.set_ylim(bottom=0)


def _label_failed(ax, x: float, text: str, color: str = "#cf222e") -> None:
    ax.annotate(text, xy=(x, 0.03), xycoords=("data", "axes fraction"), rotation=90, fontsize=8, ha="center",
                va="bottom", color=color)


def _ok(p: dict, key: str) -> bool:
    return p["status"] == "ok" and finite(p[key])


def _ours(report: dict, devices: int | None = None) -> list[dict]:
    return [p for p in sorted_points(report) if p["attention"] == "ours" and devices in (None, p["devices"])]


def _lines_vs_seq(report: dict, panels: list[tuple], title: str):
    points = _ours(report, top := max_devices(report))
    panels = [panel for panel in panels if any(_ok(p, panel[0]) for p in points)]
    if not panels:
        return None
    fig, axes = _figure(len(panels))
    for ax, (key, label, scale) in zip(axes, panels):
        at = _categories(ax, [p["seq_len"] for p in points])
        for backend in report["settings"]["backends"]:
            xy = [(at[p["seq_len"]], p[key] * scale) for p in points if p["backend"] == backend and _ok(p, key)]
            if xy:
                ax.plot(*zip(*xy), "o-", color=_COLORS[backend], label=backend)
        for p in points:
            if p["status"] != "ok":
                _label_failed(ax, at[p["seq_len"]], f"{p['backend']} {STATUS_LABELS[p['status']]}",
                              _COLORS[p["backend"]])
        _from_zero(ax)
        ax.set(xlabel="context length (tokens)", ylabel=label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{title}, {top} device(s), attention ours")
    return fig


def _plot_scaling(report: dict):
    points = [p for p in _ours(report) if _ok(p, "tokens_per_s")]
    if len({p["devices"] for p in points}) < 2 or on_cpu(report):
        return None
    fig, (ax,) = _figure()
    for backend in report["settings"]["backends"]:
        for seq, marker in zip(sorted({p["seq_len"] for p in points}), "osD^v<>ph*" * 10):
            xy = sorted((p["devices"], p["tokens_per_s"]) for p in points
                        if (p["backend"], p["seq_len"]) == (backend, seq))
            if xy:
                ax.plot(*zip(*xy), marker=marker, color=_COLORS[backend], label=f"{backend} S={fmt_seq(seq)}")
                (d0, t0), ds = xy[0], [d for d, _ in xy]
                ax.plot(ds, [t0 * d / d0 for d in ds], "--", color=_COLORS[backend], alpha=0.5, linewidth=1)
    ax.plot([], [], "--", color="gray", label="ideal linear")
    devices = sorted({p["devices"] for p in points})
    ax.set_xticks(devices, [str(d) for d in devices])
    ax.set_xlim(0, devices[-1] * 1.05)
    _from_zero(ax)
    ax.set(xlabel="devices", ylabel="tokens/s", title="Scaling with devices, attention ours")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def _bars(ax, groups: list[str], series: list[tuple[str, str, list]]) -> None:
    """Grouped bars: one group per x label; series (label, color, per group: a height, a failure label or None)."""
    width = 0.8 / len(series)
    for j, (_, color, values) in enumerate(series):
        for i, value in enumerate(values):
            x = i + (j - (len(series) - 1) / 2) * width
            if isinstance(value, str):
                _label_failed(ax, x, value)
            elif value is not None:
                ax.bar(x, value, width=width, color=color)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_xlim(-0.5, len(groups) - 0.5)
    ax.legend(handles=[Patch(color=color, label=label) for label, color, _ in series], fontsize=8)


def _ms_or_status(p: dict | None, key: str = "step_s"):
    return None if p is None else p[key] * 1e3 if _ok(p, key) else STATUS_LABELS.get(p["status"])


def _plot_breakdown(report: dict):
    points = _ours(report, top := max_devices(report))
    parts = (("step_s", "step", "#555555"), ("forward_s", "forward", "#4c78a8"),
             ("backward_s", "backward", "#f58518"), ("comm_exposed_s", "exposed comm (part of the step)", "#54a24b"),
             ("comm_s", "comm kernels busy (overlap included)", "#b8e0b0"))
    if not any(_ok(p, key) for p in points for key, _, _ in parts[1:]):
        return None
    fig, (ax,) = _figure()
    _bars(ax, [f"{p['backend']}\nS={fmt_seq(p['seq_len'])}" for p in points],
          [(label, color, [_ms_or_status(p, key) if key == "step_s" or p["status"] == "ok" else None for p in points])
           for key, label, color in parts])
    _from_zero(ax)
    ax.set(ylabel="ms", title=f"Step, forward, backward, comm: {top} device(s), attention ours")
    return fig


def _plot_ablation(report: dict):
    top = max_devices(report)
    points = {(p["backend"], p["attention"], p["seq_len"]): p for p in sorted_points(report) if p["devices"] == top}
    kinds = [a for a in ATTENTIONS if any(k[1] == a for k in points)]
    values = [p["step_s"] for p in points.values() if _ok(p, "step_s") and p["step_s"] > 0]
    if len(kinds) < 2 or not values:
        return None
    backends = [b for b in report["settings"]["backends"] if any(k[0] == b for k in points)]
    seqs = sorted({k[2] for k in points})
    fig, axes = _figure(len(backends))
    for ax, backend in zip(axes, backends):
        _bars(ax, [f"S={fmt_seq(s)}" for s in seqs], [(kind, _ATTENTION_COLORS[kind], [
            _ms_or_status(points.get((backend, kind, s))) for s in seqs]) for kind in kinds])
        _from_zero(ax)
        ax.set(ylabel="step time (ms)", title=f"{backend}, {top} device(s)")
    fig.suptitle("Attention ablation (failed points labelled)")
    return fig


def _plot_loss_curves(report: dict):
    curves = {k: v for k, v in report["equivalence"]["loss_curves"].items() if v}
    if report["settings"]["mode"] != "train" or not curves:
        return None
    fig, (ax,) = _figure()
    for (name, losses), marker in zip(curves.items(), "os^Dv" * 10):
        ys = [v if math.isfinite(v) else math.nan for v in losses]
        ax.plot(range(len(ys)), ys, "--" if name == "reference" else "-", marker=marker, markersize=4,
                color=_COLORS.get(name), label=name)
    _from_zero(ax)
    ax.set(xlabel="step", ylabel="loss", title="Loss curves (equivalence run)")
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


_PRECISION_COLORS = {"bf16": "#4c78a8", "fp8": "#f58518", "fp32": "#6c757d"}
_PRECISION_PANELS = (("tokens_per_s", "tokens/s", 1), ("peak_memory_bytes", "peak memory per device (GiB)", 2**-30),
                     ("mfu", "MFU against the bf16 peak (%)", 100),
                     ("time_to_tokens_s", "time to {tokens} tokens (h)", 1 / 3600))


def _plot_precision(report: dict):
    section = report.get("precision")
    rows = (section or {}).get("rows", [])
    panels = [panel for panel in _PRECISION_PANELS if any(_ok(r, panel[0]) for r in rows)]
    if not panels:
        return None
    groups = list(dict.fromkeys((r["backend"], r["seq_len"], r["devices"], r["attention"]) for r in rows))
    by_key = {(r["backend"], r["seq_len"], r["devices"], r["attention"], r["precision"]): r for r in rows}
    precisions = list(dict.fromkeys(r["precision"] for r in rows))
    # two panels a row, each wide enough for its groups' labels (a GPU sweep has a dozen or more points)
    columns = min(len(panels), 2)
    fig = Figure(figsize=(max(6.4, 0.9 * len(groups)) * columns, 4.2 * math.ceil(len(panels) / 2)), dpi=100,
                 layout="constrained")
    axes = list(fig.subplots(math.ceil(len(panels) / 2), columns, squeeze=False).flat)
    for spare in axes[len(panels):]:
        spare.remove()
    for ax, (key, label, scale) in zip(axes, panels):
        series = []
        for precision in precisions:
            values = []
            for group in groups:
                r = by_key.get((*group, precision))
                values.append(None if r is None else r[key] * scale if _ok(r, key) else STATUS_LABELS.get(r["status"]))
            series.append((precision, _PRECISION_COLORS.get(precision, "#555555"), values))
        _bars(ax, [f"{b}\nS={fmt_seq(s)} d={d}\n{a}" for b, s, d, a in groups], series)
        _from_zero(ax)
        ax.set(ylabel=label.format(tokens=fmt_tokens(report["settings"]["time_to_tokens"])))
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle("bf16 vs FP8 per point" + (" (CPU run: interpreted, ranks nothing)" if on_cpu(report) else ""))
    return fig


def _plot_precision_curves(report: dict):
    curves = ((report.get("precision") or {}).get("curves") or {})
    runs = [r for r in curves.get("runs", []) if r["losses"]]
    backends = [b for b in report["settings"]["backends"] if any(r["backend"] == b for r in runs)]
    if not backends:
        return None
    fig, axes = _figure(len(backends))
    for ax, backend in zip(axes, backends):
        for run in (r for r in runs if r["backend"] == backend):
            ys = [v if math.isfinite(v) else math.nan for v in run["losses"]]
            ax.plot(range(len(ys)), ys, "-" if run["precision"] != "fp8" else "--",
                    color=_PRECISION_COLORS.get(run["precision"]), label=f"{run['precision']} ({run['name']})")
        ax.set(xlabel="step", ylabel="loss", title=f"{backend}, our kernels", xlim=(0, None))
        _from_zero(ax)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Loss per step, bf16 vs FP8: S={fmt_seq(curves['seq_len'])}, sp={curves['devices']}, text")
    return fig


PLOTS = (("throughput", lambda r: _lines_vs_seq(r, [("tokens_per_s", "tokens/s", 1),
                                                     ("tflops_per_device", "TFLOP/s per device", 1)], "Throughput")),
          ("memory", lambda r: _lines_vs_seq(r, [("peak_memory_bytes", "peak memory per device (GiB)", 2**-30)],
                                             "Peak memory")),
          ("scaling", _plot_scaling), ("breakdown", _plot_breakdown), ("ablation", _plot_ablation),
          ("loss_curves", _plot_loss_curves), (noise_floor.PLOT, noise_floor.figure),
          ("precision", _plot_precision), ("precision_curves", _plot_precision_curves))


def figures(report: dict) -> list[tuple[str, Figure]]:
    """[(name, Figure)] for plots/<name>.png, in PLOTS' order; a plot without data is left out."""
    return [(name, fig) for name, make in PLOTS if (fig := make(report)) is not None]
