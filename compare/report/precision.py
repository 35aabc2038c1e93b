"""The precision section of `twinflash compare --mode train --precisions bf16,fp8` (report.json's "precision",
null without fp8): per benchmark point and precision its tokens/s, peak memory, MFU against the bf16 dense peak and
against the FP8 dense peak (`weights.flops`), time to the report's token count and, per FP8 point, its speed over
the bf16 point of the same backend, length, devices and kernel; and the loss curves bf16 vs FP8 per backend on the
same text (the bf16 noise floor's `<backend>-ours` run and its FP8 twin `<backend>-ours-fp8`,
compare/harness/noise_floor.py), with each backend's per-step relative difference, and torch's FP8 run against
JAX's. Each of those pairs is measured against the bf16 noise floor (the report's equivalence.bf16 floor: how far
two correct bf16 trainings drift apart), with the noise floor's ratio rule: mean difference / floor <=
`RATIO_LIMIT` reads "within the bf16 noise floor". Owns the section's dict
(`precision_section`) and its blocks of the report's document model (`blocks`, rendered by
compare/report/render.py); its plots are compare/report/plots.py's (`precision`, `precision_curves`).

A CPU run ranks nothing: no MFU, no speed ratio (interpreted kernels on emulated devices; FP8 there is emulated
too), the same caveat as the rest of its report.
"""

from __future__ import annotations

from compare.harness.noise_floor import FLOOR_MIN, RATIO_LIMIT, SEED, compare_curves
from compare.report.fields import DASH, STATUS_LABELS, finite, fmt, fmt_seq, fmt_tokens, on_cpu, sorted_points
from weights.flops import PEAK_FLOPS_PER_DEVICE, PEAK_FP8_FLOPS_PER_DEVICE

RECIPE = ("FP8: the decoder layers' linear matmuls (attention and MLP projections) in float8_e4m3fn with dynamic "
          "per-tensor scaling, forward and backward, as `twinflash train --fp8` (weights/fp8.py); the embedding, "
          "the LM head, the norms and the attention (our kernels, the ring) in bf16; master weights and optimizer "
          "state float32.")


def _key(p: dict) -> tuple:
    return p["backend"], p["seq_len"], p["devices"], p["attention"]


def _row(p: dict, bf16: dict | None, gpu: bool) -> dict:
    ok = p["status"] == "ok"
    tflops = p["tflops_per_device"] if ok and gpu else None
    ratio = None
    if gpu and ok and p["precision"] == "fp8" and bf16 and bf16["status"] == "ok" and finite(bf16["tokens_per_s"]):
        ratio = p["tokens_per_s"] / bf16["tokens_per_s"]
    return {"backend": p["backend"], "seq_len": p["seq_len"], "devices": p["devices"], "attention": p["attention"],
            "kernel": p["kernel"], "precision": p["precision"], "status": p["status"], "message": p["message"],
            "tokens_per_s": p["tokens_per_s"], "peak_memory_bytes": p["peak_memory_bytes"],
            "mfu": None if tflops is None else tflops * 1e12 / PEAK_FLOPS_PER_DEVICE,
            "mfu_fp8_peak": None if tflops is None else tflops * 1e12 / PEAK_FP8_FLOPS_PER_DEVICE,
            "time_to_tokens_s": p["time_to_tokens_s"], "speed_vs_bf16": ratio}


