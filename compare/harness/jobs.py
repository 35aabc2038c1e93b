"""The work `twinflash compare` hands to its backend processes, and what they hand back. Owns `Job` (one
equivalence check, one benchmark point or one loss curve of the bf16 noise floor), the job file a launch reads, the files a job leaves in the work
directory (`<id>.started` before it runs, rewritten with its progress as it goes, `<id>.json` and for an
equivalence check `<id>.safetensors` after), the inputs both backends build the same way (`job_batches`,
`Job.settings`), the setup clock of a job (`SetupClock`: launch, weights, compile, beside the measured time), and
the time arithmetic of profiler traces: the communication's busy time is the union of its events' intervals on
device 0 in the profiled step (the time the links were busy, overlap with compute not subtracted: what the
bandwidth divides); the exposed communication is the part of that union during which device 0 computed nothing
(`exposed_seconds`), the communication that costs step time: never more than the busy time, and reported as at
most the median step (the profiled step runs a little slower under the profiler).

Workers: `compare/harness/worker_torch.py` (one process per device, under torchrun) and
`compare/harness/worker_jax.py` (one process, all devices), twins that run a job file's jobs in order (the fast
path's jobs by their `fastpath_torch.py` / `fastpath_jax.py`). A job that raises in the torch worker ends its
launch (a rank that failed can leave the others waiting in a collective, so the whole group is taken down and the
harness starts a new launch for the jobs left); the JAX worker, one process, records an out-of-memory or other
error as the job's result and goes on.

Equivalence jobs (fp32) record: the loaded weights' float64 sum and sum of squares per parameter (a perturbed or
misread weight shows up by name), the next-token loss and the full logits of the first batch, every parameter's
gradient of that loss, in train mode the loss of each of `steps` optimizer steps, and the time of each phase
(`Phases`). The fast path's jobs (compare/harness/fastpath.py) leave files too: an "attention" job the
output and q/k/v gradients of the model's attention function on the fast path's inputs, a "gradients" job every
parameter's gradient of the first batch's loss (in bf16 with one kernel, or the float32 step of `twinflash
check`). Benchmark jobs record the median step time, the forward time (`forward_passes`), the communication
time of one profiled step, throughput inputs and the peak memory per device. Curve jobs (the bf16 noise floor's
trainings, compare/harness/noise_floor.py, and with `--precisions ...,fp8` their FP8 twins) train exactly as
`twinflash train --data text --seed S --mesh fsdp=1,sp=devices --dtype DTYPE --steps N [--fp8]` does (its batches,
`weights.data.training_batches`; its optimizer, `weights.schedule.default_optimizer`; the backend's
`build_training` and train step) inside the launch of their backend and device count, so that they reuse its
process, weights and compiled steps; they record the loss of every step and the job's wall time.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from weights import open_weights
from weights.atomic import write_text_atomically
from weights.data import random_batches, text_batches, training_batches
from weights.parallel import MeshShape
from weights.schedule import OptimizerConfig, default_optimizer
from weights.settings import TrainSettings

LAUNCHED_AT_ENV = "TWINFLASH_LAUNCHED_AT"  # time.time() when the harness started a worker process
PERTURBATION = 1e-2  # --perturb multiplies one parameter by 1 + this in one backend (a real, small mismatch)
# The fast path's jobs (compare/harness/fastpath.py): "attention" runs the model's attention function (the ring over
# one kernel, bf16) on the fast path's random inputs, "gradients" the loss gradients of the check's first batch.
FAST_PATH_KINDS = ("attention", "gradients")
CHECK_KINDS = ("equivalence", *FAST_PATH_KINDS)  # the jobs that time nothing and are compared, not benchmarked
EQUIVALENCE_LR = 1e-3  # train-mode loss curves: large enough that the curve moves, small enough to stay smooth
# XLA's collective op names, as HLO spells them (all-gather) or as JAX names the op (all_gather, ppermute, psum).
_COLLECTIVE_OP = re.compile(r"(all[-_]gather|all[-_]reduce|reduce[-_]scatter|psum[-_]scatter|psum|"
                            r"collective[-_]permute|ppermute|all[-_]to[-_]all)([-_]start|[-_]done)?(\.\d+)*")


@dataclasses.dataclass(frozen=True)
class Job:
    """One unit of a backend's work. `kind`: "equivalence", "bench", "curve", or one of the fast path's
    (`FAST_PATH_KINDS`); `attention`: the harness's name of the kernel family ("ours", "vendor", "reference") and
    `attention_backend` the backend's own kernel name; `scheme`, `ulysses_degree`: the sequence-parallel scheme
    (`twinflash compare --schemes`); `fp8`: the precision axis (`twinflash compare
    --precisions`), the job trains as `twinflash train --fp8` does; `mesh`: "fsdp=A,sp=B" (`twinflash check`; by
    default sp over all `devices`), one sequence per fsdp row; `perturb`: a weight's name or an attention
    perturbation (compare/harness/perturb.py)."""

    id: str
    kind: str
    backend: str
    model: str
    seq_len: int
    devices: int
    attention: str
    attention_backend: str
    dtype: str
    mode: str
    steps: int
    seed: int = 0
    remat: str = "off"  # a weights.parallel.REMAT_MODES key
    perturb: str | None = None
    trace_dir: str | None = None
    skip: str | None = None  # why the point is not attempted (decided up front by the plan), recorded as its result
    fp8: bool = False  # the decoder layers' linears in FP8, as `twinflash train --fp8` (weights/fp8.py)
    mesh: str = ""
    scheme: str = "ring"  # the sequence-parallel scheme over sp, as `twinflash train --sp-scheme`
    ulysses_degree: int | None = None  # the hybrid's U, as `--ulysses-degree`

    def mesh_shape(self) -> MeshShape:
        return MeshShape.parse(self.mesh) if self.mesh else MeshShape(sp=self.devices)

    def settings(self) -> TrainSettings:
        """The training description of this job: batch 1, the sequence split over all `devices` (fsdp=1); a curve
        job's is the one `twinflash train` builds from the same arguments (its default optimizer)."""
        steps, mesh = max(self.steps, 1), self.mesh_shape()
        if self.kind == "curve":
            hidden_size = open_weights(self.model, self.seed).config.hidden_size
            return TrainSettings(backend=self.backend, model=self.model, seq_len=self.seq_len, steps=steps,
                                 mesh=mesh, batch=1, dtype=self.dtype, seed=self.seed,
                                 data="text", optimizer=default_optimizer(hidden_size, steps),
                                 activation_checkpointing=self.remat, attention_backend=self.attention_backend,
                                 fp8=self.fp8)
        optimizer = OptimizerConfig(lr=EQUIVALENCE_LR, warmup_steps=0, total_steps=steps)
        # a check runs its few steps eagerly (torch on GPUs): compiling them would cost more than they take, and
        # the reference it is held against is eager too
        check = self.kind in CHECK_KINDS
        return TrainSettings(backend=self.backend, model=self.model, seq_len=self.seq_len, steps=steps,
                             mesh=mesh, batch=mesh.fsdp, dtype=self.dtype, seed=self.seed,
                             data="text" if check else "random", optimizer=optimizer,
                             activation_checkpointing=self.remat, attention_backend=self.attention_backend,
                             eager=check, fp8=self.fp8, sp_scheme=self.scheme, ulysses_degree=self.ulysses_degree)


