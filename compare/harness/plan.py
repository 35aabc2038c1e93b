"""The plan of `twinflash compare`: the run's settings from the arguments (validated, one typed `CompareSettings`),
the default sweep that fits the machine (device counts 1, 2, 4, ... up to the devices present, on CPU 1 and 4; on
GPUs the context lengths whose points fit the device's memory), the weights every job reads (generated or referenced
once per run), the up-front memory estimate that skips a point which cannot fit (recorded with its reason, not run),
and the jobs themselves grouped into launches: one torchrun launch and one JAX process per backend and device count,
each serving all of its points (equivalence first, then ours and vendor by growing length, the plain reference last;
the bf16 noise floor's curve jobs, planned by `noise_floor.py`, beside the points of their shape). The precision
axis (`--precisions bf16,fp8`, train mode, a bf16 --dtype): every benchmark point once per precision, the FP8 one
training as `twinflash train --fp8` does (job id ending in "-fp8"; the bf16 ids as without the axis); torch's FP8
points need torchao, and without it are recorded as skipped with the install command.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import itertools
import json
import time
from pathlib import Path

from compare.harness import jobs as J
from compare.harness.perturb import Perturbation
from compare.harness.perturb import parse as parse_perturbation
from weights import (BadInputError, LlamaConfig, convert_hf_checkpoint, is_hf_checkpoint, open_weights,
                     parameter_shapes, write_converted_checkpoint)
from weights.checkpoint import RandomWeights, model_config
from weights.data import BYTE_VOCAB
from weights.fp8 import INSTALL_TORCHAO, check_fp8_settings
from weights.layout import check_split
from weights.parallel import RING_LAYOUT
from weights.sequence_parallel import SCHEMES, check_heads, scheme_degrees
from weights.training import BACKENDS

KERNELS = {"torch": {"ours": "triton", "vendor": "sdpa_cudnn", "reference": "reference"},  # the attention backend
           "jax": {"ours": "pallas", "vendor": "cudnn", "reference": "reference"}}  # (ATTENTION_BACKENDS) of each role
INSTALL_HINT = {"torch": "pip install 'torch>=2.11' triton (or reinstall twinflash: pip install -e .)",
                "jax": "pip install 'jax>=0.10' flax orbax-checkpoint (or reinstall twinflash: pip install -e .)"}
# On CPU the points are no benchmark (interpreted kernels on emulated devices): one length and the device counts 1
# and `devices` show every code path (one device, the ring, the ablation) and keep the bare run near 2 minutes on 2
# cores; a 2-device point or a second length would each add ~30 s of interpreted kernels.
CPU_DEFAULTS = {"seq_lens": (128,), "devices": 4, "steps": 2, "dtype": "fp32"}
# 3 timed steps: the median of three; a 1B training step at 128k on 2 GPUs takes ~7 s, and every step more costs
# ~15 s per such point over a sweep that must fit 10 minutes
GPU_DEFAULTS = {"seq_lens": (8192, 32768, 131072), "steps": 3, "dtype": "bf16"}
LARGE_MODEL_PARAMS = 2e9  # above: the equivalence check keeps 2 layers and the benchmark checkpoints activations
MAX_CHECK_SEQ_LEN = 2048  # the checks' default length: the shortest point's, at most this (float32 logits, float64)
TIME_TO_TOKENS = 1e9
PRECISIONS = ("bf16", "fp8")  # bf16: the run's --dtype as it is; fp8: its decoder layers' linears in FP8 besides
# A point whose estimated peak exceeds the device's memory by this factor is skipped up front: the estimate tracks
# measured peaks within ~5 % (`estimated_peak_bytes`), so only points clearly out of reach are not attempted;
# the rest run and a real OOM is recorded as such.
SKIP_FACTOR = 1.1
WEIGHTS_DIR = "weights"  # under the run's work directory: the converted weights every job reads
WEIGHTS_LOG = "weights.json"  # beside it: how the weights were made (the harness writes it once per run)


@dataclasses.dataclass(frozen=True)
class CompareSettings:
    """Everything a `twinflash compare` run was asked for and decided, validated. `model` is what the user named
    (a preset or a directory); `weights` the converted checkpoint every job reads (set by `prepare_weights`)."""

    model: str
    mode: str
    seq_lens: tuple[int, ...]
    device_counts: tuple[int, ...]
    devices: int
    steps: int
    dtype: str
    backends: tuple[str, ...]
    attention_ablation: tuple[str, ...]
    activation_checkpointing: str
    check_seq_len: int
    check_layers: int
    bench: bool
    platform: str  # "gpu" or "cpu"
    notes: tuple[str, ...] = ()
    perturb: Perturbation | None = None
    device_memory_bytes: int | None = None  # per GPU; None on CPU (nothing skipped up front)
    time_to_tokens: float = TIME_TO_TOKENS
    precisions: tuple[str, ...] = ("bf16",)
    schemes: tuple[str, ...] = ("ring",)  # the ring first; the others at the most devices (`scheme_jobs`)
    ulysses_degree: int | None = None  # the hybrid's U
    out: Path | None = None
    weights: str | None = None

    def public(self) -> dict:
        """The report's "settings" (compare/report/schema.json)."""
        return {"model": self.model, "mode": self.mode, "seq_lens": list(self.seq_lens),
                "device_counts": list(self.device_counts), "devices": self.devices, "steps": self.steps,
                "dtype": self.dtype, "backends": list(self.backends),
                "attention_ablation": list(self.attention_ablation), "time_to_tokens": self.time_to_tokens,
                "precisions": list(self.precisions), "schemes": list(self.schemes),
                "ulysses_degree": self.ulysses_degree}


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_memory_bytes() -> int | None:
    """The first GPU's memory (all GPUs of a host are alike here), None without GPUs."""
    import torch

    return torch.cuda.get_device_properties(0).total_memory if gpu_count() else None


