"""`twinflash bench ring`: sequence-parallel attention on N GPUs (--gpus, default every GPU present, at least 2), our
torch ring and JAX ring against one GPU and
against the peer, PyTorch's context parallelism on cuDNN SDPA. This module plans the sweep, launches the workers
(`compare/bench/ring_bench_workers.py` says what is measured and how), merges their rows and reports a table and JSON.

Roles of `python -m compare.bench.ring_bench`:
  plain invocation  the parent: launches `torchrun --nproc_per_node=N -m compare.bench.ring_bench --worker torch` (our
                    torch kernels and ring, and the peer), then `python -m compare.bench.ring_bench --worker jax` (with
                    XLA_PYTHON_CLIENT_PREALLOCATE=false), each with a JSON plan; a worker that crashes or hangs
                    (per-launch timeout) costs the task it was on, which is recorded as an error, and is relaunched
                    for the remaining tasks. The JSON is rewritten after each worker (a run cut short keeps
                    what it measured); at the end the table is printed. `--rows-from` merges an earlier run's
                    rows (a point measured again replaces its earlier row), so parts can run as separate commands.
  under torchrun    without --worker (e.g. `torchrun --nproc_per_node=4 -m compare.bench.ring_bench --quick`): the torch
                    and peer parts only, on WORLD_SIZE GPUs, reported by rank 0.

Sweep: for each S_total (--seq-lens) and Hkv (--kv-heads): causal, H=32, D=128, bf16, batch 1, fwd+bwd, zigzag.
The scheme axis (--schemes, `weights/sequence_parallel.py`): the ring (both variants), Ulysses over all N GPUs, and
the hybrid of Ulysses over U adjacent GPUs (--ulysses-degree, default N / 2) with the ring (both variants) across the
N / U groups; the default takes every scheme the GPU count allows (the hybrid needs 4 or more). Each scheme's row
gives the bytes a GPU sends (`sent MB`: torch's comm log, JAX's from `weights.sequence_parallel`'s formula) and its
exposed communication (the same calls with every transfer a local copy).
Derived per row: TFLOP/s per GPU from `weights.flops.attention_flops` (the same count for every implementation,
so ratios are time ratios), efficiency t1 / (N tN) against the same framework's one-GPU row, and `vs peer`: per-GPU
TFLOP/s over the best context-parallel cuDNN row of the point (one-GPU rows: over cuDNN SDPA on one GPU).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import tempfile
from pathlib import Path

from compare.args import OneLineParser, integer, ints, lengths, names, recorded_command, with_error_contract
from compare.bench import common
from compare.bench.common import check_parts_and_heads, previous_rows, write_json
from compare.launch import Interrupted, end_process, interruptible, log_tail, run_logged, torchrun_launcher
from weights import BadInputError
from weights.attention import VARIANTS
from weights.layout import check_split
from weights.sequence_parallel import SCHEMES, check_heads, scheme_degrees
from weights.training import BACKENDS

LAYOUT = "zigzag"
ONE_GPU_KIND = {"torch": "flash-1gpu", "peer": "cudnn-1gpu", "jax": "jax-flash-1gpu"}
PARTS = ("torch", "peer", "jax")
PEER_ROTATIONS = ("allgather", "alltoall")
METHOD = {
    "flops": "weights.flops.attention_flops(batch, heads, S, S, head_dim, causal=True, backward=True)",
    "timing": "warm-up calls, then back-to-back calls between two device synchronisations (perf_counter), the "
              "slowest rank's time; iterations reduced for long points (row 'iters')",
    "exposed_comm_ms": "ring time minus the same calls with every transfer replaced by a same-sized local copy",
    "wire_GBps": "bytes sent per rank / time with a transfer in flight: torch, the comm streams' CUDA events "
                 "and the bytes it sent; JAX, NCCL kernels on GPU 0 in a jax.profiler trace of one call and the "
                 "bytes from the shapes; a lower bound (includes waiting for slower peers)",
    "peer": "torch context_parallel + cuDNN SDPA as the project's anchor script cp_cudnn.py",
    "phase_s": "JAX rows: wall seconds of each phase of the row (compilations included), where the bench's time goes",
    "schemes": "ring (K/V around the GPUs), ulysses (all-to-all of heads over all GPUs), hybrid U x R (Ulysses over "
               "U adjacent GPUs, the ring across the R groups): weights/sequence_parallel.py",
    "bytes_sent_per_rank": "bytes one GPU sends in one fwd+bwd: torch, its comm log of every transfer; JAX, "
                           "weights.sequence_parallel.sequence_parallel_bytes_sent from the shapes",
}


# ---------------------------------------------------------------------------------------------------------------
# Plan
# ---------------------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="twinflash bench ring", description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=lengths, default=(32768, 131072), help="total lengths, e.g. 32k,128k,512k")
    parser.add_argument("--kv-heads", type=ints, default=(32, 8), help="Hkv values (H=32: MHA and GQA)")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--gpus", type=int, help="GPUs of the ring rows (default: every GPU present, at least 2)")
    parser.add_argument("--schemes", type=names(SCHEMES), help="comma list of ring, ulysses, hybrid (default: "
                        "every scheme the GPU count allows)")
    parser.add_argument("--ulysses-degree", type=int, help="the hybrid's GPUs per all-to-all (default: GPUs / 2)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"subset of {','.join(PARTS)}")
    # a call's time sets how many timed calls fit the budget, so at least one call after the compiling one: with
    # one warm-up call in all, the JAX rows at 32k on 2 H200s ran at half speed (2026-11-29,
    # compare/results/ring-one-kernel-2026-11-29-h200x2)
    parser.add_argument("--warmup", type=integer(2), default=3, help="warm-up calls, the compiling one included")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--budget-s", type=float, default=4.0, help="seconds per measurement before cutting iters")
    parser.add_argument("--launch-timeout-s", type=float, default=900.0, help="per worker launch")
    parser.add_argument("--quick", action="store_true", help="smoke run: S=16k, Hkv=8, 1+1 calls")
    parser.add_argument("--rows-from", type=Path, action="append", default=[],
                        help="merge the rows of an earlier run's JSON (e.g. one part per invocation)")
    parser.add_argument("--out", type=Path, help="JSON path (default out/ring-<date>-<gpu>.json)")
    parser.add_argument("--worker", choices=BACKENDS, help=argparse.SUPPRESS)
    parser.add_argument("--plan", type=Path, help=argparse.SUPPRESS)
    return parser


def _check_args(args) -> None:
    if args.quick:
        args.seq_lens, args.kv_heads, args.warmup, args.iters, args.budget_s = (16384,), (8,), 1, 1, 1.0
    check_parts_and_heads(args, PARTS)
    if args.gpus is not None:
        _check_gpus(args)


def _check_gpus(args) -> None:
    """The GPU count against the lengths, and the schemes' degrees (`args.degrees`: scheme -> SchemeDegrees)
    against it and the heads."""
    if args.gpus < 2:
        raise BadInputError(f"--gpus: a ring needs at least 2 GPUs, got {args.gpus}")
    for seq_len in args.seq_lens:
        check_split(seq_len, args.gpus, LAYOUT)
    hybrid = args.ulysses_degree or args.gpus // 2
    wanted = args.schemes.split(",") if args.schemes else [s for s in SCHEMES if s != "hybrid" or hybrid > 1]
    if args.ulysses_degree is not None and "hybrid" not in wanted:
        raise BadInputError("--ulysses-degree is the hybrid scheme's: add hybrid to --schemes")
    args.degrees = {scheme: scheme_degrees(scheme, args.gpus, hybrid if scheme == "hybrid" else None)
                    for scheme in wanted}
    for degrees in args.degrees.values():
        for kv_heads in args.kv_heads:
            check_heads(degrees.ulysses, args.heads, kv_heads)


def use_gpus_present(args, found: int) -> None:
    """Checks --gpus against the `found` GPUs of this machine; without --gpus, takes them all."""
    if found < (args.gpus or 2):
        needed = args.gpus or "at least 2"
        raise BadInputError(f"`bench ring` needs {needed} CUDA GPUs; this machine has {found}")
    if args.gpus is None:
        args.gpus = found
        _check_gpus(args)


def plan_tasks(args) -> dict[str, list[dict]]:
    """{part: [task]}; a task names what to measure at one point (ids are unique across parts)."""
    tasks = {part: [] for part in args.parts}
    for seq_len in args.seq_lens:
        for kv_heads in args.kv_heads:
            point = dict(seq_len=seq_len, heads=args.heads, kv_heads=kv_heads, head_dim=args.head_dim,
                         batch=args.batch)

            def add(part, kind, impl, gpus, variant=None, degrees=None):
                if part not in tasks:
                    return
                fields = {} if degrees is None else dict(scheme=degrees.scheme, ulysses_degree=degrees.ulysses)
                key = variant if degrees is None or degrees.scheme == "ring" else f"u{degrees.ulysses}/{variant}"
                tasks[part].append(dict(point, id=f"{part}/{kind}/{key}/S{seq_len}/kv{kv_heads}", part=part,
                                        kind=kind, impl=impl, gpus=gpus, variant=variant, **fields,
                                        layout=LAYOUT if gpus > 1 and part != "peer" else None))

            def add_schemes(part, prefix):
                """The part's rows of every scheme; kinds "ring", "ulysses", "hybrid" (JAX's prefixed "jax-")."""
                for scheme, degrees in args.degrees.items():
                    if scheme == "ulysses":
                        add(part, prefix + scheme, f"{part} ulysses over {args.gpus}", args.gpus, None, degrees)
                        continue
                    name = "ring" if scheme == "ring" else f"hybrid U={degrees.ulysses} x ring R={degrees.ring}"
                    for variant in VARIANTS:
                        add(part, prefix + scheme, f"{part} {name}, {variant}", args.gpus, variant, degrees)

            add("torch", "flash-1gpu", "flash (triton), 1 GPU", 1)
            add("peer", "cudnn-1gpu", "cuDNN SDPA, 1 GPU", 1)
            add("jax", "jax-flash-1gpu", "flash (pallas), 1 GPU", 1)
            add_schemes("torch", "")
            for rotation in PEER_ROTATIONS:
                add("peer", "cp-cudnn", f"context parallel cuDNN, {rotation}", args.gpus, rotation)
            add_schemes("jax", "jax-")
    return tasks


# ---------------------------------------------------------------------------------------------------------------
# Launching workers
# ---------------------------------------------------------------------------------------------------------------

def read_rows_file(path: Path) -> tuple[dict, list[dict], list[str]]:
    """(meta, rows, ids of started tasks) from a worker's JSON-lines output."""
    meta, rows, started = {}, [], []
    if path.exists():
        for line in path.read_text().splitlines():
            record = json.loads(line)
            meta.update(record.get("meta", {}))
            if "started" in record:
                started.append(record["started"])
            if "row" in record:
                rows.append(record["row"])
    return meta, rows, started


