"""`twinflash train --profile` for the JAX backend: traces a few steady steps with jax.profiler and turns the trace
into `weights.profiling.DeviceEvent`s, whose breakdown into categories is `weights/profiling.py`'s. Twin of
`torch_impl/profiling.py`.

What the device ran: on a GPU, the kernels on device 0's streams; on CPU the CPU is the device, and the XLA thunks
its threads run are the events. Each event names the HLO instruction it executes (`hlo_op`), and the compiled
step's HLO text says what that instruction is: its opcode and the ops it fuses give the kind (collectives:
communication; dot / convolution / cuBLAS: GEMM); its metadata gives the regions: the Python call stack it was
traced from (`stack_frame_id`: the loss and optimizer functions of `jax_impl/train.py`, the attention function)
and JAX's name stack ("rematted_computation": checkpointing's recomputation in the backward). The twin marks the
same regions with `record_function` annotations; here the step's code needs no marks.
"""

from __future__ import annotations

import dataclasses
import glob
import re
import tempfile
import jax

from weights.profiling import STEP_ANNOTATION, DeviceEvent, breakdown

_COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all", "send", "recv",
                "collective-broadcast", "ragged-all-to-all")
_GEMM_OPS = ("dot", "convolution", "scaled-dot")
_REGION_FUNCTIONS = {  # the functions (of jax_impl/train.py) whose ops belong to a region of the step
    "loss": {"_chunk_cross_entropy_sum", "cross_entropy_sum", "sharded_cross_entropy_sum"},
    "optimizer": {"clip_gradients", "adamw_update"},
}
_ATTENTION_FUNCTION = re.compile(r"^[a-z_]*attention[a-z_]*$")  # ring_attention, flash_attention, reference_...
_HLO_OP = re.compile(r"hlo_op=([^,#\s]+)")  # inside a GPU kernel's XLA annotation: "name:#hlo_op=fusion.3,...#"
# The kinds by kernel name, for kernels whose HLO instruction is not found (cuBLAS, cuDNN, NCCL kernels' names)
_KERNEL_KINDS = (("communication", re.compile(r"nccl", re.I)), ("attention", re.compile(r"fmha|flash|sdpa", re.I)),
                 ("gemm", re.compile(r"gemm|nvjet|cutlass|cublas|xmma", re.I)))
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=]+) = (.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([^\s(]+) \(.*\{\s*$")


@dataclasses.dataclass(frozen=True)
class _Instruction:
    opcode: str
    calls: tuple[str, ...]
    op_name: str
    stack_frame: int | None
    target: str


def _opcode(rest: str) -> str:
    """The opcode of an HLO instruction's right-hand side "<shape> <opcode>(<operands>)..."."""
    depth, i = 0, 0
    if rest.startswith("("):  # a tuple shape
        for i, char in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(char, 0)
            if depth == 0:
                break
    start = rest.index(" ", i) + 1
    return rest[start:rest.index("(", start)]


def _table(text: str, title: str) -> dict[int, str]:
    match = re.search(rf"^{title}\n((?:\d+ .*\n)+)", text, re.M)
    rows = (line.split(" ", 1) for line in match.group(1).splitlines()) if match else ()
    return {int(key): value for key, value in rows}


class _Hlo:
    """The compiled step's instructions (by name) with what classifies them."""

    def __init__(self, text: str):
        self.instructions: dict[str, _Instruction] = {}
        self.computations: dict[str, list[str]] = {}
        computation = None
        for line in text.splitlines():
            header = _COMPUTATION.match(line)
            if header:
                computation = self.computations.setdefault(header.group(1), [])
                continue
            match = _INSTRUCTION.match(line)
            if match is None or computation is None:
                continue
            name, rest = match.groups()
            calls = re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", rest)
            op_name = re.search(r'op_name="([^"]*)"', rest)
            frame = re.search(r"stack_frame_id=(\d+)", rest)
            target = re.search(r'custom_call_target="([^"]*)"', rest)
            self.instructions[name] = _Instruction(
                _opcode(rest), tuple(calls), op_name.group(1) if op_name else "",
                int(frame.group(1)) if frame else None, target.group(1) if target else "")
            computation.append(name)
        functions = {key: value.strip('"') for key, value in _table(text, "FunctionNames").items()}
        locations = {key: int(re.search(r"function_name_id=(\d+)", value).group(1))
                     for key, value in _table(text, "FileLocations").items()}
        self.frames = {key: (int(re.search(r"file_location_id=(\d+)", value).group(1)),
                             int(re.search(r"parent_frame_id=(\d+)", value).group(1)))
                       for key, value in _table(text, "StackFrames").items()}
        self.function_of_location = {key: functions.get(value, "") for key, value in locations.items()}

    def _stack(self, frame: int | None) -> set[str]:
        names, seen = set(), set()
        while frame in self.frames and frame not in seen:
            seen.add(frame)
            location, parent = self.frames[frame]
            names.add(self.function_of_location.get(location, ""))
            frame = parent
        return names

    def _opcodes(self, name: str, seen: set[str]) -> set[str]:
        """Opcodes (and custom-call targets) of `name` and of every computation it calls."""
        instruction = self.instructions[name]
        found = {instruction.opcode, instruction.target}
        for called in instruction.calls:
            for inner in self.computations.get(called, ()):
                if inner not in seen:
                    seen.add(inner)
                    found |= self._opcodes(inner, seen)
        return found

    def classify(self, name: str, event_name: str, name_stack: str) -> tuple[str, frozenset]:
        """(kind, regions) of the instruction `name`, else of the one the kernel `event_name` was generated for
        (XLA names a fusion's kernel after it, "." made "_"); with neither in the HLO, the kind from the kernel's
        name and the regions from the event's JAX `name_stack` alone."""
        candidates = (name, event_name, re.sub(r"_(\d+)$", r".\1", event_name))
        name = next((c for c in candidates if c in self.instructions), "")
        instruction = self.instructions.get(name)
        by_name = next((kind for kind, pattern in _KERNEL_KINDS if pattern.search(event_name)), None)
        if instruction is None:
            regions = {"recompute"} if "rematted_computation" in name_stack else set()
            return by_name or "elementwise", frozenset(regions)
        own = {instruction.opcode.removesuffix("-start").removesuffix("-done"), instruction.target}
        if own & set(_COLLECTIVES) or "nccl" in event_name.lower():
            kind = "communication"
        elif instruction.opcode in ("while", "conditional", "call"):
            kind = "elementwise"  # a loop's body shows up as its own events
        else:
            ops = self._opcodes(name, set())
            gemm = ops & set(_GEMM_OPS) or any("gemm" in op or "cublas" in op for op in ops)
            kind = "gemm" if gemm else by_name or "elementwise"
        stack = self._stack(instruction.stack_frame)
        regions = {region for region, functions in _REGION_FUNCTIONS.items() if stack & functions}
        if any(_ATTENTION_FUNCTION.match(function) for function in stack):
            regions.add("attention")
        if "rematted_computation" in instruction.op_name:
            regions.add("recompute")
        return kind, frozenset(regions)


def _hlo_op(event) -> tuple[str, str]:
    """(the HLO instruction an event executes, its JAX name stack): the `hlo_op` stat, or the instruction named
    in the event's XLA annotation; the `tf_op` stat; "" for what the event lacks."""
    stats = {key: value for key, value in event.stats}
    name_stack = str(stats.get("tf_op", ""))
    if "hlo_op" in stats:
        return str(stats["hlo_op"]), name_stack
    for value in stats.values():
        match = _HLO_OP.search(value) if isinstance(value, str) else None
        if match:
            return match.group(1), name_stack
    return "", name_stack


def trace_events(xplane_path: str, hlo_text: str) -> tuple[list[DeviceEvent], list[tuple[float, float]]]:
    """(device events of device 0, step windows) of a jax.profiler trace, in seconds."""
    hlo = _Hlo(hlo_text)
    planes = list(jax.profiler.ProfileData.from_file(xplane_path).planes)
    gpu = [p for p in planes if p.name == "/device:GPU:0"]
    events, windows = [], []
    for plane in planes:
        on_host = plane.name.startswith("/host:CPU")
        for line in plane.lines:
            for event in line.events:
                if on_host and event.name == STEP_ANNOTATION:
                    windows.append((event.start_ns / 1e9, event.end_ns / 1e9))
                    continue
                device_line = line.name.startswith("Stream") if plane in gpu else (on_host and not gpu)
                if not device_line:
                    continue
                op, name_stack = _hlo_op(event)
                if not op and plane not in gpu:
                    continue  # a CPU thread's own bookkeeping (thunk executor, thread pool), not an op
                kind, regions = hlo.classify(op, event.name, name_stack)
                events.append(DeviceEvent(event.name, event.start_ns / 1e9, event.end_ns / 1e9, kind, regions))
    if gpu and not events:
        raise ValueError(f"no kernels on the streams of {gpu[0].name}; its lines: {[l.name for l in gpu[0].lines]}")
    return events, sorted(windows)


class StepProfiler:
    """Traces the `steps` of a run (`weights.profiling.profiled_steps`; empty: traces nothing): call `begin(step)`
    before each step and `end(step)` after its results are read on the host, then `breakdown(hlo_text)` with the
    compiled step's HLO text."""

    def __init__(self, steps: range):
        self.steps = steps
        self._scratch: tempfile.TemporaryDirectory | None = None
        self._annotation: jax.profiler.TraceAnnotation | None = None

    def begin(self, step: int) -> None:
        if step not in self.steps:
            return
        if step == self.steps[0]:
            self._scratch = tempfile.TemporaryDirectory(prefix="twinflash-profile-")
            jax.profiler.start_trace(self._scratch.name)
        self._annotation = jax.profiler.TraceAnnotation(STEP_ANNOTATION)
        self._annotation.__enter__()

    def end(self, step: int) -> None:
        if step not in self.steps:
            return
        self._annotation.__exit__(None, None, None)
        if step == self.steps[-1]:
            jax.profiler.stop_trace()

    def breakdown(self, hlo_text: str) -> dict:
        """The per-step breakdown of the traced steps (`weights.profiling.breakdown`), plus "device"."""
        if self._scratch is None:
            raise RuntimeError("no profiled step has run")
        with self._scratch as scratch:
            (xplane,) = glob.glob(f"{scratch}/**/*.xplane.pb", recursive=True)
            return {**breakdown(*trace_events(xplane, hlo_text)), "device": jax.devices()[0].device_kind}
