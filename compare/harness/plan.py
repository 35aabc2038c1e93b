"""The plan of `twinflash compare`: the run's settings from the arguments (validated), the model the equivalence
jobs load, and the jobs themselves (equivalence first, then every backend x context length x device count, and the
attention ablation) in the order they launch.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
from pathlib import Path

from compare.harness import jobs as J
from weights import BadInputError, open_weights, parameter_shapes, write_converted_checkpoint
from weights.layout import check_split
from weights.parallel import RING_LAYOUT

KERNELS = {"torch": {"ours": "triton", "vendor": "sdpa_cudnn", "reference": "reference"},
           "jax": {"ours": "pallas", "vendor": "cudnn", "reference": "reference"}}
INSTALL_HINT = {"torch": "pip install 'torch>=2.11' triton (or reinstall twinflash: pip install -e .)",
                "jax": "pip install 'jax>=0.10' flax orbax-checkpoint (or reinstall twinflash: pip install -e .)"}
CPU_DEFAULTS = {"seq_lens": (128, 256), "devices": 4, "steps": 2, "dtype": "fp32"}
GPU_DEFAULTS = {"seq_lens": (8192, 32768, 131072), "steps": 4, "dtype": "bf16"}
LARGE_MODEL_PARAMS = 2e9  # above: the equivalence check keeps 2 layers and the benchmark checkpoints activations
TIME_TO_TOKENS = 1e9


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _parsed_list(text: str, choices: tuple[str, ...], flag: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in choices]
    if bad or not items:
        raise BadInputError(f"{flag} takes a comma-separated list of {', '.join(choices)}; got {text!r}")
    return items


def _available_backends(asked: list[str], explicit: bool) -> tuple[list[str], list[str]]:
    """(backends to run, notes on those skipped). A backend asked for by name that is not installed is bad input;
    one missing from the default pair is skipped with a note in the report."""
    modules = {"torch": "torch", "jax": "jax"}
    missing = [b for b in asked if importlib.util.find_spec(modules[b]) is None]
    if missing and explicit:
        raise BadInputError(f"the {missing[0]} backend is not installed: {INSTALL_HINT[missing[0]]}")
    return [b for b in asked if b not in missing], [f"{b} not installed: {INSTALL_HINT[b]}" for b in missing]


def plan_settings(args: argparse.Namespace, gpus: int) -> dict:
    """The run's settings (validated): what the report's "settings" records, plus the check model's details."""
    defaults = GPU_DEFAULTS if gpus else CPU_DEFAULTS
    devices = args.devices if args.devices is not None else (gpus or CPU_DEFAULTS["devices"])
    if devices < 1:
        raise BadInputError(f"--devices must be >= 1, got {devices}")
    if gpus and devices > gpus:
        raise BadInputError(f"asked for {devices} devices, but this machine has {gpus} GPUs")
    counts = sorted(set(args.device_counts)) if args.device_counts else \
        sorted({2 ** i for i in range(devices.bit_length()) if 2 ** i <= devices} | {devices})
    if any(c < 1 or c > devices for c in counts):
        raise BadInputError(f"--device-counts must lie in 1..{devices}, got {args.device_counts}")
    seq_lens = tuple(args.seq_lens or defaults["seq_lens"])
    for seq_len in seq_lens:
        for count in counts:
            check_split(seq_len, count, RING_LAYOUT)
    steps = args.steps if args.steps is not None else defaults["steps"]
    if steps < 1:
        raise BadInputError(f"--steps must be >= 1, got {steps}")
    config = open_weights(args.model).config
    large = config.num_params > LARGE_MODEL_PARAMS
    check_layers = args.check_layers or (min(2, config.num_layers) if large else config.num_layers)
    if not 1 <= check_layers <= config.num_layers:
        raise BadInputError(f"--check-layers must lie in 1..{config.num_layers}, got {check_layers}")
    check_seq_len = args.check_seq_len or min(min(seq_lens), 2048)
    check_split(check_seq_len, devices, RING_LAYOUT)
    backends, notes = _available_backends(_parsed_list(args.backends, ("torch", "jax"), "--backends"),
                                          explicit=args.backends != "torch,jax")
    if "torch" not in backends:
        raise BadInputError(f"the float32 reference runs on the torch backend: {INSTALL_HINT['torch']}")
    perturb = None
    if args.perturb:
        backend, _, name = args.perturb.partition(":")
        if backend not in backends or name not in parameter_shapes(config):
            raise BadInputError(f"--perturb takes BACKEND:PARAM with a backend of {backends} and a parameter of "
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


def order_for_launches(jobs: list[J.Job]) -> list[J.Job]:
    """The reference first, then the rest with torch jobs grouped by device count (one launch each)."""
    return sorted(jobs, key=lambda j: (j.id != "reference-equivalence", j.kind != "equivalence",
                                       j.backend != "torch", j.devices if j.backend == "torch" else 0))
