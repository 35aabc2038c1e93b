"""`twinflash compare`: both backends on the same devices, weights and inputs, one after the other; an
equivalence section and a benchmark section in one report (`compare/report.py` writes report.json/.md/.html and
the plots). Owns the plan (which jobs run where), the launches of the backend workers (`compare/worker_torch.py`
under torchrun, one process per device; `compare/worker_jax.py`, one process per job over all local devices, on
CPU with that many emulated host devices), the handling of a failed launch (the job that was running is recorded
as OOM, error or timeout and the rest runs in a new launch), and the arithmetic of the benchmark numbers.

Without GPUs and with no arguments it runs the embedded default: the tiny preset, 4 emulated CPU devices (gloo
processes; XLA host devices; interpreted Triton and Pallas kernels), in a few minutes.

Benchmark numbers, per backend x context length x device count (batch 1, the sequence split over all devices):
  step_s       median over `--steps` steps after a warm-up step: forward + backward + AdamW (train mode) or the
               forward loss (forward mode)
  forward_s    median forward loss pass; backward_s = step_s - forward_s (backward and optimizer update)
  comm_s       time during which device 0 was communicating, from a profiler trace of one step (NCCL kernels, gloo
               transfers, XLA collectives); comm bytes from `weights.parallel.step_comm_bytes`
  tokens/s     seq_len / step_s; TFLOP/s per device and MFU from `weights.flops` (formula in the report)
  scaling efficiency   step_s(1 device) / (devices * step_s(devices)), the same sequence on both
Exit code: 0 when the equivalence section passes, 1 when it fails, 2 for bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from compare import jobs as J
from compare.equivalence import WEIGHTS_EXACT, equivalence_section, load_equivalence
from compare.ring_bench import _ints, _lengths
from compare.train import host_devices_env, torchrun_launcher
from weights import PRESETS, CheckpointError, open_weights, parameter_shapes, write_converted_checkpoint
from weights.layout import check_split
from weights.parallel import REMAT_MODES, RING_LAYOUT

EXIT_MISMATCH = 1
KERNELS = {"torch": {"ours": "triton", "vendor": "sdpa_cudnn", "reference": "reference"},
           "jax": {"ours": "pallas", "vendor": "cudnn", "reference": "reference"}}
INSTALL_HINT = {"torch": "pip install 'torch>=2.11' triton (or reinstall twinflash: pip install -e .)",
                "jax": "pip install 'jax>=0.10' flax orbax-checkpoint (or reinstall twinflash: pip install -e .)"}
CPU_DEFAULTS = {"seq_lens": (128, 256), "devices": 4, "steps": 2, "dtype": "fp32"}
GPU_DEFAULTS = {"seq_lens": (8192, 32768, 131072), "steps": 4, "dtype": "bf16"}
LARGE_MODEL_PARAMS = 2e9  # above: the equivalence check keeps 2 layers and the benchmark checkpoints activations
TIME_TO_TOKENS = 1e9


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help=f"converted checkpoint dir or preset ({', '.join(PRESETS)})")
    parser.add_argument("--seq-lens", type=_lengths, help="context lengths, e.g. 8k,32k,128k (default: 128,256 on "
                        "CPU, 8k,32k,128k on GPUs)")
    parser.add_argument("--devices", type=int, help="devices to use (default: all GPUs, or 4 emulated CPU devices)")
    parser.add_argument("--device-counts", type=_ints, help="benchmark device counts, e.g. 1,2,4 (default: powers "
                        "of two up to --devices)")
    parser.add_argument("--mode", choices=("forward", "train"), default="train")
    parser.add_argument("--steps", type=int, help="timed steps per point and loss-curve steps (default 2 CPU, 4 GPU)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), help="benchmark dtype (default fp32 CPU, bf16 GPU); "
                        "the equivalence check is always fp32")
    parser.add_argument("--backends", default="torch,jax", help="comma-separated: torch, jax")
    parser.add_argument("--ablation", default="ours,vendor,reference",
                        help="attention kernels at the largest device count: ours, vendor (SDPA cuDNN / JAX cuDNN), "
                             "reference (plain math)")
    parser.add_argument("--activation-checkpointing", choices=("auto", *REMAT_MODES), default="auto",
                        help="benchmark with per-layer recomputation (`twinflash train --help` lists the modes; "
                             "auto: full for models over 2B parameters, else off)")
    parser.add_argument("--check-seq-len", type=int, help="equivalence context length (default: the smallest of "
                        "--seq-lens, at most 2048)")
    parser.add_argument("--check-layers", type=int, help="equivalence on the model's first N layers (default: all, "
                        "or 2 for models over 2B parameters)")
    parser.add_argument("--no-bench", dest="bench", action="store_false", help="equivalence section only")
    parser.add_argument("--perturb", metavar="BACKEND:PARAM", help="harness self-test: scale one parameter by 1 %% "
                        "in one backend's equivalence run (the check must fail and name it)")
    parser.add_argument("--job-timeout-s", type=float, default=900.0, help="a job silent this long is stopped")
    parser.add_argument("--time-limit-s", type=float, help="stop launching after this long; the jobs left are "
                        "recorded as not run and the report is written")
    parser.add_argument("--out", type=Path, help="report directory, must not exist or be empty "
                        "(default: out/compare-<model>-<date>)")


# --- the plan ---------------------------------------------------------------------------------------------------

def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _parsed_list(text: str, choices: tuple[str, ...], flag: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in choices]
    if bad or not items:
        raise CheckpointError(f"{flag} takes a comma-separated list of {', '.join(choices)}; got {text!r}")
    return items


def _available_backends(asked: list[str], explicit: bool) -> tuple[list[str], list[str]]:
    """(backends to run, notes on those skipped). A backend asked for by name that is not installed is bad input;
    one missing from the default pair is skipped with a note in the report."""
    modules = {"torch": "torch", "jax": "jax"}
    missing = [b for b in asked if importlib.util.find_spec(modules[b]) is None]
    if missing and explicit:
        raise CheckpointError(f"the {missing[0]} backend is not installed: {INSTALL_HINT[missing[0]]}")
    return [b for b in asked if b not in missing], [f"{b} not installed: {INSTALL_HINT[b]}" for b in missing]


def plan_settings(args: argparse.Namespace, gpus: int) -> dict:
    """The run's settings (validated): what the report's "settings" records, plus the check model's details."""
    defaults = GPU_DEFAULTS if gpus else CPU_DEFAULTS
    devices = args.devices if args.devices is not None else (gpus or CPU_DEFAULTS["devices"])
    if devices < 1:
        raise CheckpointError(f"--devices must be >= 1, got {devices}")
    if gpus and devices > gpus:
        raise CheckpointError(f"asked for {devices} devices, but this machine has {gpus} GPUs")
    counts = sorted(set(args.device_counts)) if args.device_counts else \
        sorted({2 ** i for i in range(devices.bit_length()) if 2 ** i <= devices} | {devices})
    if any(c < 1 or c > devices for c in counts):
        raise CheckpointError(f"--device-counts must lie in 1..{devices}, got {args.device_counts}")
    seq_lens = tuple(args.seq_lens or defaults["seq_lens"])
    for seq_len in seq_lens:
        for count in counts:
            check_split(seq_len, count, RING_LAYOUT)
    steps = args.steps if args.steps is not None else defaults["steps"]
    if steps < 1:
        raise CheckpointError(f"--steps must be >= 1, got {steps}")
    config = open_weights(args.model).config
    large = config.num_params > LARGE_MODEL_PARAMS
    check_layers = args.check_layers or (min(2, config.num_layers) if large else config.num_layers)
    if not 1 <= check_layers <= config.num_layers:
        raise CheckpointError(f"--check-layers must lie in 1..{config.num_layers}, got {check_layers}")
    check_seq_len = args.check_seq_len or min(min(seq_lens), 2048)
    check_split(check_seq_len, devices, RING_LAYOUT)
    backends, notes = _available_backends(_parsed_list(args.backends, ("torch", "jax"), "--backends"),
                                          explicit=args.backends != "torch,jax")
    if "torch" not in backends:
        raise CheckpointError(f"the float32 reference runs on the torch backend: {INSTALL_HINT['torch']}")
    perturb = None
    if args.perturb:
        backend, _, name = args.perturb.partition(":")
        if backend not in backends or name not in parameter_shapes(config):
            raise CheckpointError(f"--perturb takes BACKEND:PARAM with a backend of {backends} and a parameter of "
                                  f"the model (e.g. torch:layers.0.attention.wq.weight), got {args.perturb!r}")
        perturb = (backend, name)
    remat = args.activation_checkpointing if args.activation_checkpointing != "auto" else ("full" if large else "off")
    return {"model": args.model, "mode": args.mode, "seq_lens": list(seq_lens), "device_counts": counts,
            "devices": devices, "steps": steps, "dtype": args.dtype or defaults["dtype"], "backends": backends,
            "attention_ablation": _parsed_list(args.ablation, ("ours", "vendor", "reference"), "--ablation"),
            "time_to_tokens": TIME_TO_TOKENS, "activation_checkpointing": remat, "check_seq_len": check_seq_len,
            "check_layers": check_layers, "bench": args.bench, "notes": notes, "perturb": perturb,
            "platform": "gpu" if gpus else "cpu"}


