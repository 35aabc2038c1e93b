"""`twinflash train`: distributed Llama training with either backend, with a live progress display and
OUT/train.jsonl. Builds `weights.settings.TrainSettings`, the one description of a run that both backends'
`run_training` receive, from the arguments; owns the batches (built here once with numpy, so both backends see the
same tokens in the same order), the checks of bad input, which processes a run needs (`compare/launch.py` starts
them: torchrun, or the JAX child process on CPU), and the per-step report (tokens/s, TFLOP/s, MFU).

Backends: `torch_impl.train.run_training(settings, batches, on_step)` runs one process per device under torchrun
(this command starts torchrun itself when not already under it: gloo processes on CPU, one per GPU with NCCL);
`jax_impl.train.run_training(settings, batches, on_step)` runs in one process over all of JAX's devices: this one,
or on CPU, when JAX's device count here is not the mesh's, a child process that asks for the mesh's number of
emulated host devices (XLA_FLAGS=--xla_force_host_platform_device_count, which JAX reads only when it starts). Both
call `on_step(step=, loss=, lr=, grad_norm=, seconds=, peak_memory_bytes=[one per device])` once per step (on
the torch rank 0 only); `step` is the 0-based optimizer step.

OUT/train.jsonl, one line per step: step, loss, lr, grad_norm, seconds, tokens_per_s (global tokens / step
wall time), tflops_per_device, mfu (null off-GPU), peak_memory_bytes (list, per device, the peak since the
process started: GPU max allocated, or host peak RSS per process on CPU). With --resume, lines of steps the
resumed run repeats are dropped first.

Model FLOPs (`weights.flops.model_flops_per_token`, forward + backward, no credit for recomputation), per trained
sequence of S tokens:
  6 * N * S + 12 * layers * heads * head_dim * S^2 / 2
where N counts the parameters every token multiplies in a matmul (all but an untied input embedding table) and
the second term is causal attention (QK^T and PV, 2 * 2 * S^2 * head_dim per head forward, x3 for forward +
backward, halved by the mask). MFU = model FLOPs per second / (`weights.flops.PEAK_FLOPS_PER_DEVICE` * devices),
989 TFLOP/s, the dense bf16 peak of an H100/H200 SXM.

Bad input (mesh not matching the device count, a sequence length the layout cannot take, a batch the fsdp axis
cannot split, an sp scheme the mesh or the heads cannot take, an incompatible checkpoint, outputs that exist) is
refused before any process starts: one line, exit 2, nothing written.

Interruption (`compare/launch.py`'s process model): SIGINT or SIGTERM to this command stops every process of the
run and prints `twinflash: interrupted at step N; last checkpoint: PATH` (N: the steps done, PATH: the newest
checkpoint in --ckpt-dir, or none), exit 130 / 143. A worker that dies ends the run with one line naming it.
"""

from __future__ import annotations

import argparse
import functools
import dataclasses
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from compare.args import SEED_MAX, OneLineParser, integer, number, with_error_contract
from compare.launch import (JAX_GPU_MEMORY_FRACTION, PROGRESS_ENV, SETTINGS_FLAG, TORCHRUN_ENV, Interrupted,
                            end_process, hand_off, host_devices_env, interruptible, progress_file, torchrun_launcher)
from compare.nodes import Nodes, add_arguments as add_node_arguments, from_args as nodes_from_args
from compare.nodes import launch_failure, torchrun_arguments
from weights import PRESETS, BadInputError, LlamaConfig, open_weights
from weights.atomic import check_output_dir, write_text_atomically
from weights.data import training_batches, training_segment_ids
from weights.fp8 import INSTALL_TORCHAO, check_fp8_settings
from weights.flops import PEAK_FLOPS_PER_DEVICE, batch_model_flops
from weights.parallel import REMAT_MODES, MeshShape, checkpointed_layers
from weights.schedule import OptimizerConfig, default_optimizer, defaults_help
from weights.sequence_parallel import SCHEMES, check_heads, scheme_degrees
from weights.settings import TrainSettings
from weights.training import (ATTENTION_BACKENDS, BACKENDS, check_attention_backend, check_batch_shape,
                              checkpoint_to_resume, run_metadata)