def job_batches(job: Job) -> np.ndarray:
    """int64 [steps + 1, 1, seq_len]: real text for equivalence checks, random tokens for benchmarks (one more
    batch than steps: the benchmark's warm-up step); a curve job's [steps, 1, seq_len] are `twinflash train`'s."""
    settings = job.settings()
    config = open_weights(job.model, job.seed).config
    if job.kind == "curve":
        return training_batches(settings, config)
    vocab = config.vocab_size
    make = text_batches if settings.data == "text" else random_batches
    return make(settings.steps + 1, settings.batch, job.seq_len, vocab, job.seed)


def write_job_file(path: Path, jobs: Iterable[Job], work_dir: Path) -> None:
    path.write_text(json.dumps({"work_dir": str(work_dir), "jobs": [dataclasses.asdict(j) for j in jobs]}))


def read_job_file(path: Path) -> tuple[list[Job], Path]:
    data = json.loads(Path(path).read_text())
    return [Job(**j) for j in data["jobs"]], Path(data["work_dir"])


def mark_started(work_dir: Path, job: Job) -> None:
    (work_dir / f"{job.id}.started").touch()


def forget_start(work_dir: Path, job: Job) -> None:
    """Before a job runs again in a new launch: it has not started there yet."""
    (work_dir / f"{job.id}.started").unlink(missing_ok=True)


def mark_progress(work_dir: Path, job: Job, done: int, total: int, phase: str) -> None:
    """What a running job has done, for the harness's progress line: `done` of `total` units, now `phase`."""
    write_text_atomically(work_dir / f"{job.id}.started", json.dumps({"done": done, "total": total, "phase": phase}))


def read_progress(work_dir: Path, job_id: str) -> dict | None:
    """The last `mark_progress` of a started job ({} before its first), None if it has not started."""
    path = work_dir / f"{job_id}.started"
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    return json.loads(text) if text else {}