def rows_finished_before(workdir: Path, worker: str, tasks: list[dict], signal_name: str,
                         earlier_ids: set[str]) -> tuple[dict, list[dict]]:
    """(meta, rows) of a worker part that a signal cut short: the rows its launches had written (every launch's
    JSON lines in `workdir`), and for each task without one a row whose error says it was not finished, unless an
    earlier run's row of that point (`earlier_ids`, from --rows-from) is kept instead."""
    meta, rows = {}, []
    for rows_path in sorted(workdir.glob(f"{worker}-*.jsonl")):
        launch_meta, launch_rows, _ = read_rows_file(rows_path)
        meta.update(launch_meta)
        rows += launch_rows
    done = {row["id"] for row in rows}
    return meta, rows + [dict(task, error=f"not finished: the bench was interrupted ({signal_name})")
                         for task in tasks if task["id"] not in done | earlier_ids]


def _worker_command(part: str, plan_path: Path, gpus: int) -> tuple[list[str], dict]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # the workers run this module (its spec's name: as __main__ too)
    if part == "jax":
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        return [sys.executable, "-m", __spec__.name, "--worker", "jax", "--plan", str(plan_path)], env
    launcher, torchrun_env = torchrun_launcher(gpus)
    return [*launcher, "-m", __spec__.name, "--worker", "torch", "--plan", str(plan_path)], \
        torchrun_env | {"PYTHONUNBUFFERED": "1"}


