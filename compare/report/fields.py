"""What the report's renderings and plots both read from a report dict (`compare/report/schema.json`): the attention
implementations in their order, the labels of a point that did not run, the benchmark points in table order, the
most devices measured, how a context length is written, the number formats (`fmt`: three significant digits, a
small value never shown as 0.0), how many parameters a gradient table lists, and whether the run was a CPU run
(which ranks nothing).
"""

from __future__ import annotations

import math
from typing import Any

ATTENTIONS = ("ours", "vendor", "reference")
DASH = "–"
WORST_PARAMETERS = 10  # parameters listed per gradient comparison, besides every failing one
STATUS_LABELS = {"oom": "OOM", "error": "ERROR", "timeout": "TIMEOUT", "unsupported": "UNSUPPORTED",
                 "skipped": "SKIPPED", "interrupted": "INTERRUPTED"}


def finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def fmt_seq(s: int) -> str:
    return f"{s // 1024}k" if s >= 1024 and s % 1024 == 0 else str(s)


def sorted_points(report: dict, fp8: bool = False, schemes: bool = False) -> list[dict]:
    """The benchmark points in table order; the FP8 ones (`--precisions ...,fp8`) only with `fp8`, those of the
    schemes besides the ring (`--schemes`) only with `schemes`: every section but the precision and the scheme
    sections shows the run's dtype on the ring alone."""
    order = {b: i for i, b in enumerate(report["settings"]["backends"])}
    points = [p for p in report["benchmark"]["points"] if (fp8 or p.get("precision") != "fp8")
              and (schemes or p.get("scheme", "ring") == "ring")]
    return sorted(points, key=lambda p: (order.get(p["backend"], len(order)), ATTENTIONS.index(p["attention"]),
                                         p["seq_len"], p["devices"], p.get("precision") == "fp8"))


def max_devices(report: dict) -> int:
    return max((p["devices"] for p in report["benchmark"]["points"]), default=report["settings"]["devices"])


def on_cpu(report: dict) -> bool:
    """A CPU run: interpreted kernels on emulated devices, timings that are not a benchmark."""
    return report["environment"]["platform"] == "cpu"


# --- number formats --------------------------------------------------------------------------------------------

def _duration(v: float) -> str:
    for least, div, unit in ((2 * 86400, 86400, "days"), (3600, 3600, "h"), (60, 60, "min")):
        if v >= least:
            return f"{v / div:.3g} {unit}"
    return _FORMATS["seconds"](v)


def _sig(v: float) -> str:
    """Three significant digits (thousands separated above 1,000): a small value is never printed as 0.0."""
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"


def _bytes(v: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(v) >= size:
            return f"{_sig(v / size)} {unit}"
    return f"{v:.3g} B"


_FORMATS = {
    "seconds": lambda v: f"{_sig(v * 1e3)} ms" if abs(v) < 1 else f"{_sig(v)} s",
    "duration": _duration,
    "bytes": _bytes,
    "count": lambda v: f"{v:,.0f}" if abs(v) >= 100 else _sig(v),
    "percent": lambda v: f"{_sig(v * 100)} %",
    "sig": _sig,
    "ratio": lambda v: f"{v:.7g}",
    "one": _sig,
}


def fmt(value: Any, kind: str) -> str:
    """`value` in one of the report's formats (seconds, duration, bytes, count, percent, sig, ratio, one); null
    is a dash, NaN and infinities are spelled out."""
    if value is None:
        return DASH
    return _FORMATS[kind](value) if finite(value) else str(value)


def fmt_tokens(n: float) -> str:
    return next((f"{n / d:.3g}{s}" for d, s in ((1e12, "T"), (1e9, "B"), (1e6, "M")) if n >= d), f"{n:,.0f}")
