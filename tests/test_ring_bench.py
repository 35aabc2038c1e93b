"""CPU tests of `twinflash bench ring`'s plumbing (compare/bench/ring_bench.py): the plan, the worker relaunch protocol
(with stand-in workers that crash or hang), the derived columns on synthetic rows, the table, the JSON, and the
one-line exit without the GPUs asked for, and --gpus (default: the GPUs present). The measurements themselves need
GPUs (see the module's docstring)."""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from compare.bench import ring_bench
from weights.flops import attention_flops


def _args(*argv):
    argv = list(argv) if "--gpus" in argv else [*argv, "--gpus", "4"]
    args = ring_bench.build_parser().parse_args(argv)
    ring_bench._check_args(args)
    return args


def test_plan_has_every_implementation_once_per_point():
    tasks = ring_bench.plan_tasks(_args("--seq-lens", "32k,128k"))
    # per point: one GPU, the ring's two variants, Ulysses, the hybrid's two variants (the peer: one GPU, two CPs)
    assert {part: len(t) for part, t in tasks.items()} == {"torch": 24, "peer": 12, "jax": 24}
    ids = [t["id"] for part in tasks.values() for t in part]
    assert len(ids) == len(set(ids))
    rings = [t for t in tasks["torch"] if t["kind"] == "ring"]
    assert {(t["variant"], t["layout"], t["gpus"]) for t in rings} == {("ring", "zigzag", 4),
                                                                       ("allgather", "zigzag", 4)}
    assert {t["seq_len"] for t in rings} == {32768, 131072} and {t["kv_heads"] for t in rings} == {32, 8}


def test_plan_has_a_scheme_axis_with_the_hybrid_where_the_gpus_allow_it():
    tasks = ring_bench.plan_tasks(_args("--seq-lens", "32k", "--kv-heads", "8"))
    schemes = {(t["kind"], t.get("scheme"), t.get("ulysses_degree"), t["variant"]) for t in tasks["jax"]
               if t["gpus"] > 1}
    assert schemes == {("jax-ring", "ring", 1, "ring"), ("jax-ring", "ring", 1, "allgather"),
                       ("jax-ulysses", "ulysses", 4, None), ("jax-hybrid", "hybrid", 2, "ring"),
                       ("jax-hybrid", "hybrid", 2, "allgather")}
    ring_ids = {t["id"] for t in tasks["torch"] if t["kind"] == "ring"}
    assert ring_ids == {"torch/ring/ring/S32768/kv8", "torch/ring/allgather/S32768/kv8"}  # as before the schemes
    two = ring_bench.plan_tasks(_args("--seq-lens", "32k", "--gpus", "2"))
    assert {t["kind"] for t in two["torch"]} == {"flash-1gpu", "ring", "ulysses"}  # no hybrid on 2 GPUs
    only = ring_bench.plan_tasks(_args("--seq-lens", "32k", "--gpus", "8", "--schemes", "hybrid",
                                       "--ulysses-degree", "4"))
    assert {(t["kind"], t.get("ulysses_degree")) for t in only["torch"]} == {("flash-1gpu", None), ("hybrid", 4)}


def _row(part, kind, gpus, ms, variant=None, **extra):
    impl = f"{kind} {variant or ''}".strip()
    return dict(id=f"{part}/{kind}/{variant}", part=part, kind=kind, impl=impl, gpus=gpus, variant=variant,
                seq_len=32768, heads=32, kv_heads=8, head_dim=128, batch=1, ms=ms, **extra)


SYNTHETIC = [
    _row("torch", "flash-1gpu", 1, 100.0),
    _row("torch", "ring", 4, 30.0, "ring", exposed_comm_ms=1.5, wire_GBps=120.0),
    _row("torch", "ring", 4, 40.0, "allgather"),
    _row("peer", "cudnn-1gpu", 1, 60.0),
    _row("peer", "cp-cudnn", 4, 20.0, "allgather"),
    _row("peer", "cp-cudnn", 4, 24.0, "alltoall"),
    _row("jax", "jax-flash-1gpu", 1, 150.0),
    _row("jax", "jax-ring", 4, None, "ring", error="OutOfMemoryError: out of memory"),
]