def run_worker(worker: str, tasks: list[dict], args, workdir: Path) -> tuple[dict, list[dict]]:
    """Runs `tasks` on a worker, relaunching after a crash or hang; every task ends with a row."""
    meta, rows, remaining, launch = {}, [], list(tasks), 0
    while remaining:
        launch += 1
        rows_path, plan_path = workdir / f"{worker}-{launch}.jsonl", workdir / f"{worker}-{launch}.plan.json"
        plan_path.write_text(json.dumps(dict(tasks=remaining, rows_path=str(rows_path), warmup=args.warmup,
                                             iters=args.iters, budget_s=args.budget_s, gpus=args.gpus,
                                             collective_timeout_s=300)))
        command, env = _worker_command(worker, plan_path, args.gpus)
        log_path = workdir / f"{worker}-{launch}.log"
        print(f"[ring bench] {worker}: {len(remaining)} tasks: {shlex.join(command)} (log {log_path})", flush=True)
        failure = run_logged(command, env, log_path, args.launch_timeout_s)
        if failure:
            failure = f"worker {failure}"
        launch_meta, launch_rows, started = read_rows_file(rows_path)
        meta.update(launch_meta)
        rows += launch_rows
        done = {row["id"] for row in launch_rows}
        unfinished = [t for t in remaining if t["id"] in started and t["id"] not in done]
        if failure is None and not unfinished and len(done) < len(remaining):
            failure = "worker exited early"
        tail = log_tail(log_path, 400)
        for task in unfinished:  # the task the worker died on
            rows.append(dict(task, error=f"{failure}: {tail}"))
        if not started:  # died before its first task: the rest would fail the same way
            rows += [dict(task, error=f"{failure or 'worker did nothing'}: {tail}") for task in remaining]
            break
        remaining = [t for t in remaining if t["id"] not in started]
    return meta, rows


