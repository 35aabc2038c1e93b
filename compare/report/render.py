"""The two renderings of `twinflash compare`'s report, report.md and report.html (`render_markdown`,
`render_html`: one document model, two writers; the number formats are compare/report/fields.py's);
`compare/report/write.py` checks and writes them.

The report opens with its summary (compare/report/summary.py: speed torch vs JAX, one line per verdict, the
throughput plot), then the details. A benchmark point whose status is not "ok" shows it (OOM, ERROR, TIMEOUT,
UNSUPPORTED, SKIPPED) once, in one cell spanning its measurements, and its message under the table. Every number
keeps three significant digits (a small value is never shown as 0.0). Communication is two numbers: the exposed part
(device 0 communicating with nothing to compute: what it costs, never more than the step) and the communication
kernels' busy time (overlap included). A CPU run says at the
top that its timings measure interpreters on emulated devices and ranks nothing: no scaling efficiency, no
speed-up, no best point, no comparison with the peers. On GPUs: our best point per (backend, context length) at the
most devices beside the peers' table, and an "ours vs peer" line where a point measures a peer's work (same model,
devices and context length: MFU against MFU). The peers' numbers are cited from compare/report/peers.json.
"""

from __future__ import annotations

import functools
import html
import math
import re

from compare.report import fastpath, hf, noise_floor, peer, precision, schemes, summary
from compare.report.fields import (ATTENTIONS, DASH, STATUS_LABELS, WORST_PARAMETERS, finite, fmt, fmt_seq, fmt_tokens,
                                   max_devices, on_cpu, sorted_points)

_GRAD_CHECK = "gradient max-abs (worst parameter)"


def _verdict(passed: bool) -> str:
    return "PASS" if passed else "FAIL"


# --- document model, shared by markdown and HTML ---------------------------------------------------------------
# blocks: ("h", level, text) ("p", [inline]) ("table", headers, rows) ("code", text) ("list", [[inline]])
# ("img", alt, src); inline (a table cell, or an item of a list): str, ("b", text) bold, ("a", text, href) link;
# a table cell may also be ("span", columns, text): one cell over `columns` columns (summary.span)

def _where(p: dict) -> str:
    fp8 = " fp8" if p.get("precision") == "fp8" else ""
    return (f"{p['backend']} {p['attention']} ({p['kernel']}){fp8} S={fmt_seq(p['seq_len'])} on {p['devices']} "
            "device(s)")


def _images(report: dict, *names: str) -> list[tuple]:
    return [("img", name.replace("_", " "), f"plots/{name}.png") for name in names
            if f"plots/{name}.png" in report.get("plots", [])]


def _document(report: dict) -> list[tuple]:
    s, model = report["settings"], report["model"]
    eq = report["equivalence"]
    failing = [f"{c['name']}: {k['metric']} {fmt(k['value'], 'sig')} > tolerance {fmt(k['tolerance'], 'sig')}"
               for c in eq["comparisons"] for k in c["checks"] if not k["passed"]]
    failing += eq.get("failures", []) + eq.get("fast_path", {}).get("failures", [])
    failing += (report.get("hf") or {}).get("failures", []) + (report.get("training_peer") or {}).get("failures", [])
    detail = ("; ".join(failing) if failing else "every check within its tolerance"
              if eq["comparisons"] else "no comparison was run") + "."
    doc = [("h", 1, f"twinflash compare: {model['name']}, {s['mode']}, {s['dtype']}")]
    if on_cpu(report):
        doc.append(("p", [("b", "CPU run: not a benchmark."), " " + CPU_CAVEAT.format(devices=s["devices"])]))
    judged = "equivalence and fast path" + (", HF rows" if report.get("hf") else "") + (
        ", the training peer's agreement" if (report.get("training_peer") or {}).get("measurements") else "")
    doc.append(("p", [("b", f"Verdict: {_verdict(report['passed'])}"), f" ({judged}) — {detail}"]))
    return (doc + summary.blocks(report) + _setup(report) + _equivalence(report) + fastpath.blocks(report) + noise_floor.blocks(report)
            + _benchmark(report)
            + _ablation(report) + schemes.blocks(report) + precision.blocks(report) + hf.blocks(report)
            + peer.blocks(report)
            + _peers(report) + _jobs(report) + _flops_and_traces(report))


