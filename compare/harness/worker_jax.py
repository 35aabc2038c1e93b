"""The JAX backend's side of `twinflash compare`: runs the jobs of a job file (`compare/harness/jobs.py`) in this one
process, each job over the first `devices` of JAX's devices (its mesh: fsdp=1, sp=devices in a compare run; the
fast path's jobs are `fastpath_jax.py`'s). Twin of
`compare/harness/worker_torch.py`; the models, kernels, ring and training step are `jax_impl`'s own, built by
`jax_impl.train.build_training` exactly as `twinflash train` builds them (a curve job of the bf16 noise floor
trains as `twinflash train` does: the same settings, batches and `train_step`).

`python -m compare.harness.worker_jax JOBFILE` (on CPU with XLA_FLAGS asking for the host devices, which the harness
sets). One process serves every job of its device count (their compiled functions stay cached between jobs, and
the run's persistent compilation cache serves a relaunch). An out-of-memory or other error of a job is recorded as
its result and the next job runs. In a launch spanning nodes (`compare/harness/across_nodes.py`) one such process
runs on each node, joined by `jax.distributed`, and arrays that span them are gathered where read whole.

Peak memory on GPUs: the allocator's peak cannot be reset between the jobs of a process, so a job's peak is that
counter where it rose during the job, else (an earlier job of the process peaked higher) the bytes in use when its
step started plus the compiled step's temporary buffers from XLA's memory analysis (`peak_memory_source`:
"measured" or "XLA plan"). On CPU it is the process's peak host RSS so far. Every job's result counts the XLA
compilations it caused (`xla_compiles`: count and seconds).

Equivalence jobs on GPUs run with float32 matmuls at full precision (`jax.default_matmul_precision("highest")`):
XLA's default for float32 dots there is TF32, which torch does not use (torch.backends.cuda.matmul.allow_tf32 is
off). On CPU the default already is full float32, and leaving the setting alone lets the benchmark point of the
same shape reuse the equivalence job's compiled train step (the setting is part of jit's cache key).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils
from safetensors.numpy import save_file

from compare.harness.equivalence import float64_chunks
from compare.harness import fastpath_jax
from compare.harness.jobs import (Job, Phases, SetupClock, bench_units, exposed_seconds,
                                  forward_passes, is_collective_op, is_out_of_memory, job_batches, launched_at,
                                  mark_progress, mark_started, read_job_file, timed_steps, union_seconds, write_result)
from compare.nodes import Nodes
from jax_impl.model import unstack_layers
from jax_impl.parallel import on_host, sharded_batch
from jax_impl.train import (Training, build_training, init_distributed, next_token_loss, peak_memory_bytes,
                            step_scalars, train_step)
from weights.layout import inverse_order, layout_order
from weights.parallel import RING_LAYOUT
from weights.training import adamw_coefficients

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch's name of it
# The float32 check's first function (also timed alone by compare/bench/jax_compile_profile.py), compiled without
# XLA's autotuning: on one H200 its GEMM autotuning of the full-precision float32 dots took most of the compilation
# (4 layers of the 1B shape at 2k tokens: 64.9 s, 10.4 s without; 148 s at 8 layers in a compare run;
# compare/results/compare-jax-check-compile-2026-11-29-h200). The check needs its dots exact, not fast. Its
# loss-curve steps too: with the first function fixed, their compilation took 125 of the check's 152 s at 8 layers.
CHECK_COMPILER_OPTIONS = (("xla_gpu_autotune_level", 0),)
check_loss_grads_and_logits = jax.jit(jax.value_and_grad(next_token_loss, has_aux=True),
                                      static_argnames=("spec", "with_logits"),
                                      compiler_options=dict(CHECK_COMPILER_OPTIONS))
_loss_and_grads_alone = jax.jit(jax.value_and_grad(next_token_loss), static_argnames=("spec",))
_forward_loss = jax.jit(next_token_loss, static_argnames=("spec",))


def _unstackedon_host(params: dict[str, jax.Array]) -> dict[str, np.ndarray]:
    """Every parameter (or gradient) by name on the host: each stacked array copied once, then split into its
    layers' rows there (splitting on the device first would cost a slice op and a copy per layer and name)."""
    return unstack_layers({name: on_host(array) for name, array in params.items()})


