"""Runs spanning several hosts ("nodes"): the node flags that `twinflash train` and `twinflash compare` share
(`--nnodes`, `--node-rank`, `--coordinator`, `--rendezvous-timeout-s`), read from SLURM's environment when not
given; what each backend's launch needs from them (torchrun's c10d rendezvous arguments; the `jax.distributed`
coordinates the JAX process receives in its environment); and the one line a node ends with when another node
never arrives or dies.

The model: one command per node, each starting this node's processes (torch: torchrun, one process per local
device; JAX: one process per node over its local devices). Ranks are numbered node by node, so the mesh's inner
axis (`weights.parallel.MeshShape`: sp by default) stays inside a node. Node 0 hosts the rendezvous at
`--coordinator` (torch: c10d's TCP store, `is_host`; JAX: the coordination service, process 0). torch's c10d
rendezvous numbers the nodes itself (by arrival, not by `--node-rank`), so torch's global rank 0, the one writer of
train.jsonl, exports and reports, may run on any node; in JAX it is process 0 on node 0. Checkpoints are written
by every node's processes together (DCP, orbax) into one directory every node sees (a shared file system), and
sealed by one writer.

SLURM (`compare/slurm/`, one task per node through `srun`): --nnodes from SLURM_NNODES (or SLURM_JOB_NUM_NODES),
--node-rank from SLURM_NODEID, the coordinator's host is the first host of SLURM_JOB_NODELIST (or SLURM_NODELIST)
and its port TWINFLASH_COORDINATOR_PORT or 29400 (c10d's default).

Failure across nodes: every wait is bounded by `--rendezvous-timeout-s`: the rendezvous (torch: c10d's join and
store timeouts; JAX: `initialization_timeout`), every collective after it (torch: the process group's timeout;
JAX: the coordination service's heartbeat), and JAX's shutdown barrier. A node that never arrives makes the others
end with `twinflash: node R on HOST: ...` and exit 2 (the run's input, the node list, was wrong); a node that dies
ends the others with that line naming the failure and exit 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import socket
from collections.abc import Mapping

from compare.args import integer, number
from compare.launch import worker_failure
from weights.errors import EXIT_BAD_INPUT, BadInputError

DEFAULT_PORT = 29400
DEFAULT_TIMEOUT_S = 300.0
PORT_ENV = "TWINFLASH_COORDINATOR_PORT"
# What a node's processes receive (the JAX process reads them before it starts JAX; torch workers their timeout).
ENV = {"count": "TWINFLASH_NNODES", "rank": "TWINFLASH_NODE_RANK", "coordinator": "TWINFLASH_COORDINATOR",
       "timeout_s": "TWINFLASH_RENDEZVOUS_TIMEOUT_S"}
# torchrun's and jax.distributed's ways of saying that the rendezvous did not complete in time
_NEVER_ARRIVED = re.compile(r"RendezvousTimeoutError|RendezvousConnectionError|RendezvousClosedError|"
                            r"DEADLINE_EXCEEDED|Barrier timed out|failed to connect to|"
                            r"Timed out after .* waiting for .*clients", re.IGNORECASE)
# gloo's, NCCL's and the JAX coordination service's ways of saying that a peer went away during the run
_PEER_LOST = re.compile(r"Connection closed by peer|Connection reset by peer|heartbeat timeout|another task died|"
                        r"NCCL.*(remote process exited|Watchdog caught collective operation timeout)", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Nodes:
    """This node's place in a run: `count` nodes, this one `rank`, the rendezvous at `coordinator` (HOST:PORT)."""

    count: int = 1
    rank: int = 0
    coordinator: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def spans_hosts(self) -> bool:
        return self.count > 1

    @property
    def hosts_rendezvous(self) -> bool:
        return self.rank == 0

    def who(self) -> str:
        """'node R on HOST' (the start of each of this node's one-line messages)."""
        return f"node {self.rank} on {socket.gethostname()}"

    def devices_per_node(self, mesh_size: int) -> int:
        if mesh_size % self.count:
            raise BadInputError(f"the mesh's {mesh_size} devices do not split evenly over --nnodes {self.count}")
        return mesh_size // self.count

    def to_env(self) -> dict[str, str]:
        return {name: str(getattr(self, field)) for field, name in ENV.items()}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Nodes | None:
        """What `to_env` handed this process, or None (a single-host run)."""
        if ENV["count"] not in environ:
            return None
        return cls(count=int(environ[ENV["count"]]), rank=int(environ[ENV["rank"]]),
                   coordinator=environ[ENV["coordinator"]], timeout_s=float(environ[ENV["timeout_s"]]))