CPU_CAVEAT = ("The kernels ran in Triton's interpreter and in Pallas's interpret mode on {devices} emulated devices "
              "(gloo processes for torch, XLA host devices for JAX, compiled without LLVM's optimisations): the "
              "timings below measure those interpreters and the host, not the kernels, and rank nothing (no "
              "scaling efficiency, no speed-up, no best point, no comparison with the peers). Peak memory is the "
              "worker process's peak host RSS so far. The equivalence verdict holds on any machine.")


def _setup(report: dict) -> list[tuple]:
    env, s, m = report["environment"], report["settings"], report["model"]
    groups: dict[str, int] = {}
    for name in env["devices"]:
        groups[name] = groups.get(name, 0) + 1
    rows = [["platform", env["platform"]],
            ["devices", ", ".join(f"{n} × {name}" if n > 1 else name for name, n in groups.items()) or DASH],
            ["driver", env["driver"] or DASH], ["python", env["python"]]]
    rows += [[lib, version or DASH] for lib, version in env["libraries"].items()]
    rows += [["git commit", env["git_commit"] or "unknown (the checkout is no git repository)"], ["host", f"{env['hostname']} ({env['cpu_count']} CPUs)"],
             ["model", (f"{m['name']}: {fmt(m['num_params'], 'count')} parameters, {m['layers']} layers, hidden "
                        f"{m['hidden']}, {m['heads']} heads ({m['kv_heads']} KV), head_dim {m['head_dim']}, "
                        f"vocab {m['vocab']}")],
             ["mode", f"{s['mode']}, {s['dtype']}, {s['steps']} steps"],
             ["context lengths", ", ".join(map(fmt_seq, s["seq_lens"]))],
             ["device counts", ", ".join(map(str, s["device_counts"])) + f" (of {s['devices']})"],
             ["backends", ", ".join(s["backends"])], ["attention ablation", ", ".join(s["attention_ablation"])]]
    if "fp8" in s.get("precisions", []):
        rows.append(["precisions", ", ".join(s["precisions"]) + " (the precision section below)"])
    if len(s.get("schemes", ["ring"])) > 1:
        hybrid = f" (hybrid U={s['ulysses_degree']})" if "hybrid" in s["schemes"] else ""
        rows.append(["sequence-parallel schemes", ", ".join(s["schemes"]) + hybrid + " (the scheme section below)"])
    return [("h", 2, "Setup"), ("code", report["command"]), ("p", [f"Created {report['created']}."]),
            ("table", ["", "value"], rows)]


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
        tol = tol if finite(tol) and tol > 0 else None

        def badness(p, tol=tol):
            d = p["max_abs_diff"] / tol if tol else p["max_abs_diff"]
            return d if finite(d) else math.inf

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


def _status(p: dict) -> str | None:
    """The label of a point that did not run (OOM, TIMEOUT, ...); None for one that did."""
    return None if p["status"] == "ok" else STATUS_LABELS.get(p["status"], p["status"].upper())


def _cells(p: dict, columns) -> list:
    """A point's measurements, or its status once in a cell spanning them all."""
    if _status(p):
        return [summary.span(len(columns), _status(p))]
    return [fmt(p[key], kind) for key, kind in columns]


