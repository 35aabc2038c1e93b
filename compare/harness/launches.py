"""Running the planned jobs of `twinflash compare`: the backend workers' launches, one per backend and device count
serving all of its jobs (`worker_torch.py` under torchrun, one process per device; `worker_jax.py`, one process
over that many devices: on CPU that many emulated host devices, on GPUs the first that many visible GPUs), the
caches every launch of a run shares (JAX's persistent compilation cache, Triton's kernel and autotuning caches,
inductor's; directories under the run's work directory), the relaunch loop after a failed launch (the job that
was running is recorded as OOM, error or timeout from the log and the rest runs in a new launch), the points the
plan skipped (recorded with their reason, never launched), and the time limit. A launch over more devices than a
node has spans nodes (`across_nodes`: node 0's side runs here, the others' on their nodes). Launches are
`compare.launch`'s owned processes: an `Interrupted` propagates with the launches stopped, and the command records
the jobs left.

Launches side by side (`run_side_by_side`): on a host of several GPUs, launches whose GPUs do not overlap run at
the same time, each on GPUs of its own (CUDA_VISIBLE_DEVICES), e.g. torch's and JAX's one-GPU launches on GPUs 0
and 1 (on 2 H200s that took ~50-75 s each while the other GPU idled). Their points stay comparable: a point's
step runs on its own devices, and a one-device point moves nothing over NVLink or PCIe but its inputs and loss;
what they share is the host's cores, for launching and compiling. Before them the jobs whose time is no
measurement, the checks (the float32 equivalence and the fast path's) and the bf16 noise floor's trainings, run in
launches of their own (one per backend, device count and kind), all at once on shared GPUs (`run_together`): mostly compilation and host work (on
2 H200s the reference, torch and JAX checks took 25, 51 and 76 s one after the other, the four trainings ~12 s
each after their points' compilation). On CPU (emulated devices share the
cores, and a point's time would count the other launch's work), across nodes, and with `--serial-launches`, one
launch at a time as planned, the checks first in their launches and each training after its point.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from compare.harness import jobs as J
from compare.harness.across_nodes import Lead, SpanningLaunch
from compare.harness.plan import CompareSettings, group_launches
from compare.launch import (JAX_GPU_MEMORY_FRACTION, crash_signal, failure_reason, host_devices_env, owned_process,
                            stop_process_tree, torchrun_launcher)
from compare.nodes import Nodes, torchrun_arguments

CACHE_DIR = "cache"  # under the run's work directory
# JAX on CPU: XLA's code generation without LLVM's optimisations. A CPU point is no benchmark and its step takes
# milliseconds, while compiling the train step (the Pallas kernels interpreted as loops) takes most of the JAX
# side's time: at level 0 about half as long (tiny model: 11 -> 5 s per train step); the equivalence metrics move
# by rounding only (< 1e-7, tolerances 1e-5 and up).
CPU_XLA_FLAGS = "--xla_backend_optimization_level=0"


def cache_env(work_dir: Path, part: str = "") -> dict[str, str]:
    """The compilation caches every launch of a run shares (a variable the user set is kept): JAX's persistent
    compilation cache for every compiled function however quick, Triton's kernels and autotuning results,
    inductor's graphs. `part`: caches of their own, for launches on GPUs shared with others, whose timing-based
    choices (Triton's autotuning, XLA's, both kept in these caches) a benchmark point must not inherit."""
    cache = work_dir / CACHE_DIR / part
    wanted = {"JAX_COMPILATION_CACHE_DIR": str(cache / "jax"), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
              "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0", "TRITON_CACHE_DIR": str(cache / "triton"),
              "TRITON_CACHE_AUTOTUNING": "1", "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}
    return {name: os.environ.get(name, value) for name, value in wanted.items()}


POLL_S = 0.2  # how often a running launch's results are looked for


def visible_gpus(count: int) -> tuple[str, ...]:
    """The first `count` GPU ids this process sees (CUDA_VISIBLE_DEVICES, else 0, 1, ...)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [i.strip() for i in visible.split(",")] if visible else [str(i) for i in range(count)]
    return tuple(ids[:count])


def _first_gpus(devices: int) -> str:
    """CUDA_VISIBLE_DEVICES for a JAX process on `devices` GPUs: the first of those this process sees (JAX
    reserves memory on every GPU it sees)."""
    return ",".join(visible_gpus(devices))