HELP = "distributed Llama training (fsdp x sp mesh), train.jsonl per step"
JSONL = "train.jsonl"
# This module's dotted name, which the processes `hand_off` starts run (`python -m`): its spec's, which holds it also
# where this module runs as `__main__`.
THIS_MODULE = __spec__.name


# --- arguments --------------------------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=BACKENDS, default="torch")
    parser.add_argument("--model", default="tiny", help=f"converted checkpoint dir or preset ({', '.join(PRESETS)})")
    parser.add_argument("--seq-len", type=integer(2), required=True)
    parser.add_argument("--steps", type=integer(1), required=True)
    parser.add_argument("--mesh", help="e.g. fsdp=2,sp=2 (default: fsdp over all devices; "
                        "on CPU one process)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--fp8", action="store_true",
                        help="the decoder layers' linear matmuls (attention and MLP projections) in FP8: dynamic "
                        "per-tensor scaling, e4m3 for activations, weights and gradients; the embeddings, LM head, "
                        "norms and attention stay bf16. Needs --dtype bf16; torch needs torchao "
                        f"({INSTALL_TORCHAO})")
    parser.add_argument("--batch", type=integer(1),
                        help="sequences per step, all devices together (default: fsdp size)")
    parser.add_argument("--data", choices=("text", "random"), default="text")
    parser.add_argument("--pack", action="store_true", help="pack the text corpus's files as documents (README)")
    parser.add_argument("--seed", type=integer(0, SEED_MAX), default=0, help="data order and preset weights")
    defaults = OptimizerConfig()
    parser.add_argument("--lr", type=number(0, above=True), help="peak learning rate (default: by model size, "
                        "see --warmup-steps)")
    parser.add_argument("--warmup-steps", type=integer(0),
                        help="linear warmup steps. Defaults: " + defaults_help().replace("%", "%%"))
    parser.add_argument("--weight-decay", type=number(0), default=defaults.weight_decay)
    parser.add_argument("--grad-clip", type=number(0, above=True), default=defaults.grad_clip_norm,
                        help="max global grad norm")
    parser.add_argument("--activation-checkpointing", nargs="?", choices=tuple(REMAT_MODES), const="full",
                        default="off", metavar="MODE",
                        help="per-layer activation checkpointing; alone: full. " + "; ".join(
                            f"{mode}: {what}" for mode, what in REMAT_MODES.items()))
    parser.add_argument("--checkpointed-layers", type=integer(0), metavar="N", help="checkpoint N of the decoder "
                        "layers, spread evenly (default: all); the others keep every activation (memory for speed)")
    parser.add_argument("--attention-backend", help="ring step kernel; " + "; ".join(
                        f"{backend}: {', '.join(names)}" for backend, names in ATTENTION_BACKENDS.items())
                        + "; default ours, the first")
    parser.add_argument("--ring-variant", choices=("ring", "allgather"), default="ring")
    parser.add_argument("--sp-scheme", choices=SCHEMES, default="ring", help="sequence parallelism over sp: ring, "
                        "ulysses (all-to-all of the heads) or hybrid (Ulysses in groups of --ulysses-degree, a ring)")
    parser.add_argument("--ulysses-degree", type=integer(1), help="hybrid: adjacent devices per all-to-all")
    parser.add_argument("--loss-chunk-tokens", type=integer(1), help="positions per logits chunk of the loss")
    parser.add_argument("--ckpt-dir", type=Path, help="checkpoint directory (created, with its parents)")
    parser.add_argument("--ckpt-every", type=integer(1), help="steps between checkpoints (always one at the end)")
    parser.add_argument("--keep", type=integer(1), default=3, help="checkpoints kept")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --ckpt-dir")
    parser.add_argument("--stop-at", type=integer(1), help="end this run after that many steps (resume later)")
    parser.add_argument("--out", type=Path, help="directory for train.jsonl (created, with its parents)")
    parser.add_argument("--plan-memory", action="store_true", help="JAX: compile the step for abstract inputs and "
                        "print XLA's per-device memory plan; nothing is loaded or trained")
    parser.add_argument("--eager", action="store_true", help="torch on GPUs: run the step without torch.compile "
                        "and the fused AdamW kernel")
    parser.add_argument("--profile", action="store_true", help="trace the last steps and write their time "
                        "breakdown by category to OUT/profile.json (and print it)")
    parser.add_argument("--no-xla-overlap", action="store_false", dest="xla_overlap", help="JAX on GPUs: compile "
                        "the step with XLA's defaults for overlap, not with its options for overlapping "
                        "communication with compute (a before/after measurement)")
    parser.add_argument("--skip-non-finite-steps", action="store_true", help="skip a step whose loss or grad norm "
                        "is not finite (its update not applied) instead of stopping the run")
    parser.add_argument("--export", type=Path, dest="export_dir",
                        help="write the final weights to DIR/converted (twinflash format) and DIR/hf (each must "
                        "not exist or be empty)")
    add_node_arguments(parser)