def _weight_sums(run: Training) -> dict[str, list[float]]:
    """float64 [sum, sum of squares] of every parameter as loaded, a chunk at a time (the 1B shape's 1.24e9 values
    as one float64 copy and its square took 11 s)."""
    sums = {}
    for name, param in _unstackedon_host(run.state["model"]).items():
        total = squares = 0.0
        for chunk in float64_chunks(param):
            total, squares = total + float(chunk.sum()), squares + float(chunk @ chunk)
        sums[name] = [total, squares]
    return sums


def _train_steps(run: Training, batches: np.ndarray, steps: range,
                 extra_options: tuple[tuple[str, object], ...] = ()) -> list[float]:
    """Losses of optimizer steps `steps` on `batches` (the state is donated and replaced in `run`), the step
    compiled with `extra_options` added to its own."""
    spec = dataclasses.replace(run.spec, compiler_options=run.spec.compiler_options + extra_options)
    losses = []
    for step in steps:
        coefficients = adamw_coefficients(spec.optimizer, step)
        run.state, loss, _ = train_step(run.state, *sharded_batch(batches[step], run.mesh),
                                        step_scalars(coefficients), spec=spec)
        losses.append(float(loss))  # waits for the step
    return losses


def equivalence(job: Job, work_dir: Path, devices: list, clock: SetupClock, host_arrays: dict) -> dict:
    """An equivalence job (jobs.py), or a "gradients" job of the fast path: its gradients alone (no weight sums,
    logits or loss curve), computed as the training step computes them (XLA's default matmul precision)."""
    phases = Phases()  # each lap after a host read, which waits for the devices' work
    settings = job.settings()
    batches = job_batches(job)
    whole = job.kind == "equivalence"
    with jax.default_matmul_precision("highest" if whole and jax.default_backend() == "gpu" else None):
        run = build_training(settings, devices, host_arrays)
        clock.weights_loaded()
        phases.lap("build")
        fastpath_jax.perturb(run, job.perturb)
        sums = _weight_sums(run) if whole else None
        phases.lap("weight sums")
        tokens, targets, positions = sharded_batch(batches[0], run.mesh)
        arrays = {}
        if whole:
            (loss, logits), grads = check_loss_grads_and_logits(run.state["model"], tokens, targets, positions,
                                                                spec=run.spec, with_logits=True)
            order = layout_order(job.seq_len, settings.mesh.sp, RING_LAYOUT)
            arrays["logits"] = np.ascontiguousarray(on_host(logits)[:, inverse_order(order)])  # safetensors: C order
            del logits  # the device's copy, before the steps need the memory
        else:
            loss, grads = _loss_and_grads_alone(run.state["model"], tokens, targets, positions, spec=run.spec)
        loss = float(loss)
        phases.lap("loss and gradients")
        arrays.update({f"grad/{name}": g for name, g in _unstackedon_host(grads).items()})
        del grads
        phases.lap("gather to host")
        # the check's steps in float32 at full precision: compiled without autotuning, as its first function
        curve = (_train_steps(run, batches, range(settings.steps), CHECK_COMPILER_OPTIONS)
                 if whole and job.mode == "train" else [])
        phases.lap("loss curve steps")
    save_file(arrays, str(work_dir / f"{job.id}.safetensors"))
    phases.lap("write")
    return {"status": "ok", "loss": loss, "loss_curve": curve, "weight_sums": sums, "phases_s": phases.seconds,
            "setup": clock.result()}