TRAIN_PLACEMENT = ("With --mesh fsdp=A,sp=B the sequence-parallel ring runs inside a node and FSDP across nodes: the "
                   "ring moves K/V every layer and belongs on the fast links inside a node (NVLink), FSDP gathers "
                   "each layer's weights once and tolerates the network; --mesh sp=B,fsdp=A asks for the other "
                   "placement")


def add_arguments(parser: argparse.ArgumentParser, placement: str = TRAIN_PLACEMENT) -> None:
    """The node flags, with `placement`: how the command spreads its work over the nodes (train's by default)."""
    group = parser.add_argument_group(
        "several hosts", "one command per node, the same flags on each (under SLURM read from SLURM_NNODES, "
        "SLURM_NODEID and the job's first host when not given). " + placement)
    group.add_argument("--nnodes", type=integer(1), help="nodes in the run (default 1, or SLURM_NNODES)")
    group.add_argument("--node-rank", type=integer(0), help="this node's rank, 0 .. nnodes-1 (node 0 hosts the "
                       "rendezvous; default SLURM_NODEID)")
    group.add_argument("--coordinator", help="HOST:PORT of the rendezvous on node 0 (default: the SLURM job's "
                       f"first host, port ${PORT_ENV} or {DEFAULT_PORT})")
    group.add_argument("--rendezvous-timeout-s", type=number(1), default=DEFAULT_TIMEOUT_S,
                       help="how long a node waits for the others, at the start and in every collective, before "
                       "it ends with one line")


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list: 'gpu[07-09,12],cpu3' -> 'gpu07'."""
    match = re.match(r"\s*([^,\[\s]+)(?:\[([^\]\-,]+))?", nodelist)
    if not match:
        raise BadInputError(f"cannot read a host from SLURM's node list {nodelist!r}")
    return match[1] + (match[2] or "")


def _check_coordinator(text: str) -> str:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise BadInputError(f"--coordinator {text!r}: expected HOST:PORT, e.g. node01:{DEFAULT_PORT}")
    return text


def from_args(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> Nodes:
    """The node flags, each taken from SLURM's environment when not given (module docstring), checked."""
    slurm_count = environ.get("SLURM_NNODES") or environ.get("SLURM_JOB_NUM_NODES")
    count = args.nnodes if args.nnodes is not None else int(slurm_count or 1)
    rank = args.node_rank if args.node_rank is not None else int(environ.get("SLURM_NODEID", 0) if count > 1 else 0)
    coordinator = args.coordinator
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if coordinator is None and count > 1 and nodelist:
        coordinator = f"{first_host(nodelist)}:{environ.get(PORT_ENV, DEFAULT_PORT)}"
    if rank >= count:
        raise BadInputError(f"--node-rank {rank} is not below --nnodes {count}")
    if count > 1 and coordinator is None:
        raise BadInputError(f"--nnodes {count} needs --coordinator HOST:PORT (node 0's address)")
    if coordinator is not None:
        _check_coordinator(coordinator)
    return Nodes(count=count, rank=rank, coordinator=coordinator, timeout_s=args.rendezvous_timeout_s)


def torchrun_arguments(nodes: Nodes, launch_id: str = "") -> list[str]:
    """torchrun's rendezvous arguments for this node (`compare.launch.torchrun_launcher` adds the processes per
    node): c10d at the coordinator, hosted by node 0, every wait bounded by the timeout; no restarts (a failed rank
    ends the run). `launch_id` tells apart the launches of one run (`twinflash compare` starts one per backend and
    device count)."""
    seconds = int(nodes.timeout_s)
    conf = (f"join_timeout={seconds},last_call_timeout=1,close_timeout={seconds},read_timeout={seconds},"
            f"is_host={str(nodes.hosts_rendezvous).lower()}")
    return [f"--nnodes={nodes.count}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={nodes.coordinator}", f"--rdzv-id={launch_id or 'twinflash'}-{nodes.coordinator}",
            f"--rdzv-conf={conf}", "--max-restarts=0"]


def launch_failure(nodes: Nodes, log: str, launch_code: int) -> tuple[str, int, bool]:
    """`compare.launch.worker_failure` for a launch spanning nodes: the line starts with this node and its host;
    a rendezvous that never completed (a node that never arrived, a coordinator never reached) is exit 2."""
    message, code, own = worker_failure(log, launch_code)
    if _NEVER_ARRIVED.search(log) and not own:
        message = (f"not every node arrived at the rendezvous {nodes.coordinator} within {nodes.timeout_s:g} s "
                   f"(--nnodes {nodes.count}); check that each node started with the same --coordinator")
        code = EXIT_BAD_INPUT
    elif _PEER_LOST.search(log) and not own:
        message = f"another node died or stopped answering ({message})"
    if not message.startswith("node "):
        message = f"{nodes.who()}: {message}"
    return message, code, own