# A benchmark point times `steps` steps (their median) and its forward twice (the median of 2), but one step and one
# forward where its steps exceed this: such a point is a long context (1B at 128k on 2 GPUs: 5.4-6.7 s steps,
# forwards of ~2 s), whose step lasts thousands of times the timer's and the launch's jitter (ms), so more passes
# would cost seconds each and change nothing; the warm-up and the profiled step stay as they are.
LONG_STEP_S = 2.0


def forward_passes(step_s: float) -> int:
    """How many timed forward passes a benchmark point with steady step `step_s` takes (LONG_STEP_S)."""
    return 1 if step_s > LONG_STEP_S else 2


def timed_steps(timed_step: Callable[[int], float], steps: int) -> list[float]:
    """Seconds of steps 1..`steps` as `timed_step(i)` measures them: every one, or the first alone where it exceeds
    LONG_STEP_S."""
    times = []
    for i in range(1, steps + 1):
        times.append(timed_step(i))
        if times[0] > LONG_STEP_S:
            break
    return times


def bench_units(steps: int) -> int:
    """Progress units of a benchmark job: setup, warm-up step, timed steps, forward passes, profiled step."""
    return steps + 5


class SetupClock:
    """A job's setup time beside its measured time, as the report shows them: `launch_s` (the process's start
    until its first job began: interpreter, imports, device and process-group initialisation; 0 for the later jobs
    of a process), `weights_s` (model built and weights read), `compile_s` (the first step's time beyond a
    steady step: compilation, autotuning, allocator warm-up), `measured_s` (everything after the first step)."""

    def __init__(self, launched_at: float | None):
        self.began = time.time()
        self.launch_s = max(0.0, self.began - launched_at) if launched_at is not None else 0.0
        self.weights_s = 0.0

    def weights_loaded(self) -> None:
        self.weights_s = time.time() - self.began

    def result(self, first_step_s: float | None = None, steady_step_s: float | None = None) -> dict:
        """The "setup" entry of a job's result, at the job's end (no compile time for a job without a warm-up
        step: an equivalence check measures all of its steps)."""
        compile_s = None if first_step_s is None else max(0.0, first_step_s - steady_step_s)
        total = time.time() - self.began
        return {"launch_s": self.launch_s, "weights_s": self.weights_s, "compile_s": compile_s,
                "measured_s": max(0.0, total - self.weights_s - (compile_s or 0.0))}


class Phases:
    """Wall seconds of a job's phases, in order: `lap(name)` ends the phase that began at the previous lap (or at
    creation). An equivalence check records them (`phases_s` in its result) to show which of building, the first
    pass (with its compilation), gathering, the loss curve's steps and writing dominates on a real model."""

    def __init__(self):
        self.last, self.seconds = time.perf_counter(), {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = now - self.last
        self.last = now


def launched_at() -> float | None:
    """When the harness started this job's process (time.time(), from LAUNCHED_AT_ENV), None outside one."""
    value = os.environ.get(LAUNCHED_AT_ENV)
    return float(value) if value else None


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        elif end > start:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def exposed_seconds(communication: Iterable[tuple[float, float]], compute: Iterable[tuple[float, float]]) -> float:
    """Length of the union of `communication` minus its overlap with the union of `compute`: the time device 0
    communicated and computed nothing. Never more than the union of `communication`, nor than the span of all the
    events given."""
    comm, busy = _union(communication), _union(compute)
    overlap, j = 0.0, 0
    for start, end in comm:
        while j < len(busy) and busy[j][1] <= start:
            j += 1
        k = j
        while k < len(busy) and busy[k][0] < end:
            overlap += min(end, busy[k][1]) - max(start, busy[k][0])
            k += 1
    return sum(b - a for a, b in comm) - overlap


def write_result(work_dir: Path, job: Job, result: dict) -> None:
    """`<id>.json`, written under a temporary name and renamed: the harness never reads half a result."""
    write_text_atomically(work_dir / f"{job.id}.json", json.dumps({"id": job.id, **result}))


def read_result(work_dir: Path, job_id: str) -> dict | None:
    path = work_dir / f"{job_id}.json"
    return json.loads(path.read_text()) if path.exists() else None


def started(work_dir: Path, job_id: str) -> bool:
    return (work_dir / f"{job_id}.started").exists()


def union_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (same unit in, seconds out when given seconds)."""
    total, reach = 0.0, -np.inf
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def is_collective_op(name: str) -> bool:
    """An XLA collective's op name (`all-gather.3`, `collective-permute-start`, JAX's `ppermute.1`, ...)."""
    return _COLLECTIVE_OP.fullmatch(name) is not None



def is_out_of_memory(text: str) -> bool:
    """Whether an error message or log says the device ran out of memory (torch or XLA wording)."""
    return bool(re.search(r"out of memory|OutOfMemoryError|RESOURCE_EXHAUSTED", text, re.IGNORECASE))