def side_launcher(backend: str, devices: int, platform: str, work_dir: Path, rendezvous: Nodes | None = None,
                  launch_id: str = "") -> tuple[list[str], dict[str, str]]:
    """(worker command without its job file, environment) of one node's side of a launch over `devices` of this
    node: alone, or with `rendezvous` (this node's place in a launch spanning nodes, `across_nodes`; `launch_id`
    names its torch rendezvous)."""
    shared = cache_env(work_dir) | {"PYTHONUNBUFFERED": "1"} | (rendezvous.to_env() if rendezvous else {})
    # The worker modules by their own names (`python -m`), imported for that here: the backend is installed
    if backend == "torch":
        from compare.harness import worker_torch

        spanning = tuple(torchrun_arguments(rendezvous, launch_id)) if rendezvous else ("--standalone",)
        launcher, env = torchrun_launcher(devices, spanning)
        return [*launcher, "-m", worker_torch.__name__], env | shared
    if platform == "cpu":
        env = host_devices_env(devices)
        if "--xla_backend_optimization_level" not in env["XLA_FLAGS"]:  # a level the user chose is kept
            env["XLA_FLAGS"] += f" {CPU_XLA_FLAGS}"
    else:  # the GPU for one process's jobs (`JAX_GPU_MEMORY_FRACTION`)
        env = dict(os.environ) | {"CUDA_VISIBLE_DEVICES": _first_gpus(devices)}
        env.setdefault(*JAX_GPU_MEMORY_FRACTION)
    from compare.harness import worker_jax

    return [sys.executable, "-m", worker_jax.__name__], env | shared


Spanning = Callable[[Path], tuple[SpanningLaunch, tuple[list[str], dict[str, str]]]]


def _spanning(lead: Lead | None, backend: str, devices: int, platform: str, work_dir: Path) -> Spanning | None:
    """None for a launch on node 0 alone; else what announces each launch to the other nodes and gives node 0's
    side of it."""
    if lead is None or not lead.spans(devices):
        return None

    def announce(job_file: Path):
        span = lead.launch(backend, devices, job_file)
        return span, side_launcher(backend, span.per_node, platform, work_dir, span.rendezvous, span.launch_id)

    return announce


def _record_not_run(jobs: list[J.Job], work_dir: Path, on_done) -> None:
    for job in jobs:
        J.write_result(work_dir, job, {"status": "timeout", "message": "not run: --time-limit-s reached"})
        on_done(job)


def run_launch(jobs: list[J.Job], command: list[str], env: dict[str, str], work_dir: Path, log: Path,
               timeout_s: float, on_done, deadline: float = math.inf, spanning: Spanning | None = None,
               lead: Lead | None = None) -> None:
    """Runs `jobs` through the worker `command`, relaunching after a failure with the jobs left. A job that was
    running when its launch failed gets status oom / error / timeout from the log, except that a job whose worker
    died by a crash signal (`compare.launch.CRASH_SIGNALS`) the first time runs once more in a fresh launch (its
    result then says so); if a launch fails before any job started, every job left gets the error. At `deadline` (time.monotonic) the launch is stopped and the jobs
    left are recorded as not run. `on_done(job)` after each job's result appears. `spanning`: the launch spans
    nodes (`across_nodes`), each launch announced to the other nodes, which `lead` watches (a lost node ends the
    run with `NodeFailure`)."""
    for _ in launch_polls(jobs, command, env, work_dir, log, timeout_s, on_done, deadline, spanning, lead):
        time.sleep(POLL_S)


