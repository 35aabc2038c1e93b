"""`twinflash compare` spanning nodes (`compare/nodes.py` has the flags and the rendezvous): which nodes a launch
runs on, and how the nodes' commands agree through the run's --out directory, which must be the same path on a
file system every node sees (as a SLURM cluster's home or scratch file system is).

Placement: every node computes the same plan from the same arguments, over `--devices` = nodes x devices per node
(default on GPUs: every GPU of every node). A launch (one backend and device count, `plan.group_launches`) of at
most a node's devices runs on node 0 alone while the others wait; a launch of more runs on the first
ceil(count / per node) nodes, count / nodes processes (devices) on each: torch one torchrun per node joined by c10d
rendezvous at --coordinator, JAX one process per node joined by `jax.distributed`.

The exchange (files in the work folder's `nodes` folder, each with one writer): node 0 (the lead) plans, makes the
weights, writes the job files, runs its side of every launch, collects the results and writes the report; the other
nodes (followers) run only their side of the launches that span them.
  run.json              lead: the arguments of the run (a follower with other arguments ends with exit 2)
  node<R>.json          follower R: it arrived (its host)
  node<R>.alive         each node: a counter it rewrites every second (a heartbeat; read against the reader's
                        own clock, so clocks that disagree between hosts do not matter)
  launch-<n>.json       lead: launch n spans nodes (backend, device count, nodes, job file, rendezvous id)
  launch-<n>.ended      lead: its side of launch n ended ("stop": whether the followers must stop theirs now)
  launch-<n>.node<R>.json   follower R: its side ended (exit code, its one line)
  end.json              lead: the run ended (its exit code; its one line when it failed)
The job results are the workers' files in the work folder (`--out`'s `work`) as on one node, written by torch's
global rank 0 (c10d may place it on any node) or JAX's process 0 (node 0); a follower's JAX process writes into a
scratch directory of its own. Each node's side of a launch logs to the work folder's
logs/<backend>-<devices>[.node<R>].log.

Failure: every wait for another node is bounded by --rendezvous-timeout-s. A node that never arrives (at the start
or at a launch's rendezvous) ends every node with one line and exit 2; a node whose heartbeat stops, or whose side
of a launch never reports, ends them with one line and exit 1; the lead ends the followers through end.json.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import math
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from compare.harness import jobs as J
from compare.harness.plan import CompareSettings
from compare.launch import Interrupted, interruptible, owned_process, repeating, stop_process_tree
from compare.nodes import Nodes, launch_failure
from weights import BadInputError
from weights.atomic import write_text_atomically
from weights.errors import EXIT_BAD_INPUT, EXIT_CHECK_FAILED, EXIT_OK

NODES_DIR = "nodes"  # under the run's work directory
POLL_S = 0.2
HEARTBEAT_S = 1.0
EXIT_NODE_LOST = 1  # a node died or stopped answering (exit 2: one never arrived, as `twinflash train`)


class NodeFailure(Exception):
    """The run cannot go on: another node never arrived (exit 2) or was lost (exit 1). `line`: what this node
    prints, `twinflash: <line>`."""

    def __init__(self, line: str, code: int):
        super().__init__(line)
        self.line, self.code = line, code


def placement(devices: int, per_node: int) -> tuple[int, int]:
    """(nodes, devices on each) of a launch over `devices`: node 0 alone when they fit one node."""
    if devices <= per_node:
        return 1, devices
    nodes = math.ceil(devices / per_node)
    if devices % nodes:
        raise BadInputError(f"{devices} devices do not split evenly over the {nodes} nodes they need "
                            f"({per_node} devices per node): choose device counts that do")
    return nodes, devices // nodes


def check_placement(settings: CompareSettings, nodes: Nodes, gpus: int) -> int:
    """Devices per node of a compare over `nodes`, every launch placeable (`placement`) and, on GPUs, each node's
    share present; bad input otherwise."""
    per_node = nodes.devices_per_node(settings.devices)
    if gpus and gpus < per_node:
        raise BadInputError(f"--devices {settings.devices} over {nodes.count} nodes needs {per_node} GPUs per node; "
                            f"this node has {gpus}")
    for count in {settings.devices, *settings.device_counts}:
        placement(count, per_node)
    return per_node


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):  # not there yet (files are written by renaming)
        return None


def _write_json(path: Path, data: dict) -> None:
    write_text_atomically(path, json.dumps(data))


def heartbeat(path: Path) -> contextlib.AbstractContextManager[None]:
    """Rewrites `path` with a growing counter every HEARTBEAT_S while the block runs (a thread of this process)."""
    counter = itertools.count(1)

    def beat() -> None:
        with contextlib.suppress(OSError):  # a full or vanished directory: the readers judge the silence
            write_text_atomically(path, str(next(counter)))

    return repeating(beat, HEARTBEAT_S, "twinflash-heartbeat")


class Heartbeats:
    """The other nodes' heartbeats as this node sees them: a node whose counter has not changed for `timeout_s`
    of this node's clock (or never appeared in that time, counted from when the watch began) is lost."""

    def __init__(self, directory: Path, ranks: list[int], timeout_s: float):
        self.directory, self.timeout_s = directory, timeout_s
        now = time.monotonic()
        self.seen = {rank: (None, now) for rank in ranks}

    def check(self, who: str) -> None:
        now = time.monotonic()
        for rank, (value, since) in self.seen.items():
            try:
                current = (self.directory / f"node{rank}.alive").read_text()
            except FileNotFoundError:
                current = None
            if current != value:
                self.seen[rank] = (current, now)
            elif now - since > self.timeout_s:
                host = (_read_json(self.directory / f"node{rank}.json") or {}).get("host", "its host")
                raise NodeFailure(f"{who}: node {rank} on {host} stopped answering (no heartbeat for "
                                  f"{self.timeout_s:g} s, --rendezvous-timeout-s); it died or lost the shared "
                                  f"--out directory", EXIT_NODE_LOST)


