"""Starting the processes the commands run in, and the one process model of every command that starts some
(`twinflash train`, the compare harness, the benchmarks): torchrun with one process per device on this host, a JAX
process with a given number of emulated host devices, the hand-off of a training run's settings to the processes it
starts; each command keeps its own protocol with the processes (and its relaunch loop).

The process model: the CLI owns its workers. Each launch runs in a session of its own (a Ctrl-C at the terminal
reaches the CLI alone, which decides) and is stopped with every process under it when its block ends, however it
ends (`owned_process`; torchrun starts each worker in a session of its own, so the tree is walked, not a process
group killed). On Linux a launch gets SIGTERM if the CLI dies without stopping it (PR_SET_PDEATHSIG; torchrun's
agent then stops its workers). Inside `interruptible()` the first SIGINT or SIGTERM raises `Interrupted` in the
CLI, whose command stops its launch, says in one line what is left and exits 128 + the signal (130, 143). A worker
that dies is named in one line by `worker_failure`, read from the launch's log, which the command keeps. A launch
that is waited for with a deadline, its output in a log (the benchmarks'), runs through `run_logged`, and its
failure quotes the log's end (`log_tail`). What a command does on a thread beside its launches while it waits
(a run's live progress, a node's heartbeat) repeats through `repeating`. A torchrun worker's module ends its process
through `end_process` (the interpreter's teardown can abort a gloo rank after its work is done).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

from weights.settings import TrainSettings

TORCHRUN_ENV = "TORCHELASTIC_RUN_ID"  # set by torchrun in every worker
SETTINGS_FLAG = "--settings-json"  # `python -m MODULE --settings-json FILE`: a process `hand_off` started
_HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"  # XLA_FLAGS entry: JAX's number of CPU devices
PROGRESS_ENV = "TWINFLASH_PROGRESS_FILE"  # where a handed-off training run records its steps done, for the CLI
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# The share of each GPU's memory a JAX process of ours may use, set unless the user set it. JAX's default, 0.75,
# caps XLA's allocator at three quarters of the GPU whether or not it preallocates, while a torch process can use
# all of it: with that cap the JAX 8B step ran out of memory at 96k tokens on 2 H200s (46.75 GiB of temporaries
# beside 48 GiB of training state) where torch trained 192k. The rest is left to cuBLAS / cuDNN workspaces, NCCL's
# buffers and the CUDA context, which live outside XLA's allocator.
JAX_GPU_MEMORY_FRACTION = ("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
# What an owned process runs first on Linux, then exec's the command (same PID): it lets SIGINT and SIGTERM through
# again (held back while it started) and asks for SIGTERM when the CLI dies (prctl 1: PR_SET_PDEATHSIG, kept across
# exec), or sends it now if the CLI is already gone. Not a `preexec_fn`: that makes Python fork (not vfork) a
# process JAX runs threads in, which JAX warns is unsafe.
_OWNED_START = ("import ctypes, os, signal, sys; signal.pthread_sigmask(signal.SIG_UNBLOCK, "
                "(signal.SIGINT, signal.SIGTERM)); ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0); "
                "os.getppid() == int(sys.argv[1]) or os.kill(os.getpid(), signal.SIGTERM); "
                "os.execvp(sys.argv[2], sys.argv[2:])")


def end_process(code: int | None) -> NoReturn:
    """Ends a worker process of ours (the `__main__` of a module torchrun runs) with exit code `code` (None: 0) as
    multiprocessing ends its children: exit handlers run and the output is flushed, then `os._exit`, without the
    interpreter's teardown. In that teardown a gloo thread still letting go of its last collective's tensors waits
    for the GIL and is ended by the finalizing interpreter, an unwind through a C++ destructor: std::terminate,
    SIGABRT after a run that succeeded (a core dump's stack: ~AsyncAllgatherWork, decref_pyobject, take_gil,
    pthread_exit). Four gloo ranks ending with one all_gather aborted in 7 launches of 15 through `sys.exit`, in none
    of 45 through `os._exit` (15 of them with the exit handlers run first, as here; CPU, torch 2.13)."""
    atexit._run_exitfuncs()  # what `sys.exit` would run first (logging's flush, jax.distributed's shutdown barrier)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code or 0)


class Interrupted(Exception):
    """SIGINT or SIGTERM reached the CLI (inside `interruptible`)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        """128 + the signal, as a shell reports a process the signal ended: 130 for SIGINT, 143 for SIGTERM."""
        return 128 + self.signum


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Within the block, the first SIGINT or SIGTERM raises `Interrupted` in the main thread; later ones are
    ignored (the command is already stopping: a second Ctrl-C must not cut its report short). The handlers are
    restored after. Outside the main thread (where Python cannot handle signals) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired: list[int] = []

    def raise_once(signum, frame):
        if not fired:
            fired.append(signum)
            raise Interrupted(signum)

    previous = {signum: signal.signal(signum, raise_once) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def repeating(action: Callable[[], None], period_s: float, name: str) -> Iterator[None]:
    """While the block runs, `action()` on a daemon thread of its own named `name`: at once, then every `period_s`
    until the block ends, which waits for a call under way (no call outlives the block). What a command does beside
    its launches while it waits for them: poll their progress, beat a node's heartbeat."""
    stop = threading.Event()

    def run() -> None:
        action()
        while not stop.wait(period_s):
            action()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def torchrun_launcher(device_count: int, rendezvous: tuple[str, ...] = ("--standalone",)
                      ) -> tuple[list[str], dict[str, str]]:
    """(`python -m torch.distributed.run` with one process per device on this host, its environment: this
    process's, with the CPU threads split between the processes unless OMP_NUM_THREADS is set). Append
    `-m MODULE ARGS`. `rendezvous`: this host alone, or a run spanning nodes (`compare.nodes.torchrun_arguments`)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // device_count)))
    return [sys.executable, "-m", "torch.distributed.run", *rendezvous, f"--nproc-per-node={device_count}"], env


def host_devices_env(count: int) -> dict[str, str]:
    """This process's environment with XLA_FLAGS asking for `count` host devices (replacing any such request)."""
    env = dict(os.environ)
    flags = [flag for flag in env.get("XLA_FLAGS", "").split() if not flag.startswith(_HOST_DEVICES_FLAG + "=")]
    env["XLA_FLAGS"] = " ".join([*flags, f"{_HOST_DEVICES_FLAG}={count}"])
    return env


def hand_off(settings: TrainSettings, module: str, launcher: list[str], env: dict[str, str], scratch: Path,
             failure: Callable[[str, int], tuple[str, int, bool]] | None = None) -> int:
    """Runs `launcher + [-m MODULE --settings-json FILE]` with `settings` in FILE (in `scratch`, a directory the
    caller removes) and waits; the processes it starts train (`module`: the train command's, by the name its
    module object gives, whose `main` reads the flag) and record their steps done in `progress_file(scratch)`.
    Returns 0, or after a failure the failed process's exit code (at least 1) once one line on stderr said which
    process died and why (or passed on its own one-line error) and named the log kept with its full output
    (`failure`: `worker_failure`, or a launch's own reading of its log, as `compare.nodes.launch_failure`).
    `Interrupted` propagates, the processes stopped."""
    settings_file = scratch / "settings.json"
    settings_file.write_text(settings.to_json())
    command = [*launcher, "-m", module, SETTINGS_FLAG, str(settings_file)]
    fd, log_name = tempfile.mkstemp(prefix="twinflash-train-", suffix=".log")
    log = Path(log_name)
    keep_log = False
    try:
        with os.fdopen(fd, "w") as out, owned_process(command, env=env | {PROGRESS_ENV: str(progress_file(scratch))},
                                                      stderr=out) as process:
            process.wait()
        if process.returncode == 0:
            return 0
        message, code, own = (failure or worker_failure)(log.read_text(errors="replace"), process.returncode)
        keep_log = not own
        print(f"twinflash: {message}" if own else f"twinflash: {message}; full log: {log}", file=sys.stderr)
        return code
    finally:
        if not keep_log:
            log.unlink(missing_ok=True)


def progress_file(scratch: Path) -> Path:
    return scratch / "progress.json"


@contextlib.contextmanager
def owned_process(command: list[str], **popen) -> Iterator[subprocess.Popen]:
    """`subprocess.Popen(command, **popen)` as a worker the CLI owns: in a session of its own, stopped with every
    process under it when the block ends (`stop_process_tree`), and on Linux sent SIGTERM if the CLI dies first.
    SIGINT and SIGTERM are held back while it starts, so that a signal cannot leave it started and not owned."""
    linux = sys.platform.startswith("linux")
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS if linux else ())  # the start lets them through
    try:
        process = subprocess.Popen([sys.executable, "-c", _OWNED_START, str(os.getpid()), *command] if linux
                                   else command, start_new_session=True, **popen)
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        raise
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a signal held back is handled here, inside the `try`
        yield process
    finally:
        stop_process_tree(process)


