"""The live view of a `twinflash compare` run (rich): one line for the run (jobs done of all, elapsed, an estimate
of what is left) and one line per job once it starts (its phase, elapsed time, an estimate of what is left of it),
read from the progress the workers record (`jobs.mark_progress`) by a thread that polls the work directory. Where
the console is not a terminal (a log file), one plain line per finished job instead.

Estimates: a job's rest from its timed units so far (the warm-up step, which compiles, is left out of the rate);
the run's rest from the mean time of the jobs that ran, times the jobs left.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console
from rich.progress import Progress, TextColumn, TimeElapsedColumn

from compare.harness import jobs as J
from compare.launch import repeating

POLL_S = 0.5


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else \
        f"{seconds // 60}:{seconds % 60:02d}"


class _JobLine:
    def __init__(self, task: int):
        self.task, self.began, self.timed_from, self.timed_done = task, time.monotonic(), None, 0

    def left(self, progress: dict) -> float | None:
        """Seconds left from the rate of the units after the warm-up step (None before there is one)."""
        done, total = progress.get("done", 0), progress.get("total", 0)
        if done >= 2 and self.timed_from is None:
            self.timed_from, self.timed_done = time.monotonic(), done
        if self.timed_from is None or done <= self.timed_done:
            return None
        rate = (time.monotonic() - self.timed_from) / (done - self.timed_done)
        return rate * (total - done)


class RunProgress:
    """The live lines of a run's `jobs`. `done(job, result)` after each job's result."""

    def __init__(self, jobs: list[J.Job], work_dir: Path, console: Console):
        self.jobs, self.work_dir, self.console = jobs, work_dir, console
        self.live = console.is_terminal
        self.progress = Progress(TextColumn("{task.description}"), TextColumn("{task.fields[phase]}"),
                                 TimeElapsedColumn(), TextColumn("{task.fields[left]}"), console=console,
                                 disable=not self.live)
        self.run_task = self.progress.add_task("[bold]compare[/]", phase=f"0/{len(jobs)} jobs", left="")
        self.lines: dict[str, _JobLine] = {}
        self.finished: dict[str, float] = {}
        self.began = time.monotonic()
        self.lock = threading.Lock()

    def done(self, job: J.Job, result: dict) -> None:
        with self.lock:
            line = self.lines.get(job.id)
            took = time.monotonic() - line.began if line else 0.0
            self.finished[job.id] = took
            status = result["status"]
            step = f", step {result['step_s']:.3g} s" if result.get("step_s") else ""
            setup = result.get("setup")
            timing = (f", setup {sum(setup[k] or 0.0 for k in ('launch_s', 'weights_s', 'compile_s')):.3g} s, measured "
                      f"{setup['measured_s']:.3g} s" if setup else "")
            if line is not None:
                self.progress.update(line.task, phase=f"{status}{step}{timing}", left="")
                self.progress.stop_task(line.task)
            if not self.live:
                self.console.print(f"{job.id}: {status}{step}{timing} {(result.get('message') or '')[:160]}",
                                   highlight=False, soft_wrap=True)
            self._update_run()

    def _update_run(self) -> None:
        ran = [t for t in self.finished.values() if t > 0]
        left_jobs = len(self.jobs) - len(self.finished)
        estimate = sum(ran) / len(ran) * left_jobs if ran else None
        self.progress.update(self.run_task, phase=f"{len(self.finished)}/{len(self.jobs)} jobs",
                             left=f"~{_clock(estimate)} left" if left_jobs else "")

    def _poll(self) -> None:
        with self.lock:
            for job in self.jobs:
                if job.id in self.finished:
                    continue
                progress = J.read_progress(self.work_dir, job.id)
                if progress is None:
                    continue
                line = self.lines.get(job.id)
                if line is None:
                    line = self.lines[job.id] = _JobLine(self.progress.add_task(f"  {job.id}", phase="setup",
                                                                                left=""))
                left = line.left(progress)
                self.progress.update(line.task, phase=progress.get("phase", "setup"),
                                     left=f"~{_clock(left)} left" if left is not None else "")
            self._update_run()

    @contextlib.contextmanager
    def shown(self) -> Iterator[None]:
        """The live view while the block runs."""
        with self.progress, repeating(self._poll, POLL_S, "twinflash-progress"):
            yield