def precision_section(report: dict, floor: dict | None, curves: list[dict]) -> dict | None:
    """report.json's "precision" from a report dict whose benchmark points name their precision, the noise
    floor's settings (`noise_floor.plan`, None when no curves ran) and the curve records of the runs of our kernels
    in both precisions (`noise_floor.run_record` with "precision" added); None unless the run asked for fp8."""
    if "fp8" not in report["settings"].get("precisions", []):
        return None
    gpu = not on_cpu(report)
    points = sorted_points(report, fp8=True)
    bf16 = {_key(p): p for p in points if p["precision"] != "fp8"}
    section = {"precisions": report["settings"]["precisions"], "recipe": RECIPE,
               "peak_flops_per_device": PEAK_FLOPS_PER_DEVICE if gpu else None,
               "peak_fp8_flops_per_device": PEAK_FP8_FLOPS_PER_DEVICE if gpu else None,
               "rows": [_row(p, bf16.get(_key(p)), gpu) for p in points], "curves": None}
    if floor is not None:
        order = {b: i for i, b in enumerate(report["settings"]["backends"])}
        curves = sorted(curves, key=lambda r: (order.get(r["backend"], len(order)), r["precision"] == "fp8"))
        losses = {r["name"]: r["losses"] for r in curves if r["status"] == "ok" and r["losses"]}
        pairs = [compare_curves(f"{backend}: fp8 vs bf16", "precision", f"{backend}-ours", f"{backend}-ours-fp8",
                                losses)
                 for backend in report["settings"]["backends"]
                 if f"{backend}-ours" in losses and f"{backend}-ours-fp8" in losses]
        if {"torch-ours-fp8", "jax-ours-fp8"} <= set(losses):
            pairs.append(compare_curves("torch vs jax, fp8", "cross", "torch-ours-fp8", "jax-ours-fp8", losses))
        bf16_floor = (report["equivalence"].get("bf16") or {}).get("floor")
        section["curves"] = {"seq_len": floor["seq_len"], "devices": floor["devices"], "steps": floor["steps"],
                             "data": "text", "seed": SEED, "runs": curves,
                             "pairs": [_against_floor(p, bf16_floor) for p in pairs], "floor": bf16_floor,
                             "ratio_limit": RATIO_LIMIT[0]}
    return section


def _against_floor(pair: dict, floor: float | None) -> dict:
    """`pair` with its mean difference over the bf16 noise floor ("ratio") and whether that is within the noise
    floor's `RATIO_LIMIT` ("within_floor"); both None without a measured floor or a finite mean."""
    ratio = None
    if floor is not None and pair["mean"] is not None and finite(pair["mean"]):
        ratio = pair["mean"] / max(floor, FLOOR_MIN)
    return {**pair, "ratio": ratio, "within_floor": None if ratio is None else ratio <= RATIO_LIMIT[0]}


def blocks(report: dict) -> list[tuple]:
    """The section's headings, paragraphs, tables and images; [] without a precision section."""
    section = report.get("precision")
    if not section:
        return []
    gpu = not on_cpu(report)
    tokens = report["settings"]["time_to_tokens"]
    headers = ["backend", "attention", "S", "devices", "precision", "tokens/s", "peak memory per device"]
    headers += ["MFU (bf16 peak)", "MFU (FP8 peak)"] if gpu else []
    headers += [f"time to {fmt_tokens(tokens)} tokens"] + (["fp8 / bf16 speed"] if gpu else [])
    rows = []
    for r in section["rows"]:
        label = STATUS_LABELS.get(r["status"])
        cells = [("tokens_per_s", "count"), ("peak_memory_bytes", "bytes")]
        cells += [("mfu", "percent"), ("mfu_fp8_peak", "percent")] if gpu else []
        cells += [("time_to_tokens_s", "duration")]
        row = [r["backend"], f"{r['attention']} ({r['kernel']})", fmt_seq(r["seq_len"]), str(r["devices"]),
               r["precision"]] + [label or fmt(r[key], kind) for key, kind in cells]
        rows.append(row + ([f"{r['speed_vs_bf16']:.3g}×" if finite(r["speed_vs_bf16"]) else DASH] if gpu else []))
    if gpu:
        peaks = (f"MFU against the bf16 dense peak ({section['peak_flops_per_device'] / 1e12:,.0f} TFLOP/s) and, in "
                 f"its own column, against the FP8 dense peak ({section['peak_fp8_flops_per_device'] / 1e12:,.0f} "
                 "TFLOP/s, weights.flops.PEAK_FP8_FLOPS_PER_DEVICE); fp8 / bf16 speed: the FP8 point's tokens/s "
                 "over the bf16 point's of the same backend, length, devices and kernel.")
    else:
        peaks = ("CPU run: FP8 runs emulated beside interpreted kernels; no MFU and no speed ratio (the timings "
                 "rank nothing).")
    doc = [("h", 2, "Precision: bf16 vs FP8"), ("p", [RECIPE]), ("p", [peaks]), ("table", headers, rows)]
    notes = [[f"{r['backend']} {r['attention']} S={fmt_seq(r['seq_len'])} on {r['devices']} device(s) "
              f"{r['precision']}: {STATUS_LABELS.get(r['status'], r['status'])}: {r['message']}"]
             for r in section["rows"] if r["message"]]
    doc += [("p", ["Notes:"]), ("list", notes)] if notes else []
    doc += _images(report, "precision")
    return doc + _curve_blocks(report, section["curves"])