def run_logged(command: list[str], env: dict[str, str], log_path: Path, timeout_s: float) -> str | None:
    """Runs `command` as an owned process (`owned_process`) with its output in `log_path` until it exits or
    `timeout_s` passes (then it is stopped): None when it exited 0, else what went wrong ("exited with 1", "timed out
    after 600s"), for the caller to put after the name of what it launched."""
    with open(log_path, "w") as log, owned_process(command, env=env, stdout=log, stderr=log) as process:
        try:
            code = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return f"timed out after {timeout_s:.0f}s"
    return f"exited with {code}" if code else None


def log_tail(log_path: Path, chars: int) -> str:
    """The last three lines of a launch's log on one line (" | " between them), at most its last `chars` characters:
    what a one-line failure quotes."""
    return " | ".join(log_path.read_text(errors="replace").strip().splitlines()[-3:])[-chars:]


def _children_by_parent() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # it ended meanwhile
            continue
        parent = int(stat.rpartition(")")[2].split()[1])  # after the command name, which may hold spaces
        children.setdefault(parent, []).append(int(entry.name))
    return children


def process_tree(root: int) -> list[int]:
    """`root` and every process under it (Linux: from /proc; elsewhere just `root`)."""
    if not Path("/proc/self/stat").exists():
        return [root]
    children, tree = _children_by_parent(), [root]
    for pid in tree:
        tree.extend(children.get(pid, ()))
    return tree


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signum)