# ---------------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------------

def summarize(rows: list[dict]) -> list[dict]:
    """Adds tflops_per_gpu, efficiency and vs_peer (module docstring) to copies of `rows`."""
    from weights.flops import attention_flops

    out = []
    for row in rows:
        row = dict(row)
        if row.get("ms") and not row.get("error"):
            flops = attention_flops(row["batch"], row["heads"], row["seq_len"], row["seq_len"], row["head_dim"],
                                    causal=True, backward=True)
            row["tflops_per_gpu"] = flops / (row["ms"] * 1e-3) / row["gpus"] / 1e12
        out.append(row)

    def point(row):
        return row["seq_len"], row["kv_heads"]

    def timed(candidates):
        return [r for r in candidates if r.get("tflops_per_gpu")]

    for row in timed(out):
        if row["gpus"] > 1:
            single = timed(r for r in out if point(r) == point(row) and r["kind"] == ONE_GPU_KIND[row["part"]])
            if single:
                row["efficiency"] = single[0]["ms"] / (row["gpus"] * row["ms"])
            peers = timed(r for r in out if point(r) == point(row) and r["kind"] == "cp-cudnn")
        else:
            peers = timed(r for r in out if point(r) == point(row) and r["kind"] == "cudnn-1gpu")
        if peers:
            row["vs_peer"] = row["tflops_per_gpu"] / max(p["tflops_per_gpu"] for p in peers)
    return out


