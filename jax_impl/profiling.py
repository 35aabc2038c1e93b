"""`twinflash train --profile` for the JAX backend: marks the regions of the step (`region`), traces a few steady
steps with jax.profiler and turns the trace into `weights.profiling.DeviceEvent`s, whose breakdown into categories
is `weights/profiling.py`'s. Twin of `torch_impl/profiling.py`.

What the device ran: on a GPU, the kernels on device 0's streams; on CPU the CPU is the device, and the XLA thunks
its threads run are the events. An event's regions come from JAX's name stack: the step's code marks the loss, the
optimizer and the attention function with `region` (a `jax.named_scope`, the twin's `record_function`), which
XLA keeps in every instruction's `op_name` through autodiff ("transpose(jvp(twinflash_loss))" in the backward)
and checkpointing ("rematted_computation": the recomputation in the backward). The name stack is read from the
event itself (a GPU kernel's XLA annotation carries its instruction's op_name) and from the compiled step's HLO
text, where the event's HLO instruction (`hlo_op`, else the kernel's own name) is looked up; the instruction also
gives the kind: its opcode and the ops it fuses (collectives: communication; dot / convolution / cuBLAS: GEMM).
A kernel whose instruction is not in the text (on jax 0.11.2's GPU traces none was: the names did not match)
keeps the regions of its own annotation and gets its kind from its name (cuBLAS, cuDNN, NCCL, our kernels).
"""

from __future__ import annotations

import dataclasses
import glob
import re
import tempfile
import jax

from weights.profiling import REGIONS, STEP_ANNOTATION, DeviceEvent, breakdown

_COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all", "send", "recv",
                "collective-broadcast", "ragged-all-to-all")
_GEMM_OPS = ("dot", "convolution", "scaled-dot")
_SCOPE_PREFIX = "twinflash_"  # a region's named scope: "twinflash_loss", ...
_SCOPES = re.compile(rf"\b{_SCOPE_PREFIX}({'|'.join(REGIONS)})\b")
_UNMATCHED_SAMPLE = 5  # kernels not found in the HLO text that profile.json names (with their annotation)
_RECOMPUTED = "rematted_computation"  # jax.checkpoint's name for the forward it reruns in the backward
_HLO_OP = re.compile(r"hlo_op=([^,#\s]+)")  # inside a GPU kernel's XLA annotation: "name:#hlo_op=fusion.3,...#"
# The kinds by kernel name, for kernels whose HLO instruction is not found (NCCL; cuDNN's and our attention
# kernels, "twinflash_forward", ...; cuBLAS, CUTLASS and XLA's Triton GEMM fusions)
_KERNEL_KINDS = (("communication", re.compile(r"nccl", re.I)),
                 ("attention", re.compile(r"fmha|flash|sdpa|cudnn", re.I)),
                 ("gemm", re.compile(r"gemm|nvjet|cutlass|cublas|xmma", re.I)))
