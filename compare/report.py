"""`twinflash compare`'s report: out_dir/report.json, report.md, report.html and plots/*.png from the dict that
compare/harness.py builds (format "twinflash-compare/1", each key described in compare/report_schema.json). Owns
the schema check (`validate_report`), the two renderings (`render_markdown`, `render_html`: one document model, two
writers), the plots (matplotlib `Figure` objects on the Agg canvas, no pyplot state), the number formats (`fmt`),
and the peers' numbers (`load_peers`: compare/peers.json, measured on H200 with /work/shared/anchors).

`write_report(report, out_dir)` validates first and writes nothing for an invalid report (ValueError, one line
naming the first violation's path); otherwise each file goes to a temporary name in out_dir and is renamed into
place (os.replace) once all are rendered. report.json's "plots" lists the PNGs written (a plot without data is left
out, not drawn empty); a "plots" list in the input is replaced. A benchmark point whose status is not "ok" shows it
(OOM, ERROR, TIMEOUT, UNSUPPORTED) in its measurement cells and its message under the table. Peers: our best point
per (backend, context length) at the most devices beside the peers' table, and an "ours vs peer" line where a point
measures a peer's work (same model, devices and context length: MFU against MFU).
"""

from __future__ import annotations

import functools
import html
import json
import warnings
import math
import os
import re
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.patches import Patch

SCHEMA_PATH = Path(__file__).with_name("report_schema.json")
PEERS_PATH = Path(__file__).with_name("peers.json")
WORST_PARAMETERS = 10  # parameters listed per comparison, besides every failing one
ATTENTIONS = ("ours", "vendor", "reference")
STATUS_LABELS = {"oom": "OOM", "error": "ERROR", "timeout": "TIMEOUT", "unsupported": "UNSUPPORTED"}
_COLORS = {"torch": "#ee4c2c", "jax": "#1a73e8", "reference": "#6c757d"}
_ATTENTION_COLORS = {"ours": "#2a9d8f", "vendor": "#e9c46a", "reference": "#8d99ae"}
_GRAD_CHECK = "gradient max-abs (worst parameter)"
DASH = "–"


# --- schema and peers ------------------------------------------------------------------------------------------

@functools.cache
def _schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))


def validate_report(report: dict) -> None:
    """Raises ValueError (one line: the path of the first violation and what is wrong) unless `report` matches
    compare/report_schema.json. Needs jsonschema (a dependency of twinflash; a machine with only the backends'
    own packages, such as a GPU image, skips the check with a warning)."""
    try:
        import jsonschema
    except ModuleNotFoundError:
        warnings.warn("jsonschema is not installed: report.json was not checked against its schema", stacklevel=2)
        return
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(_schema()).iter_errors(report))
    if error is not None:
        path = "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
        raise ValueError(f"invalid compare report at {path}: {' '.join(error.message.split())[:300]}")


def load_peers() -> list[dict]:
    """The peers' measurements of compare/peers.json: [{work, peer, value, unit, source}]."""
    return json.loads(PEERS_PATH.read_text(encoding="utf-8"))


# --- number formats --------------------------------------------------------------------------------------------

def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _duration(v: float) -> str:
    for least, div, unit in ((2 * 86400, 86400, "days"), (3600, 3600, "h"), (60, 60, "min")):
        if v >= least:
            return f"{v / div:.3g} {unit}"
    return _FORMATS["seconds"](v)


_FORMATS = {
    "seconds": lambda v: f"{v * 1e3:.3g} ms" if v < 1 else f"{v:.3g} s" if v < 100 else f"{v:,.0f} s",
    "duration": _duration,
    "bytes": lambda v: f"{v / 2**30:.2f} GiB" if v >= 2**30 else f"{v / 2**20:.1f} MiB",
    "count": lambda v: f"{v:,.0f}",
    "percent": lambda v: f"{v * 100:.3g} %",
    "sig": lambda v: f"{v:.3g}",
    "ratio": lambda v: f"{v:.6f}",
    "one": lambda v: f"{v:,.1f}",
}


def fmt(value: Any, kind: str) -> str:
    """`value` in one of the report's formats (seconds, duration, bytes, count, percent, sig, ratio, one); null
    is a dash, NaN and infinities are spelled out."""
    if value is None:
        return DASH
    return _FORMATS[kind](value) if _finite(value) else str(value)


