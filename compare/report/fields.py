"""What the report's renderings and plots both read from a report dict (`compare/report/schema.json`): the attention
implementations in their order, the labels of a point that did not run, the benchmark points in table order, the
most devices measured, how a context length is written, and whether the run was a CPU run (which ranks nothing).
"""

from __future__ import annotations

import math
from typing import Any

ATTENTIONS = ("ours", "vendor", "reference")
STATUS_LABELS = {"oom": "OOM", "error": "ERROR", "timeout": "TIMEOUT", "unsupported": "UNSUPPORTED",
                 "skipped": "SKIPPED", "interrupted": "INTERRUPTED"}


def finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def fmt_seq(s: int) -> str:
    return f"{s // 1024}k" if s >= 1024 and s % 1024 == 0 else str(s)


def sorted_points(report: dict) -> list[dict]:
    order = {b: i for i, b in enumerate(report["settings"]["backends"])}
    return sorted(report["benchmark"]["points"], key=lambda p: (order.get(p["backend"], len(order)),
                  ATTENTIONS.index(p["attention"]), p["seq_len"], p["devices"]))


def max_devices(report: dict) -> int:
    return max((p["devices"] for p in report["benchmark"]["points"]), default=report["settings"]["devices"])


def on_cpu(report: dict) -> bool:
    """A CPU run: interpreted kernels on emulated devices, timings that are not a benchmark."""
    return report["environment"]["platform"] == "cpu"