# ops that only move or name values: left out of a fusion's description (`_Hlo.describe`)
_PLUMBING = {"parameter", "constant", "bitcast", "tuple", "get-tuple-element", "broadcast", "reshape"}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=]+) = (.*)$")
# "[ENTRY] %name (params) -> shape {" or, printed without the program shape, "[ENTRY] %name {"
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([^\s(={]+).*\{\s*$")  # tried after _INSTRUCTION


def region(name: str):
    """Marks a region of the step (`weights.profiling.REGIONS`) for the profile: a `jax.named_scope` around the
    code that traces it (it changes no computation, only the instructions' op_name metadata)."""
    if name not in REGIONS:
        raise ValueError(f"unknown region {name!r}; regions are {REGIONS}")
    return jax.named_scope(_SCOPE_PREFIX + name)


def regions_of(name_stack: str) -> frozenset:
    """The regions a JAX name stack (an op_name, or any text holding some) says an instruction ran in."""
    found = set(_SCOPES.findall(name_stack))
    if _RECOMPUTED in name_stack:
        found.add("recompute")
    return frozenset(found)


@dataclasses.dataclass(frozen=True)
class _Instruction:
    opcode: str
    calls: tuple[str, ...]
    op_name: str
    target: str
    shape: str  # the result's, layout left out: "f8e4m3fn[14336,16384]"
    fusion_kind: str  # "kLoop", "kInput", "kCustom", ... for a fusion, else ""


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


class _Hlo:
    """The compiled step's instructions (by name) with what classifies them."""

    def __init__(self, text: str):
        self.instructions: dict[str, _Instruction] = {}
        self.computations: dict[str, list[str]] = {}
        members: list[str] = []  # the instructions of the computation being read (none before the first)
        for line in text.splitlines():
            match = _INSTRUCTION.match(line)
            if match is None:
                header = _COMPUTATION.match(line)
                if header:
                    members = self.computations.setdefault(header.group(1), [])
                continue
            name, rest = match.groups()
            calls = re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", rest)
            op_name = re.search(r'op_name="([^"]*)"', rest)
            target = re.search(r'custom_call_target="([^"]*)"', rest)
            opcode = _opcode(rest)
            shape = re.sub(r"\{[^}]*\}", "", rest[:max(rest.find(f" {opcode}("), 0)])  # layouts left out
            fusion_kind = re.search(r"kind=(k\w+)", rest)
            self.instructions[name] = _Instruction(opcode, tuple(calls), op_name.group(1) if op_name else "",
                                                   target.group(1) if target else "", shape,
                                                   fusion_kind.group(1) if fusion_kind else "")
            members.append(name)

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

    def instruction_name(self, name: str, event_name: str) -> str:
        """The instruction `name`, else the one the kernel `event_name` was generated for (XLA names a fusion's
        kernel after it, "." made "_"); "" when the HLO has neither."""
        candidates = (name, event_name, re.sub(r"_(\d+)$", r".\1", event_name))
        return next((c for c in candidates if c in self.instructions), "")

    def describe(self, event_name: str) -> str:
        """What the kernel `event_name` computes, from its instruction (`instruction_name`): result shape, opcode
        (a fusion's kind and the ops it fuses, its parameters and plumbing left out; a custom call's target) and the
        last part of its op_name; "" when the HLO does not have it. What a profile's costliest kernel is, without
        the HLO dump beside it (e.g. "f8e4m3fn[14336,16384] fusion kInput of transpose")."""
        name = self.instruction_name("", event_name)
        if not name:
            return ""
        instruction = self.instructions[name]
        what = f"{_short_shape(instruction.shape)} {instruction.opcode}"
        if instruction.fusion_kind:
            ops = self._opcodes(name, set()) - {"fusion", "parameter", ""}
            what += f" {instruction.fusion_kind} of {', '.join(sorted(ops - _PLUMBING or ops))}"
        if instruction.target:
            what += f" {instruction.target}"
        where = "/".join(instruction.op_name.split("/")[-2:])
        return f"{what}: {where}" if where else what

    def classify(self, name: str, event_name: str, name_stack: str) -> tuple[str, frozenset]:
        """(kind, regions) of the instruction `name`, else of the one the kernel `event_name` was generated for
        (XLA names a fusion's kernel after it, "." made "_"). The regions are those of the instruction's op_name
        and of the event's own `name_stack` (its annotation's text); with no instruction in the HLO, the kind
        comes from the kernel's name."""
        name = self.instruction_name(name, event_name)
        instruction = self.instructions.get(name)
        by_name = next((kind for kind, pattern in _KERNEL_KINDS if pattern.search(event_name)), None)
        regions = regions_of(name_stack)
        if instruction is None:
            return by_name or "elementwise", regions
        own = {instruction.opcode.removesuffix("-start").removesuffix("-done"), instruction.target}
        if own & set(_COLLECTIVES) or "nccl" in event_name.lower():
            kind = "communication"
        elif instruction.opcode in ("while", "conditional", "call"):
            kind = "elementwise"  # a loop's body shows up as its own events
        else:
            ops = self._opcodes(name, set())
            gemm = ops & set(_GEMM_OPS) or any("gemm" in op or "cublas" in op for op in ops)
            kind = "gemm" if gemm else by_name or "elementwise"
        return kind, regions | regions_of(instruction.op_name)


def _short_shape(shape: str, shown: int = 2) -> str:
    """An HLO result shape for a one-line description: a tuple of more than `shown` arrays as its first ones and
    how many it has (a while loop's state holds dozens)."""
    parts = re.findall(r"\w+\[[^\]]*\]", shape)
    if not shape.startswith("(") or len(parts) <= shown:
        return re.sub(r"/\*[^*]*\*/", "", shape)
    return f"({', '.join(parts[:shown])}, ... {len(parts)} arrays)"


def _hlo_op(event) -> tuple[str, str]:
    """(the HLO instruction an event executes: its `hlo_op` stat, or the instruction named in its XLA annotation,
    "" when none; the text of all its string stats, where a GPU kernel's annotation puts its op_name: "tf_op",
    "name" or the raw annotation, as the profiler version has it)."""
    stats = {key: value for key, value in event.stats}
    text = " ".join(value for value in stats.values() if isinstance(value, str))
    if "hlo_op" in stats:
        return str(stats["hlo_op"]), text
    match = _HLO_OP.search(text)
    return (match.group(1) if match else ""), text


def trace_events(xplane_path: str, hlo: _Hlo) -> tuple[list[DeviceEvent], list[tuple[float, float]], dict]:
    """(device events of device 0, step windows, how they were classified) of a jax.profiler trace, in seconds,
    with the compiled step's HLO. The last says how many events were found in the HLO and how many got a region,
    with a few kernels that were not found: what to look at when a GPU profile's regions come out empty."""
    planes = list(jax.profiler.ProfileData.from_file(xplane_path).planes)
    gpu = [p for p in planes if p.name == "/device:GPU:0"]
    events, windows, found, unmatched = [], [], 0, {}
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
                if hlo.instruction_name(op, event.name):
                    found += 1
                elif len(unmatched) < _UNMATCHED_SAMPLE:
                    unmatched.setdefault(event.name[:80], {"hlo_op": op, "annotation": name_stack[:300]})
    if gpu and not events:
        raise ValueError(f"no kernels on the streams of {gpu[0].name}; its lines: {[l.name for l in gpu[0].lines]}")
    lookup = {"events": len(events), "found_in_hlo": found, "with_region": sum(bool(e.regions) for e in events),
              "not_found": unmatched}
    return events, sorted(windows), lookup


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
            hlo = _Hlo(hlo_text)
            events, windows, lookup = trace_events(xplane, hlo)
            profile = breakdown(events, windows)
            for item in profile["top"]:  # what each costliest kernel computes, where the HLO has it
                if described := hlo.describe(item["name"]):
                    item["hlo"] = described
            return {**profile, "device": jax.devices()[0].device_kind, "hlo_lookup": lookup}
