"""The bf16 noise floor of `twinflash compare --mode train` in bf16: how far two correct bf16 trainings drift apart
through rounding alone, beside how far torch and JAX drift apart. Owns the runs (which trainings, their arguments
and time bounds; each is a `twinflash train` of its own, so it trains exactly as a user's run does, with the
default optimizer settings of `weights.schedule.default_optimizer`), the arithmetic on their per-step losses and
the verdict; `compare/report/noise_floor.py` renders it.

Runs (the same model, weights, text batches and optimizer; bf16 compute; fsdp=1 x sp=min(devices, 2)):
  <backend>-ours       our kernels (torch triton, JAX pallas)
  <backend>-<floor>    the same backend with a correct but different attention kernel: the vendor's (torch
                       sdpa_cudnn, JAX cudnn) on GPUs; off-GPU, where no vendor kernel runs, the plain-math reference
Pairs:
  noise floor          <backend>-ours vs <backend>-<floor>, per backend: what bf16 rounding alone, amplified by
                       training, moves the loss by
  cross                torch-ours vs jax-ours
Per pair and step: relative difference |a - b| / ((|a| + |b|) / 2); its max, mean and final value over the steps.
ratio = mean(cross) / mean(floor), the floor being the larger of the backends' floors (the mean: the max and the
final value are single steps of chaotic trajectories), and never below `FLOOR_MIN` (kernels that agree bit for bit
give a zero floor). Verdict "consistent with bf16 noise" when ratio <= `RATIO_LIMIT`.

The verdict is reported beside the float32 checks, not folded into the exit code: a ratio of two 50-step trainings
is a statistic of chaotic trajectories with a spread of its own, not a bound on arithmetic; the float32 checks are
that bound. `--perturb BACKEND:PARAM` applies here too: both runs of that backend load the weights with one
parameter scaled (so its floor stays clean and only the cross pair moves): the negative control of the verdict.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

from compare.args import integer, lengths, number
from compare.harness import jobs as J
from compare.harness.plan import KERNELS
from compare.launch import failure_reason, owned_process
from weights import LlamaConfig, open_weights, write_converted_checkpoint
from weights.layout import check_split
from weights.parallel import RING_LAYOUT
from weights.schedule import default_optimizer

RATIO_LIMIT = (1.5, "mean relative difference of torch vs JAX over that of one backend with another correct "
                    "attention kernel: both are bf16 rounding amplified by training, so a correct pair of stacks "
                    "drifts apart about as far as the floor; 1.5 leaves room for the spread of one pair of "
                    "chaotic trajectories, while a real mistake (a weight scaled by 1 %, tests/test_noise_floor.py) "
                    "moves the ratio by far more")
FLOOR_MIN = 1e-6  # relative: a few float32 roundings of the loss; two runs closer than that are one run
SPLIT = 2  # the runs' sp: the ring's merge is in play; at most this many devices, so the runs fit any box
DEFAULTS = {"gpu": {"seq_len": 8192, "steps": 50, "run_limit_s": 300.0},
            "cpu": {"seq_len": 128, "steps": 10, "run_limit_s": 900.0}}
FLOOR_ATTENTION = {"gpu": "vendor", "cpu": "reference"}
SEED = 0  # the compare jobs' seed: the same preset weights as the equivalence jobs


@dataclasses.dataclass(frozen=True)
class Run:
    """One bf16 training of the noise floor: `attention` is the harness's kernel family, `kernel` the backend's."""

    name: str
    backend: str
    attention: str
    kernel: str


def _length(text: str) -> int:
    values = lengths(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"expected one length like 8192 or 8k, got {text!r}")
    return values[0]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The noise floor's options of `twinflash compare` (it runs in train mode when the dtype is bf16)."""
    gpu, cpu = DEFAULTS["gpu"], DEFAULTS["cpu"]
    parser.add_argument("--noise-floor-steps", type=integer(0), help="steps of each bf16 noise-floor training "
                        f"(0: none; default {gpu['steps']} on GPUs, {cpu['steps']} on CPU). It runs with --mode "
                        "train and a bf16 --dtype (the default on GPUs; on CPU pass --dtype bf16): torch and JAX "
                        "with our kernels and with the vendor's (CPU: the reference), fsdp=1 x sp=min(devices, 2)")
    parser.add_argument("--noise-floor-seq-len", type=_length, help="context length of the noise-floor trainings "
                        f"(default {gpu['seq_len'] // 1024}k on GPUs, {cpu['seq_len']} on CPU)")
    parser.add_argument("--noise-floor-run-limit-s", type=number(0, above=True), help="each noise-floor training "
                        f"is stopped after this long (default {gpu['run_limit_s']:.0f} s on GPUs, "
                        f"{cpu['run_limit_s']:.0f} s on CPU)")