def _benchmark(report: dict) -> list[tuple]:
    columns = [("step_s", "seconds"), ("forward_s", "seconds"), ("backward_s", "seconds"),
               ("comm_exposed_s", "seconds"), ("comm_s", "seconds"), ("comm_bytes", "bytes"),
               ("comm_bandwidth_gbps", "one"), ("tokens_per_s", "count"), ("tflops_per_device", "one"),
               ("mfu", "percent"), ("peak_memory_bytes", "bytes"), ("scaling_efficiency", "percent"),
               ("time_to_tokens_s", "duration")]
    headers = ["backend", "attention", "kernel", "S", "devices", "step", "forward", "backward",
               "exposed comm (≤ step)", "comm kernels busy", "comm volume", "comm GB/s (busy)", "tokens/s",
               "TFLOP/s per device", "MFU", "peak memory per device", "scaling efficiency",
               f"time to {fmt_tokens(report['settings']['time_to_tokens'])} tokens"]
    if on_cpu(report):  # CPU timings rank nothing
        drop = headers.index("scaling efficiency")
        del headers[drop], columns[drop - 5]
    what = "training step (forward, backward, optimizer)" if report["settings"]["mode"] == "train" else "forward"
    points = sorted_points(report)
    rows = [[p["backend"], p["attention"], p["kernel"], fmt_seq(p["seq_len"]), str(p["devices"])]
            + _cells(p, columns) for p in points]
    notes = [[f"{_where(p)}: {STATUS_LABELS.get(p['status'], p['status'])}: {p['message']}"]
             for p in points if p["message"]]
    comm = ("Exposed comm: the time of the profiled step during which device 0 communicated and computed nothing "
            "(at most the median step): the communication that costs time. Comm kernels "
            "busy: the union of the communication's own intervals on device 0 in the profiled step (NCCL kernels, "
            "gloo transfers, XLA collectives), hidden or not, which the bandwidth divides; it can exceed the step "
            "where transfers overlap compute or the profiler slows the step." + (
                " Torch on CPU: exposed comm not measured (Triton's interpreter leaves no profiler event for the "
                "compute that hides a transfer)." if on_cpu(report) else ""))
    doc = [("h", 2, "Benchmark"), ("p", [f"Median {what}; one row per point."]), ("p", [comm]),
           ("table", headers, rows) if rows else ("p", ["No benchmark points."])]
    doc += [("p", ["Notes:"]), ("list", notes)] if notes else []
    return doc + _images(report, "scaling", "memory", "breakdown")  # throughput: the summary's plot


def _ablation(report: dict) -> list[tuple]:
    top = max_devices(report)
    cells: dict[tuple, dict[str, dict]] = {}
    for p in sorted_points(report):
        if p["devices"] == top:
            cells.setdefault((p["backend"], p["seq_len"]), {})[p["attention"]] = p
    kinds = [a for a in ATTENTIONS if any(a in row for row in cells.values())]
    if len(kinds) < 2:
        return []
    rows, ranked = [], not on_cpu(report)
    for (backend, seq), row in cells.items():
        ok = all(a in row and row[a]["status"] == "ok" and finite(row[a]["step_s"]) for a in ("ours", "vendor"))
        speedup = f"{row['vendor']['step_s'] / row['ours']['step_s']:.3g}×" if ok and row["ours"]["step_s"] else DASH
        rows.append([backend, fmt_seq(seq)] + [f"{_status(row[a]) or fmt(row[a]['step_s'], 'seconds')} ({row[a]['kernel']})"
                                               if a in row else DASH for a in kinds] + ([speedup] if ranked else []))
    what = "; speed-up = vendor step time / ours." if ranked else " (interpreted on CPU: not a ranking)."
    return [("h", 2, "Attention ablation"),
            ("p", [f"Step time on {top} device(s) per attention implementation{what}"]),
            ("table", ["backend", "S"] + kinds + (["ours speed-up vs vendor"] if ranked else []), rows)
            ] + _images(report, "ablation")


def _peer_scope(work: str) -> tuple[int | None, int | None]:
    """(devices, seq_len) that a peer's work names, e.g. "4 GPUs ..., S=32k" -> (4, 32768)."""
    gpus, seq = re.search(r"(\d+)\s*GPUs?\b", work), re.search(r"S=(\d+)(k?)", work)
    return (int(gpus.group(1)) if gpus else None, int(seq.group(1)) * (1024 if seq.group(2) else 1) if seq else None)