def test_summary_columns():
    rows = {r["id"]: r for r in ring_bench.summarize(SYNTHETIC)}
    flops = attention_flops(1, 32, 32768, 32768, 128, causal=True, backward=True)
    ring = rows["torch/ring/ring"]
    assert ring["tflops_per_gpu"] == pytest.approx(flops / 0.030 / 4 / 1e12)
    assert ring["efficiency"] == pytest.approx(100 / (4 * 30))
    assert ring["vs_peer"] == pytest.approx(20 / 30)  # the best peer (allgather), same FLOPs: a time ratio
    assert rows["peer/cp-cudnn/alltoall"]["efficiency"] == pytest.approx(60 / (4 * 24))
    assert rows["torch/flash-1gpu/None"]["vs_peer"] == pytest.approx(60 / 100)  # one GPU: vs cuDNN SDPA
    assert "efficiency" not in rows["torch/flash-1gpu/None"]
    failed = rows["jax/jax-ring/ring"]
    assert failed["error"] and "tflops_per_gpu" not in failed and "vs_peer" not in failed


def test_table_shows_ratios_and_errors():
    from rich.console import Console

    console = Console(width=220, record=True)
    console.print(ring_bench.render_table(ring_bench.summarize(SYNTHETIC)))
    text = console.export_text()
    ring_line = next(line for line in text.splitlines() if "ring ring" in line)
    assert "83%" in ring_line and "0.67" in ring_line and "1.5" in ring_line and "120" in ring_line
    assert "OutOfMemoryError" in text


def test_report_writes_json(tmp_path, capsys):
    meta = {"gpu": "NVIDIA H200", "torch": "2.11.0"}
    path = ring_bench.report(SYNTHETIC, meta, ["--quick"], tmp_path / "r.json", 4)
    document = json.loads(path.read_text())
    assert document["command"] == "twinflash bench ring --quick"
    assert document["versions"] == meta and document["gpus"] == 4 and "exposed_comm_ms" in document["method"]
    assert len(document["rows"]) == len(SYNTHETIC) and document["rows"][1]["vs_peer"] == pytest.approx(2 / 3)
    assert ring_bench.default_out_path(meta, datetime.date(2026, 11, 21)) == Path(
        "out/ring-2026-11-21-h200.json")


def test_rows_measured_again_replace_their_earlier_copies():
    earlier = [{"id": "torch/ring", "ms": 5.0}, {"id": "jax/ring", "ms": 9.0}]
    merged = ring_bench.merge_rows(earlier, [{"id": "jax/ring", "ms": 4.0}, {"id": "jax/flash-1gpu", "ms": 7.0}])
    assert merged == [{"id": "torch/ring", "ms": 5.0}, {"id": "jax/ring", "ms": 4.0},
                      {"id": "jax/flash-1gpu", "ms": 7.0}]


STAND_IN_WORKER = textwrap.dedent("""
    import json, sys, time
    plan = json.load(open(sys.argv[1]))
    out = open(plan["rows_path"], "a")
    def put(record):
        out.write(json.dumps(record) + "\\n"); out.flush()
    put({"meta": {"gpu": "stand-in"}})
    for task in plan["tasks"]:
        put({"started": task["id"]})
        if task["id"] == "crash":
            sys.exit("segfault-ish")
        if task["id"] == "hang":
            time.sleep(60)
        put({"row": dict(task, ms=1.0)})
""")