def _wait_for(path: Path, timeout_s: float, watch: Callable[[], None] = lambda: None) -> dict | None:
    """`path`'s JSON once it appears, or None after `timeout_s`; `watch()` between looks (it may raise)."""
    deadline = time.monotonic() + timeout_s
    while (data := _read_json(path)) is None:
        if time.monotonic() > deadline:
            return None
        watch()
        time.sleep(POLL_S)
    return data


@dataclasses.dataclass
class SpanningLaunch:
    """Node 0's view of one launch over several nodes (`Lead.launch`): `rendezvous` is node 0's place in it."""

    number: int
    rendezvous: Nodes
    launch_id: str
    per_node: int  # devices (processes) on each node


class Lead:
    """Node 0 of a compare spanning nodes (with one node, a stand-in that does nothing): the arrival of the
    others, the launches that span them, the end of the run."""

    def __init__(self, nodes: Nodes, arguments: dict | None = None):
        self.nodes, self.arguments = nodes, arguments
        self.per_node: int | None = None
        self.directory: Path | None = None
        self.watch: Heartbeats | None = None
        self.launches = 0
        self._beating = contextlib.ExitStack()

    def gpus(self, gpus: int) -> int:
        """The GPUs the plan may use: every node's."""
        return gpus * self.nodes.count

    def planned(self, settings: CompareSettings, gpus: int) -> CompareSettings:
        """`settings` checked for the nodes (`check_placement`), with a note on the placement (printed as the run
        starts)."""
        if not self.nodes.spans_hosts:
            return settings
        self.per_node = check_placement(settings, self.nodes, gpus)
        note = (f"{self.nodes.count} nodes x {self.per_node} devices: launches of more than {self.per_node} devices "
                f"span nodes (torch: torchrun with c10d rendezvous; JAX: one process per node, jax.distributed)")
        return dataclasses.replace(settings, notes=(*settings.notes, note))

    def arrive(self, work_dir: Path) -> None:
        """Publishes the run and waits for every other node to arrive; removes `work_dir` and raises NodeFailure
        (exit 2) when one does not within the timeout."""
        if not self.nodes.spans_hosts:
            return
        self.directory = work_dir / NODES_DIR
        self.directory.mkdir()
        self._beating.enter_context(heartbeat(self.directory / "node0.alive"))
        _write_json(self.directory / "run.json", {"arguments": self.arguments, "nnodes": self.nodes.count,
                                                  "coordinator": self.nodes.coordinator})
        others = list(range(1, self.nodes.count))
        deadline = time.monotonic() + self.nodes.timeout_s
        while missing := [r for r in others if not (self.directory / f"node{r}.json").exists()]:
            if time.monotonic() > deadline:
                self._beating.close()
                self.directory = None
                shutil.rmtree(work_dir, ignore_errors=True)
                raise NodeFailure(
                    f"{self.nodes.who()}: node {', '.join(map(str, missing))} of --nnodes {self.nodes.count} never "
                    f"arrived within {self.nodes.timeout_s:g} s: start the same command on every node, each with "
                    f"its --node-rank, the same --coordinator and the same --out on a file system all nodes see",
                    EXIT_BAD_INPUT)
            time.sleep(POLL_S)
        self.watch = Heartbeats(self.directory, others, self.nodes.timeout_s)

    def check(self) -> None:
        """Raises NodeFailure when another node's heartbeat stopped."""
        if self.watch is not None:
            self.watch.check(self.nodes.who())

    def spans(self, devices: int) -> bool:
        """Whether a launch over `devices` spans nodes (more than a node's devices)."""
        return self.nodes.spans_hosts and placement(devices, self.per_node)[0] > 1

    def launch(self, backend: str, devices: int, job_file: Path) -> SpanningLaunch:
        """Announces a launch over `devices` (one that `spans`) to the nodes it spans; node 0's place in it."""
        count, per_node = placement(devices, self.per_node)
        self.launches += 1
        number = self.launches
        launch_id = f"twinflash-{number}-{backend}-{devices}"
        _write_json(self.directory / f"launch-{number}.json",
                    {"backend": backend, "devices": devices, "nodes": count, "per_node": per_node,
                     "job_file": str(job_file), "launch_id": launch_id})
        return SpanningLaunch(number, dataclasses.replace(self.nodes, count=count), launch_id, per_node)

    def finish(self, span: SpanningLaunch, log_tail: str, code: int, stopped: bool, any_started: bool) -> None:
        """After node 0's side of `span` ended (exit `code`; `stopped`: node 0 stopped it): tells the followers,
        waits for their sides (bounded), and raises NodeFailure when a node never arrived at the rendezvous
        (exit 2) or was lost (exit 1). Other failures are the jobs' (recorded and relaunched by the caller)."""
        _write_json(self.directory / f"launch-{span.number}.ended", {"stop": stopped or code != 0})
        sides = {}
        for rank in range(1, span.rendezvous.count):
            # a follower stops its side within the timeout after the lead's ended: that and a margin
            side = _wait_for(self.directory / f"launch-{span.number}.node{rank}.json", self.nodes.timeout_s + 30,
                             self.check)
            if side is None:
                raise NodeFailure(f"{self.nodes.who()}: node {rank}'s side of the {span.launch_id} launch never "
                                  f"ended (it died or lost the shared --out directory)", EXIT_NODE_LOST)
            sides[rank] = side
        if any_started:
            return
        failures = [launch_failure(span.rendezvous, log_tail, code)[:2]] if code else []
        failures += [(side["line"], side["code"]) for side in sides.values() if side["exit"]]
        for line, exit_code in failures:
            if exit_code == EXIT_BAD_INPUT and "not every node arrived" in line:
                raise NodeFailure(line, EXIT_BAD_INPUT)

    def end(self, code: int, line: str | None) -> None:
        """The run ended with `code` (`line`: its failure, None when it ran to its report)."""
        if self.directory is None:
            return
        with contextlib.suppress(OSError):
            _write_json(self.directory / "end.json", {"exit": code, "line": line})
        self._beating.close()