def launch_polls(jobs: list[J.Job], command: list[str], env: dict[str, str], work_dir: Path, log: Path,
                 timeout_s: float, on_done, deadline: float = math.inf, spanning: Spanning | None = None,
                 lead: Lead | None = None) -> Iterator[None]:
    """`run_launch` one poll at a time: yields while its worker runs (the caller waits between polls, and may
    drive several launches so); closing it stops the worker."""
    remaining = list(jobs)
    crashed: dict[str, str] = {}  # job id -> the signal its first worker died by
    while remaining:
        if time.monotonic() > deadline:
            _record_not_run(remaining, work_dir, on_done)
            return
        job_file = work_dir / f"jobs-{remaining[0].id}.json"
        J.write_job_file(job_file, remaining, work_dir)
        span, (command, env) = spanning(job_file) if spanning else (None, (command, env))
        launched = list(remaining)
        offset = log.stat().st_size if log.exists() else 0
        launch_env = env | {J.LAUNCHED_AT_ENV: repr(time.time())}
        with open(log, "a") as out, owned_process([*command, str(job_file)], stdout=out, stderr=out,
                                                  env=launch_env) as process:
            timed_out, last = False, time.monotonic()
            while process.poll() is None:
                yield
                if lead is not None:
                    lead.check()
                finished = [j for j in remaining if J.read_result(work_dir, j.id) is not None]
                for job in finished:
                    _note_crash(work_dir, job, crashed)
                    on_done(job)
                    remaining.remove(job)
                    last = time.monotonic()
                if time.monotonic() - last > timeout_s or time.monotonic() > deadline:
                    timed_out = True
                    stop_process_tree(process)
        with open(log) as text:
            text.seek(offset)
            tail = text.read()[-3000:]
        if span is not None:  # the other nodes' sides end too (a result their rank 0 writes last may come now)
            lead.finish(span, tail, process.returncode, timed_out, any(J.started(work_dir, j.id) for j in launched))
        for job in [j for j in remaining if J.read_result(work_dir, j.id) is not None]:
            _note_crash(work_dir, job, crashed)
            on_done(job)
            remaining.remove(job)
        if not remaining:
            return
        running = [j for j in remaining if J.started(work_dir, j.id)]
        crash = None if timed_out or J.is_out_of_memory(tail) else crash_signal(tail, process.returncode)
        if crash and running and running[0].id not in crashed:
            crashed[running[0].id] = crash
            J.forget_start(work_dir, running[0])
            with open(log, "a") as out:
                out.write(f"[compare] {running[0].id}: its worker died by {crash}; running it once more in a fresh "
                          "launch\n")
            continue
        failed = running[:1] if running else list(remaining)
        status = "timeout" if timed_out else ("oom" if J.is_out_of_memory(tail) else "error")
        silent = "stopped at --time-limit-s" if time.monotonic() > deadline else f"no progress for {timeout_s:.0f} s"
        crashed_again = crash and running and f"its worker died by {crash}, the second time in a fresh launch"
        message = (silent if timed_out else crashed_again or failure_reason(tail) or
                   f"worker exited with code {process.returncode}") + f" (log: work/logs/{log.name})"
        for job in failed:
            J.write_result(work_dir, job, {"status": status, "message": message})
            on_done(job)
            remaining.remove(job)


def _note_crash(work_dir: Path, job: J.Job, crashed: dict[str, str]) -> None:
    """A job that ran again after its first worker crashed says so in its result's message (the report's notes)."""
    if job.id not in crashed:
        return
    result = J.read_result(work_dir, job.id)
    note = f"ran again in a fresh launch: its first worker died by {crashed[job.id]}"
    J.write_result(work_dir, job, {**{k: v for k, v in result.items() if k != "id"},
                                   "message": "; ".join(filter(None, (result.get("message"), note)))})


@dataclasses.dataclass(frozen=True)
class Launch:
    """One planned launch for `run_side_by_side`: over `devices` GPUs, `start(gpus)` its polls (`launch_polls`) on
    those GPU ids (None: on the GPUs its environment already names)."""

    devices: int
    start: Callable[[tuple[str, ...] | None], Iterator[None]]


def run_side_by_side(launches: list[Launch], gpus: tuple[str, ...] | None) -> None:
    """Runs `launches`: with `gpus` None one after the other in their order; else each as soon as `devices` of
    `gpus` are free, on those (the first launch in order that fits starts, a later one going first where an
    earlier one does not fit yet, so that no GPU idles while a launch that fits it waits). An exception (an
    `Interrupted`, a lost node) stops every running launch and propagates."""
    if gpus is not None and any(launch.devices > len(gpus) for launch in launches):
        raise ValueError(f"a launch needs more GPUs than the {len(gpus)} given")
    pending, running, free = list(launches), [], list(gpus or ())
    try:
        while pending or running:
            for launch in list(pending):
                if gpus is None:
                    if running:
                        break
                    taken = None
                elif launch.devices <= len(free):
                    taken, free = tuple(free[:launch.devices]), free[launch.devices:]
                else:
                    continue
                pending.remove(launch)
                running.append((launch.start(taken), taken or ()))
            for entry in list(running):
                polls, taken = entry
                if next(polls, StopIteration) is StopIteration:
                    running.remove(entry)
                    free = sorted([*free, *taken], key=(gpus or ()).index)
            if running:
                time.sleep(POLL_S)
    finally:
        for polls, _ in running:
            polls.close()  # stops its worker (`owned_process`)