def fmt_tokens(n: float) -> str:
    return next((f"{n / d:.3g}{s}" for d, s in ((1e12, "T"), (1e9, "B"), (1e6, "M")) if n >= d), f"{n:,.0f}")


def fmt_seq(s: int) -> str:
    return f"{s // 1024}k" if s >= 1024 and s % 1024 == 0 else str(s)


def _verdict(passed: bool) -> str:
    return "PASS" if passed else "FAIL"


# --- document model, shared by markdown and HTML ---------------------------------------------------------------
# blocks: ("h", level, text) ("p", [inline]) ("table", headers, rows) ("code", text) ("list", [[inline]])
# ("img", alt, src); inline (a table cell, or an item of a list): str, ("b", text) bold, ("a", text, href) link

def _points(report: dict) -> list[dict]:
    order = {b: i for i, b in enumerate(report["settings"]["backends"])}
    return sorted(report["benchmark"]["points"], key=lambda p: (order.get(p["backend"], len(order)),
                  ATTENTIONS.index(p["attention"]), p["seq_len"], p["devices"]))


def _max_devices(report: dict) -> int:
    return max((p["devices"] for p in report["benchmark"]["points"]), default=report["settings"]["devices"])


def _where(p: dict) -> str:
    return f"{p['backend']} {p['attention']} ({p['kernel']}) S={fmt_seq(p['seq_len'])} on {p['devices']} device(s)"


def _images(report: dict, *names: str) -> list[tuple]:
    return [("img", name.replace("_", " "), f"plots/{name}.png") for name in names
            if f"plots/{name}.png" in report.get("plots", [])]


def _document(report: dict) -> list[tuple]:
    s, model = report["settings"], report["model"]
    failing = [f"{c['name']}: {k['metric']} {fmt(k['value'], 'sig')} > tolerance {fmt(k['tolerance'], 'sig')}"
               for c in report["equivalence"]["comparisons"] for k in c["checks"] if not k["passed"]]
    detail = ("; ".join(failing) if failing else "every check within its tolerance"
              if report["equivalence"]["comparisons"] else "no comparison was run") + "."
    doc = [("h", 1, f"twinflash compare: {model['name']}, {s['mode']}, {s['dtype']}"),
           ("p", [("b", f"Verdict: {_verdict(report['passed'])}"), f" (equivalence) — {detail}"]),
           ("code", report["command"]), ("p", [f"Created {report['created']}."])]
    return (doc + _setup(report) + _equivalence(report) + _benchmark(report) + _ablation(report) + _peers(report)
            + _flops_and_traces(report))


def _setup(report: dict) -> list[tuple]:
    env, s, m = report["environment"], report["settings"], report["model"]
    groups: dict[str, int] = {}
    for name in env["devices"]:
        groups[name] = groups.get(name, 0) + 1
    rows = [["platform", env["platform"]],
            ["devices", ", ".join(f"{n} × {name}" if n > 1 else name for name, n in groups.items()) or DASH],
            ["driver", env["driver"] or DASH], ["python", env["python"]]]
    rows += [[lib, version or DASH] for lib, version in env["libraries"].items()]
    rows += [["git commit", env["git_commit"] or DASH], ["host", f"{env['hostname']} ({env['cpu_count']} CPUs)"],
             ["model", (f"{m['name']}: {fmt(m['num_params'], 'count')} parameters, {m['layers']} layers, hidden "
                        f"{m['hidden']}, {m['heads']} heads ({m['kv_heads']} KV), head_dim {m['head_dim']}, "
                        f"vocab {m['vocab']}")],
             ["mode", f"{s['mode']}, {s['dtype']}, {s['steps']} steps"],
             ["context lengths", ", ".join(map(fmt_seq, s["seq_lens"]))],
             ["device counts", ", ".join(map(str, s["device_counts"])) + f" (of {s['devices']})"],
             ["backends", ", ".join(s["backends"])], ["attention ablation", ", ".join(s["attention_ablation"])]]
    return [("h", 2, "Setup"), ("table", ["", "value"], rows)]


