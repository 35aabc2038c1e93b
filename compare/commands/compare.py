"""`twinflash compare`: both backends on the same devices, weights and inputs, one after the other; an
equivalence section and a benchmark section in one report. This module owns the arguments and the command; it asks
the harness (compare/harness/) for the data and the report (compare/report/) to write it: the plan is `plan.py`'s
(which jobs run where), the launches of the backend workers and the relaunch after a failed launch `launches.py`'s,
a run spanning nodes `across_nodes.py`'s, the verdicts `equivalence.py`'s (float32), `fastpath.py`'s (the bf16 code
the points time) and `noise_floor.py`'s, the benchmark arithmetic and the report `compare/report/`'s.

Without GPUs and with no arguments it runs the embedded default: the tiny preset, 4 emulated CPU devices (gloo
processes; XLA host devices; interpreted Triton and Pallas kernels), in about 1½ minutes on 2 cores. A run pays its
setup once (`plan.prepare_weights`: the weights made once; `launches`: one launch per backend and device count,
shared compilation caches; on several GPUs, the equivalence checks and noise-floor trainings all at once first,
compared while the benchmark points run, and those points' launches on disjoint GPUs side by side) and reports
every job's setup beside its measured time; `progress.py` shows it live.

Benchmark numbers, per backend x context length x device count (batch 1, the sequence split over all devices):
  step_s       median over `--steps` steps after a warm-up step (one step where it exceeds 2 s:
               `jobs.LONG_STEP_S`): forward + backward + AdamW (train mode) or the forward loss (forward mode)
  forward_s    median of 2 forward loss passes (1 where step_s exceeds 2 s: `jobs.LONG_STEP_S`);
               backward_s = step_s - forward_s (backward and optimizer update)
  comm_s       time during which device 0 was communicating, from a profiler trace of one step (NCCL kernels, gloo
               transfers, XLA collectives), overlap with compute included; comm bytes from
               `weights.parallel.step_comm_bytes`
  comm_exposed_s   the part of that time during which device 0 computed nothing (at most step_s)
  tokens/s     seq_len / step_s; TFLOP/s per device and MFU from `weights.flops` (formula in the report)
  scaling efficiency   step_s(1 device) / (devices * step_s(devices)), the same sequence on both
With `--precisions bf16,fp8` every point runs once more in FP8 (`plan.py`), the noise floor's trainings of our
kernels too (`noise_floor.py`), and the report compares them (compare/report/precision.py).
With `--schemes ring,ulysses,hybrid` each scheme besides the ring gets the float32 check and a benchmark point of
our kernels at the most devices per length (job ids `<backend>-<scheme>-equivalence`, `...-ours-<scheme>`), shown in
the report's scheme section (compare/report/schemes.py).
With `--model HF_DIR` (a Hugging Face Llama directory, converted once for the run) the report adds HF's
LlamaForCausalLM with our ring beside our torch model per context length (compare/harness/hf_rows.py, after the
jobs), which must agree with ours. On 2 or more GPUs in train mode with torch in --backends the report adds the live
training peer (compare/harness/peer_rows.py, after the jobs): PyTorch's context parallelism with cuDNN as the attention
of our torch step, beside ours in both backends, each of which must agree with our torch row.
Exit code: 0 when the equivalence section passes (its float32 checks and its fast path) and HF's model and the
training peer, where measured, agree, 1 when one fails, 2 for bad input, 130 / 143 when interrupted by SIGINT / SIGTERM: the workers are stopped and the report of the jobs that
finished is written, the rest marked "interrupted" (one line names it).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import shutil
import sys
import threading
import time
from pathlib import Path

from compare.args import integer, ints, lengths, names, number
from compare.harness import across_nodes, noise_floor
from compare.harness import jobs as J
from compare.harness.across_nodes import Lead
from compare.harness.equivalence import WEIGHTS_EXACT, equivalence_section, load_equivalence
from compare.harness.fastpath import fast_path_section
from compare.harness.hf_rows import plan_hf_rows, run_hf_rows
from compare.harness.peer_rows import plan_peer_rows, run_peer_rows
from compare.harness.launches import CACHE_DIR, run_jobs, side_launcher
from compare.harness.plan import (PRECISIONS, WEIGHTS_DIR, CompareSettings, check_model, gpu_count, gpu_memory_bytes,
                                  plan_jobs, plan_settings, prepare_weights)
from compare.harness.progress import RunProgress
from compare.launch import Interrupted, interruptible
from compare.nodes import Nodes, add_arguments as add_node_arguments, from_args as nodes_from_args
from compare.report.data import add_scaling, benchmark_point, job_timing, report_dict
from compare.report.fields import fmt_seq
from compare.report.hf import hf_section
from compare.report.peer import peer_section
from compare.report.precision import precision_section
from compare.report.write import load_peers, write_report
from weights import PRESETS, BadInputError, is_hf_checkpoint, open_weights
from weights.atomic import check_output_dir
from weights.errors import EXIT_CHECK_FAILED, EXIT_OK
from weights.fp8 import INSTALL_TORCHAO
from weights.parallel import REMAT_MODES
from weights.sequence_parallel import SCHEMES
from weights.training import BACKENDS


HELP = ("both backends, same weights and devices: equivalence + benchmark report (no arguments on a CPU machine: "
        "tiny model, 4 emulated devices)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="converted checkpoint dir, Hugging Face Llama dir (converted "
                        "for the run; its report adds HF's model with our ring beside ours, compare/report/hf.py) or "
                        f"preset ({', '.join(PRESETS)})")
    parser.add_argument("--seq-lens", type=lengths, help="context lengths, e.g. 8k,32k,128k (default: 128 on "
                        "CPU; on GPUs those of 8k,32k,128k that fit the model on the most devices)")
    parser.add_argument("--devices", type=integer(1),
                        help="devices to use (default: all GPUs, or 4 emulated CPU devices)")
    parser.add_argument("--device-counts", type=ints, help="benchmark device counts, e.g. 1,2,4 (default: 1, 2, "
                        "4, ... up to --devices on GPUs; 1 and --devices on CPU)")
    parser.add_argument("--mode", choices=("forward", "train"), default="train")
    parser.add_argument("--steps", type=integer(1),
                        help="timed steps per point and loss-curve steps (default 2 CPU, 3 GPU)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), help="benchmark dtype (default fp32 CPU, bf16 GPU); "
                        "the equivalence check is fp32, its fast path bf16; bf16 in train mode adds the bf16 noise floor")
    parser.add_argument("--precisions", type=names(PRECISIONS), default="bf16",
                        help="train mode: bf16 (the --dtype as it is) and fp8 (the decoder layers' linears in FP8, "
                             "as `twinflash train --fp8`; needs --dtype bf16, and torchao for torch: "
                             f"{INSTALL_TORCHAO}): every benchmark point once per precision, and the noise floor's "
                             "trainings of our kernels also in FP8; the report's precision section compares them")
    parser.add_argument("--backends", type=names(BACKENDS), default=",".join(BACKENDS),
                        help=f"comma-separated: {', '.join(BACKENDS)}")
    parser.add_argument("--ablation", type=names(("ours", "vendor", "reference")), default="ours,vendor,reference",
                        help="attention kernels at the largest device count: ours, vendor (SDPA cuDNN / JAX cuDNN), "
                             "reference (plain math)")
    parser.add_argument("--schemes", type=names(SCHEMES), default="ring",
                        help="sequence-parallel schemes (`twinflash train --sp-scheme`): ring, ulysses, hybrid; each "
                             "besides the ring gets the float32 check on all devices and a benchmark point of our "
                             "kernels at the most devices per length (the report's scheme section)")
    parser.add_argument("--ulysses-degree", type=integer(2), help="the hybrid's Ulysses degree U (default: "
                        "devices / 2): U adjacent devices exchange heads, the ring runs across the groups")
    parser.add_argument("--activation-checkpointing", choices=("auto", *REMAT_MODES), default="auto",
                        help="benchmark with per-layer recomputation (`twinflash train --help` lists the modes; "
                             "auto: full for models over 2B parameters, else off)")
    parser.add_argument("--check-seq-len", type=integer(2), help="equivalence context length (default: the "
                        "smallest of --seq-lens, at most 2048)")
    parser.add_argument("--check-layers", type=integer(1), help="equivalence on the model's first N layers "
                        "(default: all, or 2 for models over 2B parameters)")
    parser.add_argument("--no-bench", dest="bench", action="store_false", help="equivalence section only")
    parser.add_argument("--perturb", metavar="BACKEND:PARAM|BACKEND:attention-T=F",
                        help="harness self-test (compare/harness/perturb.py): scale one parameter by 1 %% in one "
                             "backend's float32 check and noise-floor runs (the check must fail and name it), or "
                             "one output of our attention (T: out, dq, dk, dv) by F on the points' path in that "
                             "backend's fast-path checks and noise-floor run of our kernels (the fast path must fail "
                             "naming the backend and T, the noise floor name the run)")
    parser.add_argument("--job-timeout-s", type=number(0, above=True), default=900.0,
                        help="a job silent this long is stopped")
    parser.add_argument("--time-limit-s", type=number(0, above=True), help="stop launching after this long; the "
                        "jobs left are recorded as not run and the report is written")
    parser.add_argument("--serial-launches", dest="side_by_side", action="store_false",
                        help="one launch at a time (default on a host of several GPUs: launches on disjoint GPUs, "
                             "e.g. the backends' one-GPU launches, run side by side)")
    parser.add_argument("--out", type=Path, help="report directory, must not exist or be empty "
                        "(default: out/compare-<model>-<date>)")
    noise_floor.add_arguments(parser)
    add_node_arguments(parser, "--devices counts every node's devices (default on GPUs: all of them); a launch "
                       "of more devices than a node has spans nodes, the others run on node 0; --out is required, "
                       "on a file system every node sees (node 0 writes the report there)")


def _default_out(model: str) -> Path:
    return Path("out") / f"compare-{Path(model).name}-{datetime.datetime.now():%Y%m%d-%H%M%S}"


def _sig(value, scale: float = 1.0, suffix: str = "") -> str:
    """Three significant digits, never a 0.0 for a value that is not zero; a dash for none."""
    if value is None:
        return "-"
    value *= scale
    return f"{value:,.0f}{suffix}" if abs(value) >= 1000 else f"{value:.3g}{suffix}"


# (header, cell, priority): the columns that fit the console's width are kept, the highest priority number dropped
# first
_SUMMARY_COLUMNS = (
    ("backend", lambda p: p["backend"], 0), ("attn", lambda p: p["attention"], 0),
    ("S", lambda p: fmt_seq(p["seq_len"]), 0), ("dev", lambda p: str(p["devices"]), 0),
    ("prec", lambda p: p.get("precision") or "-", 0), ("scheme", lambda p: p.get("scheme", "ring"), 0),
    ("status", lambda p: p["status"], 0),
    ("step", lambda p: _sig(p["step_s"], 1e3, " ms"), 1),
    ("tok/s", lambda p: _sig(p["tokens_per_s"]), 2), ("MFU", lambda p: _sig(p["mfu"], 100, "%"), 3),
    ("exp. comm", lambda p: _sig(p["comm_exposed_s"], 1e3, " ms"), 4),
    ("peak GiB", lambda p: _sig(p["peak_memory_bytes"], 2**-30), 5),
    ("TF/s/dev", lambda p: _sig(p["tflops_per_device"]), 6),
)


def _summary_table(report: dict, width: int):
    """The closing table, with as many columns as fit `width` (the lowest-priority ones dropped first)."""
    import io

    from rich import box
    from rich.console import Console
    from rich.table import Table

    points = report["benchmark"]["points"]
    fp8 = any(p.get("precision") == "fp8" for p in points)
    schemes = any(p.get("scheme", "ring") != "ring" for p in points)
    columns = [c for c in _SUMMARY_COLUMNS if (c[0] != "MFU" or any(p["mfu"] is not None for p in points))
               and (c[0] != "prec" or fp8) and (c[0] != "scheme" or schemes)]
    measure = Console(width=10_000, file=io.StringIO())
    while True:
        table = Table(title=f"twinflash compare: {report['model']['name']}, {report['settings']['mode']}",
                      box=box.SIMPLE_HEAD, pad_edge=False)
        for header, _, _ in columns:
            table.add_column(header, justify="right", no_wrap=True)
        for p in points:
            table.add_row(*(cell(p) for _, cell, _ in columns))
        if measure.measure(table).maximum <= width or max(c[2] for c in columns) == 0:
            return table
        columns.remove(max(columns, key=lambda c: c[2]))


def run_command(args: argparse.Namespace) -> int:
    """One node's `twinflash compare` after argument parsing; spanning nodes, node 0 runs the compare
    (`across_nodes.lead_run`) and the others their side of the launches that span them (`across_nodes.follow`)."""
    nodes = nodes_from_args(args)
    if not nodes.spans_hosts:
        return run_compare(args, args.argv)
    if args.out is None:
        raise BadInputError(f"--nnodes {nodes.count}: give --out, the same directory on every node, on a file system "
                            "all nodes see (node 0 writes the report there; the nodes exchange their work through it)")
    if nodes.rank == 0:
        return across_nodes.lead_run(args, nodes, run_compare)
    gpus = gpu_count()  # the same plan as node 0's, so that bad input ends every node at once
    settings = plan_settings(args, gpus * nodes.count, gpu_memory_bytes() if gpus else None)
    across_nodes.check_placement(settings, nodes, gpus)
    out = args.out.resolve()

    def launcher(backend: str, devices: int, rendezvous, launch_id: str):
        return side_launcher(backend, devices, settings.platform, out / "work", rendezvous, launch_id)

    return across_nodes.follow(args, nodes, out, launcher)


def run_compare(args: argparse.Namespace, argv: list[str], lead: Lead | None = None) -> int:
    """The compare after argument parsing (on node 0 of a run spanning nodes: `lead`); raises BadInputError for
    bad input."""
    with interruptible():
        try:
            return _run(args, argv, lead or Lead(Nodes()))
        except Interrupted as stop:  # outside the jobs' run: before it, or while the report was being written
            print(f"twinflash: compare interrupted ({stop.signal_name}) outside its jobs' run; no report written",
                  file=sys.stderr)
            return stop.exit_code


def _record_interrupted(jobs: list[J.Job], work_dir: Path, stop: Interrupted) -> int:
    """Marks the jobs without a result "interrupted"; returns how many."""
    left = [job for job in jobs if J.read_result(work_dir, job.id) is None]
    for job in left:
        J.write_result(work_dir, job, {"status": "interrupted", "message": f"not finished: {stop.signal_name}"})
    return len(left)


def _run(args: argparse.Namespace, argv: list[str], lead: Lead) -> int:
    from rich.console import Console

    out = (args.out or _default_out(args.model)).resolve()
    check_output_dir(out, "--out", empty=True)
    gpus = gpu_count()
    settings = lead.planned(plan_settings(args, lead.gpus(gpus), gpu_memory_bytes() if gpus else None), gpus)
    bf16_floor = noise_floor.plan(args, settings)
    deadline = math.inf if args.time_limit_s is None else time.monotonic() + args.time_limit_s
    work_dir, trace_dir = out / "work", out / "traces"
    work_dir.mkdir(parents=True, exist_ok=True)
    lead.arrive(work_dir)
    trace_dir.mkdir(exist_ok=True)
    console = Console(stderr=True)
    for note in settings.notes:
        console.print(f"[yellow]note:[/] {note}")
    began = time.perf_counter()
    settings = prepare_weights(dataclasses.replace(settings, out=out), work_dir)
    console.print(f"weights: {settings.model} -> {os.path.relpath(settings.weights, out)} in "
                  f"{time.perf_counter() - began:.3g} s, read by every job", highlight=False, soft_wrap=True)
    check_path = check_model(settings, work_dir)
    jobs = plan_jobs(settings, check_path, trace_dir) + noise_floor.plan_jobs(bf16_floor, settings, check_path)
    view = RunProgress(jobs, work_dir, console)

    def on_done(job: J.Job) -> None:
        view.done(job, J.read_result(work_dir, job.id))

    early: dict[str, dict] = {}

    def compare_early() -> None:  # the checks ran before the points: compared while the points run
        early["equivalence"] = _equivalence_section(jobs, work_dir, settings)

    comparing = threading.Thread(target=compare_early, daemon=True)
    interrupted, left = None, 0
    with view.shown():
        try:
            run_jobs(jobs, settings, work_dir, args.job_timeout_s, on_done, deadline, lead, args.side_by_side,
                     on_checks_done=comparing.start)
        except Interrupted as stop:  # the launch is stopped; the report shows what finished
            interrupted, left = stop, _record_interrupted(jobs, work_dir, stop)
    if comparing.is_alive():
        comparing.join()
    hf_dir = settings.model if is_hf_checkpoint(settings.model) else None
    memory_skips = {job.seq_len: job.skip for job in jobs if job.kind == "bench" and job.backend == "torch"
                    and job.attention == "ours" and job.devices == settings.devices and not job.fp8 and job.skip}
    hf_measurements, hf_note = plan_hf_rows(settings, hf_dir, lead.nodes.spans_hosts, memory_skips)
    hf_records = []
    if hf_measurements and interrupted is None:
        try:
            hf_records = run_hf_rows(hf_measurements, settings, hf_dir, work_dir, args.job_timeout_s, deadline,
                                     lambda line: console.print(line, markup=False, highlight=False))
        except Interrupted as stop:  # the compare's own jobs are done: the report has them, not the HF rows
            interrupted, hf_note = stop, f"HF rows not measured: interrupted ({stop.signal_name})"
    peer_measurements, peer_note = plan_peer_rows(settings, lead.nodes.spans_hosts, memory_skips)
    peer_records = []
    if peer_measurements and interrupted is None:
        try:
            peer_records = run_peer_rows(peer_measurements, settings, work_dir, args.job_timeout_s, deadline,
                                         lambda line: console.print(line, markup=False, highlight=False))
        except Interrupted as stop:  # as for the HF rows: the report has the compare's own jobs
            interrupted, peer_note = stop, f"the training peer not measured: interrupted ({stop.signal_name})"

    config = open_weights(settings.weights).config
    results = {job.id: J.read_result(work_dir, job.id) for job in jobs}
    # computed here when the checks did not run first, or their comparison failed (it raises again, here)
    equivalence = early.get("equivalence") or _equivalence_section(jobs, work_dir, settings)
    curves = {job.id: noise_floor.run_record(job, results[job.id]) | {"precision": "fp8" if job.fp8 else "bf16"}
              for job in jobs if job.kind == "curve"}
    if bf16_floor is not None:
        equivalence["bf16"] = noise_floor.noise_floor_section(
            bf16_floor, [{k: v for k, v in curves[job.id].items() if k != "precision"} for job in jobs
                         if job.kind == "curve" and not job.fp8], open_weights(check_path).config)
        console.print(f"bf16 noise floor: {equivalence['bf16']['verdict']}", markup=False, highlight=False)
    points = [benchmark_point(job, results[job.id], config, settings) for job in jobs if job.kind == "bench"]
    add_scaling(points, settings.platform)
    report = report_dict(settings=settings, config=config, equivalence=equivalence, points=points,
                         peers=load_peers(), argv=argv, jobs=[job_timing(job, results[job.id]) for job in jobs],
                         hf=hf_section(hf_records, points, hf_note, settings.platform),
                         training_peer=peer_section(peer_records, peer_note))
    report["precision"] = precision_section(report, bf16_floor, [curves[job.id] for job in jobs if job.kind == "curve"
                                                                 and job.attention == "ours"])
    write_report(report, out)
    try:
        _remove_bulk(work_dir)
        if not console.is_terminal:  # a log file gets the whole table; a terminal the columns that fit its width
            console.width = 200
        console.print(_summary_table(report, console.width))
        verdict = "[green]PASSED[/]" if report["passed"] else "[red]FAILED[/]"
        console.print(f"equivalence {verdict} (float32: {'passed' if equivalence['passed'] else 'FAILED'}, fast path: "
                      f"{'passed' if equivalence['fast_path']['passed'] else 'FAILED'}); report: {out / 'report.md'} "
                      "(also report.html, report.json)", soft_wrap=True)
        for comparison in equivalence["comparisons"]:
            for check in comparison["checks"]:
                if not check["passed"]:
                    console.print(f"  [red]{comparison['name']}: {check['metric']} = {check['value']:.3g} > "
                                  f"{check['tolerance']:.3g}[/]")
            moved = [p["name"] for p in comparison["parameters"] if p["weight_sum_diff"] > WEIGHTS_EXACT[0]]
            if moved:
                console.print(f"  [red]{comparison['name']}: loaded weights differ: {', '.join(moved)}[/]")
            bad = [p["name"] for p in comparison["parameters"] if not p["passed"]]
            if bad:
                console.print(f"  [red]{comparison['name']}: parameters out of tolerance: {', '.join(bad[:8])}"
                              f"{' ...' if len(bad) > 8 else ''}[/]")
        for failure in equivalence.get("failures", []) + equivalence["fast_path"]["failures"]:
            console.print(f"  [red]{failure[:300]}[/]", highlight=False)
        if report["hf"] is not None:
            console.print(f"HF transformers with our ring: {_hf_summary(report['hf'])}", markup=False,
                          highlight=False, soft_wrap=True)
        if interrupted is not None:
            print(f"twinflash: compare interrupted ({interrupted.signal_name}); report of the {len(jobs) - left} of "
                  f"{len(jobs)} jobs that finished, the rest marked interrupted: {out / 'report.md'}", file=sys.stderr)
            return interrupted.exit_code
        return EXIT_OK if report["passed"] else EXIT_CHECK_FAILED
    except Interrupted as stop:  # the report is whole: only the clean-up or the console's summary was cut
        print(f"twinflash: compare interrupted ({stop.signal_name}) after its report was written: "
              f"{out / 'report.md'}", file=sys.stderr)
        return stop.exit_code


def _hf_summary(section: dict) -> str:
    """One line: whether HF's model agreed with ours at each length, or why nothing was measured."""
    if section["note"]:
        return section["note"]
    parts = []
    for m in section["measurements"]:
        hf = next((row for row in m["rows"] if row["kind"] == "hf"), None)
        if hf is None or hf["agrees"] is None:
            parts.append(f"S={fmt_seq(m['seq_len'])}: {m['status']}")
        else:
            parts.append(f"S={fmt_seq(m['seq_len'])}: {'agrees' if hf['agrees'] else 'DISAGREES'} (loss "
                         f"{hf['loss_rel_diff_vs_ours']:.2g}, grad norm {hf['grad_norm_rel_diff_vs_ours']:.2g} rel.)")
    return "; ".join(parts)


