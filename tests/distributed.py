"""Runs test cases on fresh torch.distributed processes (gloo on CPU, NCCL on GPUs), one spawn per world size.

Process start costs seconds, so a test module spawns each world size once and runs all its cases there: `cases` is
{case name: (function name in `module`, kwargs)}; each function is called as fn(rank, world, **kwargs) inside the
rank's process and returns picklable results (an exception becomes {"error": "..."} for that case). The parent waits
with a timeout, so a hang fails the test run instead of stalling it.
"""

from __future__ import annotations

import importlib
import os
import queue as queue_module
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SPAWN_TIMEOUT_S = 300


def _rank_main(rank, world, comm_backend, init_file, module, cases, results):
    if comm_backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(comm_backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    functions = importlib.import_module(module)
    out = {}
    for name, (case_fn, kwargs) in cases.items():
        try:
            out[name] = getattr(functions, case_fn)(rank, world, **kwargs)
        except Exception as err:  # reported to the parent, which fails that case's test with the message
            out[name] = {"error": f"{type(err).__name__}: {err}"}
    results.put((rank, out))
    dist.destroy_process_group()


def run_on_ranks(world: int, cases: dict, *, module: str, comm_backend: str = "gloo",
                 timeout: float = SPAWN_TIMEOUT_S) -> list:
    """Runs `cases` on `world` fresh processes; returns the per-rank result dicts in rank order."""
    context = mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [context.Process(target=_rank_main, args=(r, world, comm_backend, init_file, module, cases, results))
                 for r in range(world)]
        for proc in procs:
            proc.start()
        per_rank = {}
        try:
            for _ in range(world):
                rank, out = results.get(timeout=timeout)
                per_rank[rank] = out
        except queue_module.Empty:
            pytest.fail(f"ranks {sorted(set(range(world)) - set(per_rank))} did not finish within {timeout}s (hang?)")
        finally:
            for proc in procs:
                proc.join(timeout=30)
                if proc.is_alive():
                    proc.kill()
    return [per_rank[r] for r in range(world)]