def _equivalence(report: dict) -> list[tuple]:
    eq = report["equivalence"]
    doc = [("h", 2, "Equivalence"),
           ("p", [(f"S={fmt_seq(eq['seq_len'])} on {eq['devices']} device(s), {eq['layers']} layers, "
                   f"{eq['dtype']}; reference: {eq['reference']}. "), ("b", _verdict(eq["passed"])), "."])]
    for c in eq["comparisons"]:
        doc.append(("h", 3, f"{c['name']}: {_verdict(c['passed'])}"))
        doc.append(("table", ["check", "value", "tolerance", "verdict", "why this tolerance"],
                    [[k["metric"], fmt(k["value"], "sig"), fmt(k["tolerance"], "sig"), _verdict(k["passed"]),
                      k["why"]] for k in c["checks"]]))
        params = c["parameters"]
        if not params:
            continue
        tol = next((k["tolerance"] for k in c["checks"] if k["metric"] == _GRAD_CHECK), None)
        tol = tol if _finite(tol) and tol > 0 else None

        def badness(p, tol=tol):
            d = p["max_abs_diff"] / tol if tol else p["max_abs_diff"]
            return d if _finite(d) else math.inf

        ranked = sorted(params, key=badness, reverse=True)
        shown = ranked[:WORST_PARAMETERS] + [p for p in ranked[WORST_PARAMETERS:] if not p["passed"]]
        doc.append(("p", [(f"{len(params)} parameters, {sum(not p['passed'] for p in params)} failing; the "
                           f"{min(len(params), WORST_PARAMETERS)} worst by max-abs difference"
                           f"{' / tolerance' if tol else ''}, and every failing one:")]))
        doc.append(("table", ["parameter", "max-abs diff", "diff / tolerance", "norm ratio", "verdict"],
                    [[p["name"], fmt(p["max_abs_diff"], "sig"), fmt(p["max_abs_diff"] / tol, "sig") if tol else DASH,
                      fmt(p["norm_ratio"], "ratio"), _verdict(p["passed"])] for p in shown]))
    curves = {k: v for k, v in eq["loss_curves"].items() if v}
    if curves:
        doc.append(("p", ["Final loss: " + ", ".join(f"{k} {fmt(v[-1], 'sig')} ({len(v)} steps)"
                                                       for k, v in curves.items()) + "."]))
    return doc + _images(report, "loss_curves")


def _cells(p: dict, columns) -> list[str]:
    return [STATUS_LABELS.get(p["status"]) or fmt(p[key], kind) for key, kind in columns]


def _benchmark(report: dict) -> list[tuple]:
    columns = (("step_s", "seconds"), ("forward_s", "seconds"), ("backward_s", "seconds"), ("comm_s", "seconds"),
               ("comm_bytes", "bytes"), ("comm_bandwidth_gbps", "one"), ("tokens_per_s", "count"),
               ("tflops_per_device", "one"), ("mfu", "percent"), ("peak_memory_bytes", "bytes"),
               ("scaling_efficiency", "percent"), ("time_to_tokens_s", "duration"))
    headers = ["backend", "attention", "kernel", "S", "devices", "step", "forward", "backward", "comm",
               "comm volume", "comm GB/s", "tokens/s", "TFLOP/s per device", "MFU", "peak memory per device",
               "scaling efficiency", f"time to {fmt_tokens(report['settings']['time_to_tokens'])} tokens"]
    what = "training step (forward, backward, optimizer)" if report["settings"]["mode"] == "train" else "forward"
    points = _points(report)
    rows = [[p["backend"], p["attention"], p["kernel"], fmt_seq(p["seq_len"]), str(p["devices"])]
            + _cells(p, columns) for p in points]
    notes = [[f"{_where(p)}: {STATUS_LABELS.get(p['status'], p['status'])}: {p['message']}"]
             for p in points if p["message"]]
    doc = [("h", 2, "Benchmark"), ("p", [f"Median {what}; one row per point."]),
           ("table", headers, rows) if rows else ("p", ["No benchmark points."])]
    doc += [("p", ["Notes:"]), ("list", notes)] if notes else []
    return doc + _images(report, "throughput", "scaling", "memory", "breakdown")


def _ablation(report: dict) -> list[tuple]:
    top = _max_devices(report)
    cells: dict[tuple, dict[str, dict]] = {}
    for p in _points(report):
        if p["devices"] == top:
            cells.setdefault((p["backend"], p["seq_len"]), {})[p["attention"]] = p
    kinds = [a for a in ATTENTIONS if any(a in row for row in cells.values())]
    if len(kinds) < 2:
        return []
    rows = []
    for (backend, seq), row in cells.items():
        ok = all(a in row and row[a]["status"] == "ok" and _finite(row[a]["step_s"]) for a in ("ours", "vendor"))
        speedup = f"{row['vendor']['step_s'] / row['ours']['step_s']:.2f}×" if ok and row["ours"]["step_s"] else DASH
        rows.append([backend, fmt_seq(seq)] + [f"{_cells(row[a], [('step_s', 'seconds')])[0]} ({row[a]['kernel']})"
                                               if a in row else DASH for a in kinds] + [speedup])
    return [("h", 2, "Attention ablation"),
            ("p", [f"Step time on {top} device(s) per attention implementation; speed-up = vendor step time / ours."]),
            ("table", ["backend", "S"] + kinds + ["ours speed-up vs vendor"], rows)] + _images(report, "ablation")