def _equivalence_section(jobs: list[J.Job], work_dir: Path, settings: CompareSettings) -> dict:
    """The report's equivalence section from the equivalence jobs' results and files (or the failures of those
    that did not finish), with the fast path's (`fastpath.fast_path_section`) in it."""
    loaded, failures = {}, []
    for job in (j for j in jobs if j.kind == "equivalence"):
        result = J.read_result(work_dir, job.id)
        if result["status"] == "ok":
            loaded[job.id.removesuffix("-equivalence")] = load_equivalence(work_dir, job.id, result)
        else:
            failures.append(f"{job.id}: {result['status']}: {result.get('message')}")
    if failures:
        section = {"seq_len": settings.check_seq_len, "devices": settings.devices, "layers": settings.check_layers,
                   "dtype": "fp32", "reference": REFERENCE, "passed": False, "comparisons": [], "loss_curves": {},
                   "failures": failures}
    else:
        section = equivalence_section(loaded, seq_len=settings.check_seq_len, devices=settings.devices,
                                      layers=settings.check_layers, reference_description=REFERENCE)
    del loaded  # the float32 arrays, before the fast path reads its own
    reference = next(j for j in jobs if j.id == "reference-equivalence")
    section["fast_path"] = fast_path_section([j for j in jobs if j.kind in J.FAST_PATH_KINDS], work_dir, reference)
    return section


def _remove_bulk(work_dir: Path) -> None:
    """What the report summarises or the run can remake: the equivalence jobs' logits and gradients, the run's
    weights and compilation caches (gigabytes for a real model)."""
    for tensors in work_dir.glob("*.safetensors"):
        tensors.unlink()
    for directory in (WEIGHTS_DIR, "check-model", CACHE_DIR):
        shutil.rmtree(work_dir / directory, ignore_errors=True)


REFERENCE = ("torch_impl's Llama on one device in float32 with plain attention math (torch_impl/attention.py), "
             "itself checked against Hugging Face transformers in tests/test_model.py")