def plan(args: argparse.Namespace, settings: dict) -> dict | None:
    """The noise floor's settings (validated), or None when it does not run (forward mode, fp32, 0 steps)."""
    defaults = DEFAULTS[settings.platform]
    steps = defaults["steps"] if args.noise_floor_steps is None else args.noise_floor_steps
    if settings.mode != "train" or settings.dtype != "bf16" or steps == 0:
        return None
    seq_len = args.noise_floor_seq_len or defaults["seq_len"]
    devices = min(settings.devices, SPLIT)
    check_split(seq_len, devices, RING_LAYOUT)
    alternative = FLOOR_ATTENTION[settings.platform]
    runs = [Run(f"{backend}-{attention}", backend, attention, KERNELS[backend][attention])
            for backend in settings.backends for attention in ("ours", alternative)]
    return {"seq_len": seq_len, "devices": devices, "steps": steps, "runs": runs,
            "run_limit_s": args.noise_floor_run_limit_s or defaults["run_limit_s"]}


# --- the runs ---------------------------------------------------------------------------------------------------

def _perturbed_model(model: str, name: str, directory: Path) -> str:
    """`model` written as a converted checkpoint with parameter `name` scaled by 1 + PERTURBATION."""
    source = open_weights(model, SEED)
    tensors = {n: source.tensor(n) for n in source.names()}
    tensors[name] = tensors[name] * (1 + J.PERTURBATION)
    write_converted_checkpoint(tensors, source.config, directory)
    return str(directory)


def train_argv(run: Run, model: str, floor: dict, out: Path) -> list[str]:
    """The `twinflash train` command line of `run` (after `python -m compare.cli`)."""
    return ["train", "--backend", run.backend, "--attention-backend", run.kernel, "--model", model,
            "--seq-len", str(floor["seq_len"]), "--steps", str(floor["steps"]),
            "--mesh", f"fsdp=1,sp={floor['devices']}", "--dtype", "bf16", "--data", "text", "--seed", str(SEED),
            "--out", str(out)]


def _environment(devices: int, platform: str) -> dict[str, str]:
    """This process's environment, on GPUs showing the runs only the first `devices` GPUs (`twinflash train`
    takes a mesh of all the devices it sees)."""
    env = dict(os.environ)
    if platform == "gpu":
        visible = env.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(devices)]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[:devices])
    return env


def _losses(out: Path) -> list[float]:
    path = out / "train.jsonl"
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()] if path.exists() else []


def _train(run: Run, model: str, floor: dict, work_dir: Path, deadline: float, platform: str) -> dict:
    """One training, stopped at its time limit or the command's deadline: its record for the report."""
    out, log = work_dir / "noise-floor" / run.name, work_dir / "logs" / f"noise-floor-{run.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    stop_at = min(deadline, began + floor["run_limit_s"])
    with open(log, "w") as sink, owned_process([sys.executable, "-m", "compare.cli",
                                                *train_argv(run, model, floor, out)],
                                               stdout=sink, stderr=sink,
                                               env=_environment(floor["devices"], platform)) as process:
        while process.poll() is None and time.monotonic() < stop_at:
            time.sleep(0.5)
        timed_out = process.poll() is None
    losses, seconds = _losses(out), time.monotonic() - began
    record = {"name": run.name, "backend": run.backend, "attention": run.attention, "kernel": run.kernel,
              "losses": losses, "seconds": seconds, "status": "ok", "message": None}
    if timed_out or process.returncode != 0 or len(losses) < floor["steps"]:
        tail = log.read_text(errors="replace")[-3000:]
        record["status"] = "timeout" if timed_out else "oom" if J.is_out_of_memory(tail) else "error"
        why = (f"stopped after {seconds:.0f} s (--noise-floor-run-limit-s or --time-limit-s)" if timed_out
               else failure_reason(tail) or f"exited with code {process.returncode}")
        record["message"] = f"{why}; {len(losses)} of {floor['steps']} steps (log: work/logs/{log.name})"
    return record


def run_trainings(floor: dict, settings: dict, model: str, work_dir: Path, deadline: float, on_done) -> list[dict]:
    """Every run of `plan`'s, one after the other; `on_done(record)` after each. With `settings.perturb`,
    both runs of the perturbed backend load the perturbed weights."""
    perturbed = None
    if settings.perturb:
        backend, name = settings.perturb
        perturbed = (backend, _perturbed_model(model, name, work_dir / "noise-floor-perturbed-model"))
    records = []
    for run in floor["runs"]:
        run_model = perturbed[1] if perturbed and perturbed[0] == run.backend else model
        records.append(_train(run, run_model, floor, work_dir, deadline, settings.platform))
        on_done(records[-1])
    return records