def _peer_scope(work: str) -> tuple[int | None, int | None]:
    """(devices, seq_len) that a peer's work names, e.g. "4 GPUs ..., S=32k" -> (4, 32768)."""
    gpus, seq = re.search(r"(\d+)\s*GPUs?\b", work), re.search(r"S=(\d+)(k?)", work)
    return (int(gpus.group(1)) if gpus else None, int(seq.group(1)) * (1024 if seq.group(2) else 1) if seq else None)


def _peers(report: dict) -> list[tuple]:
    top, best = _max_devices(report), {}
    for p in _points(report):
        key = (p["backend"], p["seq_len"])
        if p["devices"] == top and p["status"] == "ok" and _finite(p["tokens_per_s"]) and (
                key not in best or p["tokens_per_s"] > best[key]["tokens_per_s"]):
            best[key] = p
    doc = [("h", 2, "Peers"), ("p", [f"Ours: the best point per backend and context length on {top} device(s)."]),
           ("table", ["backend", "S", "attention (kernel)", "step", "tokens/s", "TFLOP/s per device", "MFU"],
            [[b, fmt_seq(seq), f"{p['attention']} ({p['kernel']})", fmt(p["step_s"], "seconds"),
              fmt(p["tokens_per_s"], "count"), fmt(p["tflops_per_device"], "one"), fmt(p["mfu"], "percent")]
             for (b, seq), p in best.items()]) if best else ("p", ["No successful point."])]
    if not report["peers"]:
        return doc
    doc += [("p", [("Peers, as measured by their own code (attention rows time the attention alone: compare them "
                    "with `twinflash bench kernels` / `bench ring`, not with the whole-model numbers above):")]),
            ("table", ["work", "peer", "value", "unit", "source"],
             [[q["work"], q["peer"], f"{q['value']:,.4g}", q["unit"], q["source"]] for q in report["peers"]])]
    squash = functools.partial(re.sub, r"[^a-z0-9]", "")
    lines = [[(f"ours vs peer: {_where(p)}: {fmt(p['mfu'], 'percent')} MFU vs {q['peer']} {q['value']:.1f} % MFU "
               f"({p['mfu'] * 100 / q['value']:.2f}×; {q['work']})")]
             for q in report["peers"] if q["unit"] == "% MFU" and report["settings"]["mode"] == "train"
             and squash(report["model"]["name"].lower()) in squash(q["work"].lower())
             for p in _points(report) if (p["devices"], p["seq_len"]) == _peer_scope(q["work"])
             and p["status"] == "ok" and _finite(p["mfu"]) and q["value"]]
    return doc + ([("list", lines)] if lines else [])


def _flops_and_traces(report: dict) -> list[tuple]:
    peak = report["flops"]["peak_flops_per_device"]
    doc = [("h", 2, "FLOPs and MFU"), ("code", report["flops"]["formula"]),
           ("p", [f"Peak per device: {peak / 1e12:,.0f} TFLOP/s." if _finite(peak)
                  else "No peak known for this platform: MFU is not reported."])]
    traces = [[("a", p["trace"], p["trace"]), f" ({_where(p)})"] for p in _points(report) if p["trace"]]
    return doc + ([("h", 2, "Profiler traces"), ("list", traces)] if traces else [])


# --- writers ---------------------------------------------------------------------------------------------------

def _md_text(text: str) -> str:
    return re.sub(r"\s+", " ", str(text)).replace("|", "\\|").replace("<", "&lt;")


def _md_inline(parts) -> str:
    return "".join(_md_text(x) if isinstance(x, str) else f"**{_md_text(x[1])}**" if x[0] == "b"
                   else f"[{_md_text(x[1])}](<{x[2]}>)" for x in (parts if isinstance(parts, list) else [parts]))