def _fmt(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def render_table(rows: list[dict]):
    from rich.table import Table

    gpus = max((row["gpus"] for row in rows), default=1)
    table = Table(title=f"Sequence-parallel attention, causal, bf16, fwd+bwd (zigzag on {gpus} GPUs)")
    for name in ("S", "Hkv", "implementation", "GPUs", "ms", "TFLOP/s/GPU", "eff.", "sent MB", "exposed comm ms",
                 "wire GB/s", "vs peer", "note"):
        table.add_column(name, justify="left" if name in ("implementation", "note") else "right")
    for row in sorted(rows, key=lambda r: (r["seq_len"], -r["kv_heads"], PARTS.index(r["part"]), r["gpus"])):
        note = row.get("error") or row.get("note") or ""
        table.add_row(f"{row['seq_len'] // 1024}k", str(row["kv_heads"]), row["impl"], str(row["gpus"]),
                      _fmt(row.get("ms"), ".1f"), _fmt(row.get("tflops_per_gpu"), ".0f"),
                      _fmt(row.get("efficiency"), ".0%"),
                      _fmt(row["bytes_sent_per_rank"] / 1e6 if row.get("bytes_sent_per_rank") else None, ".0f"),
                      _fmt(row.get("exposed_comm_ms"), ".1f"),
                      _fmt(row.get("wire_GBps"), ".0f"), _fmt(row.get("vs_peer"), ".2f"),
                      note if len(note) < 90 else note[:87] + "...")
    return table


def default_out_path(meta: dict, today: datetime.date) -> Path:
    return common.default_out_path("ring", meta, today)


def save(rows: list[dict], meta: dict, argv: list[str], out: Path | None, gpus: int) -> tuple[Path, list[dict]]:
    """Writes the JSON document (rows with the derived columns); returns its path and those rows."""
    rows = summarize(rows)
    path = out or default_out_path(meta, datetime.date.today())
    write_json(path, {"command": recorded_command(["twinflash", "bench", "ring", *argv]),
                      "date": datetime.datetime.now().isoformat(timespec="seconds"), "gpus": gpus,
                      "versions": meta, "method": METHOD, "rows": rows})
    return path, rows


def report(rows: list[dict], meta: dict, argv: list[str], out: Path | None, gpus: int) -> Path:
    """Writes the JSON and prints the table."""
    from rich.console import Console

    path, rows = save(rows, meta, argv, out, gpus)
    Console(width=200).print(render_table(rows))
    print(f"[ring bench] wrote {path}")
    return path


# ---------------------------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------------------------

def merge_rows(earlier: list[dict], measured: list[dict]) -> list[dict]:
    """`earlier` (from --rows-from) with `measured` added; a re-measured point replaces its earlier row."""
    fresh = {row["id"] for row in measured}
    return [row for row in earlier if row["id"] not in fresh] + measured


def _run_under_torchrun(args, argv) -> None:
    from compare.bench.ring_bench_workers import run_torch

    if args.plan is not None:  # launched by the parent
        run_torch(json.loads(args.plan.read_text()))
        return
    tasks = [t for part in ("torch", "peer") for t in plan_tasks(args).get(part, [])]
    with tempfile.TemporaryDirectory() as tmp:
        rows_path = Path(tmp) / "rows.jsonl"
        run_torch(dict(tasks=tasks, rows_path=str(rows_path), warmup=args.warmup, iters=args.iters,
                       budget_s=args.budget_s, gpus=args.gpus, collective_timeout_s=300))
        if int(os.environ.get("RANK", "0")) == 0:
            meta, rows, _ = read_rows_file(rows_path)
            report(rows, meta, argv, args.out, args.gpus)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return with_error_contract(lambda: _main(argv))


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.worker == "jax":
        from compare.bench.ring_bench_workers import run_jax

        run_jax(json.loads(args.plan.read_text()))
        return 0
    _check_args(args)
    if "LOCAL_RANK" in os.environ:
        use_gpus_present(args, int(os.environ["WORLD_SIZE"]))  # one process per GPU
        _run_under_torchrun(args, argv)
        return 0
    import torch

    use_gpus_present(args, torch.cuda.device_count())
    meta, rows = previous_rows(args.rows_from)
    tasks = plan_tasks(args)
    with interruptible(), tempfile.TemporaryDirectory(prefix="ring-bench-") as tmp:
        worker, worker_tasks = "torch", []
        try:
            for worker, parts in (("torch", ("torch", "peer")), ("jax", ("jax",))):
                worker_tasks = [t for part in parts for t in tasks.get(part, [])]
                if worker_tasks:
                    worker_meta, worker_rows = run_worker(worker, worker_tasks, args, Path(tmp))
                    meta.update(worker_meta)
                    rows = merge_rows(rows, worker_rows)
                    save(rows, meta, argv, args.out, args.gpus)  # kept if a later part is cut short
        except Interrupted as stop:  # the workers are stopped: keep every row they finished, name the rest
            worker_meta, finished = rows_finished_before(Path(tmp), worker, worker_tasks, stop.signal_name,
                                                         {row["id"] for row in rows})
            path = report(merge_rows(rows, finished), meta | worker_meta, argv, args.out, args.gpus)
            print(f"twinflash: bench ring interrupted ({stop.signal_name}); the rows measured before it are in {path}",
                  file=sys.stderr)
            return stop.exit_code
    report(rows, meta, argv, args.out, args.gpus)
    return 0


if __name__ == "__main__":
    end_process(main())