def run_jobs(jobs: list[J.Job], settings: CompareSettings, work_dir: Path, timeout_s: float, on_done,
             deadline: float = math.inf, lead: Lead | None = None, side_by_side: bool = True,
             on_checks_done: Callable[[], None] | None = None) -> None:
    """The points the plan skipped are recorded (vendor kernels off-GPU as unsupported, points beyond the device's
    memory as skipped); the rest run in one launch per backend and device count (`plan.group_launches`), over
    several nodes where `lead` places them so. Where `side_by_side` and `launches_side_by_side` allow it, the jobs
    that measure no time (equivalence checks, the noise floor's trainings) run first in launches of their own, all
    at once (then `on_checks_done()`), and the benchmark points' launches on disjoint GPUs side by side."""
    logs = work_dir / "logs"
    logs.mkdir(exist_ok=True)
    runnable = []
    for job in jobs:
        if job.skip is not None:
            status = "unsupported" if job.attention == "vendor" and settings.platform == "cpu" else "skipped"
            J.write_result(work_dir, job, {"status": status, "message": job.skip})
            on_done(job)
        else:
            runnable.append(job)

    def launch(backend: str, devices: int, group: list[J.Job], shared_by: str = "") -> Launch:
        """`shared_by`: the kind of jobs of a launch that shares its GPUs with others (`run_together`)."""
        def start(gpus: tuple[str, ...] | None) -> Iterator[None]:
            command, env = side_launcher(backend, devices, settings.platform, work_dir)
            env = env if gpus is None else env | {"CUDA_VISIBLE_DEVICES": ",".join(gpus)}
            if shared_by:
                env |= cache_env(work_dir, shared_by)
                if backend == "jax":  # beside other launches on the same GPUs: memory taken as needed
                    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
            log = logs / f"{backend}-{devices}{'-' if shared_by else ''}{shared_by}.log"
            return launch_polls(group, command, env, work_dir, log, timeout_s, on_done, deadline,
                                _spanning(lead, backend, devices, settings.platform, work_dir), lead)

        return Launch(devices, start)

    planned = group_launches(runnable)
    if not (side_by_side and launches_side_by_side(settings, lead)):
        run_side_by_side([launch(*group) for group in planned], None)
        return
    gpus = visible_gpus(settings.devices)
    shared = {"equivalence": J.CHECK_KINDS, "curve": ("curve",)}  # the launches' kinds of jobs, by name
    checks = [(backend, devices, [j for j in group if j.kind in kinds], name)
              for backend, devices, group in planned for name, kinds in shared.items()]
    run_together([launch(*group) for group in checks if group[2]], gpus)
    if on_checks_done is not None:
        on_checks_done()
    points = [(backend, devices, [j for j in group if j.kind == "bench"]) for backend, devices, group in planned]
    run_side_by_side([launch(*group) for group in points if group[2]], gpus)


def run_together(launches: list[Launch], gpus: tuple[str, ...]) -> None:
    """Runs `launches` at the same time, each on the first of `gpus` it needs: they share GPUs, which only jobs
    whose time is no measurement may do (the equivalence checks). An exception stops every running launch and
    propagates."""
    running = [launch.start(gpus[:launch.devices]) for launch in launches]
    try:
        while running:
            running = [polls for polls in running if next(polls, StopIteration) is not StopIteration]
            if running:
                time.sleep(POLL_S)
    finally:
        for polls in running:
            polls.close()  # stops its worker (`owned_process`)


def launches_side_by_side(settings: CompareSettings, lead: Lead | None) -> bool:
    """Whether launches on disjoint GPUs may run at the same time: on one host of several GPUs (module
    docstring)."""
    return settings.platform == "gpu" and settings.devices > 1 and (lead is None or not lead.nodes.spans_hosts)