def estimated_peak_bytes(config: LlamaConfig, *, seq_len: int, devices: int, attention: str, dtype: str, mode: str,
                         remat: str) -> float:
    """Per device, one step of batch 1 over `devices` (fsdp=1, sp=devices): the float32 state (weights, and in
    training their gradients and AdamW's two moments) sharded over the devices, the activations the backward keeps
    for the device's tokens, and for the plain reference attention its score matrices. Calibrated on the
    Llama-3.2-1B shape on H200 (compare/results/compare-llama3.2-1b-2026-11-21-h200x4: measured 21.0 / 62.5 GiB
    at 32k / 128k on 4 GPUs, estimated 20.1 / 60.6); a decision aid, not a measurement."""
    compute = 2 if dtype == "bf16" else 4
    train = mode == "train"
    local = seq_len / devices
    state = config.num_params * (16 if train else 4) / devices
    per_token_layer = compute * (11 * config.hidden_size + 4 * config.intermediate_size)  # fitted, see above
    kept_layers = config.num_layers if train and remat == "off" else 1
    activations = local * per_token_layer * kept_layers
    if train and remat != "off":
        activations += local * config.num_layers * config.hidden_size * compute  # the layers' inputs
    if attention == "reference":  # scores in the compute dtype and their float32 softmax, for every key
        activations += config.num_heads * local * seq_len * (compute + 4) * kept_layers
    return state + activations + 2 * 2**30  # CUDA context, workspaces, the loss's chunk of logits


def skip_reason(config: LlamaConfig, settings: CompareSettings, *, seq_len: int, devices: int,
                attention: str) -> str | None:
    """Why a benchmark point is not attempted (its estimated peak clearly exceeds the device), or None."""
    if settings.device_memory_bytes is None:
        return None
    need = estimated_peak_bytes(config, seq_len=seq_len, devices=devices, attention=attention,
                                dtype=settings.dtype, mode=settings.mode, remat=settings.activation_checkpointing)
    if need <= SKIP_FACTOR * settings.device_memory_bytes:
        return None
    return (f"not run: estimated peak {need / 2**30:,.0f} GiB per device > {settings.device_memory_bytes / 2**30:.0f}"
            f" GiB (compare.harness.plan.estimated_peak_bytes)")


def _parsed_list(text: str, choices: tuple[str, ...], flag: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in choices]
    if bad or not items:
        raise BadInputError(f"{flag} takes a comma-separated list of {', '.join(choices)}; got {text!r}")
    return items