def curve(job: Job, work_dir: Path, devices: list, clock: SetupClock, host_arrays: dict) -> dict:
    """A curve job (compare/harness/jobs.py): `twinflash train`'s steps on its batches, the loss of each."""
    settings = job.settings()
    batches = job_batches(job)
    run = build_training(settings, devices, host_arrays)
    clock.weights_loaded()
    fastpath_jax.perturb(run, job.perturb)
    losses, seconds = [], []
    for step in range(settings.steps):
        mark_progress(work_dir, job, step, settings.steps, f"step {step + 1}/{settings.steps}")
        began = time.perf_counter()
        losses += _train_steps(run, batches, range(step, step + 1))
        seconds.append(time.perf_counter() - began)
    steady = statistics.median(seconds[1:]) if len(seconds) > 1 else None
    return {"status": "ok", "losses": losses, "seconds": time.time() - clock.began,
            "setup": clock.result(seconds[0] if steady else None, steady)}


_SPAN_LINES = ("XLA Modules", "Steps", "XLA TraceMe")  # lines whose events span whole steps, not kernels


def _leaves(events: list) -> list:
    """The events of one timeline line that contain no other event of it (nested ones: a loop around its body)."""
    ordered = sorted(events, key=lambda e: (e.start_ns, -e.end_ns))
    return [e for e, after in zip(ordered, ordered[1:] + [None])
            if after is None or after.start_ns >= e.end_ns]