def run_arguments(args: argparse.Namespace) -> dict:
    """What must be equal on every node: the arguments but the node's rank (and those SLURM may supply instead)."""
    own = ("func", "argv", "nnodes", "node_rank", "coordinator")
    return json.loads(json.dumps({k: v for k, v in vars(args).items() if k not in own}, default=str))


def lead_run(args: argparse.Namespace, nodes: Nodes, run: Callable[[argparse.Namespace, list[str], Lead], int]
             ) -> int:
    """Node 0's command: `run` (the compare) with a `Lead`, whose end the followers learn however it ends."""
    lead = Lead(nodes, run_arguments(args))
    try:
        code = run(args, args.argv, lead)
    except NodeFailure as failure:
        lead.end(failure.code, failure.line)
        print(f"twinflash: {failure.line}", file=sys.stderr)
        return failure.code
    except BaseException as error:
        lead.end(1, f"{type(error).__name__}: {str(error)[:300]}")
        raise
    lead.end(code, None if code in (EXIT_OK, EXIT_CHECK_FAILED) else f"its exit code {code}")
    return code


# --- a follower ---------------------------------------------------------------------------------------------------

def _follower_job_file(spec: dict, scratch: Path) -> Path:
    """The job file this node's side runs: torch's as it is (its global rank 0, the writer, may be here); JAX's
    with this node's scratch directory for the files its process writes (node 0's process writes the run's)."""
    if spec["backend"] == "torch":
        return Path(spec["job_file"])
    jobs, _ = J.read_job_file(Path(spec["job_file"]))
    path = scratch / "jobs.json"
    J.write_job_file(path, [dataclasses.replace(job, trace_dir=None) for job in jobs], scratch)
    return path