def check_model(settings: dict, work_dir: Path) -> str:
    """The model the equivalence jobs load: the model itself, or its first `check_layers` layers written as a
    converted checkpoint (the same tensors: random preset weights are drawn per tensor name)."""
    source = open_weights(settings["model"])
    if settings["check_layers"] == source.config.num_layers:
        return settings["model"]
    config = dataclasses.replace(source.config, num_layers=settings["check_layers"])
    directory = work_dir / "check-model"
    write_converted_checkpoint({name: source.tensor(name) for name in parameter_shapes(config)}, config, directory)
    return str(directory)


def plan_jobs(settings: dict, check_model_path: str, trace_dir: Path) -> list[J.Job]:
    """Equivalence jobs (the torch float32 reference on one device first), then benchmark points: every backend x
    context length x device count with our kernels, and the ablation at the largest device count."""
    devices, mode, steps = settings["devices"], settings["mode"], settings["steps"]
    eq = {"kind": "equivalence", "model": check_model_path, "seq_len": settings["check_seq_len"], "dtype": "fp32",
          "mode": mode, "steps": steps}
    jobs = [J.Job(id="reference-equivalence", backend="torch", devices=1, attention="reference",
                  attention_backend="reference", **eq)]
    perturb_backend, perturb_name = settings["perturb"] or (None, None)
    for backend in settings["backends"]:
        jobs.append(J.Job(id=f"{backend}-equivalence", backend=backend, devices=devices, attention="ours",
                          attention_backend=KERNELS[backend]["ours"],
                          perturb=perturb_name if backend == perturb_backend else None, **eq))
    if not settings["bench"]:
        return jobs
    for backend in settings["backends"]:
        for seq_len in settings["seq_lens"]:
            points = [(count, "ours") for count in settings["device_counts"]]
            points += [(devices, a) for a in settings["attention_ablation"] if a != "ours"]
            for count, attention in points:
                traced = count == devices and attention == "ours"
                jobs.append(J.Job(id=f"{backend}-s{seq_len}-d{count}-{attention}", kind="bench", backend=backend,
                                  model=settings["model"], seq_len=seq_len, devices=count, attention=attention,
                                  attention_backend=KERNELS[backend][attention], dtype=settings["dtype"], mode=mode,
                                  steps=steps, remat=settings["activation_checkpointing"],
                                  trace_dir=str(trace_dir) if traced else None))
    return jobs