_MARKDOWN = {
    "h": lambda level, text: "#" * level + " " + _md_text(text),
    "p": _md_inline,
    "code": lambda text: f"```\n{text}\n```",
    "list": lambda items: "\n".join(f"- {_md_inline(item)}" for item in items),
    "img": lambda alt, src: f"![{alt}]({src})",
    "table": lambda head, rows: "\n".join("| " + " | ".join(map(_md_inline, row)) + " |"
                                          for row in [head, ["---"] * len(head), *rows]),
}


def render_markdown(report: dict) -> str:
    """report.md: the whole report as GitHub-flavoured Markdown, images linked relatively (plots/*.png)."""
    return "\n\n".join(_MARKDOWN[kind](*rest) for kind, *rest in _document(report)) + "\n"


_CSS = """body{font-family:system-ui,sans-serif;max-width:1400px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1em;font-size:90%}th,td{border:1px solid #ccc;padding:.2em .5em}
th{background:#f3f4f6;text-align:left}.pass{color:#1a7f37;font-weight:bold}.fail,.status{color:#cf222e;
font-weight:bold}pre{background:#f6f8fa;padding:.6em;overflow-x:auto;white-space:pre-wrap}img{max-width:100%}
.wide{overflow-x:auto}"""


def _html_inline(parts) -> str:
    esc = html.escape
    return "".join(esc(x) if isinstance(x, str) else f"<strong>{esc(x[1])}</strong>" if x[0] == "b"
                   else f'<a href="{esc(x[2])}">{esc(x[1])}</a>'
                   for x in (parts if isinstance(parts, list) else [parts]))


def _html_row(cells, tag: str = "td") -> str:
    classes = {"PASS": "pass", "FAIL": "fail", **dict.fromkeys(STATUS_LABELS.values(), "status")}
    return "<tr>" + "".join(f"<{tag}{f' class={classes[c]!r}' if isinstance(c, str) and c in classes else ''}>"
                            f"{_html_inline(c)}</{tag}>" for c in cells) + "</tr>"


_HTML = {
    "h": lambda level, text: f"<h{level}>{html.escape(text)}</h{level}>",
    "p": lambda parts: f"<p>{_html_inline(parts)}</p>",
    "code": lambda text: f"<pre>{html.escape(text)}</pre>",
    "list": lambda items: "<ul>" + "".join(f"<li>{_html_inline(item)}</li>" for item in items) + "</ul>",
    "img": lambda alt, src: f'<p><img src="{html.escape(src)}" alt="{html.escape(alt)}"></p>',
    "table": lambda head, rows: (f'<div class="wide"><table><thead>{_html_row(head, "th")}</thead><tbody>'
                                 + "".join(map(_html_row, rows)) + "</tbody></table></div>"),
}


def render_html(report: dict) -> str:
    """report.html: the same content as report.md, self-contained but for the PNGs (relative links)."""
    title = html.escape(f"twinflash compare: {report['model']['name']} ({_verdict(report['passed'])})")
    return (f'<!doctype html>\n<html lang="en">\n<head><meta charset="utf-8"><title>{title}</title>\n'
            f"<style>{_CSS}</style></head>\n<body>\n"
            + "\n".join(_HTML[kind](*rest) for kind, *rest in _document(report)) + "\n</body>\n</html>\n")


# --- plots: each returns a Figure, or None when it has no data -----------------------------------------------

def _figure(panels: int = 1):
    fig = Figure(figsize=(6.4 * panels, 4.2), dpi=100, layout="constrained")
    return fig, list(fig.subplots(1, panels, squeeze=False)[0])


def _log2_x(ax, xs, label=fmt_seq) -> None:
    ticks = sorted(set(xs))
    ax.set_xscale("log", base=2)
    ax.set_xlim(ticks[0] / 1.4, ticks[-1] * 1.4)
    ax.set_xticks(ticks, [label(t) for t in ticks])
    ax.minorticks_off()


def _label_failed(ax, x: float, text: str, color: str = "#cf222e") -> None:
    ax.annotate(text, xy=(x, 0.03), xycoords=("data", "axes fraction"), rotation=90, fontsize=8, ha="center",
                va="bottom", color=color)


def _ok(p: dict, key: str) -> bool:
    return p["status"] == "ok" and _finite(p[key])


def _ours(report: dict, devices: int | None = None) -> list[dict]:
    return [p for p in _points(report) if p["attention"] == "ours" and devices in (None, p["devices"])]