def activity_intervals(trace_dir: str, platform: str) -> tuple[list, list]:
    """(communication, compute) (start, end) seconds of device 0 in a profile: on GPU 0, NCCL kernels and every
    other kernel; on CPU, the XLA collectives' events and the other innermost events of the host threads that run
    the CPU devices."""
    (xplane,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    communication, compute = [], []
    for plane in jax.profiler.ProfileData.from_file(xplane).planes:
        on_gpu0 = plane.name == "/device:GPU:0"
        if not (on_gpu0 if platform == "gpu" else plane.name.startswith("/host:CPU")):
            continue
        for line in plane.lines:
            if any(span in line.name for span in _SPAN_LINES):
                continue
            events = list(line.events)
            for event in events:
                if ("nccl" in event.name.lower()) if on_gpu0 else is_collective_op(event.name):
                    communication.append((event.start_ns / 1e9, event.end_ns / 1e9))
            compute += [(e.start_ns / 1e9, e.end_ns / 1e9) for e in _leaves(events)
                        if "nccl" not in e.name.lower() and not is_collective_op(e.name)]
    return communication, compute


def _job_peak(run: Training, before: int, step_args: tuple, mode: str) -> tuple[int | None, str]:
    """(this job's peak bytes per device, how it was found): see the module docstring."""
    peaks = peak_memory_bytes(run.mesh)
    after = max(peaks)
    local = [d for d in run.mesh.devices.flat if d.process_index == jax.process_index()]  # this process's only
    on_gpu = all((d.memory_stats() or {}).get("peak_bytes_in_use") is not None for d in local)
    if after > before or not on_gpu:
        return after, "measured" if on_gpu else "host peak RSS"
    temp = step_temp_bytes(run, step_args) if mode == "train" else None
    if temp is None:
        return None, "unknown"
    in_use = max((d.memory_stats() or {}).get("bytes_in_use", 0) for d in local)
    return int(in_use + temp), "XLA plan"


def step_temp_bytes(run: Training, step_args: tuple) -> int | None:
    """The compiled train step's temporary buffers (XLA's memory analysis), None where the XLA build has none.
    For arguments of the shapes the step already ran with, `lower(...).compile()` is served from jit's cache: no
    second compilation (tests/test_compare.py checks it with `backend_compiles`)."""
    try:
        return train_step.lower(*step_args, spec=run.spec).compile().memory_analysis().temp_size_in_bytes
    except Exception:  # an XLA build without the analysis: no number rather than a wrong one
        return None


@contextlib.contextmanager
def backend_compiles() -> Iterator[dict]:
    """{"count", "seconds"} of XLA's compilations inside the block (a persistent-cache hit compiles nothing): in
    each job's result (`xla_compiles`), where its setup went, and a function compiled twice shows there."""
    counted = {"count": 0, "seconds": 0.0}

    def listen(event: str, seconds: float, **_) -> None:
        if event == BACKEND_COMPILE_EVENT:
            counted["count"] += 1
            counted["seconds"] += seconds

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield counted
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def bench(job: Job, work_dir: Path, devices: list, clock: SetupClock, host_arrays: dict) -> dict:
    settings = job.settings()
    batches = job_batches(job)
    units = bench_units(job.steps)
    run = build_training(settings, devices, host_arrays)
    clock.weights_loaded()
    peak_before = max(peak_memory_bytes(run.mesh))
    inputs = [sharded_batch(batch, run.mesh) for batch in batches]

    def forward(i: int) -> float:
        return float(_forward_loss(run.state["model"], *inputs[i], spec=run.spec))

    def step(i: int) -> float:
        return _train_steps(run, batches, range(i, i + 1))[0] if job.mode == "train" else forward(i)

    def timed(fn, i: int, phase: str, done: int) -> float:
        mark_progress(work_dir, job, done, units, phase)
        began = time.perf_counter()
        fn(i)  # both end in a host read of the loss, which waits for the step
        seconds = time.perf_counter() - began
        if jax.process_count() == 1:
            return seconds
        # across nodes the slowest process's time: every process then takes the same decisions on it (how many
        # passes, jobs.LONG_STEP_S)
        return float(np.max(multihost_utils.process_allgather(np.array(seconds))))

    first_s = timed(step, 0, "warm-up step", 1)  # compilation and allocator warm-up
    step_times = timed_steps(lambda i: timed(step, i, f"step {i}/{job.steps}", 1 + i), len(inputs) - 1)
    step_s = statistics.median(step_times)
    forward(0)  # compiles the forward alone
    forward_s = statistics.median(timed(forward, i, "forward", 2 + job.steps + i)
                                  for i in range(min(forward_passes(step_s), len(inputs))))
    peak, peak_source = _job_peak(run, peak_before, (run.state, *inputs[0], step_scalars(
        adamw_coefficients(run.spec.optimizer, 0))), job.mode)
    trace_dir = job.trace_dir and str(Path(job.trace_dir) / job.id)
    platform = jax.default_backend()
    comm_s = exposed_s = None
    if job.devices > 1 or trace_dir:  # one device: no communication to find, no trace asked for
        mark_progress(work_dir, job, units - 1, units, "profiled step")
        with tempfile.TemporaryDirectory() as scratch:
            log_dir = trace_dir or scratch
            with jax.profiler.trace(log_dir):
                step(0)
            if job.devices > 1:
                communication, compute = activity_intervals(log_dir, platform)
                comm_s = union_seconds(communication)
                exposed_s = min(exposed_seconds(communication, compute), step_s)  # measured in the profiled step
    return {"status": "ok", "step_s": step_s, "first_step_s": first_s, "forward_s": forward_s, "comm_s": comm_s,
            "comm_exposed_s": exposed_s, "peak_memory_bytes": peak, "peak_memory_source": peak_source,
            "trace": trace_dir, "platform": platform, "setup": clock.result(first_s, step_s)}


def main(argv: list[str]) -> int:
    jobs, work_dir = read_job_file(Path(argv[0]))
    started_at = launched_at()
    nodes = Nodes.from_env()  # a launch spanning nodes: this node's process joins the others' before JAX starts
    if nodes is not None:
        init_distributed(nodes.coordinator, nodes.count, nodes.rank, nodes.timeout_s)
    host_arrays: dict[tuple[str, int], dict] = {}  # per weights: the jobs of a launch read them from disk once
    for job in jobs:
        mark_started(work_dir, job)
        clock = SetupClock(started_at)
        started_at = None  # the process's start is the first job's setup alone
        weights = host_arrays.setdefault((job.model, job.seed), {})
        with backend_compiles() as compiles:
            try:
                result = {"equivalence": equivalence, "gradients": equivalence, "attention": fastpath_jax.attention,
                          "bench": bench, "curve": curve}[job.kind](
                    job, work_dir, jax.devices()[:job.devices], clock, weights)
            except Exception as failure:  # recorded in the report; the sweep goes on
                message = f"{type(failure).__name__}: {failure}"
                traceback.print_exc()
                result = {"status": "oom" if is_out_of_memory(message) else "error", "message": message[:2000]}
        write_result(work_dir, job, result | {"xla_compiles": compiles})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