# --- launching --------------------------------------------------------------------------------------------------

def _launcher(backend: str, devices: int, platform: str) -> tuple[list[str], dict[str, str]]:
    if backend == "torch":
        launcher, env = torchrun_launcher(devices)
        return [*launcher, "-m", "compare.worker_torch"], env | {"PYTHONUNBUFFERED": "1"}
    env = host_devices_env(devices) if platform == "cpu" else dict(os.environ)
    return [sys.executable, "-m", "compare.worker_jax"], env | {"PYTHONUNBUFFERED": "1"}


def _stop(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _failure_reason(log_tail: str) -> str | None:
    """The last exception line of a worker's log (a rank's own error, not torchrun's summary of it)."""
    lines = [line.partition("]: ")[2] if line.startswith("[rank") else line for line in log_tail.splitlines()]
    errors = [line.strip() for line in lines
              if re.match(r"\s*[\w.]*(Error|Exception|RESOURCE_EXHAUSTED)\b", line) and "ChildFailedError" not in line]
    if errors:
        return errors[-1][:500]
    if re.search(r"exitcode\s*:\s*-9\b", log_tail):
        return "a worker was killed by SIGKILL (the host out of memory?)"
    return None


def _record_not_run(jobs: list[J.Job], work_dir: Path, on_done) -> None:
    for job in jobs:
        J.write_result(work_dir, job, {"status": "timeout", "message": "not run: --time-limit-s reached"})
        on_done(job)


def run_launch(jobs: list[J.Job], command: list[str], env: dict[str, str], work_dir: Path, log: Path,
               timeout_s: float, on_done, deadline: float = math.inf) -> None:
    """Runs `jobs` through the worker `command`, relaunching after a failure with the jobs left. A job that was
    running when its launch failed gets status oom / error / timeout from the log; if a launch fails before any
    job started, every job left gets the error. At `deadline` (time.monotonic) the launch is stopped and the jobs
    left are recorded as not run. `on_done(job)` after each job's result appears."""
    remaining = list(jobs)
    while remaining:
        if time.monotonic() > deadline:
            _record_not_run(remaining, work_dir, on_done)
            return
        job_file = work_dir / f"jobs-{remaining[0].id}.json"
        J.write_job_file(job_file, remaining, work_dir)
        offset = log.stat().st_size if log.exists() else 0
        with open(log, "a") as out:
            process = subprocess.Popen([*command, str(job_file)], stdout=out, stderr=subprocess.STDOUT, env=env,
                                       start_new_session=True)
            timed_out, last = False, time.monotonic()
            while process.poll() is None:
                time.sleep(0.2)
                finished = [j for j in remaining if J.read_result(work_dir, j.id) is not None]
                for job in finished:
                    on_done(job)
                    remaining.remove(job)
                    last = time.monotonic()
                if time.monotonic() - last > timeout_s or time.monotonic() > deadline:
                    timed_out = True
                    _stop(process)
        for job in [j for j in remaining if J.read_result(work_dir, j.id) is not None]:
            on_done(job)
            remaining.remove(job)
        if not remaining:
            return
        with open(log) as text:
            text.seek(offset)
            tail = text.read()[-3000:]
        running = [j for j in remaining if J.started(work_dir, j.id)]
        failed = running[:1] if running else list(remaining)
        status = "timeout" if timed_out else ("oom" if J.is_out_of_memory(tail) else "error")
        silent = "stopped at --time-limit-s" if time.monotonic() > deadline else f"no progress for {timeout_s:.0f} s"
        message = (silent if timed_out else _failure_reason(tail) or
                   f"worker exited with code {process.returncode}") + f" (log: work/logs/{log.name})"
        for job in failed:
            J.write_result(work_dir, job, {"status": status, "message": message})
            on_done(job)
            remaining.remove(job)


def run_jobs(jobs: list[J.Job], settings: dict, work_dir: Path, timeout_s: float, on_done,
             deadline: float = math.inf) -> None:
    """Vendor kernels off-GPU are recorded as unsupported; torch jobs run in one launch per device count (ranks
    = devices), JAX jobs in one process each (its peak-memory counter cannot be reset between jobs)."""
    logs = work_dir / "logs"
    logs.mkdir(exist_ok=True)
    runnable = []
    for job in jobs:
        if job.attention == "vendor" and settings["platform"] == "cpu":
            J.write_result(work_dir, job, {"status": "unsupported",
                                           "message": f"{job.attention_backend} needs a CUDA GPU"})
            on_done(job)
        else:
            runnable.append(job)
    groups: list[tuple[str, int, list[J.Job]]] = []
    for job in runnable:
        if job.backend == "torch" and groups and groups[-1][0] == "torch" and groups[-1][1] == job.devices:
            groups[-1][2].append(job)
        else:
            groups.append((job.backend, job.devices, [job]))
    for backend, devices, group in groups:
        launch_devices = devices if backend == "torch" else settings["devices"]
        command, env = _launcher(backend, launch_devices, settings["platform"])
        run_launch(group, command, env, work_dir, logs / f"{backend}-{devices}.log", timeout_s, on_done, deadline)


def order_for_launches(jobs: list[J.Job]) -> list[J.Job]:
    """The reference first, then the rest with torch jobs grouped by device count (one launch each)."""
    return sorted(jobs, key=lambda j: (j.id != "reference-equivalence", j.kind != "equivalence",
                                       j.backend != "torch", j.devices if j.backend == "torch" else 0))


# --- the command ------------------------------------------------------------------------------------------------

def _default_out(model: str) -> Path:
    return Path("out") / f"compare-{Path(model).name}-{datetime.datetime.now():%Y%m%d-%H%M%S}"


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out} exists and is not empty; refusing to overwrite it")