def test_worker_crash_and_hang_cost_only_their_task(tmp_path, monkeypatch):
    script = tmp_path / "worker.py"
    script.write_text(STAND_IN_WORKER)
    monkeypatch.setattr(ring_bench, "_worker_command",
                        lambda part, plan_path, gpus: ([sys.executable, str(script), str(plan_path)], {}))
    tasks = [dict(id=name) for name in ("a", "crash", "b", "hang", "c")]
    args = _args("--launch-timeout-s", "5")
    meta, rows = ring_bench.run_worker("torch", tasks, args, tmp_path)
    by_id = {row["id"]: row for row in rows}
    assert meta == {"gpu": "stand-in"} and sorted(by_id) == ["a", "b", "c", "crash", "hang"]
    assert all(by_id[i]["ms"] == 1.0 for i in "abc")
    assert by_id["crash"]["error"].startswith("worker exited with 1: ") and "segfault-ish" in by_id["crash"]["error"]
    assert by_id["hang"]["error"].startswith("worker timed out after 5s")


def test_an_interrupted_part_keeps_the_rows_it_finished(tmp_path, monkeypatch, capsys):
    # SIGTERM while the JAX part's worker hangs on its second task: the first task's row, the earlier run's row of
    # the interrupted point (not replaced by a "not finished" one) and a "not finished" row for the third are written
    script = tmp_path / "worker.py"
    script.write_text(STAND_IN_WORKER)
    monkeypatch.setattr(ring_bench, "_worker_command",
                        lambda part, plan_path, gpus: ([sys.executable, str(script), str(plan_path)], {}))
    monkeypatch.setattr(ring_bench, "use_gpus_present", lambda args, found: None)
    tasks = [dict(id=name, seq_len=32768, heads=32, kv_heads=8, head_dim=128, batch=1, part="jax", kind="ring",
                  impl=f"stand-in {name}", gpus=4, variant="ring", layout="zigzag") for name in ("a", "hang", "c")]
    monkeypatch.setattr(ring_bench, "plan_tasks", lambda args: {"jax": tasks})
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"versions": {}, "rows": [dict(tasks[1], ms=2.0)]}))
    out = tmp_path / "ring.json"
    threading.Timer(3.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
    assert ring_bench.main(["--gpus", "4", "--parts", "jax", "--rows-from", str(earlier), "--out", str(out)]) == 143
    rows = {row["id"]: row for row in json.loads(out.read_text())["rows"]}
    assert rows["a"]["ms"] == 1.0 and rows["hang"]["ms"] == 2.0
    assert rows["c"]["error"] == "not finished: the bench was interrupted (SIGTERM)"
    assert f"the rows measured before it are in {out}" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has 2 GPUs")
@pytest.mark.parametrize("argv, needed", [(["--quick"], "at least 2"), (["--quick", "--gpus", "4"], "4")])
def test_without_the_gpus_one_line_and_exit_2(argv, needed, capsys):
    assert ring_bench.main(argv) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0
    assert err.startswith(f"twinflash: error: `bench ring` needs {needed} CUDA GPUs; this machine has ")


def test_gpus_default_to_those_present_and_size_the_ring_rows():
    args = ring_bench.build_parser().parse_args(["--seq-lens", "32k"])
    ring_bench._check_args(args)
    ring_bench.use_gpus_present(args, 2)
    assert args.gpus == 2
    tasks = ring_bench.plan_tasks(args)
    assert {t["gpus"] for part in tasks.values() for t in part} == {1, 2}
    assert "--nproc-per-node=2" in ring_bench._worker_command("torch", Path("plan.json"), 2)[0]
    explicit = _args("--seq-lens", "32k", "--gpus", "2")
    ring_bench.use_gpus_present(explicit, 8)  # fewer than present: the ring rows use 2
    assert explicit.gpus == 2 and {t["gpus"] for t in ring_bench.plan_tasks(explicit)["jax"]} == {1, 2}


@pytest.mark.parametrize("argv, message", [
    (["--seq-lens", "1004", "--gpus", "4"], "sequence length 1004 does not split into the zigzag layout over 4 devices"),
    (["--gpus", "1"], "--gpus: a ring needs at least 2 GPUs, got 1"),
    (["--seq-lens", "32q"], "'32q' is not a length like 32768 or 32k"),
    (["--kv-heads", "5"], "--kv-heads: 5 does not divide --heads 32"),
    (["--parts", "torch,tpu"], "--parts: unknown tpu"),
    (["--gpus", "2", "--schemes", "hybrid"], "hybrid Ulysses degree 1 over sp=2"),
    (["--gpus", "4", "--schemes", "ring", "--ulysses-degree", "2"], "--ulysses-degree is the hybrid scheme's"),
    (["--gpus", "4", "--heads", "12", "--kv-heads", "3", "--schemes", "hybrid", "--ulysses-degree", "2"],
     "Ulysses degree 2 and the 3 KV heads"),
    (["--schemes", "tree"], "--schemes"),
    (["--warmup", "1"], "--warmup: must be >= 2, got 1"),
])
def test_bad_arguments_one_line_and_exit_2(argv, message, capsys):
    assert ring_bench.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("twinflash: error: ") and message in err and err.strip().count("\n") == 0


@pytest.mark.parametrize("variant", ["ring", "allgather"])
def test_jax_ring_rows_measure_exposed_communication_and_bandwidth(variant):
    """The JAX side of the bench on 4 CPU host devices (the GPU run is the same code): the ring timed normally and
    in the local-copies mode, the busy time of its collectives from a profiler trace, bytes from the shapes."""
    from compare.bench.ring_bench_workers import jax_measure, jax_ring_bytes_per_rank

    import jax
    from jax.sharding import Mesh
    import numpy as np

    devices = jax.devices()[:4]
    task = {"kind": "jax-ring", "batch": 1, "seq_len": 64, "heads": 4, "kv_heads": 2, "head_dim": 16,
            "layout": "zigzag", "variant": variant}
    plan = {"warmup": 1, "iters": 1, "budget_s": 0.1}
    row = jax_measure(task, plan, devices, Mesh(np.array(devices), ("sp",)))
    assert row["ms"] > 0 and row["compute_only_ms"] > 0
    assert row["exposed_comm_ms"] == pytest.approx(row["ms"] - row["compute_only_ms"])
    assert row["comm_busy_ms"] > 0 and row["wire_GBps"] > 0
    assert set(row["phase_s"]) == {"compile_and_time", "comm_trace", "compile_and_time_local_copies"}
    assert all(seconds > 0 for seconds in row["phase_s"].values())
    local_kv = 2 * 16 * 2 * 16  # K and V: 16 local tokens x 2 heads x 16 dims
    hops = 4 if variant == "ring" else 3
    assert row["bytes_sent_per_rank"] == jax_ring_bytes_per_rank(task, 4) == (2 * 3 * 2 + hops * 4) * local_kv


@pytest.mark.parametrize("scheme, degree", [("ulysses", 4), ("hybrid", 2)])
def test_jax_scheme_rows_measure_exposed_communication_and_bytes(scheme, degree):
    """The Ulysses and hybrid rows of the JAX side on 4 CPU host devices: timed, in local-copies mode, busy time,
    and the bytes of `weights.sequence_parallel`'s formula."""
    from compare.bench.ring_bench_workers import jax_measure, jax_ring_bytes_per_rank
    from weights.sequence_parallel import scheme_degrees, sequence_parallel_bytes_sent

    import jax
    from jax.sharding import Mesh
    import numpy as np

    devices = jax.devices()[:4]
    task = {"kind": f"jax-{scheme}", "batch": 1, "seq_len": 64, "heads": 4, "kv_heads": 2, "head_dim": 16,
            "layout": "zigzag", "variant": None if scheme == "ulysses" else "ring", "scheme": scheme,
            "ulysses_degree": degree}
    row = jax_measure(task, {"warmup": 1, "iters": 1, "budget_s": 0.1}, devices, Mesh(np.array(devices), ("sp",)))
    assert row["ms"] > 0 and row["compute_only_ms"] > 0 and row["comm_busy_ms"] > 0
    expected = sequence_parallel_bytes_sent(scheme_degrees(scheme, 4, degree), batch=1, local_tokens=16, heads=4,
                                            kv_heads=2, head_dim=16, compute_bytes=2, variant="ring", backward=True)
    assert row["bytes_sent_per_rank"] == jax_ring_bytes_per_rank(task, 4) == expected