def _available_backends(asked: list[str], explicit: bool) -> tuple[list[str], list[str]]:
    """(backends to run, notes on those skipped). A backend asked for by name that is not installed is bad input;
    one missing from the default pair is skipped with a note in the report."""
    missing = [b for b in asked if importlib.util.find_spec(b) is None]
    if missing and explicit:
        raise BadInputError(f"the {missing[0]} backend is not installed: {INSTALL_HINT[missing[0]]}")
    return [b for b in asked if b not in missing], [f"{b} not installed: {INSTALL_HINT[b]}" for b in missing]


def _precisions(text: str, mode: str, dtype: str, seq_lens: tuple[int, ...], counts: tuple[int, ...]
                ) -> tuple[str, ...]:
    """--precisions, validated: fp8 trains (train mode) in bf16 with FP8 linears, on every point's tokens per
    device a multiple of the FP8 GEMMs' (`weights.fp8.check_fp8_settings`)."""
    precisions = tuple(dict.fromkeys(_parsed_list(text, PRECISIONS, "--precisions")))
    if "fp8" in precisions:
        if mode != "train" or dtype != "bf16":
            raise BadInputError(f"--precisions fp8 needs --mode train and --dtype bf16 (got --mode {mode}, --dtype "
                                f"{dtype}): its points train as `twinflash train --dtype bf16 --fp8` does")
        for seq_len in seq_lens:
            for count in counts:
                check_fp8_settings(True, dtype, seq_len // count)
    return precisions


def fp8_skip(backend: str) -> str | None:
    """Why a backend's FP8 jobs cannot run here (torch's need torchao, as `twinflash train --fp8` does), or None."""
    if backend == "torch" and importlib.util.find_spec("torchao") is None:
        return f"FP8 with the torch backend needs torchao: {INSTALL_TORCHAO}"
    return None


def default_check_layers(config: LlamaConfig) -> int:
    """The checks' layers by default: all, or 2 for models over LARGE_MODEL_PARAMS."""
    return min(2, config.num_layers) if config.num_params > LARGE_MODEL_PARAMS else config.num_layers


def default_device_counts(devices: int, gpus: int) -> tuple[int, ...]:
    """On GPUs 1, 2, 4, ... up to `devices`, and `devices` itself; on CPU 1 and `devices` (CPU_DEFAULTS)."""
    if not gpus:
        return tuple(sorted({1, devices}))
    return tuple(sorted({2 ** i for i in range(devices.bit_length()) if 2 ** i <= devices} | {devices}))


def plan_settings(args: argparse.Namespace, gpus: int, device_memory_bytes: int | None = None) -> CompareSettings:
    """The run's settings (validated). `gpus`: the GPUs present (0: CPU, emulated devices); `device_memory_bytes`:
    each GPU's memory, which bounds the default context lengths and skips the points that cannot fit."""
    defaults = GPU_DEFAULTS if gpus else CPU_DEFAULTS
    devices = args.devices if args.devices is not None else (gpus or CPU_DEFAULTS["devices"])
    if devices < 1:
        raise BadInputError(f"--devices must be >= 1, got {devices}")
    if gpus and devices > gpus:
        raise BadInputError(f"asked for {devices} devices, but this machine has {gpus} GPUs")
    counts = tuple(sorted(set(args.device_counts))) if args.device_counts else default_device_counts(devices, gpus)
    if any(c < 1 or c > devices for c in counts):
        raise BadInputError(f"--device-counts must lie in 1..{devices}, got {args.device_counts}")
    config = model_config(args.model)
    if config.vocab_size < BYTE_VOCAB:  # the checks and the noise floor train on text (weights/data.py)
        raise BadInputError(f"--model {args.model}: its vocabulary of {config.vocab_size} is below the "
                            f"{BYTE_VOCAB} byte tokens of the text the checks train on")
    large = config.num_params > LARGE_MODEL_PARAMS
    remat = args.activation_checkpointing if args.activation_checkpointing != "auto" else ("full" if large else "off")
    dtype = args.dtype or defaults["dtype"]
    seq_lens = tuple(args.seq_lens or defaults["seq_lens"])
    memory = device_memory_bytes if gpus else None
    if not args.seq_lens and memory is not None:  # the default lengths whose points fit the largest device count
        fitting = tuple(s for s in seq_lens if estimated_peak_bytes(
            config, seq_len=s, devices=max(counts), attention="ours", dtype=dtype, mode=args.mode,
            remat=remat) <= SKIP_FACTOR * memory)
        seq_lens = fitting or seq_lens[:1]
    for seq_len in seq_lens:
        for count in counts:
            check_split(seq_len, count, RING_LAYOUT)
    steps = args.steps if args.steps is not None else defaults["steps"]
    if steps < 1:
        raise BadInputError(f"--steps must be >= 1, got {steps}")
    check_layers = args.check_layers or default_check_layers(config)
    if not 1 <= check_layers <= config.num_layers:
        raise BadInputError(f"--check-layers must lie in 1..{config.num_layers}, got {check_layers}")
    check_seq_len = args.check_seq_len or min(min(seq_lens), MAX_CHECK_SEQ_LEN)
    for count in {devices, *counts}:  # the float32 check on all devices, the fast path on each count
        check_split(check_seq_len, count, RING_LAYOUT)
    asked = _parsed_list(args.backends, BACKENDS, "--backends")
    if "torch" not in asked:  # the reference is no backend to compare, but the compare needs it
        raise BadInputError(f"--backends {args.backends}: the float32 reference runs on the torch backend; name "
                            f"torch too (--backends torch,{args.backends})")
    backends, notes = _available_backends(asked, explicit=args.backends != ",".join(BACKENDS))
    if "torch" not in backends:
        raise BadInputError(f"the float32 reference runs on the torch backend: {INSTALL_HINT['torch']}")
    perturb = parse_perturbation(args.perturb, backends, parameter_shapes(config)) if args.perturb else None
    precisions = _precisions(args.precisions, args.mode, dtype, seq_lens, counts)
    schemes, ulysses_degree = _schemes(args.schemes, args.ulysses_degree, devices, config)
    return CompareSettings(
        model=args.model, mode=args.mode, seq_lens=seq_lens, device_counts=counts, devices=devices, steps=steps,
        dtype=dtype, backends=tuple(backends),
        attention_ablation=tuple(_parsed_list(args.ablation, ("ours", "vendor", "reference"), "--ablation")),
        activation_checkpointing=remat, check_seq_len=check_seq_len, check_layers=check_layers, bench=args.bench,
        platform="gpu" if gpus else "cpu", notes=tuple(notes), perturb=perturb, device_memory_bytes=memory,
        precisions=precisions, schemes=schemes, ulysses_degree=ulysses_degree)


def _schemes(asked: str, ulysses_degree: int | None, devices: int, config: LlamaConfig
             ) -> tuple[tuple[str, ...], int | None]:
    """(the schemes, the ring first; the hybrid's U, by default devices / 2), each checked against the devices and
    the model's heads (BadInputError naming what works)."""
    schemes = ("ring", *(s for s in _parsed_list(asked, SCHEMES, "--schemes") if s != "ring"))
    if "hybrid" not in schemes:
        if ulysses_degree is not None:
            raise BadInputError("--ulysses-degree is the hybrid scheme's: add hybrid to --schemes")
    elif ulysses_degree is None:
        ulysses_degree = devices // 2
    for scheme in schemes[1:]:
        degrees = scheme_degrees(scheme, devices, ulysses_degree if scheme == "hybrid" else None)
        check_heads(degrees.ulysses, config.num_heads, config.num_kv_heads)
    return schemes, ulysses_degree


def prepare_weights(settings: CompareSettings, work_dir: Path) -> CompareSettings:
    """`settings` with `weights` set: `prepared_weights(settings.model, work_dir)`."""
    return dataclasses.replace(settings, weights=prepared_weights(settings.model, work_dir))


def prepared_weights(model: str, work_dir: Path) -> str:
    """The weights every job of a run reads, made once: a preset's random weights generated into work_dir/weights
    as a converted checkpoint (safetensors, which each process memory-maps), a Hugging Face directory converted
    there, a converted directory used where it is. work_dir/weights.json records what was done and how long it took; a second call finds the weights there
    and makes nothing."""
    log = work_dir / WEIGHTS_LOG
    directory = work_dir / WEIGHTS_DIR
    if Path(model).is_dir() and not is_hf_checkpoint(model):
        return str(Path(model).resolve())
    if not log.exists() and is_hf_checkpoint(model):  # converted once; its HF directory is the HF rows' (hf_rows.py)
        began = time.perf_counter()
        convert_hf_checkpoint(model, directory)
        log.write_text(json.dumps({"model": model, "converted_s": time.perf_counter() - began,
                                   "directory": WEIGHTS_DIR}))
    elif not log.exists():
        began = time.perf_counter()
        source = open_weights(model)
        if not isinstance(source, RandomWeights):
            raise BadInputError(f"--model {model}: neither a converted directory nor a preset")
        write_converted_checkpoint(dict(source), source.config, directory)
        log.write_text(json.dumps({"model": model, "generated_s": time.perf_counter() - began,
                                   "directory": WEIGHTS_DIR}))
    return str(directory)


def check_model(settings: CompareSettings, work_dir: Path) -> str:
    """The model the equivalence jobs load: `first_layers(settings.weights, settings.check_layers, work_dir)`."""
    return first_layers(settings.weights, settings.check_layers, work_dir)


def first_layers(weights: str, layers: int, work_dir: Path) -> str:
    """`weights`, or their first `layers` layers written as a converted checkpoint (the same tensors) under
    work_dir."""
    source = open_weights(weights)
    if layers == source.config.num_layers:
        return weights
    config = dataclasses.replace(source.config, num_layers=layers)
    directory = work_dir / "check-model"
    write_converted_checkpoint({name: source.tensor(name) for name in parameter_shapes(config)}, config, directory)
    return str(directory)


def plan_jobs(settings: CompareSettings, check_model_path: str, trace_dir: Path) -> list[J.Job]:
    """Equivalence jobs (the torch float32 reference on one device first), the fast path's (`fast_path_jobs`), then
    benchmark points: every backend x context length x device count with our kernels, and the ablation at the
    largest device count, each once per precision. A point that cannot run here carries its reason in `skip`
    (vendor kernels off-GPU; torch's FP8 without torchao; a peak estimated beyond the device)."""
    devices, mode, steps = settings.devices, settings.mode, settings.steps
    eq = {"kind": "equivalence", "model": check_model_path, "seq_len": settings.check_seq_len, "dtype": "fp32",
          "mode": mode, "steps": steps}
    jobs = [J.Job(id="reference-equivalence", backend="torch", devices=1, attention="reference",
                  attention_backend="reference", **eq)]
    for backend in settings.backends:
        perturb = settings.perturb and settings.perturb.for_job(backend, "equivalence", "ours", "fp32")
        jobs.append(J.Job(id=f"{backend}-equivalence", backend=backend, devices=devices, attention="ours",
                          attention_backend=KERNELS[backend]["ours"], perturb=perturb, **eq))
        jobs += [J.Job(id=f"{backend}-{scheme}-equivalence", backend=backend, devices=devices, attention="ours",
                       attention_backend=KERNELS[backend]["ours"], **eq, **_scheme_fields(settings, scheme))
                 for scheme in settings.schemes[1:]]
    for backend in settings.backends:
        jobs += fast_path_jobs(backend, settings.platform, check_model_path, settings.check_seq_len,
                               settings.device_counts, devices, settings.perturb, steps=steps)
    if not settings.bench:
        return jobs
    config = open_weights(settings.weights).config
    for backend in settings.backends:
        for seq_len in settings.seq_lens:
            points = [(count, "ours") for count in settings.device_counts]
            points += [(devices, a) for a in settings.attention_ablation if a != "ours"]
            for (count, attention), precision in itertools.product(points, settings.precisions):
                traced = count == devices and attention == "ours"
                kernel, fp8 = KERNELS[backend][attention], precision == "fp8"
                skip = (f"{kernel} needs a CUDA GPU" if attention == "vendor" and settings.platform == "cpu" else
                        (fp8 and fp8_skip(backend)) or
                        skip_reason(config, settings, seq_len=seq_len, devices=count, attention=attention))
                jobs.append(J.Job(id=f"{backend}-s{seq_len}-d{count}-{attention}{'-fp8' if fp8 else ''}",
                                  kind="bench", backend=backend, model=settings.weights, seq_len=seq_len,
                                  devices=count, attention=attention, attention_backend=kernel, dtype=settings.dtype,
                                  mode=mode, steps=steps, remat=settings.activation_checkpointing,
                                  trace_dir=str(trace_dir) if traced else None, skip=skip, fp8=fp8))
            skip = skip_reason(config, settings, seq_len=seq_len, devices=devices, attention="ours")
            jobs += [J.Job(id=f"{backend}-s{seq_len}-d{devices}-ours-{scheme}", kind="bench", backend=backend,
                           model=settings.weights, seq_len=seq_len, devices=devices, attention="ours",
                           attention_backend=KERNELS[backend]["ours"], dtype=settings.dtype, mode=mode, steps=steps,
                           remat=settings.activation_checkpointing, skip=skip, **_scheme_fields(settings, scheme))
                     for scheme in settings.schemes[1:]]
    return jobs


def _scheme_fields(settings: CompareSettings, scheme: str) -> dict:
    """A job's scheme and, for the hybrid, its Ulysses degree."""
    return {"scheme": scheme, "ulysses_degree": settings.ulysses_degree if scheme == "hybrid" else None}


FAST_PATH_VENDOR = {"gpu": "vendor", "cpu": "reference"}  # off-GPU the plain-math reference plays the vendor


def fast_path_jobs(backend: str, platform: str, model: str, seq_len: int, device_counts, step_devices: int,
                   perturb: Perturbation | None = None, mesh: str = "", steps: int = 1) -> list[J.Job]:
    """The fast path's jobs of one backend (compare/harness/fastpath.py): the attention function with our kernels
    and with the vendor's (off-GPU the reference) on each of `device_counts`, and the bf16 step's gradients with
    each on `step_devices` (`mesh`: on that mesh instead, `twinflash check`), on the first of the text batches of
    a check of `steps` steps (the float32 step they are held to must be the first of as many: `job_batches`)."""
    jobs = []
    for attention in ("ours", FAST_PATH_VENDOR[platform]):
        kernel = KERNELS[backend][attention]
        common = {"backend": backend, "model": model, "seq_len": seq_len, "attention": attention,
                  "attention_backend": kernel, "dtype": "bf16", "mode": "forward", "steps": steps}
        jobs += [J.Job(id=f"{backend}-fast-path-d{count}-{attention}", kind="attention", devices=count, mesh=mesh,
                       perturb=perturb and perturb.for_job(backend, "attention", attention, "bf16"), **common)
                 for count in device_counts]
        jobs.append(J.Job(id=f"{backend}-bf16-step-{attention}", kind="gradients", devices=step_devices, mesh=mesh,
                          perturb=perturb and perturb.for_job(backend, "gradients", attention, "bf16"), **common))
    return jobs


def group_launches(jobs: list[J.Job]) -> list[tuple[str, int, list[J.Job]]]:
    """[(backend, devices, jobs)]: one launch per backend and device count, in the order the first job of each
    appears; inside a launch the checks first (equivalence, then the fast path's), then our and the vendor's kernels
    by growing length, the plain reference last (the largest, and the likeliest to run out of memory: a torch launch
    ends on an OOM). A
    curve job (the bf16 noise floor) follows the benchmark point of its length and kernel, whose compiled step and
    tuned kernels it reuses."""
    groups: dict[tuple[str, int], list[J.Job]] = {}
    for job in jobs:
        groups.setdefault((job.backend, job.devices), []).append(job)
    order = {"ours": 1, "vendor": 1, "reference": 2}
    return [(backend, devices, sorted(group, key=lambda j: (j.kind not in J.CHECK_KINDS,
                                                            0 if j.kind in J.CHECK_KINDS else order[j.attention],
                                                            j.seq_len, j.attention == "vendor", j.kind == "curve")))
            for (backend, devices), group in groups.items()]
