"""The process model of the commands that start workers (`compare/launch.py`), end to end on CPU: a signal to the
CLI alone stops every process it started (found by walking the process tree from the CLI's PID in /proc before the
signal, never by name), prints one line and exits 128 + the signal; a worker that dies ends the run with one line
naming its rank. `compare` interrupted writes the report of what finished, the rest marked "interrupted".
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from compare.launch import worker_failure

ROOT = Path(__file__).resolve().parents[1]
STOP_WITHIN_S = 15.0  # the bound: every process gone this long after the signal
START_WITHIN_S = 120.0  # a 2-process gloo run reaches its first steps in ~20 s on a CI core; generous for a busy one

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="walks the process tree in /proc")


def _tree(root: int) -> list[int]:
    """`root` and every process under it, from /proc (the test's own walk, not the code's under test)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except OSError:
                continue
            children.setdefault(parent, []).append(int(entry.name))
    tree = [root]
    for pid in tree:
        tree.extend(children.get(pid, ()))
    return tree


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has stopped; its parent (init for an orphan) reaps it


def _start(tmp_path: Path, *args: str) -> subprocess.Popen:
    """The CLI in a process group of its own, as a shell starts a command (a Ctrl-C signals that group)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "compare.cli", *args], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def _wait_for(condition, process: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + START_WITHIN_S
    while not condition():
        if process.poll() is not None or time.monotonic() > deadline:
            _stop(process)
            pytest.fail(f"{what} did not happen: {process.communicate()[1][-2000:]}")
        time.sleep(0.2)


def _stop(process: subprocess.Popen) -> None:
    for pid in reversed(_tree(process.pid)):  # the test's own clean-up, should an assertion fail
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _end(process: subprocess.Popen, tree: list[int]) -> tuple[int, str]:
    """Waits for the CLI to end and every process of `tree` to be gone, within STOP_WITHIN_S; (exit code, stderr)."""
    signalled = time.monotonic()
    try:
        _, stderr = process.communicate(timeout=STOP_WITHIN_S)
    except subprocess.TimeoutExpired:
        _stop(process)
        pytest.fail("the CLI did not end within 15 s of the signal")
    while any(_alive(pid) for pid in tree) and time.monotonic() - signalled < STOP_WITHIN_S:
        time.sleep(0.1)
    left = [pid for pid in tree if _alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes still alive {STOP_WITHIN_S} s after the signal: {left}"
    return process.returncode, stderr


# A stand-in for torchrun: starts a process in a session of its own (as torchrun starts each rank), prints its PID.
_SPAWNER = ("import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', 'import time; "
            "time.sleep(60)'], start_new_session=True); print(child.pid, flush=True); time.sleep(60)")


def test_an_owned_process_is_stopped_with_the_processes_in_sessions_of_their_own():
    from compare.launch import owned_process

    with owned_process([sys.executable, "-c", _SPAWNER], stdout=subprocess.PIPE, text=True) as process:
        grandchild = int(process.stdout.readline())
        tree = _tree(process.pid)
        assert grandchild in tree and os.getsid(grandchild) != os.getsid(process.pid)  # not in its group
    process.stdout.close()
    deadline = time.monotonic() + 5.0  # SIGKILL is immediate; the margin is for a loaded CI core
    while any(_alive(pid) for pid in tree) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in tree if _alive(pid)]


_ENDING = """\
import atexit, sys
from compare.launch import end_process
class Finalized:  # a module global: its __del__ runs in the interpreter's teardown
    def __del__(self):
        print("torn down", flush=True)