def stop_process_tree(process: subprocess.Popen) -> None:
    """Kills a process started by `owned_process` and every process under it, and reaps it. The tree is frozen
    first (SIGSTOP, walked again until no new process appears: a stopped process starts none), then killed, so
    that no process is re-parented away from the walk before it is found."""
    if process.poll() is None:
        frozen: list[int] = []
        while fresh := [pid for pid in process_tree(process.pid) if pid not in frozen]:
            for pid in fresh:
                _signal(pid, signal.SIGSTOP)
            frozen += fresh
        for pid in frozen:
            _signal(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)  # what is left in its session's group (it may have ended itself)
    process.wait()


def _unprefixed_lines(log: str) -> list[str]:
    """A worker log's lines without the `[rankN]: ` that PyTorch puts before a rank's own (its uncaught exceptions)."""
    return [line.partition("]: ")[2] if line.startswith("[rank") else line for line in log.splitlines()]


def failure_reason(log_tail: str) -> str | None:
    """The last exception line of a worker's log (a rank's own error, not torchrun's summary of it)."""
    lines = _unprefixed_lines(log_tail)
    errors = [line.strip() for line in lines
              if re.match(r"\s*[\w.]*(Error|Exception|RESOURCE_EXHAUSTED)\b", line) and "ChildFailedError" not in line]
    if errors:
        return errors[-1][:500]
    if re.search(r"exitcode\s*:\s*-9\b", log_tail):
        return "a worker was killed by SIGKILL (the host out of memory?)"
    return None


