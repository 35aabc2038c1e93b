"""`twinflash train --profile` for the PyTorch backend: traces a few steady steps with torch.profiler and turns the
trace into `weights.profiling.DeviceEvent`s, whose breakdown into categories is `weights/profiling.py`'s. Twin of
`jax_impl/profiling.py`.

What the device ran: on a GPU, the kernels, memcpys and memsets of the trace; on CPU the CPU is the device, and
its ops (`cpu_op` events) are the events (nested ops: `weights.profiling.breakdown` gives each instant to the
innermost). An event's kind comes from its name (NCCL / gloo: communication; cuBLAS / CUTLASS / aten matmuls:
GEMM; cuDNN / flash / our Triton attention kernels: attention). Its regions come from the host: the
`record_function` annotations (`weights.profiling.region_annotation`) enclosing the host op that launched it, the
backward's ops inheriting the regions of the forward op they differentiate (the trace's sequence numbers pair
them), so a loss or attention backward counts as loss or attention. On a GPU the profile also names where the
host's time went (`host_events`, `weights.profiling.host_costliest`): where the device idles, the host is the bound.
"""

from __future__ import annotations

import contextlib
import json
import re
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from weights.profiling import (REGIONS, STEP_ANNOTATION, DeviceEvent, HostEvent, breakdown, host_costliest,
                               region_annotation)

_COMMUNICATION = re.compile(r"nccl|gloo|c10d::|ncclDevKernel|all_?reduce|all_?gather|reduce_?scatter", re.I)
_GEMM = re.compile(r"gemm|nvjet|cutlass|cublas|xmma|aten::(mm|addmm|bmm|baddbmm|matmul|linear|_scaled_mm)$", re.I)
_ATTENTION = re.compile(r"fmha|flash|sdpa|attn|_dkdv_kernel|_dq_kernel|_delta_kernel|scaled_dot_product", re.I)
_HOST_CATEGORIES = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")
_DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
_REGION_OF_ANNOTATION = {region_annotation(region): region for region in REGIONS}
_BACKWARD_NODE = "autograd::engine::evaluate_function: "


def _kind(name: str) -> str:
    for kind, pattern in (("communication", _COMMUNICATION), ("gemm", _GEMM), ("attention", _ATTENTION)):
        if pattern.search(name):
            return kind
    return "elementwise"


def _host_regions(host: list[dict]) -> dict[int, frozenset]:
    """id(event) -> the regions of each host event: the annotations enclosing it on its thread, plus, inside a
    backward node, the regions of the forward op with the node's sequence number."""
    forward_regions: dict[int, frozenset] = {}
    regions: dict[int, frozenset] = {}
    stacks: dict[tuple, list[tuple[float, frozenset]]] = {}
    for event in sorted(host, key=lambda e: (e["ts"], -e.get("dur", 0))):
        stack = stacks.setdefault((event["pid"], event["tid"]), [])
        while stack and stack[-1][0] <= event["ts"]:
            stack.pop()
        inherited = stack[-1][1] if stack else frozenset()
        name = event["name"]
        own = {_REGION_OF_ANNOTATION[name]} if name in _REGION_OF_ANNOTATION else set()
        sequence = event.get("args", {}).get("Sequence number")
        if name.startswith(_BACKWARD_NODE) and sequence is not None:
            own |= forward_regions.get(sequence, frozenset())
        current = inherited | own
        if sequence is not None and not name.startswith(_BACKWARD_NODE):
            forward_regions.setdefault(sequence, current)
        regions[id(event)] = current
        stack.append((event["ts"] + event.get("dur", 0), current))
    return regions


def trace_events(trace: dict, on_gpu: bool) -> tuple[list[DeviceEvent], list[tuple[float, float]]]:
    """(device events, step windows) of a chrome trace exported by torch.profiler, in seconds."""
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    host = [e for e in spans if e.get("cat") in _HOST_CATEGORIES]
    regions = _host_regions(host)
    windows = sorted((e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6) for e in host
                     if e["name"] == STEP_ANNOTATION and e.get("cat") == "user_annotation")
    if on_gpu:
        launches = {e["args"]["correlation"]: e for e in host
                    if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
        work = [(e, launches.get(e.get("args", {}).get("correlation"))) for e in spans
                if e.get("cat") in _DEVICE_CATEGORIES]
    else:
        work = [(e, e) for e in host if e.get("cat") == "cpu_op"]
    events = [DeviceEvent(e["name"], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6, _kind(e["name"]),
                          regions.get(id(launch), frozenset()) if launch is not None else frozenset())
              for e, launch in work]
    return events, windows


def host_events(trace: dict) -> list[HostEvent]:
    """The host's operations, annotations and CUDA API calls of a chrome trace exported by torch.profiler."""
    return [HostEvent(e["name"], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6, (e["pid"], e["tid"]))
            for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e and e.get("cat") in _HOST_CATEGORIES]


class StepProfiler:
    """Traces the `steps` of a run (`weights.profiling.profiled_steps`; empty: traces nothing) on this rank: call
    `begin(step)` before each step and `end(step)` after it, then `breakdown()`."""

    def __init__(self, device: torch.device, steps: range):
        self.device = device
        self.steps = steps
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self._profile = profile(activities=activities)
        self._annotation: record_function | None = None
        self._trace: dict | None = None

    def begin(self, step: int) -> None:
        if step not in self.steps:
            return
        if step == self.steps[0]:
            self._profile.__enter__()
        self._annotation = record_function(STEP_ANNOTATION)
        self._annotation.__enter__()

    def end(self, step: int) -> None:
        if step not in self.steps:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the step's window ends with its last kernel
        self._annotation.__exit__(None, None, None)
        if step == self.steps[-1]:
            self._profile.__exit__(None, None, None)
            with tempfile.TemporaryDirectory() as scratch:
                path = Path(scratch) / "trace.json"
                self._profile.export_chrome_trace(str(path))
                self._trace = json.loads(path.read_text())

    def breakdown(self) -> dict:
        """The per-step breakdown of the traced steps (`weights.profiling.breakdown`), plus "device"."""
        if self._trace is None:
            raise RuntimeError("no profiled step has run")
        on_gpu = self.device.type == "cuda"
        events, windows = trace_events(self._trace, on_gpu)
        # on a GPU the host is a separate bound (the idle category); on CPU it is the device, already broken down
        host = {"host_top": host_costliest(host_events(self._trace), windows)} if on_gpu else {}
        name = torch.cuda.get_device_name(self.device) if on_gpu else "cpu"
        return {**breakdown(events, windows), **host, "device": name}


def region(name: str) -> contextlib.AbstractContextManager:
    """Marks a region of the step (`weights.profiling.REGIONS`) for the profile (a no-op unless it is tracing)."""
    return record_function(region_annotation(name))