def settings_from_args(args: argparse.Namespace, device_count: int | None) -> TrainSettings:
    """Validated settings; `device_count` gives the default mesh (fsdp over all devices; None: not known here, as
    in a run spanning nodes, which then needs --mesh)."""
    if args.mesh is None and device_count is None:
        raise BadInputError("a run spanning nodes needs --mesh (e.g. fsdp=2,sp=4: the devices of every node)")
    mesh = MeshShape.parse(args.mesh) if args.mesh is not None else MeshShape(fsdp=device_count)
    if args.stop_at is not None and args.stop_at > args.steps:
        raise BadInputError(f"--stop-at {args.stop_at} is beyond --steps {args.steps}")
    if args.resume and args.ckpt_dir is None:
        raise BadInputError("--resume needs --ckpt-dir")
    if args.profile and (args.out is None or (args.stop_at or args.steps) < 2):
        raise BadInputError("--profile needs --out and at least 2 steps (the first one is not profiled)")
    if args.plan_memory and args.backend != "jax":
        raise BadInputError("--plan-memory needs --backend jax (torch runs eagerly: it has no plan before it runs)")
    settings = TrainSettings(
        backend=args.backend, model=args.model, seq_len=args.seq_len, steps=args.steps, mesh=mesh,
        batch=args.batch or mesh.fsdp, dtype=args.dtype, fp8=args.fp8, data=args.data, seed=args.seed, pack=args.pack,
        activation_checkpointing=args.activation_checkpointing, checkpointed_layers=args.checkpointed_layers,
        attention_backend=args.attention_backend or ATTENTION_BACKENDS[args.backend][0],
        ring_variant=args.ring_variant, sp_scheme=args.sp_scheme, ulysses_degree=args.ulysses_degree,
        loss_chunk_tokens=args.loss_chunk_tokens, ckpt_dir=args.ckpt_dir,
        ckpt_every=args.ckpt_every, keep=args.keep, resume=args.resume, stop_at=args.stop_at, out=args.out,
        export_dir=args.export_dir, plan_memory=args.plan_memory, eager=args.eager,
        profile=args.profile, skip_non_finite_steps=args.skip_non_finite_steps, xla_overlap=args.xla_overlap)
    check_attention_backend(settings)
    check_fp8_settings(settings.fp8, settings.dtype, settings.batch * settings.seq_len // mesh.size)
    if settings.fp8 and settings.backend == "torch" and importlib.util.find_spec("torchao") is None:
        raise BadInputError(f"--fp8 with --backend torch needs torchao: {INSTALL_TORCHAO}")
    check_output_locations(settings)
    # the defaults follow the model's width: read after the checks above, as reading a checkpoint is work
    given = {"lr": args.lr, "warmup_steps": args.warmup_steps}
    optimizer = default_optimizer(open_weights(args.model, args.seed).config.hidden_size, args.steps,
                                  weight_decay=args.weight_decay, grad_clip_norm=args.grad_clip,
                                  **{k: v for k, v in given.items() if v is not None})
    return dataclasses.replace(settings, optimizer=optimizer)


def check_output_locations(settings: TrainSettings) -> None:
    """Refuses, before anything is loaded or started, outputs the run could not write at its end: --out,
    --ckpt-dir and --export's directories must be creatable (missing parents are created) and writable, not files;
    --export's two directories and, without --resume, OUT/train.jsonl must not exist yet (or be empty)."""
    if settings.out is not None:
        check_output_dir(settings.out, "--out", empty=False)
        if (settings.out / JSONL).exists() and not settings.resume:
            raise BadInputError(f"{settings.out / JSONL} exists; refusing to overwrite it (use --resume to continue "
                                "that run, or another --out)")
    if settings.ckpt_dir is not None:
        check_output_dir(settings.ckpt_dir, "--ckpt-dir", empty=False)
    for path in settings.export_paths or ():
        check_output_dir(path, "--export", empty=True)


# --- data and checks ----------------------------------------------------------------------------------------------

def _check_outputs(settings: TrainSettings, start_step: int) -> None:
    check_output_locations(settings)  # again in the processes `hand_off` starts: they get settings, not arguments
    if settings.stop_at is not None and settings.stop_at <= start_step:
        raise BadInputError(f"--stop-at {settings.stop_at} is not after the checkpoint's step {start_step}")


def _checkpointing(backend: str):
    """The backend's `checkpointing` module (the twins share its names), imported only when asked for."""
    if backend == "torch":
        from torch_impl import checkpointing
    else:
        from jax_impl import checkpointing
    return checkpointing


def check_shape(settings: TrainSettings, device_count: int) -> LlamaConfig:
    """The model's config, after the checks that need neither data nor checkpoints: mesh vs devices, batch and
    sequence length vs mesh and layout, the sp scheme vs mesh and heads, model name (all a --plan-memory run
    needs)."""
    settings.mesh.check_devices(device_count)
    check_batch_shape(settings.batch, settings.seq_len, settings.mesh)
    degrees = scheme_degrees(settings.sp_scheme, settings.mesh.sp, settings.ulysses_degree)
    config = open_weights(settings.model, settings.seed).config
    check_heads(degrees.ulysses, config.num_heads, config.num_kv_heads)
    checkpointed_layers(settings.activation_checkpointing, config.num_layers, settings.checkpointed_layers)
    return config


def check_run(settings: TrainSettings, device_count: int, *, check_outputs: bool = True, checksums: bool = True
              ) -> tuple[LlamaConfig, np.ndarray, int, np.ndarray | None]:
    """Every check of a run that needs no device work, reading checkpoints through the backend's own
    `checkpointing` (the twins share its names): (model config, batches, step to start from, segment ids or None).
    `check_outputs=False` skips the checks of OUT and EXPORT (a torch worker other than rank 0, which writes them);
    `checksums=False` compares the resumed checkpoint's file sizes only (a torch worker: rank 0 verifies the
    checksums once more in `run_training`)."""
    checkpointing = _checkpointing(settings.backend)
    config = check_shape(settings, device_count)
    batches = training_batches(settings, config)
    start = checkpoint_to_resume(settings, run_metadata(settings, config), checkpointing.completed_checkpoints,
                                 checkpointing.read_metadata, checksums=checksums).step
    if check_outputs:
        _check_outputs(settings, start)
    return config, batches, start, training_segment_ids(settings, config)


# --- the per-step report ---------------------------------------------------------------------------------------

class StepReport:
    """`on_step` of the run: computes throughput and MFU, appends OUT/train.jsonl, drives the progress display."""

    def __init__(self, settings: TrainSettings, config: LlamaConfig, start_step: int, on_gpu: bool,
                 progress: Path | None = None):
        self.settings = settings
        self.progress_path = progress  # the steps done, for the CLI's line if the run is interrupted
        self.devices = settings.mesh.size
        ids = training_segment_ids(settings, config) if settings.pack else [None] * settings.steps  # MFU: documents
        self.step_flops = lambda step: batch_model_flops(config, settings.batch, settings.seq_len, ids[step])
        self.on_gpu = on_gpu
        self.jsonl = None
        if settings.out is not None:
            settings.out.mkdir(parents=True, exist_ok=True)
            _drop_lines_from(settings.out / JSONL, start_step)
            self.jsonl = open(settings.out / JSONL, "a")
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(TextColumn(f"[bold]train {settings.backend}[/]"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[stats]}"), TimeRemainingColumn())
        stop = settings.stop_at or settings.steps
        self.task = self.progress.add_task("train", total=stop, completed=start_step, stats="")
        self.records: list[dict[str, Any]] = []

    def __enter__(self) -> StepReport:
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.records:
            self.progress.console.print(self.summary())

    def summary(self) -> str:
        """One line for logs: the last loss and the median throughput of the steps after this run's first (which
        includes start-up work such as kernel compilation)."""
        steady = self.records[1:] or self.records

        median = lambda key: float(np.median([r[key] for r in steady]))  # noqa: E731
        mfu = f", MFU {median('mfu'):.1%}" if steady[0]["mfu"] is not None else ""
        peak = max(max(r["peak_memory_bytes"]) for r in self.records)
        return (f"steps {self.records[0]['step']}..{self.records[-1]['step']}: loss {self.records[-1]['loss']:.4f}, "
                f"median {median('tokens_per_s'):,.0f} tokens/s, {median('tflops_per_device'):.1f} TFLOP/s per "
                f"device{mfu}, peak memory {peak / 2**30:.2f} GiB per device")

    def profile(self, breakdown: dict) -> None:
        """`on_profile` of the run: OUT/profile.json (the breakdown and the run's settings) and the table."""
        from weights.profiling import PROFILE_JSON, format_table, write_profile

        profile = {**breakdown, "backend": self.settings.backend, "settings": json.loads(self.settings.to_json())}
        write_profile(self.settings.out / PROFILE_JSON, profile)
        self.progress.console.print(format_table(profile), markup=False, highlight=False, soft_wrap=True)

    def __call__(self, *, step: int, loss: float, lr: float, grad_norm: float, seconds: float,
                 peak_memory_bytes: list[int]) -> None:
        tflops = self.step_flops(step) / seconds / self.devices / 1e12
        record: dict[str, Any] = {
            "step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "seconds": seconds,
            "tokens_per_s": self.settings.batch * self.settings.seq_len / seconds,
            "tflops_per_device": tflops,
            "mfu": tflops * 1e12 / PEAK_FLOPS_PER_DEVICE if self.on_gpu else None,
            "peak_memory_bytes": list(peak_memory_bytes),
        }
        self.records.append(record)
        if self.progress_path is not None:  # first: train.jsonl never has a line more than the count says
            _record_progress(self.progress_path, step + 1)
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()
        mfu = f" | MFU {record['mfu']:.1%}" if record["mfu"] is not None else ""
        stats = (f"loss {loss:.4f} | {record['tokens_per_s']:,.0f} tok/s | {tflops:.1f} TFLOP/s/device{mfu} | "
                 f"peak {max(peak_memory_bytes) / 2**30:.2f} GiB")
        self.progress.update(self.task, completed=step + 1, stats=stats)


def _record_progress(path: Path, steps_done: int) -> None:
    write_text_atomically(path, json.dumps({"steps_done": steps_done}))


def _drop_lines_from(path: Path, step: int) -> None:
    """Keeps only the lines of steps before `step` in an existing train.jsonl (atomically rewritten)."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] < step]
    write_text_atomically(path, "".join(line + "\n" for line in kept))


# --- running ---------------------------------------------------------------------------------------------------------

def _run_torch_worker(settings: TrainSettings) -> int:
    """One torchrun worker: the checks again (torchrun may have been started by hand), then training."""
    import torch

    from torch_impl.train import init_distributed, run_training

    rank0, world = int(os.environ["RANK"]) == 0, int(os.environ["WORLD_SIZE"])
    config, batches, start, ids = check_run(settings, world, check_outputs=rank0, checksums=False)
    nodes = Nodes.from_env()
    if nodes is not None:
        init_distributed(timeout_s=nodes.timeout_s)  # before `run_training`, which then finds the group joined
    if not rank0:
        run_training(settings, batches, segment_ids=ids)
        return 0
    progress = Path(os.environ[PROGRESS_ENV]) if PROGRESS_ENV in os.environ else None
    with StepReport(settings, config, start, on_gpu=torch.cuda.is_available(), progress=progress) as report:
        run_training(settings, batches, report, report.profile, segment_ids=ids)
    return 0


def _launch_torchrun(settings: TrainSettings, device_count: int, scratch: Path, nodes: Nodes) -> int:
    """Starts one worker per device with torchrun on this host, joined with the other nodes' when the run spans
    several (`compare.nodes`), and waits for them (`hand_off`)."""
    start = check_run(settings, settings.mesh.size if nodes.spans_hosts else device_count)[2]
    _record_progress(progress_file(scratch), start)
    if not nodes.spans_hosts:
        return hand_off(settings, THIS_MODULE, *torchrun_launcher(device_count), scratch)
    launcher, env = torchrun_launcher(device_count, tuple(torchrun_arguments(nodes)))
    return hand_off(settings, THIS_MODULE, launcher, env | nodes.to_env(), scratch,
                    functools.partial(launch_failure, nodes))


def _run_jax_here(settings: TrainSettings, progress: Path | None = None) -> int:
    """A JAX run in this process, over all of JAX's devices; its steps done recorded in `progress`."""
    import jax

    from jax_impl.memory_plan import step_memory_plan
    from jax_impl.train import run_training

    if settings.plan_memory:
        check_shape(settings, jax.device_count())
        plan = step_memory_plan(settings)
        print(f"XLA memory plan of the {settings.model} train step, S={settings.seq_len}, mesh {settings.mesh}, "
              f"{settings.dtype}, checkpointing {settings.activation_checkpointing}, on "
              f"{jax.devices()[0].platform} devices, per device: " + ", ".join(
                  f"{name} {size / 2**30:.2f} GiB" for name, size in plan.items()))
        return 0
    writer = jax.process_index() == 0  # in a run spanning nodes, process 0 writes train.jsonl
    config, batches, start, segment_ids = check_run(settings, jax.device_count(), check_outputs=writer)
    if not writer:
        run_training(settings, batches, segment_ids=segment_ids)
        return 0
    if progress is not None:
        _record_progress(progress, start)
    with StepReport(settings, config, start, on_gpu=jax.default_backend() == "gpu", progress=progress) as report:
        run_training(settings, batches, report, on_profile=report.profile, segment_ids=segment_ids)
    return 0


def _run_jax(settings: TrainSettings, scratch: Path, nodes: Nodes) -> int:
    """A JAX run over the mesh's devices: here, or on CPU when JAX here has another number of devices, in a child
    process with that many emulated host devices (JAX fixes its CPU device count when it first starts). A run
    spanning nodes runs in a child process that joins the other nodes' (`jax.distributed`) before JAX starts,
    with this node's share of the mesh as its host devices on CPU (JAX is not started here)."""
    if nodes.spans_hosts:
        if settings.plan_memory:
            raise BadInputError("--plan-memory plans one process's devices: run it without --nnodes")
        _record_progress(progress_file(scratch), check_run(settings, settings.mesh.size)[2])
        env = host_devices_env(nodes.devices_per_node(settings.mesh.size)) | nodes.to_env()
        return hand_off(settings, THIS_MODULE, [sys.executable], env, scratch,
                        functools.partial(launch_failure, nodes))
    import jax

    if jax.default_backend() == "cpu" and jax.device_count() != settings.mesh.size:
        # bad input refused here, before the child starts
        if settings.plan_memory:
            check_shape(settings, settings.mesh.size)
        else:
            _record_progress(progress_file(scratch), check_run(settings, settings.mesh.size)[2])
        return hand_off(settings, THIS_MODULE, [sys.executable], host_devices_env(settings.mesh.size), scratch)
    return _run_jax_here(settings, progress_file(scratch))


def run_handed_off(settings: TrainSettings) -> int:
    """A process `compare.launch.hand_off` started: a torchrun worker, or the JAX child with the mesh's host devices."""
    if settings.backend == "torch":
        return _run_torch_worker(settings)
    nodes = Nodes.from_env()
    if nodes is not None:  # a rendezvous that does not complete aborts the process: `compare.nodes.launch_failure`
        from jax_impl.train import init_distributed

        init_distributed(nodes.coordinator, nodes.count, nodes.rank, nodes.timeout_s)
    return _run_jax_here(settings, Path(os.environ[PROGRESS_ENV]) if PROGRESS_ENV in os.environ else None)


def _device_count() -> int | None:
    """GPUs visible to torch, or None on a CPU-only machine (where the mesh says how many processes to start)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else None


def _interrupted(stop: Interrupted, settings: TrainSettings | None, scratch: Path) -> int:
    """The one line of an interrupted run (its processes already stopped), and its exit code."""
    if sys.stdout.isatty():  # a worker's live display, killed mid-frame, leaves the cursor hidden on its line
        print("\x1b[?25h", flush=True)
    progress = progress_file(scratch)
    if settings is None or not progress.exists():
        print(f"twinflash: interrupted ({stop.signal_name}) before training started", file=sys.stderr)
        return stop.exit_code
    steps_done = json.loads(progress.read_text())["steps_done"]
    checkpoint = None
    if settings.ckpt_dir is not None:
        checkpoint = _checkpointing(settings.backend).latest_checkpoint(settings.ckpt_dir)
    print(f"twinflash: interrupted at step {steps_done}; last checkpoint: {checkpoint or 'none'}", file=sys.stderr)
    return stop.exit_code


def run_command(args: argparse.Namespace) -> int:
    """`twinflash train` after argument parsing; raises BadInputError for bad input. Interruptible (the module's
    docstring), except in a worker torchrun started by hand."""
    if TORCHRUN_ENV in os.environ and args.backend == "torch":
        return _run_torch_worker(settings_from_args(args, int(os.environ["WORLD_SIZE"])))
    settings = None
    nodes = nodes_from_args(args)
    with interruptible(), tempfile.TemporaryDirectory(prefix="twinflash-train-") as scratch:
        try:
            if args.backend == "jax":
                # read when JAX starts its GPU backend (here, at jax.device_count() below, or in a child)
                os.environ.setdefault(*JAX_GPU_MEMORY_FRACTION)
                if nodes.spans_hosts:
                    settings = settings_from_args(args, None)
                else:
                    import jax

                    settings = settings_from_args(args, jax.device_count())
                return _run_jax(settings, Path(scratch), nodes)
            gpus = _device_count()
            if nodes.spans_hosts:
                settings = settings_from_args(args, None if gpus is None else gpus * nodes.count)
                per_node = nodes.devices_per_node(settings.mesh.size)
                if gpus is not None and gpus < per_node:
                    raise BadInputError(f"mesh {settings.mesh} over {nodes.count} nodes needs {per_node} GPUs per "
                                        f"node; this node has {gpus}")
                return _launch_torchrun(settings, per_node, Path(scratch), nodes)
            settings = settings_from_args(args, gpus or 1)
            return _launch_torchrun(settings, gpus or settings.mesh.size, Path(scratch), nodes)
        except Interrupted as stop:
            return _interrupted(stop, settings, Path(scratch))


def main(argv: list[str] | None = None) -> int:
    """`python -m compare.commands.train ...` (what torchrun runs) with the CLI's one-line error contract (printed
    by rank 0 only: every rank refuses the same input)."""
    argv = sys.argv[1:] if argv is None else list(argv)

    def command() -> int:
        if argv[:1] == [SETTINGS_FLAG] and len(argv) == 2:  # `hand_off` to the processes it starts
            return run_handed_off(TrainSettings.from_json(Path(argv[1]).read_text()))
        parser = OneLineParser(prog="twinflash train", description=__doc__.splitlines()[0])
        add_arguments(parser)
        return run_command(parser.parse_args(argv))

    return with_error_contract(command, quiet=os.environ.get("RANK", "0") != "0")


if __name__ == "__main__":
    end_process(main())
