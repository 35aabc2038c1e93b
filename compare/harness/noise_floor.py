"""The bf16 noise floor of `twinflash compare --mode train` in bf16: how far two correct bf16 trainings drift apart
through rounding alone, beside how far torch and JAX drift apart. Owns the runs (which trainings, with which
arguments: each is a "curve" job of the compare run, `compare/harness/jobs.py`, executed by the worker of its
backend in the launch of its device count next to the benchmark points of the same shape, so that it reuses that
launch's process, the run's weights and the compiled step; it trains exactly as `twinflash train --data text
--seed 0 --mesh fsdp=1,sp=N --dtype bf16 --steps STEPS` does, with the default optimizer settings of
`weights.schedule.default_optimizer`), the arithmetic on their per-step losses and the verdict;
`compare/report/noise_floor.py` renders it.

Runs (the same model, weights, text batches and optimizer; bf16 compute; fsdp=1 x sp=min(devices, 2)):
  <backend>-ours       our kernels (torch triton, JAX pallas)
  <backend>-<floor>    the same backend with a correct but different attention kernel: the vendor's (torch
                       sdpa_cudnn, JAX cudnn) on GPUs; off-GPU, where no vendor kernel runs, the plain-math reference
  <backend>-ours-fp8   with `--precisions ...,fp8` only: <backend>-ours with FP8 linears (`twinflash train --fp8`),
                       the precision section's loss curve beside <backend>-ours (compare/report/precision.py); no
                       part of the floor's pairs, runs table or plot
Pairs: all six of the four runs (torch and JAX, each with ours and with the other kernel):
  floor                <backend>-ours vs <backend>-<floor>, per backend: what bf16 rounding alone, amplified by
                       training, moves the loss by (if both kernels are right)
  cross                torch-ours vs jax-ours: what the verdict is about
  vendor cross         torch-<floor> vs jax-<floor>: two frameworks, the vendor's kernels in both
  mixed                torch-ours vs jax-<floor>, torch-<floor> vs jax-ours
Per pair and step: relative difference |a - b| / ((|a| + |b|) / 2); its max, mean and final value over the steps
(the report shows the means as a matrix). The floor is the smaller of the two within-backend floors, or the vendor
runs' cross-framework difference where that is larger (`FLOOR_WHY`): a backend whose own kernel is wrong inflates
its own floor, so the larger floor would hide it (issue 33: JAX's wrong ring gradients made its floor 4.7 % against
torch's 0.05 %, and divided by that, torch vs JAX read "ratio 0.97"). An outlier is a run whose mean differences
to each of the other three all exceed `OUTLIER_FACTOR` x the floor: the verdict names it ("jax-ours differs from the
other three runs"). ratio = mean(cross) / floor (the mean: the max and the final value are single steps of chaotic
trajectories; the floor never below `FLOOR_MIN`: kernels that agree bit for bit give a zero floor). Verdict
"consistent with bf16 noise" when no run is an outlier and ratio <= `RATIO_LIMIT`.

The verdict is reported beside the float32 checks and the fast path, not folded into the exit code: a ratio of two
50-step trainings is a statistic of chaotic trajectories with a spread of its own, not a bound on arithmetic; the
float32 checks and the fast path (compare/harness/fastpath.py) are that bound. `--perturb` applies here too
(compare/harness/perturb.py): a weight's, to both runs of that backend (so its floor stays clean and only the
cross pair moves); an attention perturbation, to that backend's run of our kernels, which the verdict names when
the error moves training beyond bf16 noise (tests/test_noise_floor.py: out x 1.1 does, 10x the floor; a 1 % scale
of one output does not, and is the fast path's to catch). A run that fails, runs out of memory or is stopped is recorded like any job (`launches.py`) and leaves its
pairs out ("not measured" when no floor or no cross pair is left).
"""

from __future__ import annotations

import argparse
import dataclasses
import math

from compare.args import integer, lengths
from compare.harness import jobs as J
from compare.harness.plan import KERNELS, CompareSettings, fp8_skip
from weights import LlamaConfig
from weights.fp8 import check_fp8_settings
from weights.layout import check_split
from weights.parallel import RING_LAYOUT
from weights.schedule import default_optimizer

RATIO_LIMIT = (1.5, "mean relative difference of torch vs JAX over the floor: both are bf16 rounding amplified by "
                    "training, so a correct pair of stacks drifts apart about as far as the floor; 1.5 leaves room "
                    "for the spread of one pair of chaotic trajectories, while a real mistake (a weight scaled by "
                    "1 %, tests/test_noise_floor.py) moves the ratio by far more")
OUTLIER_FACTOR = (3.0, "a run is an outlier when its mean difference to each of the other three runs exceeds 3x the "
                       "floor: correct runs sit within ~1-1.5x the floor of each other (RATIO_LIMIT's spread), so 3x "
                       "to all three at once is one run off on its own, and the other three agree without it")