# Signals of a native crash (segmentation fault, bus error, abort, ...): a driver's or compiler's fault, which a fresh
# process may not meet again (one JAX 2-GPU job segfaulted in 1 of 3 GPU runs: compare-llama3.2-1b-2026-11-23-
# h200x2-512f5af). SIGKILL is not one (the host's out-of-memory killer, or our own stop), nor SIGTERM.
CRASH_SIGNALS = frozenset({"SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE", "SIGABRT"})


def crash_signal(log_tail: str, launch_code: int | None) -> str | None:
    """The crash signal (`CRASH_SIGNALS`) a launch's worker died by: the launched process's own (a JAX worker's
    negative exit code) or a rank's, as torchrun's summary reports it (`exitcode  : -11`); None otherwise."""
    codes = [launch_code] if launch_code is not None and launch_code < 0 else []
    codes += [int(code) for code in re.findall(r"exitcode\s*:\s*(-\d+)", log_tail)]
    known = {member.value for member in signal.Signals}
    names = [signal.Signals(-code).name for code in codes if -code in known]
    return next((name for name in names if name in CRASH_SIGNALS), None)


# What a process prints as it aborts (SIGABRT): C++'s std::terminate on an exception nobody caught ("terminate called
# after throwing an instance of 'gloo::IoException'", then its "what():" line) or on a thread destroyed unjoined
# ("terminate called without an active exception"), Python's fatal error, absl's fatal log line (JAX: "F1128 ...
# client.h:80] Terminating process because ...").
_ABORT_LINES = re.compile(r"^\s*(terminate called .*|what\(\):\s*.*|Fatal Python error: .*"
                          r"|F\d{4} [\d:.]+\s+\d+ \S+\] .*)$")
_SIGNAL_ECHOES = ("Fatal Python error: Aborted", "Fatal Python error: Segmentation fault")  # faulthandler's, no cause


def abort_reason(log: str) -> str | None:
    """Why a worker that died by a signal aborted, as its log says (`_ABORT_LINES`; a `what():` line joined to the
    `terminate called` line before it), at most 300 characters; None where the log says nothing of it."""
    found: list[str] = []
    for line in _unprefixed_lines(log):
        match = _ABORT_LINES.match(line)
        if match is None or match[1].startswith(_SIGNAL_ECHOES):
            continue
        if match[1].startswith("what()") and found and found[-1].startswith("terminate called"):
            found[-1] += " " + match[1]
        else:
            found.append(match[1])
    return " ".join(found[-1].split())[:300] if found else None


def _exit_description(code: int, log: str = "") -> str:
    if code >= 0:
        return f"exited with code {code}"
    reason = abort_reason(log)
    return f"killed by {signal.Signals(-code).name}" + (f": {reason}" if reason else "")


def worker_failure(log: str, launch_code: int) -> tuple[str, int, bool]:
    """(one line saying which process of a failed launch died and why, the exit code the command returns, whether
    the line is a rank's own) from the launch's log and exit code. torchrun's summary names the first rank that
    failed and its exit code; a rank's own one-line error (`twinflash: ...`, the CLI's contract) is passed on as it
    is, with its exit code; a rank killed by a signal is named with what the log says of its abort (`abort_reason`)."""
    root_cause = log.rpartition("Root Cause")[2]
    rank = re.search(r"^\s*rank\s*:\s*(\d+)", root_cause, re.MULTILINE)
    rank_code = re.search(r"^\s*exitcode\s*:\s*(-?\d+)", root_cause, re.MULTILINE)
    code = int(rank_code[1]) if rank and rank_code else launch_code
    own = [line.strip() for line in log.splitlines() if line.startswith("twinflash: ")]
    if own:
        return own[-1].removeprefix("twinflash: "), code if code > 0 else 1, True
    who = f"rank {rank[1]}" if rank and rank_code else "the worker process"
    why = _exit_description(code, log) if code < 0 else failure_reason(log) or _exit_description(code)
    return f"{who} died ({why})", code if code > 0 else 1, False
