"""The per-step time breakdown of `twinflash train --profile`, framework-neutral (stdlib only): the categories, the
rule that gives every instant of a step to exactly one of them, the profile.json schema, its sanity check and the
table. The backends' `profiling.py` turn their profiler traces into `DeviceEvent`s (what ran on the device, when,
of which kind, inside which regions of the step) and the windows of the profiled steps; everything else is here.

How an instant of a step is attributed (`breakdown`): the device events active at that instant are looked at;
if any compute event (anything but communication) is active, the instant belongs to the category of the compute
event that started last (the innermost one where events nest, as CPU ops do); else, if communication is active,
it is exposed communication; else the device is idle (host gaps: launch overhead, Python, synchronisation). So
the categories add up to the step by construction, and communication that overlaps compute costs nothing in the
sum: `communication_total_s` (the union of all communication, hidden or not) is reported beside the categories.

An event's category: communication first (by its kind); then the region of the step it ran in, innermost
meaning first: optimizer (gradient clipping and AdamW), loss (LM head logits and cross-entropy, forward and
backward, the chunks' logits recomputed for the backward included), recomputation (a checkpointed layer rerun in
the backward), attention (the attention function, forward and backward, with the ring's own work); then by kind:
GEMMs, and everything else (RMSNorm, RoPE, SwiGLU, residual adds, casts, copies, FSDP's copy-in/out) as
elementwise.

profile.json: {"step_s": mean profiled step, "categories": {name: seconds per step}, "communication_total_s",
"steps": how many steps were profiled, "top": [{"name", "category", "seconds", "calls"}] (per step, the
`TOP_EVENTS` costliest device events by name, and how many of them started in a step: a kernel run twice shows as
twice the calls; JAX adds "hlo" where the compiled step has the kernel's instruction: what it computes, its shape,
fusion and ops, `jax_impl.profiling._Hlo.describe`; the table prints the first `TOP_PRINTED`),
optionally "host_top": [{"name", "seconds"}] (per step, where the host's time went, by the self time of its
operations: `host_costliest`; where the device idles, the host is the bound), plus whatever run description the
caller adds (backend, device, settings)}.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

CATEGORIES = {
    "attention": "attention kernels, forward and backward (and the ring's own work around them)",
    "gemm": "matmuls of the layers (projections, MLP)",
    "communication_exposed": "collectives and ring transfers with no compute running beside them",
    "elementwise": "norms, RoPE, SwiGLU, residuals, casts, copies: every other kernel",
    "loss": "LM head logits and cross-entropy, forward and backward",
    "optimizer": "gradient norm, clipping and AdamW",
    "recompute": "checkpointed layers rerun in the backward",
    "idle": "no device work at all (host gaps: launches, Python, synchronisation)",
}
KINDS = ("communication", "attention", "gemm", "elementwise")  # what an event is, from its own name or op
REGIONS = ("optimizer", "loss", "recompute", "attention")  # where in the step it ran; innermost meaning first
PROFILE_JSON = "profile.json"
STEP_ANNOTATION = "twinflash/step"
PROFILED_STEPS = 3
# The categories are built to add up to the step exactly; the check allows the 15 % the task sets, so that a
# profile.json edited or merged by hand still passes when it is roughly right and fails when a category is missing.
SUM_TOLERANCE = 0.15
TOP_EVENTS = 40  # profile.json's kernels: enough to account for most of a step's elementwise work
TOP_PRINTED = 12  # the table's


def region_annotation(region: str) -> str:
    """The name of the profiler annotation (torch `record_function`) that marks `region` of the step."""
    if region not in REGIONS:
        raise ValueError(f"unknown region {region!r}; regions are {REGIONS}")
    return f"twinflash/{region}"


@dataclasses.dataclass(frozen=True)
class DeviceEvent:
    """One piece of device work: name, [start, end) in seconds on the clock of the step windows, its kind (a
    `KINDS` entry) and the regions (`REGIONS` entries) it ran inside."""

    name: str
    start: float
    end: float
    kind: str
    regions: frozenset = frozenset()


@dataclasses.dataclass(frozen=True)
class HostEvent:
    """One host operation or annotation: name, [start, end) in seconds on the clock of the step windows, and the
    thread it ran on (events nest only within a thread)."""

    name: str
    start: float
    end: float
    thread: tuple = ()


def host_costliest(events: Sequence[HostEvent], windows: Sequence[tuple[float, float]],
                   top: int = TOP_PRINTED) -> list[dict]:
    """Per step, the host's costliest operations by SELF time (an event's duration minus that of the events nested
    directly in it on its thread), for the events inside the `windows`: the step annotation's own self time is the
    host's time between operations (Python), a launch call's is the launch. The costliest `top`, in seconds per
    step."""
    inside = [e for e in events if any(low <= e.start and e.end <= high for low, high in windows)]
    self_time: dict[str, float] = defaultdict(float)
    by_thread: dict[tuple, list[HostEvent]] = defaultdict(list)
    for event in inside:
        by_thread[event.thread].append(event)
    for thread_events in by_thread.values():
        stack: list[HostEvent] = []
        for event in sorted(thread_events, key=lambda e: (e.start, -(e.end - e.start))):
            while stack and stack[-1].end <= event.start:
                stack.pop()
            if stack:  # a direct child: its time is not its parent's own
                self_time[stack[-1].name] -= event.end - event.start
            self_time[event.name] += event.end - event.start
            stack.append(event)
    steps = max(1, len(windows))
    costliest = heapq.nlargest(top, self_time.items(), key=lambda item: item[1])
    return [{"name": name[:120], "seconds": seconds / steps} for name, seconds in costliest]


def category(kind: str, regions: Iterable[str]) -> str:
    """The category of an event of `kind` inside `regions` (module docstring)."""
    if kind == "communication":
        return "communication_exposed"
    regions = set(regions)
    for region in REGIONS:
        if region in regions:
            return region
    return kind


def profiled_steps(start: int, stop: int) -> range:
    """The steps of a run [start, stop) that --profile traces: the last `PROFILED_STEPS`, never the first (which
    compiles and autotunes). Empty when the run is too short."""
    return range(max(start + 1, stop - PROFILED_STEPS), stop)


def _union_seconds(intervals: list[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _attribute_window(events: Sequence[DeviceEvent], low: float, high: float, totals: dict[str, float],
                      by_name: dict[tuple[str, str], float], calls: dict[tuple[str, str], int]) -> float:
    """Adds the window's instants to `totals` (category -> s) and `by_name`, the events starting in it to `calls`;
    returns its communication union."""
    inside = sorted((e for e in events if e.end > low and e.start < high), key=lambda e: e.start)
    for event in inside:
        if event.start >= low:
            calls[(event.name, category(event.kind, event.regions))] += 1
    points = sorted({low, high, *(max(e.start, low) for e in inside), *(min(e.end, high) for e in inside)})
    compute: list[tuple[float, int]] = []  # (-start, index): the latest-started active compute event on top
    communication: list[tuple[float, int]] = []  # (end, index)
    following = 0
    for a, b in zip(points, points[1:]):
        while following < len(inside) and max(inside[following].start, low) <= a:
            event = inside[following]
            if event.kind == "communication":
                heapq.heappush(communication, (event.end, following))
            else:
                heapq.heappush(compute, (-event.start, following))
            following += 1
        while compute and inside[compute[0][1]].end <= a:
            heapq.heappop(compute)
        while communication and communication[0][0] <= a:
            heapq.heappop(communication)
        if compute:
            event = inside[compute[0][1]]
        elif communication:
            event = inside[communication[0][1]]
        else:
            totals["idle"] += b - a
            continue
        name = category(event.kind, event.regions)
        totals[name] += b - a
        by_name[(event.name, name)] += b - a
    return _union_seconds([(max(e.start, low), min(e.end, high)) for e in inside if e.kind == "communication"])


def breakdown(events: Sequence[DeviceEvent], windows: Sequence[tuple[float, float]]) -> dict:
    """The per-step breakdown (module docstring) of the device `events` over the profiled steps' `windows`
    ([start, end) seconds, one per step)."""
    if not windows:
        raise ValueError("no profiled step: the trace holds no step window")
    totals = dict.fromkeys(CATEGORIES, 0.0)
    by_name: dict[tuple[str, str], float] = defaultdict(float)
    calls: dict[tuple[str, str], int] = defaultdict(int)
    communication = sum(_attribute_window(events, low, high, totals, by_name, calls) for low, high in windows)
    steps = len(windows)
    top = sorted(by_name.items(), key=lambda item: -item[1])[:TOP_EVENTS]
    return {"step_s": sum(high - low for low, high in windows) / steps,
            "categories": {name: seconds / steps for name, seconds in totals.items()},
            "communication_total_s": communication / steps, "steps": steps,
            "top": [{"name": name[:120], "category": cat, "seconds": seconds / steps,
                     "calls": calls[(name, cat)] / steps} for (name, cat), seconds in top]}


def check_breakdown(profile: dict, tolerance: float = SUM_TOLERANCE) -> None:
    """Raises ValueError unless `profile` has every category and they sum to its step within `tolerance`."""
    categories = profile.get("categories", {})
    missing = [name for name in CATEGORIES if name not in categories]
    if missing:
        raise ValueError(f"profile lacks the categories {missing}")
    if any(seconds < 0 for seconds in categories.values()):
        raise ValueError(f"profile has negative times: {categories}")
    total, step = sum(categories.values()), profile["step_s"]
    if not step > 0 or abs(total - step) > tolerance * step:
        raise ValueError(f"profile categories sum to {total:.6g} s, the step is {step:.6g} s "
                         f"(allowed: {tolerance:.0%} apart)")


def format_table(profile: dict) -> str:
    """The breakdown as a text table: seconds per step, share of the step, what each category holds."""
    step = profile["step_s"]
    rows = [f"{'category':<22} {'ms/step':>10} {'share':>7}  what"]
    for name, seconds in profile["categories"].items():
        rows.append(f"{name:<22} {seconds * 1e3:>10.2f} {seconds / step:>7.1%}  {CATEGORIES.get(name, '')}")
    rows.append(f"{'step':<22} {step * 1e3:>10.2f} {1:>7.1%}  mean of {profile['steps']} profiled steps")
    communication = profile["communication_total_s"]
    rows.append(f"{'(communication total)':<22} {communication * 1e3:>10.2f} {communication / step:>7.1%}  "
                "hidden or not; not part of the sum")
    rows.append("costliest device events (ms/step, calls/step, category):")
    rows.extend(f"  {item['seconds'] * 1e3:9.2f} {item['calls']:7.1f}  {item['category']:<21} "
                f"{item['name'][:82]}" for item in profile["top"][:TOP_PRINTED])
    if profile.get("host_top"):
        rows.append("costliest host operations, by self time (ms/step):")
        rows.extend(f"  {item['seconds'] * 1e3:9.2f}  {item['name'][:112]}" for item in profile["host_top"])
    return "\n".join(rows)


def write_profile(path: Path, profile: dict) -> None:
    """Checks `profile` (`check_breakdown`) and writes it as JSON."""
    check_breakdown(profile)
    Path(path).write_text(json.dumps(profile, indent=1) + "\n")
