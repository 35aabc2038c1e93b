"""Running the planned jobs of `twinflash compare`: the backend workers' launches (`worker_torch.py` under torchrun,
one process per device; `worker_jax.py`, one process per job over all local devices, on CPU with that many emulated
host devices), the relaunch loop after a failed launch (the job that was running is recorded as OOM, error or
timeout from the log and the rest runs in a new launch), and the time limit. Launches are `compare.launch`'s owned
processes: an `Interrupted` propagates with the launch stopped, and the command records the jobs left.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

from compare.harness import jobs as J
from compare.launch import failure_reason, host_devices_env, owned_process, stop_process_tree, torchrun_launcher


def _launcher(backend: str, devices: int, platform: str) -> tuple[list[str], dict[str, str]]:
    if backend == "torch":
        launcher, env = torchrun_launcher(devices)
        return [*launcher, "-m", "compare.harness.worker_torch"], env | {"PYTHONUNBUFFERED": "1"}
    env = host_devices_env(devices) if platform == "cpu" else dict(os.environ)
    return [sys.executable, "-m", "compare.harness.worker_jax"], env | {"PYTHONUNBUFFERED": "1"}


def _record_not_run(jobs: list[J.Job], work_dir: Path, on_done) -> None:
    for job in jobs:
        J.write_result(work_dir, job, {"status": "timeout", "message": "not run: --time-limit-s reached"})
        on_done(job)


def run_launch(jobs: list[J.Job], command: list[str], env: dict[str, str], work_dir: Path, log: Path,
               timeout_s: float, on_done, deadline: float = math.inf) -> None:
    """Runs `jobs` through the worker `command`, relaunching after a failure with the jobs left. A job that was
    running when its launch failed gets status oom / error / timeout from the log; if a launch fails before any
    job started, every job left gets the error. At `deadline` (time.monotonic) the launch is stopped and the jobs
    left are recorded as not run. `on_done(job)` after each job's result appears."""
    remaining = list(jobs)
    while remaining:
        if time.monotonic() > deadline:
            _record_not_run(remaining, work_dir, on_done)
            return
        job_file = work_dir / f"jobs-{remaining[0].id}.json"
        J.write_job_file(job_file, remaining, work_dir)
        offset = log.stat().st_size if log.exists() else 0
        with open(log, "a") as out, owned_process([*command, str(job_file)], stdout=out, stderr=out,
                                                  env=env) as process:
            timed_out, last = False, time.monotonic()
            while process.poll() is None:
                time.sleep(0.2)
                finished = [j for j in remaining if J.read_result(work_dir, j.id) is not None]
                for job in finished:
                    on_done(job)
                    remaining.remove(job)
                    last = time.monotonic()
                if time.monotonic() - last > timeout_s or time.monotonic() > deadline:
                    timed_out = True
                    stop_process_tree(process)
        for job in [j for j in remaining if J.read_result(work_dir, j.id) is not None]:
            on_done(job)
            remaining.remove(job)
        if not remaining:
            return
        with open(log) as text:
            text.seek(offset)
            tail = text.read()[-3000:]
        running = [j for j in remaining if J.started(work_dir, j.id)]
        failed = running[:1] if running else list(remaining)
        status = "timeout" if timed_out else ("oom" if J.is_out_of_memory(tail) else "error")
        silent = "stopped at --time-limit-s" if time.monotonic() > deadline else f"no progress for {timeout_s:.0f} s"
        message = (silent if timed_out else failure_reason(tail) or
                   f"worker exited with code {process.returncode}") + f" (log: work/logs/{log.name})"
        for job in failed:
            J.write_result(work_dir, job, {"status": status, "message": message})
            on_done(job)
            remaining.remove(job)


def run_jobs(jobs: list[J.Job], settings: dict, work_dir: Path, timeout_s: float, on_done,
             deadline: float = math.inf) -> None:
    """Vendor kernels off-GPU are recorded as unsupported; torch jobs run in one launch per device count (ranks
    = devices), JAX jobs in one process each (its peak-memory counter cannot be reset between jobs)."""
    logs = work_dir / "logs"
    logs.mkdir(exist_ok=True)
    runnable = []
    for job in jobs:
        if job.attention == "vendor" and settings["platform"] == "cpu":
            J.write_result(work_dir, job, {"status": "unsupported",
                                           "message": f"{job.attention_backend} needs a CUDA GPU"})
            on_done(job)
        else:
            runnable.append(job)
    groups: list[tuple[str, int, list[J.Job]]] = []
    for job in runnable:
        if job.backend == "torch" and groups and groups[-1][0] == "torch" and groups[-1][1] == job.devices:
            groups[-1][2].append(job)
        else:
            groups.append((job.backend, job.devices, [job]))
    for backend, devices, group in groups:
        launch_devices = devices if backend == "torch" else settings["devices"]
        command, env = _launcher(backend, launch_devices, settings["platform"])
        run_launch(group, command, env, work_dir, logs / f"{backend}-{devices}.log", timeout_s, on_done, deadline)