def _lines_vs_seq(report: dict, panels: list[tuple], title: str):
    points = _ours(report, top := _max_devices(report))
    panels = [panel for panel in panels if any(_ok(p, panel[0]) for p in points)]
    if not panels:
        return None
    fig, axes = _figure(len(panels))
    for ax, (key, label, scale) in zip(axes, panels):
        for backend in report["settings"]["backends"]:
            xy = [(p["seq_len"], p[key] * scale) for p in points if p["backend"] == backend and _ok(p, key)]
            if xy:
                ax.plot(*zip(*xy), "o-", color=_COLORS[backend], label=backend)
        for p in points:
            if p["status"] != "ok":
                _label_failed(ax, p["seq_len"], f"{p['backend']} {STATUS_LABELS[p['status']]}", _COLORS[p["backend"]])
        _log2_x(ax, [p["seq_len"] for p in points])
        ax.set(xlabel="context length (tokens)", ylabel=label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{title}, {top} device(s), attention ours")
    return fig


def _plot_scaling(report: dict):
    points = [p for p in _ours(report) if _ok(p, "tokens_per_s")]
    if len({p["devices"] for p in points}) < 2:
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
    _log2_x(ax, [p["devices"] for p in points], str)
    ax.set_yscale("log")
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
    points = _ours(report, top := _max_devices(report))
    parts = (("step_s", "step", "#555555"), ("forward_s", "forward", "#4c78a8"),
             ("backward_s", "backward", "#f58518"), ("comm_s", "comm", "#54a24b"))
    if not any(_ok(p, key) for p in points for key, _, _ in parts[1:]):
        return None
    fig, (ax,) = _figure()
    _bars(ax, [f"{p['backend']}\nS={fmt_seq(p['seq_len'])}" for p in points],
          [(label, color, [_ms_or_status(p, key) if key == "step_s" or p["status"] == "ok" else None for p in points])
           for key, label, color in parts])
    ax.set(ylabel="ms", title=f"Step, forward, backward, comm: {top} device(s), attention ours")
    return fig


def _plot_ablation(report: dict):
    top = _max_devices(report)
    points = {(p["backend"], p["attention"], p["seq_len"]): p for p in _points(report) if p["devices"] == top}
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
        if max(values) / min(values) > 50:
            ax.set_yscale("log")
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
    ax.set(xlabel="step", ylabel="loss", title="Loss curves (equivalence run)")
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


_PLOTS = (("throughput", lambda r: _lines_vs_seq(r, [("tokens_per_s", "tokens/s", 1),
                                                     ("tflops_per_device", "TFLOP/s per device", 1)], "Throughput")),
          ("memory", lambda r: _lines_vs_seq(r, [("peak_memory_bytes", "peak memory per device (GiB)", 2**-30)],
                                             "Peak memory")),
          ("scaling", _plot_scaling), ("breakdown", _plot_breakdown), ("ablation", _plot_ablation),
          ("loss_curves", _plot_loss_curves))


def _numpy_scalar(value: Any) -> Any:
    """json.dumps' fallback: numpy scalars (the schema takes them as numbers) as Python numbers."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def write_report(report: dict, out_dir: Path) -> None:
    """Checks `report` (ValueError, nothing written) and writes out_dir/report.json ("plots" filled in),
    report.md, report.html and out_dir/plots/*.png; each file is renamed into place once all are rendered."""
    data = {**report, "plots": []} if isinstance(report, dict) else report
    validate_report(data)
    out_dir = Path(out_dir)
    figures = [(name, fig) for name, make in _PLOTS if (fig := make(data)) is not None]
    data["plots"] = [f"plots/{name}.png" for name, _ in figures]
    texts = {"report.json": json.dumps(data, indent=1, default=_numpy_scalar) + "\n",
             "report.md": render_markdown(data), "report.html": render_html(data)}
    (out_dir / "plots" if figures else out_dir).mkdir(parents=True, exist_ok=True)
    staged: list[tuple[Path, Path]] = []
    try:
        for name, fig in figures:
            final = out_dir / "plots" / f"{name}.png"
            staged.append((final.with_name(f".{final.name}.{os.getpid()}.tmp"), final))
            fig.savefig(staged[-1][0], format="png")
        for name, text in texts.items():
            staged.append((out_dir / f".{name}.{os.getpid()}.tmp", out_dir / name))
            staged[-1][0].write_text(text, encoding="utf-8")
    except BaseException:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        raise
    for tmp, final in staged:
        os.replace(tmp, final)