def _summary_table(report: dict):
    from rich.table import Table

    table = Table(title=f"twinflash compare: {report['model']['name']}, {report['settings']['mode']}")
    for column in ("backend", "S", "devices", "attention", "status", "tokens/s", "TFLOP/s/dev", "MFU", "peak GiB",
                   "scaling"):
        table.add_column(column, justify="right")

    def show(value, fmt):
        return "-" if value is None else fmt.format(value)

    for p in report["benchmark"]["points"]:
        table.add_row(p["backend"], str(p["seq_len"]), str(p["devices"]), p["attention"], p["status"],
                      show(p["tokens_per_s"], "{:,.0f}"), show(p["tflops_per_device"], "{:.3g}"),
                      show(p["mfu"] and 100 * p["mfu"], "{:.1f}%"),
                      show(p["peak_memory_bytes"] and p["peak_memory_bytes"] / 2**30, "{:.2f}"),
                      show(p["scaling_efficiency"], "{:.2f}"))
    return table


def run_command(args: argparse.Namespace, argv: list[str]) -> int:
    """`twinflash compare` after argument parsing; raises CheckpointError for bad input."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from compare.report import load_peers, write_report
    from compare.report_data import add_scaling, benchmark_point, report_dict

    settings = plan_settings(args, _gpu_count())
    out = (args.out or _default_out(args.model)).resolve()
    _check_out(out)
    if args.job_timeout_s <= 0 or (args.time_limit_s is not None and args.time_limit_s <= 0):
        raise CheckpointError("--job-timeout-s and --time-limit-s must be > 0")
    deadline = math.inf if args.time_limit_s is None else time.monotonic() + args.time_limit_s
    settings["out"] = out
    work_dir, trace_dir = out / "work", out / "traces"
    work_dir.mkdir(parents=True, exist_ok=True)
    trace_dir.mkdir(exist_ok=True)
    console = Console(stderr=True)
    for note in settings["notes"]:
        console.print(f"[yellow]note:[/] {note}")
    jobs = order_for_launches(plan_jobs(settings, check_model(settings, work_dir), trace_dir))
    progress = Progress(TextColumn("[bold]compare[/]"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[last]}"), TimeElapsedColumn(), console=console)
    task = progress.add_task("jobs", total=len(jobs), last="")

    def on_done(job: J.Job) -> None:
        result = J.read_result(work_dir, job.id)
        progress.update(task, advance=1, last=f"{job.id}: {result['status']}")
        timing = f", step {result['step_s']:.3f} s" if result.get("step_s") else ""
        progress.console.print(f"{job.id}: {result['status']}{timing} {(result.get('message') or '')[:160]}")

    with progress:
        run_jobs(jobs, settings, work_dir, args.job_timeout_s, on_done, deadline)

    config = open_weights(settings["model"]).config
    results = {job.id: J.read_result(work_dir, job.id) for job in jobs}
    loaded = {}
    failures = []
    for job in jobs:
        if job.kind == "equivalence":
            name = job.id.removesuffix("-equivalence")
            if results[job.id]["status"] == "ok":
                loaded[name] = load_equivalence(work_dir, job.id, results[job.id])
            else:
                failures.append(f"{job.id}: {results[job.id]['status']}: {results[job.id].get('message')}")
    if failures:
        equivalence = {"seq_len": settings["check_seq_len"], "devices": settings["devices"],
                       "layers": settings["check_layers"], "dtype": "fp32", "reference": REFERENCE, "passed": False,
                       "comparisons": [], "loss_curves": {}, "failures": failures}
    else:
        equivalence = equivalence_section(loaded, seq_len=settings["check_seq_len"], devices=settings["devices"],
                                          layers=settings["check_layers"], reference_description=REFERENCE)
    points = [benchmark_point(job, results[job.id], config, settings) for job in jobs if job.kind == "bench"]
    add_scaling(points)
    report = report_dict(settings=settings, config=config, equivalence=equivalence, points=points,
                         peers=load_peers(), argv=argv)
    write_report(report, out)
    for tensors in work_dir.glob("*.safetensors"):  # logits and gradients: large, and summarised in the report
        tensors.unlink()
    console.print(_summary_table(report))
    verdict = "[green]PASSED[/]" if report["passed"] else "[red]FAILED[/]"
    console.print(f"equivalence {verdict}; report: {out / 'report.md'} (also report.html, report.json)")
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
    for failure in equivalence.get("failures", []):
        console.print(f"  [red]{failure[:300]}[/]")
    return 0 if report["passed"] else EXIT_MISMATCH


REFERENCE = ("torch_impl's Llama on one device in float32 with plain attention math (torch_impl/attention.py), "
             "itself checked against Hugging Face transformers in tests/test_model.py")