# --- the arithmetic ---------------------------------------------------------------------------------------------

def relative_differences(a: list[float], b: list[float]) -> list[float]:
    """Per step of the steps both have: |a - b| / ((|a| + |b|) / 2); inf where a loss is not finite."""
    diffs = []
    for x, y in zip(a, b):
        if not (math.isfinite(x) and math.isfinite(y)):
            diffs.append(math.inf)
        else:
            scale = (abs(x) + abs(y)) / 2
            diffs.append(abs(x - y) / scale if scale > 0 else 0.0)
    return diffs


def compare_curves(name: str, kind: str, a: str, b: str, losses: dict[str, list[float]]) -> dict:
    """One pair of the section: per-step relative differences of runs `a` and `b` and their max / mean / final."""
    diffs = relative_differences(losses[a], losses[b])
    return {"name": name, "kind": kind, "a": a, "b": b, "steps": len(diffs), "relative_differences": diffs,
            "max": max(diffs) if diffs else None, "mean": sum(diffs) / len(diffs) if diffs else None,
            "final": diffs[-1] if diffs else None}


def _pairs(records: list[dict]) -> list[tuple[str, str, str, str]]:
    """(name, kind, a, b) of every pair whose two runs both finished."""
    done = {r["name"]: r for r in records if r["status"] == "ok" and r["losses"]}
    pairs = []
    for backend in ("torch", "jax"):
        ours = f"{backend}-ours"
        for other in (r["name"] for r in records if r["backend"] == backend and r["attention"] != "ours"):
            if ours in done and other in done:
                pairs.append((f"{backend} noise floor: ours vs {done[other]['attention']} "
                              f"({done[ours]['kernel']} vs {done[other]['kernel']})", "floor", ours, other))
    if "torch-ours" in done and "jax-ours" in done:
        pairs.append(("torch vs jax, our kernels", "cross", "torch-ours", "jax-ours"))
    return pairs


def verdict(pairs: list[dict]) -> dict:
    """The ratio of the cross pair's mean difference to the noise floor's, and what it says."""
    floors = [p for p in pairs if p["kind"] == "floor" and p["mean"] is not None]
    cross = next((p for p in pairs if p["kind"] == "cross" and p["mean"] is not None), None)
    limit, why = RATIO_LIMIT
    base = {"ratio": None, "ratio_limit": limit, "consistent": None, "floor_pair": None, "floor": None,
            "why": why}
    if not floors or cross is None:
        missing = "a noise floor" if not floors else "the torch vs jax pair"
        return {**base, "verdict": f"not measured: {missing} did not run to the end (see the runs)"}
    floor = max(floors, key=lambda p: p["mean"])
    ratio = cross["mean"] / max(floor["mean"], FLOOR_MIN)
    consistent = ratio <= limit
    words = "consistent with bf16 noise" if consistent else "larger than bf16 noise"
    return {**base, "ratio": ratio, "consistent": consistent, "floor_pair": floor["name"], "floor": floor["mean"],
            "verdict": f"{words}: ratio {ratio:.2f} {'within' if consistent else 'above'} {limit}"}


def noise_floor_section(floor: dict, records: list[dict], config: LlamaConfig) -> dict:
    """report.json's equivalence.bf16 from `plan`'s settings, `run_trainings`' records and the runs' model."""
    losses = {r["name"]: r["losses"] for r in records}
    pairs = [compare_curves(name, kind, a, b, losses) for name, kind, a, b in _pairs(records)]
    optimizer = default_optimizer(config.hidden_size, floor["steps"])
    return {"dtype": "bf16", "seq_len": floor["seq_len"], "devices": floor["devices"], "steps": floor["steps"],
            "data": "text", "seed": SEED, "layers": config.num_layers,
            "optimizer": {"lr": optimizer.lr, "warmup_steps": optimizer.warmup_steps,
                          "min_lr_ratio": optimizer.min_lr_ratio},
            "floor_min": FLOOR_MIN, "runs": records, "pairs": pairs, **verdict(pairs)}


def run_noise_floor(floor: dict | None, settings: dict, model: str, work_dir: Path, deadline: float,
                    say) -> dict | None:
    """The whole bf16 section (None when `plan` said it does not run); `say(line)` reports each run's end."""
    if floor is None:
        return None

    def on_done(record: dict) -> None:
        final = f", final loss {record['losses'][-1]:.4g}" if record["losses"] else ""
        say(f"noise-floor {record['name']}: {record['status']} in {record['seconds']:.0f} s{final} "
            f"{record['message'] or ''}")

    records = run_trainings(floor, settings, model, work_dir, deadline, on_done)
    section = noise_floor_section(floor, records, open_weights(model, SEED).config)
    say(f"bf16 noise floor: {section['verdict']}")
    return section