FLOOR_WHY = ("the smaller within-backend floor, because a backend whose own kernel is wrong inflates its own floor "
             "(the larger floor would hide the very error it measures); but never below the two vendor runs' "
             "cross-framework difference, which measures how far two correct frameworks drift apart on their own")
FLOOR_MIN = 1e-6  # relative: a few float32 roundings of the loss; two runs closer than that are one run
SPLIT = 2  # the runs' sp: the ring's merge is in play; at most this many devices, so the runs fit any box
DEFAULTS = {"gpu": {"seq_len": 8192, "steps": 50}, "cpu": {"seq_len": 128, "steps": 10}}
FLOOR_ATTENTION = {"gpu": "vendor", "cpu": "reference"}
SEED = 0  # the compare jobs' seed: the same preset weights as the equivalence jobs
JOB_PREFIX = "noise-floor-"  # a run's job id: this and the run's name


@dataclasses.dataclass(frozen=True)
class Run:
    """One bf16 training of the noise floor: `attention` is the harness's kernel family, `kernel` the backend's."""

    name: str
    backend: str
    attention: str
    kernel: str
    fp8: bool = False


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
                        "with our kernels and with the vendor's (CPU: the reference), fsdp=1 x sp=min(devices, 2), "
                        "each a job of the run (bounded by --job-timeout-s) that trains as `twinflash train --data "
                        "text --seed 0` does")
    parser.add_argument("--noise-floor-seq-len", type=_length, help="context length of the noise-floor trainings "
                        f"(default {gpu['seq_len'] // 1024}k on GPUs, {cpu['seq_len']} on CPU)")