def _curve_blocks(report: dict, curves: dict | None) -> list[tuple]:
    if curves is None:
        return [("p", ["No loss curves: the bf16 noise floor's trainings did not run (--noise-floor-steps 0)."])]
    doc = [("h", 3, "Loss curves, bf16 vs FP8"),
           ("p", [f"{curves['steps']} training steps of text (seed {curves['seed']}) at "
                  f"S={fmt_seq(curves['seq_len'])}, fsdp=1 × sp={curves['devices']}, each backend with our kernels "
                  "in bf16 (the noise floor's run) and with FP8 linears, the same weights, batches and optimizer "
                  "(`twinflash train --data text` and `--fp8`); relative difference per step |a − b| / mean(|a|, "
                  "|b|)."]),
           ("table", ["run", "precision", "status", "first loss", "final loss", "steps", "wall time"],
            [[r["name"], r["precision"], STATUS_LABELS.get(r["status"], r["status"].upper()),
              f"{r['losses'][0]:.4f}" if r["losses"] else DASH, f"{r['losses'][-1]:.4f}" if r["losses"] else DASH,
              str(len(r["losses"])), f"{r['seconds']:.0f} s"] for r in curves["runs"]])]
    if curves["pairs"]:
        floor, limit = curves.get("floor"), curves.get("ratio_limit", RATIO_LIMIT[0])
        if floor is None:
            doc.append(("p", ["No bf16 noise floor in this report (its runs did not finish, or the report "
                              "predates the comparison): the pairs are shown without a verdict."]))
        else:
            doc.append(("p", [f"Against the bf16 noise floor ({floor * 100:.3g} %, the section above): ratio = "
                              f"mean difference / floor; within the floor at {limit:g} or less, the noise floor's "
                              "own rule (compare/harness/noise_floor.py RATIO_LIMIT)."]))
        doc.append(("table", ["pair", "steps", "max", "mean", "final", "ratio to the bf16 floor", "verdict"],
                    [[p["name"], str(p["steps"])] + [fmt(p[k], "percent") for k in ("max", "mean", "final")]
                     + _verdict_cells(p, limit) for p in curves["pairs"]]))
    notes = [[f"{r['name']}: {r['message']}"] for r in curves["runs"] if r["message"]]
    doc += [("p", ["Runs that did not finish:"]), ("list", notes)] if notes else []
    return doc + _images(report, "precision_curves")


def _verdict_cells(pair: dict, limit: float) -> list[str]:
    ratio = pair.get("ratio")
    if ratio is None:
        return [DASH, "not measured"]
    return [f"{ratio:.2f}", f"within the bf16 noise floor (at most {limit:g})" if pair["within_floor"]
            else f"beyond the bf16 noise floor (above {limit:g})"]


def _images(report: dict, *names: str) -> list[tuple]:
    return [("img", name.replace("_", " "), f"plots/{name}.png") for name in names
            if f"plots/{name}.png" in report.get("plots", [])]
