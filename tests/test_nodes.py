"""Runs spanning several hosts (`compare/nodes.py`), on one machine: two "nodes" are two `twinflash train` commands
with `--nnodes 2`, ranks 0 and 1, the coordinator on localhost, two devices per node (torch: two gloo processes
under each node's torchrun; JAX: one process per node with two host devices, CPU collectives over gloo). They train
the tiny model for 10 steps on fsdp=2 x sp=2 (sp within a node, FSDP's gathers and reductions across the nodes) and
must log the losses of the single-node run of the same mesh (the ring across the nodes, fsdp=1 x sp=4, is the
compare's 4-device launch below: its logits and gradients must pass the equivalence checks); a node alone (its peer
never starts) must end with one line and exit 2 within the timeout. The SLURM script is checked for syntax and run
with a fake `srun` and a fake SLURM environment, whose command must give each node the flags its place in the job
implies.

`twinflash compare` across nodes (`compare/harness/across_nodes.py`): two "nodes" of two devices each run a tiny
compare whose 4-device launches span both (both backends, fp32); node 0's report must hold the 4-device points
measured and the equivalence checks passed as on one node (their tolerances are the harness's own), and node 1's
side of each launch must have run. Each node alone ends with one line and exit 2 within the timeout.

Tolerance: two nodes vs one, fp32: 1e-5 relative per step. The same devices compute the same float32 math; only
which process holds which device changes, and collectives between processes may sum in another order (~1e-7
relative per step on losses of ~5, grown by AdamW over 10 steps, far below 1e-5).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from compare import nodes as N
from compare.harness import across_nodes
from compare.cli import build_parser
from compare.commands.train import add_arguments
from weights import BadInputError
from weights.parallel import MeshShape

STEPS = 10
RTOL = 1e-5  # module docstring
LAUNCH_TIMEOUT_S = 400
ALONE_TIMEOUT_S = 5  # --rendezvous-timeout-s of the node left alone
COMMON = ["--model", "tiny", "--seq-len", "64", "--steps", str(STEPS), "--batch", "2", "--attention-backend",
          "reference"]
SLURM_SCRIPT = Path(__file__).resolve().parent.parent / "compare" / "slurm" / "twinflash.sbatch"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


def _command(backend: str, mesh: str, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "compare.cli", "train", "--backend", backend, *COMMON, "--mesh", mesh,
            "--out", str(out), *extra]


def _losses(out: Path) -> np.ndarray:
    return np.array([json.loads(line)["loss"] for line in (out / "train.jsonl").read_text().splitlines()])


def _two_nodes(backend: str, mesh: str, out: Path) -> None:
    """Both nodes' commands at once, sharing --out (a file system both nodes see, as on a cluster)."""
    flags = ["--nnodes", "2", "--coordinator", f"localhost:{_free_port()}", "--rendezvous-timeout-s", "120"]
    started = [subprocess.Popen(_command(backend, mesh, out, *flags, "--node-rank", str(rank)),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    logs = [process.communicate(timeout=LAUNCH_TIMEOUT_S)[0] for process in started]
    assert [process.returncode for process in started] == [0, 0], "\n".join(log[-3000:] for log in logs)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_two_nodes_train_like_one_node_and_a_node_alone_ends_with_one_line(backend, tmp_path):
    mesh = "fsdp=2,sp=2"
    one, two = tmp_path / "one", tmp_path / "two"
    done = subprocess.run(_command(backend, mesh, one), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    _two_nodes(backend, mesh, two)
    reference, spanning = _losses(one), _losses(two)
    assert len(spanning) == STEPS and np.isfinite(spanning).all()
    np.testing.assert_allclose(spanning, reference, rtol=RTOL, err_msg=mesh)
    assert spanning[-1] < spanning[0] - 0.5, spanning  # it learned: the comparison is not of two blank runs

    # node 1 alone: node 0, the rendezvous's host, never starts
    began = time.monotonic()
    alone = subprocess.run(_command(backend, mesh, tmp_path / "alone", "--nnodes", "2", "--node-rank", "1",
                                    "--coordinator", f"localhost:{_free_port()}", "--rendezvous-timeout-s",
                                    str(ALONE_TIMEOUT_S)), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    lines = [line for line in alone.stderr.splitlines() if line.startswith("twinflash:")]
    assert alone.returncode == 2, alone.stderr[-3000:]
    assert len(lines) == 1 and f"node 1 on {socket.gethostname()}" in lines[0], lines
    assert "not every node arrived" in lines[0], lines
    # the wait itself is the timeout; the rest is starting the processes (seconds each on a small machine)
    assert time.monotonic() - began < ALONE_TIMEOUT_S + 120
    assert not (tmp_path / "alone" / "train.jsonl").exists()


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def _compare_args(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    return parser.parse_args(["compare", *argv])


def test_node_flags_from_slurm_and_from_the_command_line():
    slurm = {"SLURM_NNODES": "4", "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "gpu[07-09,12],cpu3",
             N.PORT_ENV: "23456"}
    base = ["--seq-len", "64", "--steps", "1"]
    assert N.from_args(_args(base), slurm) == N.Nodes(count=4, rank=2, coordinator="gpu07:23456")
    given = _args([*base, "--nnodes", "2", "--node-rank", "1", "--coordinator", "head:29500",
                   "--rendezvous-timeout-s", "30"])
    assert N.from_args(given, slurm) == N.Nodes(count=2, rank=1, coordinator="head:29500", timeout_s=30)
    assert N.from_args(_args(base), {}) == N.Nodes()  # no SLURM, no flags: this host alone
    assert N.first_host("node1") == "node1" and N.first_host("a-b[3-4]") == "a-b3"
    for argv, fragment in ((["--nnodes", "2"], "needs --coordinator"),
                           (["--nnodes", "2", "--node-rank", "2", "--coordinator", "h:1"], "not below"),
                           (["--nnodes", "2", "--coordinator", "h"], "HOST:PORT")):
        with pytest.raises(BadInputError, match=fragment):
            N.from_args(_args([*base, *argv]), {})

    rendezvous = N.torchrun_arguments(N.Nodes(count=2, rank=0, coordinator="h:7", timeout_s=30))
    assert "--rdzv-backend=c10d" in rendezvous and "--rdzv-endpoint=h:7" in rendezvous
    conf = next(a for a in rendezvous if a.startswith("--rdzv-conf="))
    assert "join_timeout=30" in conf and "is_host=true" in conf
    assert "is_host=false" in " ".join(N.torchrun_arguments(N.Nodes(count=2, rank=1, coordinator="h:7")))
    nodes = N.Nodes(count=2, rank=1, coordinator="h:7", timeout_s=30)
    assert N.Nodes.from_env(nodes.to_env()) == nodes and N.Nodes.from_env({}) is None
    with pytest.raises(BadInputError, match="evenly"):
        nodes.devices_per_node(3)


def test_mesh_order_places_the_inner_axis_on_adjacent_ranks():
    # ranks 0-3 on node 0, 4-7 on node 1: the default keeps each sp ring (a row) inside a node
    default, swapped = MeshShape.parse("fsdp=2,sp=4"), MeshShape.parse("sp=4,fsdp=2")
    assert default.rank_grid().tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert swapped.rank_grid().tolist() == [[0, 2, 4, 6], [1, 3, 5, 7]]  # fsdp pairs inside a node
    assert MeshShape.parse(str(swapped)) == swapped and str(default) == "fsdp=2,sp=4"
    assert default.axes() == swapped.axes()  # the same mesh for checkpoints: only the placement differs


def test_slurm_script_builds_each_nodes_command(tmp_path):
    assert subprocess.run(["bash", "-n", str(SLURM_SCRIPT)]).returncode == 0
    fake_srun = tmp_path / "srun"
    fake_srun.write_text('#!/bin/bash\nprintf "%s\\n" "$@" > "$SRUN_ARGS"\n')
    fake_srun.chmod(fake_srun.stat().st_mode | stat.S_IEXEC)
    record = tmp_path / "srun-args"
    env = {"PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}", "SRUN_ARGS": str(record), "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu[07-08]"}
    train = ["train", "--backend", "jax", "--seq-len", "64", "--steps", "1", "--mesh", "fsdp=2,sp=2"]
    done = subprocess.run(["bash", str(SLURM_SCRIPT), *train], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    words = record.read_text().splitlines()
    assert words[:3] == ["--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=0"], words
    assert words[4:6] == ["-m", "compare.cli"] and words[6:] == train
    port = 20000 + 4242 % 20000
    for rank in (0, 1):  # what each task's command reads, srun having set SLURM_NODEID
        task_env = {**env, "SLURM_NNODES": "2", "SLURM_NODEID": str(rank), N.PORT_ENV: str(port)}
        nodes = N.from_args(_args(words[7:]), task_env)
        assert nodes == N.Nodes(count=2, rank=rank, coordinator=f"gpu07:{port}"), nodes
    compare = ["compare", "--out", str(tmp_path / "cmp")]  # the compare mode: the same mapping, its own flags
    assert subprocess.run(["bash", str(SLURM_SCRIPT), *compare], env=env).returncode == 0
    words = record.read_text().splitlines()
    assert words[6:] == compare
    task_env = {**env, "SLURM_NNODES": "2", "SLURM_NODEID": "1", N.PORT_ENV: str(port)}
    assert N.from_args(_compare_args(words[7:]), task_env) == N.Nodes(count=2, rank=1, coordinator=f"gpu07:{port}")
    missing = subprocess.run(["bash", str(SLURM_SCRIPT), *train], env={"PATH": env["PATH"]}, capture_output=True,
                             text=True)
    assert missing.returncode != 0 and "SLURM_JOB_ID" in missing.stderr


def _compare(out: Path, rank: int, port: int, timeout_s: float) -> list[str]:
    # forward mode: the equivalence check's logits and gradients without the loss curves' compiled train steps
    return [sys.executable, "-m", "compare.cli", "compare", "--mode", "forward", "--seq-lens", "64", "--devices", "4",
            "--device-counts", "4", "--ablation", "ours", "--steps", "1", "--out", str(out), "--nnodes", "2",
            "--node-rank", str(rank), "--coordinator", f"localhost:{port}", "--rendezvous-timeout-s", str(timeout_s)]


@pytest.mark.slow
def test_compare_spans_two_nodes_and_a_node_alone_ends_with_one_line(tmp_path):
    out = tmp_path / "compare"
    port = _free_port()
    started = [subprocess.Popen(_compare(out, rank, port, 120), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True) for rank in (0, 1)]
    logs = [process.communicate(timeout=2 * LAUNCH_TIMEOUT_S)[0] for process in started]
    assert [process.returncode for process in started] == [0, 0], "\n".join(log[-3000:] for log in logs)
    report = json.loads((out / "report.json").read_text())
    points = {(p["backend"], p["devices"]): p for p in report["benchmark"]["points"]}
    assert {key: p["status"] for key, p in points.items()} == {("torch", 4): "ok", ("jax", 4): "ok"}
    assert all(p["step_s"] > 0 for p in points.values())
    equivalence = report["equivalence"]
    assert equivalence["passed"] and equivalence["devices"] == 4, equivalence.get("failures")
    assert [c["name"] for c in equivalence["comparisons"]] == ["torch vs reference", "jax vs reference",
                                                               "torch vs jax"]
    assert all(check["passed"] for c in equivalence["comparisons"] for check in c["checks"])
    for backend in ("torch", "jax"):  # node 1 ran its side of both backends' 4-device launches
        assert (out / "work" / "logs" / f"{backend}-4.node1.log").exists()
    assert "node 1" in logs[1] and "node 0 writes the report" in logs[1]

    # each node alone: node 0 waits for node 1 to arrive, node 1 for node 0 to start the run
    began = time.monotonic()
    alone = [subprocess.Popen(_compare(tmp_path / f"alone-{rank}", rank, _free_port(), ALONE_TIMEOUT_S),
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    errors = [process.communicate(timeout=LAUNCH_TIMEOUT_S)[1] for process in alone]
    for rank, process, stderr in zip((0, 1), alone, errors):
        lines = [line for line in stderr.splitlines() if line.startswith("twinflash:")]
        assert process.returncode == 2 and len(lines) == 1, stderr[-3000:]
        assert f"node {rank} on {socket.gethostname()}" in lines[0], lines
        assert ("never arrived" if rank == 0 else "did not start the run") in lines[0], lines
    assert time.monotonic() - began < ALONE_TIMEOUT_S + 120  # the wait is the timeout; the rest is starting Python
    assert not any((tmp_path / "alone-0").iterdir())  # node 0 leaves its --out as it found it


def test_compare_placement_and_its_bad_input():
    assert across_nodes.placement(2, 2) == (1, 2) and across_nodes.placement(4, 2) == (2, 2)
    assert across_nodes.placement(6, 4) == (2, 3)  # two nodes, three devices each
    with pytest.raises(BadInputError, match="split evenly"):
        across_nodes.placement(5, 4)
    no_out = subprocess.run([sys.executable, "-m", "compare.cli", "compare", "--nnodes", "2", "--coordinator", "h:1"],
                            capture_output=True, text=True, timeout=120)
    assert no_out.returncode == 2 and "give --out" in no_out.stderr, no_out.stderr