def plan(args: argparse.Namespace, settings: CompareSettings) -> dict | None:
    """The noise floor's settings (validated), or None when it does not run (forward mode, fp32, 0 steps)."""
    defaults = DEFAULTS[settings.platform]
    steps = defaults["steps"] if args.noise_floor_steps is None else args.noise_floor_steps
    if settings.mode != "train" or settings.dtype != "bf16" or steps == 0:
        return None
    seq_len = args.noise_floor_seq_len or defaults["seq_len"]
    devices = min(settings.devices, SPLIT)
    check_split(seq_len, devices, RING_LAYOUT)
    check_fp8_settings("fp8" in settings.precisions, settings.dtype, seq_len // devices)
    alternative = FLOOR_ATTENTION[settings.platform]
    runs = [Run(f"{backend}-{attention}", backend, attention, KERNELS[backend][attention])
            for backend in settings.backends for attention in ("ours", alternative)]
    if "fp8" in settings.precisions:
        runs += [Run(f"{backend}-ours-fp8", backend, "ours", KERNELS[backend]["ours"], fp8=True)
                 for backend in settings.backends]
    return {"seq_len": seq_len, "devices": devices, "steps": steps, "runs": runs}


# --- the runs ---------------------------------------------------------------------------------------------------

def plan_jobs(floor: dict | None, settings: CompareSettings, model: str) -> list[J.Job]:
    """The curve jobs of `plan`'s runs on `model` (none when the floor does not run); with `settings.perturb`, the
    runs it applies to carry it (module docstring); an FP8 run that cannot run here is skipped with its
    reason (`plan.fp8_skip`)."""
    if floor is None:
        return []
    return [J.Job(id=f"{JOB_PREFIX}{run.name}", kind="curve", backend=run.backend, model=model,
                  seq_len=floor["seq_len"], devices=floor["devices"], attention=run.attention,
                  attention_backend=run.kernel, dtype="bf16", mode="train", steps=floor["steps"], seed=SEED,
                  perturb=settings.perturb and settings.perturb.for_job(run.backend, "curve", run.attention, "bf16"),
                  fp8=run.fp8,
                  skip=fp8_skip(run.backend) if run.fp8 else None)
            for run in floor["runs"]]


def run_record(job: J.Job, result: dict) -> dict:
    """The report's record of one run from its curve job and that job's result."""
    losses = result.get("losses") or []
    record = {"name": job.id.removeprefix(JOB_PREFIX), "backend": job.backend, "attention": job.attention,
              "kernel": job.attention_backend, "losses": losses, "seconds": result.get("seconds") or 0.0,
              "status": result["status"], "message": result.get("message")}
    if record["status"] == "ok" and len(losses) < job.steps:  # a worker that ended a curve early is a bug: shown
        record.update(status="error", message=f"{len(losses)} of {job.steps} steps recorded")
    elif record["status"] != "ok":
        record["message"] = f"{record['message'] or 'no message'}; {len(losses)} of {job.steps} steps"
    return record


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


def _pair_kind(a: dict, b: dict) -> str:
    if a["backend"] == b["backend"]:
        return "floor"
    if a["attention"] == b["attention"]:
        return "cross" if a["attention"] == "ours" else "vendor cross"
    return "mixed"


def _pair_name(kind: str, a: dict, b: dict) -> str:
    if kind == "floor":
        return f"{a['backend']} noise floor: ours vs {b['attention']} ({a['kernel']} vs {b['kernel']})"
    if kind in ("cross", "vendor cross"):
        return f"torch vs jax, {'our' if kind == 'cross' else 'the ' + a['attention']} kernels"
    return f"{a['name']} vs {b['name']}"


def _pairs(records: list[dict]) -> list[tuple[str, str, str, str]]:
    """(name, kind, a, b) of every pair of finished runs (at most six: floors, cross, vendor cross, mixed)."""
    done = sorted((r for r in records if r["status"] == "ok" and r["losses"]),
                  key=lambda r: (r["backend"] != "torch", r["attention"] != "ours"))  # torch first, ours first
    rank = {"floor": 0, "cross": 1, "vendor cross": 2, "mixed": 3}
    pairs = [(_pair_name(_pair_kind(a, b), a, b), _pair_kind(a, b), a["name"], b["name"])
             for i, a in enumerate(done) for b in done[i + 1:]]
    return sorted(pairs, key=lambda p: rank[p[1]])


def _outliers(pairs: list[dict], floor: float) -> tuple[list[str], dict[str, float]]:
    """The runs whose differences to each of three others all exceed OUTLIER_FACTOR x `floor`, and each run's
    smallest difference to another."""
    nearest: dict[str, list[float]] = {}
    for p in pairs:
        for run in (p["a"], p["b"]):
            nearest.setdefault(run, []).append(p["mean"])
    limit = OUTLIER_FACTOR[0] * floor
    outliers = [run for run, means in nearest.items() if len(means) == 3 and min(means) > limit]
    return outliers, {run: min(means) for run, means in nearest.items()}


def verdict(pairs: list[dict]) -> dict:
    """The floor (FLOOR_WHY), the runs that differ from the other three, the ratio of the cross pair's mean
    difference to the floor, and what they say."""
    measured = [p for p in pairs if p["mean"] is not None]
    floors = [p for p in measured if p["kind"] == "floor"]
    cross = next((p for p in measured if p["kind"] == "cross"), None)
    vendor = next((p for p in measured if p["kind"] == "vendor cross"), None)
    limit, why = RATIO_LIMIT
    base = {"ratio": None, "ratio_limit": limit, "consistent": None, "floor_pair": None, "floor": None, "why": why,
            "floor_why": FLOOR_WHY, "outliers": [], "outlier_factor": OUTLIER_FACTOR[0],
            "outlier_why": OUTLIER_FACTOR[1]}
    if not floors or cross is None:
        missing = "a noise floor" if not floors else "the torch vs jax pair"
        return {**base, "verdict": f"not measured: {missing} did not run to the end (see the runs)"}
    chosen = min(floors, key=lambda p: p["mean"])
    if vendor is not None and vendor["mean"] > chosen["mean"]:
        chosen = vendor
    floor = max(chosen["mean"], FLOOR_MIN)
    outliers, nearest = _outliers(measured, floor)
    ratio = cross["mean"] / floor
    consistent = ratio <= limit and not outliers
    words = [f"{run} differs from the other three runs (by at least {nearest[run] * 100:.3g} %, over "
             f"{OUTLIER_FACTOR[0]:g} x the floor {floor * 100:.3g} %)" for run in outliers]
    words.append(f"{'consistent with' if ratio <= limit else 'larger than'} bf16 noise: ratio {ratio:.2f} "
                 f"{'within' if ratio <= limit else 'above'} {limit}")
    if outliers:
        words[-1] = f"torch vs JAX {words[-1].split(': ', 1)[1]}"
    return {**base, "ratio": ratio, "consistent": consistent, "floor_pair": chosen["name"], "floor": chosen["mean"],
            "outliers": outliers, "verdict": "; ".join(words)}


def noise_floor_section(floor: dict, records: list[dict], config: LlamaConfig) -> dict:
    """report.json's equivalence.bf16 from `plan`'s settings, the runs' records (`run_record`) and their model."""
    losses = {r["name"]: r["losses"] for r in records}
    pairs = [compare_curves(name, kind, a, b, losses) for name, kind, a, b in _pairs(records)]
    optimizer = default_optimizer(config.hidden_size, floor["steps"])
    return {"dtype": "bf16", "seq_len": floor["seq_len"], "devices": floor["devices"], "steps": floor["steps"],
            "data": "text", "seed": SEED, "layers": config.num_layers,
            "optimizer": {"lr": optimizer.lr, "warmup_steps": optimizer.warmup_steps,
                          "min_lr_ratio": optimizer.min_lr_ratio},
            "floor_min": FLOOR_MIN, "runs": records, "pairs": pairs, **verdict(pairs)}
