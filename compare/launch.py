"""Starting the processes the commands run in: torchrun with one process per device on this host, a JAX process
with a given number of emulated host devices, the hand-off of a training run's settings to the processes it
starts, and stopping a launch with everything it started. `twinflash train`, the compare harness and the ring
benchmark launch through here; each keeps its own protocol with the processes (and its relaunch loop).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from weights.settings import TrainSettings

TORCHRUN_ENV = "TORCHELASTIC_RUN_ID"  # set by torchrun in every worker
SETTINGS_FLAG = "--settings-json"  # `python -m compare.commands.train --settings-json FILE`: a process of our own
TRAIN_MODULE = "compare.commands.train"
_HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"  # XLA_FLAGS entry: JAX's number of CPU devices


def torchrun_launcher(device_count: int) -> tuple[list[str], dict[str, str]]:
    """(`python -m torch.distributed.run` with one process per device on this host, its environment: this
    process's, with the CPU threads split between the processes unless OMP_NUM_THREADS is set). Append
    `-m MODULE ARGS`."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // device_count)))
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={device_count}"], env


def host_devices_env(count: int) -> dict[str, str]:
    """This process's environment with XLA_FLAGS asking for `count` host devices (replacing any such request)."""
    env = dict(os.environ)
    flags = [flag for flag in env.get("XLA_FLAGS", "").split() if not flag.startswith(_HOST_DEVICES_FLAG + "=")]
    env["XLA_FLAGS"] = " ".join([*flags, f"{_HOST_DEVICES_FLAG}={count}"])
    return env


def hand_off(settings: TrainSettings, launcher: list[str], env: dict[str, str]) -> int:
    """Runs `launcher + [-m compare.commands.train --settings-json FILE]` with `settings` in FILE and waits;
    returns its exit code. The processes it starts train (`compare.commands.train.run_handed_off`)."""
    with tempfile.TemporaryDirectory(prefix="twinflash-train-") as tmp:
        settings_file = Path(tmp) / "settings.json"
        settings_file.write_text(settings.to_json())
        command = [*launcher, "-m", TRAIN_MODULE, SETTINGS_FLAG, str(settings_file)]
        return subprocess.run(command, env=env).returncode


def stop_process_group(process: subprocess.Popen) -> None:
    """Kills a process started with `start_new_session=True` and everything it started, and reaps it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()