def _peers(report: dict) -> list[tuple]:
    if on_cpu(report):
        return _peer_table(report, "Peers, as measured on GPUs by their own code (shown for reference: this CPU run "
                                   "is not compared with them):")
    top, best = max_devices(report), {}
    for p in sorted_points(report):
        key = (p["backend"], p["seq_len"])
        if p["devices"] == top and p["status"] == "ok" and finite(p["tokens_per_s"]) and (
                key not in best or p["tokens_per_s"] > best[key]["tokens_per_s"]):
            best[key] = p
    doc = [("h", 2, "Peers"), ("p", [f"Ours: the best point per backend and context length on {top} device(s)."]),
           ("table", ["backend", "S", "attention (kernel)", "step", "tokens/s", "TFLOP/s per device", "MFU"],
            [[b, fmt_seq(seq), f"{p['attention']} ({p['kernel']})", fmt(p["step_s"], "seconds"),
              fmt(p["tokens_per_s"], "count"), fmt(p["tflops_per_device"], "one"), fmt(p["mfu"], "percent")]
             for (b, seq), p in best.items()]) if best else ("p", ["No successful point."])]
    doc = doc + _peer_table(report, "Peers, as measured by their own code (attention rows time the attention "
                                    "alone: compare them with `twinflash bench kernels` / `bench ring`, not with "
                                    "the whole-model numbers above):")
    squash = functools.partial(re.sub, r"[^a-z0-9]", "")
    lines = [[(f"ours vs peer: {_where(p)}: {fmt(p['mfu'], 'percent')} MFU vs {q['peer']} {q['value']:.1f} % MFU "
               f"({p['mfu'] * 100 / q['value']:.2f}×; {q['work']})")]
             for q in report["peers"] if q["unit"] == "% MFU" and report["settings"]["mode"] == "train"
             and squash(report["model"]["name"].lower()) in squash(q["work"].lower())
             for p in sorted_points(report) if (p["devices"], p["seq_len"]) == _peer_scope(q["work"])
             and p["status"] == "ok" and finite(p["mfu"]) and q["value"]]
    return doc + ([("list", lines)] if lines else [])


def _peer_table(report: dict, intro: str) -> list[tuple]:
    if not report["peers"]:
        return []
    return [("h", 2, "Peers") if on_cpu(report) else ("p", []), ("p", [intro]),
            ("table", ["work", "peer", "value", "unit", "measured by", "source"],
             [[q["work"], q["peer"], f"{q['value']:,.4g}", q["unit"], q.get("command", DASH), q["source"]]
              for q in report["peers"]])]


def _jobs(report: dict) -> list[tuple]:
    """Every job's setup (its process's start for the first job of a process, weights, compilation) beside the
    time it measured."""
    jobs = report.get("jobs") or []
    if not jobs:
        return []
    keys = ("launch_s", "weights_s", "compile_s")
    rows = [[j["id"], j["status"]] + [fmt(j[k], "seconds") for k in keys]
            + [fmt(sum(j[k] for k in keys if finite(j[k])) if finite(j["weights_s"]) else None, "seconds"),
               fmt(j["measured_s"], "seconds"), _phases(j.get("phases_s"))] for j in jobs]
    return [("h", 2, "Setup and measurement per job"),
            ("p", ["One launch per backend and device count serves all of its jobs: launch is the process's start "
                   "(its first job only), weights the model built and its weights read (generated once per run), "
                   "compile the first step beyond a steady one (compilation, autotuning; none for an equivalence check, whose "
                   "steps are all measured), measured the rest, and an equivalence check's phases within it. On a host "
                   "of several GPUs, launches on disjoint "
                   "GPUs (the backends' one-GPU launches) run side by side unless --serial-launches: each point runs "
                   "on GPUs of its own and a one-GPU point moves nothing over NVLink or PCIe; they share the host's "
                   "cores."]),
            ("table", ["job", "status", "launch", "weights", "compile", "setup", "measured", "phases"], rows)]


def _phases(phases_s: dict | None) -> str:
    """An equivalence job's phases, in order, with their seconds (where its time goes); blank for other jobs."""
    return ", ".join(f"{name} {fmt(seconds, 'seconds')}" for name, seconds in (phases_s or {}).items())