def _run_side(spec: dict, number: int, nodes: Nodes, directory: Path, work_dir: Path, launcher: SideLauncher,
              watch: Heartbeats) -> dict:
    """This node's side of launch `number`, until it ends; stopped when the lead's side ended with a failure,
    `nodes.timeout_s` after the lead's ended otherwise, or when the run ended."""
    rendezvous = dataclasses.replace(nodes, count=spec["nodes"])
    log = work_dir / "logs" / f"{spec['backend']}-{spec['devices']}.node{nodes.rank}.log"
    with tempfile.TemporaryDirectory(prefix="twinflash-node-") as scratch:
        job_file = _follower_job_file(spec, Path(scratch))
        command, env = launcher(spec["backend"], spec["per_node"], rendezvous, spec["launch_id"])
        with open(log, "a") as out, owned_process([*command, str(job_file)], stdout=out, stderr=out,
                                                  env=env | {J.LAUNCHED_AT_ENV: repr(time.time())}) as process:
            ended_at = None
            while process.poll() is None:
                time.sleep(POLL_S)
                ended = _read_json(directory / f"launch-{number}.ended")
                if ended is not None and ended_at is None:
                    ended_at = time.monotonic()
                overdue = ended_at is not None and time.monotonic() - ended_at > nodes.timeout_s
                if (ended or {}).get("stop") or overdue or (directory / "end.json").exists():
                    stop_process_tree(process)
                watch.check(nodes.who())
    if not process.returncode:
        return {"exit": 0, "code": 0, "line": None}
    line, code, _ = launch_failure(rendezvous, log.read_text(errors="replace")[-6000:], process.returncode)
    return {"exit": process.returncode, "code": code, "line": line}


# (backend, devices on this node, this node's place in the launch, launch id) -> (worker command, environment):
# `launches.side_launcher` for the run's platform and work directory
SideLauncher = Callable[[str, int, Nodes, str], tuple[list[str], dict[str, str]]]


def follow(args: argparse.Namespace, nodes: Nodes, out: Path, launcher: SideLauncher) -> int:
    """A follower's command: arrive, run this node's side of each launch that spans it, end when the lead does.
    Returns its exit code (0: its part done; the report, its verdict and exit code are node 0's) once one line said
    why it ended. Interrupted, it stops its side and says so (node 0 then finds it lost)."""
    try:
        return _follow(args, nodes, out, launcher)
    except NodeFailure as failure:
        print(f"twinflash: {failure.line}", file=sys.stderr)
        return failure.code
    except Interrupted as stop:
        print(f"twinflash: {nodes.who()}: interrupted ({stop.signal_name})", file=sys.stderr)
        return stop.exit_code


def _follow(args: argparse.Namespace, nodes: Nodes, out: Path, launcher: SideLauncher) -> int:
    directory = out / "work" / NODES_DIR
    who = nodes.who()
    run = _wait_for(directory / "run.json", nodes.timeout_s)
    if run is None:
        raise NodeFailure(f"{who}: node 0 did not start the run in {out} within {nodes.timeout_s:g} s "
                          f"(--rendezvous-timeout-s): start it with the same --out, on a file system all nodes see, "
                          f"and the same --coordinator", EXIT_BAD_INPUT)
    if run["nnodes"] != nodes.count or run["coordinator"] != nodes.coordinator:
        raise BadInputError(f"node 0 runs with --nnodes {run['nnodes']} --coordinator {run['coordinator']}; this node "
                            f"with --nnodes {nodes.count} --coordinator {nodes.coordinator}")
    differ = sorted(k for k, v in run_arguments(args).items() if run["arguments"].get(k) != v)
    if differ:
        raise BadInputError(f"this node's arguments differ from node 0's in {', '.join(differ)}: every node needs the "
                            "same arguments")
    _write_json(directory / f"node{nodes.rank}.json", {"host": socket.gethostname()})
    watch = Heartbeats(directory, [0], nodes.timeout_s)
    number = 1
    with interruptible(), heartbeat(directory / f"node{nodes.rank}.alive"):
        while (end := _read_json(directory / "end.json")) is None:
            spec = _read_json(directory / f"launch-{number}.json")
            if spec is None:
                watch.check(who)
                time.sleep(POLL_S)
                continue
            if nodes.rank < spec["nodes"]:
                side = _run_side(spec, number, nodes, directory, out / "work", launcher, watch)
                _write_json(directory / f"launch-{number}.node{nodes.rank}.json", side)
            number += 1
    if end["line"] is not None:
        print(f"twinflash: {who}: node 0 ended the run: {end['line']}", file=sys.stderr)
        return end["exit"]
    print(f"twinflash: {who}: its part of the compare is done; node 0 writes the report ({out / 'report.md'})",
          file=sys.stderr)
    return EXIT_OK