kept = Finalized()
atexit.register(print, "exit handlers ran")
print("buffered output", end=" ")
{ending}(3)
"""


def test_end_process_skips_the_interpreter_s_teardown_and_keeps_the_rest_of_an_exit():
    """`end_process` (a torch worker's end: the gloo abort in teardown is in its docstring) runs the exit handlers,
    flushes the output and exits with the code, and the interpreter's teardown does not run; `sys.exit` there is
    the negative control, whose teardown does run."""
    def end(ending: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", _ENDING.format(ending=ending)], capture_output=True, text=True,
                              cwd=ROOT, timeout=60)

    ended = end("end_process")
    assert ended.returncode == 3, ended.stderr
    assert ended.stdout.split() == ["buffered", "output", "exit", "handlers", "ran"], ended.stdout
    exited = end("sys.exit")
    assert exited.returncode == 3 and "torn down" in exited.stdout, exited.stdout


def test_an_owned_process_gets_sigterm_when_its_owner_is_killed():
    owner = ("import sys, time; from compare.launch import owned_process\n"
             "with owned_process([sys.executable, '-c', 'import time; time.sleep(60)']) as p:\n"
             "    print(p.pid, flush=True); time.sleep(60)")
    process = subprocess.Popen([sys.executable, "-c", owner], stdout=subprocess.PIPE, text=True,
                               env=dict(os.environ, PYTHONPATH=str(ROOT)))
    with process.stdout:
        child = int(process.stdout.readline())
    time.sleep(0.5)  # the start shim has exec'd the command (the death signal is asked for before the exec)
    process.kill()
    process.wait()
    deadline = time.monotonic() + 5.0  # the kernel sends the death signal at once; margin for a loaded CI core
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the owned process outlived its SIGKILLed owner"


def _train(tmp_path: Path) -> tuple[subprocess.Popen, list[int]]:
    """A torch run over 2 gloo processes, long enough to be stopped, once it has done 2 steps and completed a
    checkpoint (a stop while the first one is being written rightly reports none): (CLI, its tree)."""
    process = _start(tmp_path, "train", "--seq-len", "64", "--steps", "2000", "--mesh", "fsdp=2", "--data", "random",
                     "--attention-backend", "reference", "--out", "out", "--ckpt-dir", "ckpt", "--ckpt-every", "2")
    jsonl, checkpoints = tmp_path / "out" / "train.jsonl", tmp_path / "ckpt"
    _wait_for(lambda: jsonl.exists() and len(jsonl.read_text().splitlines()) >= 2 and checkpoints.exists()
              and any(path.name.startswith("step-") for path in checkpoints.iterdir()), process,
              "2 training steps and a checkpoint")
    tree = _tree(process.pid)
    assert len(tree) >= 4, f"expected the CLI, torchrun's agent and 2 ranks, found {tree}"  # the walk saw them
    return process, tree


def _one_line(stderr: str, pattern: str) -> re.Match:
    lines = [line for line in stderr.splitlines() if line.startswith("twinflash:")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    match = re.fullmatch(pattern, lines[0])
    assert match, lines[0]
    return match


def test_sigint_to_train_stops_every_worker(tmp_path):
    process, tree = _train(tmp_path)
    process.send_signal(signal.SIGINT)
    code, stderr = _end(process, tree)
    assert code == 130
    line = _one_line(stderr, r"twinflash: interrupted at step (\d+); last checkpoint: (\S+)")
    steps_done, checkpoint = int(line[1]), Path(tmp_path, line[2])
    assert steps_done >= 2
    assert checkpoint.parent == tmp_path / "ckpt" and checkpoint.exists()
    lines = (tmp_path / "out" / "train.jsonl").read_text().splitlines()
    # the count is recorded just before a step's line: a stop between the two leaves that line out
    assert steps_done - 1 <= len(lines) <= steps_done


def test_a_killed_rank_ends_the_run(tmp_path):
    process, tree = _train(tmp_path)
    ranks = {pid: env for pid in tree if (env := _environ(pid)).get("RANK") is not None}
    victim = next(pid for pid, env in ranks.items() if env["RANK"] == "1")
    os.kill(victim, signal.SIGKILL)
    code, stderr = _end(process, tree)
    assert code != 0
    line = _one_line(stderr, r"twinflash: rank 1 died \(killed by SIGKILL\); full log: (\S+)")
    log = Path(line[1])
    assert log.exists(), "the log the line names is kept"
    log.unlink()


# torchrun's summary at the end of a launch's log where rank 1 aborted (its shape as torch 2.13's torchrun writes it)
_ABORTED_RANK_SUMMARY = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
Root Cause (first observed failure):
[0]:
  time      : 2026-11-28_21:05:00
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -6 (pid: 14745)  (SIGABRT)
  error_file: <N/A>
  traceback : Signal 6 (SIGABRT) received by PID 14745
"""


def test_a_rank_that_aborted_is_named_with_what_it_printed():
    def failure(*printed: str) -> str:
        message, code, own = worker_failure("\n".join([*printed, _ABORTED_RANK_SUMMARY]), 1)
        assert code == 1 and not own
        return message

    uncaught = ("[rank1]: terminate called after throwing an instance of 'gloo::IoException'",
                "[rank1]:   what():  [gloo/transport/tcp/pair.cc:589] Read error [127.0.0.1]:3977: Connection reset",
                "Fatal Python error: Aborted")
    assert failure(*uncaught) == ("rank 1 died (killed by SIGABRT: terminate called after throwing an instance of "
                                  "'gloo::IoException' what(): [gloo/transport/tcp/pair.cc:589] Read error "
                                  "[127.0.0.1]:3977: Connection reset)")
    assert failure("terminate called without an active exception") == (
        "rank 1 died (killed by SIGABRT: terminate called without an active exception)")
    # negative control: a log that says nothing of the abort (faulthandler's echo of the signal names no cause)
    assert failure("step 3 done", "Fatal Python error: Aborted") == "rank 1 died (killed by SIGABRT)"


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def test_sigterm_to_compare_s_group_writes_the_report_of_what_finished(tmp_path):
    process = _start(tmp_path, "compare", "--backends", "torch", "--devices", "2", "--seq-lens", "64", "--mode",
                     "forward", "--ablation", "ours", "--steps", "1", "--out", "out")
    work = tmp_path / "out" / "work"
    _wait_for(lambda: any(work.glob("*-equivalence.json")) and any(work.glob("*.started")) and
              len(_tree(process.pid)) >= 2, process, "a finished job and a running launch")
    tree = _tree(process.pid)
    os.killpg(process.pid, signal.SIGTERM)  # the whole group, as a shell's job control sends it
    code, stderr = _end(process, tree)
    assert code == 143
    _one_line(stderr, r"twinflash: compare interrupted \(SIGTERM\); report of the (\d+) of (\d+) jobs that finished, "
                      r"the rest marked interrupted: \S+report\.md")
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    statuses = [p["status"] for p in report["benchmark"]["points"]]
    assert "interrupted" in statuses, statuses
    assert (tmp_path / "out" / "report.md").exists() and "INTERRUPTED" in (tmp_path / "out" / "report.md").read_text()