def _flops_and_traces(report: dict) -> list[tuple]:
    peak = report["flops"]["peak_flops_per_device"]
    doc = [("h", 2, "FLOPs and MFU"), ("code", report["flops"]["formula"]),
           ("p", [f"Peak per device: {peak / 1e12:,.0f} TFLOP/s." if finite(peak)
                  else "No peak known for this platform: MFU is not reported."])]
    traces = [[("a", p["trace"], p["trace"]), f" ({_where(p)})"] for p in sorted_points(report, fp8=True)
              if p["trace"]]
    return doc + ([("h", 2, "Profiler traces"), ("list", traces)] if traces else [])


# --- writers ---------------------------------------------------------------------------------------------------

def _md_text(text: str) -> str:
    return re.sub(r"\s+", " ", str(text)).replace("|", "\\|").replace("<", "&lt;")


def _md_inline(parts) -> str:
    return "".join(_md_text(x) if isinstance(x, str) else f"**{_md_text(x[1])}**" if x[0] == "b"
                   else f"[{_md_text(x[1])}](<{x[2]}>)" for x in (parts if isinstance(parts, list) else [parts]))


def _md_row(cells) -> str:
    spread = [part for c in cells for part in ([c[2]] + [""] * (c[1] - 1) if isinstance(c, tuple) and c[0] == "span"
                                               else [c])]
    return "| " + " | ".join(map(_md_inline, spread)) + " |"


_MARKDOWN = {
    "h": lambda level, text: "#" * level + " " + _md_text(text),
    "p": _md_inline,
    "code": lambda text: f"```\n{text}\n```",
    "list": lambda items: "\n".join(f"- {_md_inline(item)}" for item in items),
    "img": lambda alt, src: f"![{alt}]({src})",
    "table": lambda head, rows: "\n".join(map(_md_row, [head, ["---"] * len(head), *rows])),
}


def markdown(blocks: list[tuple]) -> str:
    """Blocks of the document model as GitHub-flavoured Markdown."""
    return "\n\n".join(_MARKDOWN[kind](*rest) for kind, *rest in blocks) + "\n"


def render_markdown(report: dict) -> str:
    """report.md: the whole report as GitHub-flavoured Markdown, images linked relatively (plots/*.png)."""
    return markdown(_document(report))


_CSS = """body{font-family:system-ui,sans-serif;max-width:1400px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1em;font-size:90%}th,td{border:1px solid #ccc;padding:.2em .5em}
th{background:#f3f4f6;text-align:left}.pass{color:#1a7f37;font-weight:bold}.fail,.status{color:#cf222e;
font-weight:bold}pre{background:#f6f8fa;padding:.6em;overflow-x:auto;white-space:pre-wrap}img{max-width:100%}
.wide{overflow-x:auto}td.n{white-space:nowrap}"""


def _html_inline(parts) -> str:
    esc = html.escape
    return "".join(esc(x) if isinstance(x, str) else f"<strong>{esc(x[1])}</strong>" if x[0] == "b"
                   else f'<a href="{esc(x[2])}">{esc(x[1])}</a>'
                   for x in (parts if isinstance(parts, list) else [parts]))


_NOWRAP = 12  # a cell this short (a number with its unit: "207 ms", "36.2 %") is never broken over two lines


def _html_cell(c, tag: str) -> str:
    classes = {"PASS": "pass", "FAIL": "fail", **dict.fromkeys(STATUS_LABELS.values(), "status")}
    columns, c = (c[1], c[2]) if isinstance(c, tuple) and c[0] == "span" else (1, c)
    css = classes.get(c, "n" if len(c) <= _NOWRAP else None) if isinstance(c, str) else None
    return (f"<{tag}{f' colspan={columns}' if columns > 1 else ''}{f' class={css!r}' if css else ''}>"
            f"{_html_inline(c)}</{tag}>")


def _html_row(cells, tag: str = "td") -> str:
    return "<tr>" + "".join(_html_cell(c, tag) for c in cells) + "</tr>"


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
