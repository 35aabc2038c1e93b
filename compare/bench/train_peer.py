"""`twinflash bench train-peer`: issue 40's live training peer. PyTorch's own context parallelism (the ring of
`torch.distributed.tensor.experimental.context_parallel`, cuDNN SDPA at each of its steps) as the attention of our
torch training step, beside the same step with our ring and kernels: the same GPUs, model, weights, tokens, FSDP2
sharding, compiled modules, chunked loss, fused AdamW and checkpointing (`torch_impl.train.build_training`), so the
rows differ in the sequence-parallel attention alone. Why not torchtitan itself: neither it nor its dependencies
(torchdata, tyro, ...) are in the GPU image, and its Llama would differ from ours in more than the attention; this is
the stack its documentation runs (FSDP2 + context parallel + cuDNN SDPA), on our model.

Each row, on every rank: `--warmup` untimed and `--steps` timed steps of random tokens (the same global batches in
both rows), each step's device time between CUDA events as `twinflash train` takes it; tokens/s, TFLOP/s per GPU and
MFU from the median timed step (`weights.flops`), the peak memory of the slowest rank, the first step's loss and
gradient norm (before any update: the same weights in both rows). The peer's step runs inside `context_parallel(sp
mesh, buffers=[tokens, targets, positions])`: PyTorch shards the full sequence itself, in its head-tail order (rank r
holds chunks r and 2W-1-r of 2W, our zigzag), and patches `F.scaled_dot_product_attention`, which
`pytorch_cp_attention` calls with the KV heads repeated to the query heads (as torchtitan does); the backward is
PyTorch's ring backward (DTensor's dispatch). Its rotation: `--rotate-method` (PyTorch's `set_rotate_method`).
Checkpointing: both rows "full" by default (torchtitan's published 8B runs: full recomputation); with "save-attention"
ours keeps its attention's out and log-sum-exp while the peer's attention, which keeps nothing, is recomputed.

Then (unless --no-jax) our JAX step on the same GPUs, weights and tokens (`twinflash train --backend jax`, the same
seed; `jax_row`), the issue's goal being ours at 1.1x the peer in both backends. `hf_rows.compare_rows` adds each row's
speed against our torch row and whether its first loss and gradient norm agree with it within `AGREEMENT_TOLERANCE`;
the table prints ours / each row. Exit 1 when a launch fails or a row disagrees, 2 for bad input (without CUDA GPUs:
PyTorch's context parallelism has no CPU attention to dispatch to).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
from pathlib import Path

from compare.args import OneLineParser, integer, lengths, number, with_error_contract
from compare.bench.common import finish_rows
from compare.harness.hf_rows import AGREEMENT_TOLERANCE, compare_rows
from compare.launch import (JAX_GPU_MEMORY_FRACTION, Interrupted, host_devices_env, interruptible, log_tail, run_logged,
                            torchrun_launcher)
from weights import BadInputError, open_weights
from weights.layout import check_split
from weights.parallel import REMAT_MODES, checkpointed_layers

ROWS = {"ours": "twinflash torch step + our ring (Gluon)", "peer": "the same step + PyTorch CP (cuDNN)"}
JAX_ROW = ("ours_jax", "twinflash JAX step + our ring (Mosaic)")
ROTATE_METHODS = ("allgather", "alltoall")
LAYOUT = "zigzag"  # PyTorch's head-tail order, which the peer's buffers are sharded in


def pytorch_cp_attention(backends: tuple | None = None):
    """The model's attention function (q [B, S, H, D], k/v [B, S, Hkv, D], causal) as scaled_dot_product_attention on
    [B, H, S, D] with the KV heads repeated to H (head h reads KV head h // (H / Hkv), our grouping), looked up on
    `F` at each call so that `context_parallel`'s patch takes it; SDPA's `backends` (None: cuDNN's alone)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = list(backends or (SDPBackend.CUDNN_ATTENTION,))

    def attention(q, k, v):
        group = q.shape[2] // k.shape[2]
        k, v = (x.repeat_interleave(group, dim=2) for x in (k, v))
        with sdpa_kernel(chosen):
            out = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=True)
        return out.transpose(1, 2)
    return attention


def row_of(kind: tuple[str, str], plan: dict, seconds: list[float], losses: list[float], first_grad_norm: float,
           peak_memory_bytes: int) -> dict:
    """A row of the table and the JSON from one run's step times and losses: the median timed step's rates (model
    FLOPs: `weights.flops.batch_model_flops`), the first step's loss and gradient norm."""
    from weights.flops import PEAK_FLOPS_PER_DEVICE, batch_model_flops

    step_s = statistics.median(seconds[plan["warmup"]:])
    config = open_weights(plan["model"], plan["seed"]).config
    tflops = batch_model_flops(config, 1, plan["seq_len"]) / step_s / plan["devices"] / 1e12
    return dict(kind=kind[0], model=kind[1], dtype="bf16", seq_len=plan["seq_len"], devices=plan["devices"],
                step_s=step_s, tokens_per_s=plan["seq_len"] / step_s, tflops_per_device=tflops,
                mfu=tflops * 1e12 / PEAK_FLOPS_PER_DEVICE, peak_memory_bytes=peak_memory_bytes, loss=losses[0],
                grad_norm=first_grad_norm, step_seconds=seconds, losses=losses)


# ---------------------------------------------------------------------------------------------------------------
# The workers (under torchrun, one per GPU)
# ---------------------------------------------------------------------------------------------------------------

ATTENTION_BACKENDS = {"ours": ("torch", "triton"), "peer": ("torch", "sdpa_cudnn"), JAX_ROW[0]: ("jax", "pallas")}


def _settings(plan: dict, kind: str):
    """The `twinflash train` settings of row `kind` (its backend and attention backend) on the plan's devices."""
    from weights.parallel import MeshShape
    from weights.settings import TrainSettings

    backend, attention_backend = ATTENTION_BACKENDS[kind]
    return TrainSettings(backend=backend, model=plan["model"], seq_len=plan["seq_len"],
                         steps=plan["warmup"] + plan["steps"], mesh=MeshShape(fsdp=1, sp=plan["devices"]), batch=1,
                         dtype="bf16", data="random", seed=plan["seed"], activation_checkpointing=plan["checkpointing"],
                         checkpointed_layers=plan["checkpointed_layers"], attention_backend=attention_backend)


def _batches(plan: dict, settings):
    """The plan's global batches: random tokens of the model's vocabulary, the same for every row."""
    from weights.data import random_batches

    vocab = open_weights(plan["model"], plan["seed"]).config.vocab_size
    return random_batches(settings.steps, 1, plan["seq_len"], vocab, seed=plan["seed"])


def _measure(kind: str, plan: dict, device) -> dict:
    """One row: `kind`'s step over the plan's batches on this rank's part of the mesh."""
    import torch
    from torch.distributed.tensor.experimental import context_parallel

    from torch_impl.parallel import local_batch
    from torch_impl.train import StepNumbers, build_training, completion_mark, launch_step, seconds_between
    from weights.training import next_token_targets, valid_target_count

    seq_len = plan["seq_len"]
    settings = _settings(plan, kind)
    run = build_training(settings, device, attention=pytorch_cp_attention() if kind == "peer" else None)
    count = valid_target_count(1, seq_len)
    numbers, done = [], completion_mark(device)
    for step, batch in enumerate(_batches(plan, settings)):
        if kind == "ours":
            local = local_batch(batch, run.mesh, device)
            loss, grad_norm, _ = launch_step(run.model, run.optimizer, *local, step, count)
        else:  # full sequences, which context_parallel shards in place
            tokens = torch.from_numpy(batch).to(device)
            targets = torch.from_numpy(next_token_targets(batch)).to(device)
            positions = torch.arange(seq_len, device=device)[None]  # [1, S]: every buffer sharded on dim 1
            buffers = [tokens, targets, positions]
            with context_parallel(run.mesh["sp"], buffers=buffers, buffer_seq_dims=[1, 1, 1],
                                  no_restore_buffers=set(buffers)):
                loss, grad_norm, _ = launch_step(run.model, run.optimizer, tokens, targets, positions, step, count)
        numbers.append(StepNumbers(loss, grad_norm, device))
    seconds, losses, grad_norms = [], [], []
    for step_numbers in numbers:
        loss, grad_norm, peaks = step_numbers.read()
        seconds.append(seconds_between(done, step_numbers.done))
        done = step_numbers.done
        losses.append(loss)
        grad_norms.append(grad_norm)
    del run
    gc.collect()
    if device.type == "cuda":  # the next row's peak is its own
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return row_of((kind, ROWS[kind]), plan, seconds, losses, grad_norms[0], max(peaks))


def run_worker(plan: dict) -> None:
    """Both rows on this rank; rank 0 appends each to the plan's rows file as it ends."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    from torch_impl.train import init_distributed

    device = init_distributed()
    try:
        set_rotate_method(plan["rotate_method"])
        meta = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(device)}
        for kind in ROWS:
            row = _measure(kind, plan, device)
            if dist.get_rank() == 0:
                with open(plan["rows_path"], "a") as rows:
                    rows.write(json.dumps({"meta": meta, "row": row}) + "\n")
    finally:
        dist.destroy_process_group()


def run_jax_worker(plan: dict) -> None:
    """Our JAX step over the first `devices` of JAX's (`jax_impl.train.run_training`, as `twinflash train --backend
    jax` runs it), every step's numbers written to the plan's jax_steps_path."""
    import jax

    from jax_impl.train import run_training

    settings = _settings(plan, JAX_ROW[0])
    steps = []
    run_training(settings, _batches(plan, settings), on_step=lambda **numbers: steps.append(numbers),
                 devices=jax.devices()[:plan["devices"]])
    Path(plan["jax_steps_path"]).write_text(json.dumps(steps))


# ---------------------------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------------------------

def jax_row(plan: dict, work: Path, timeout_s: float) -> tuple[dict | None, str | None]:
    """(our JAX step's row, the failure in one line or None): `run_jax_worker` in a process of its own (the torch
    launch has freed the GPUs; without GPUs, over the plan's number of emulated devices), the same seed (the same
    random weights and batches as the torch rows), its steps read as the torch rows are measured."""
    plan = dict(plan, jax_steps_path=str(work / "jax-steps.json"))
    (work / "jax-plan.json").write_text(json.dumps(plan))
    env = host_devices_env(plan["devices"])  # (CPU only: XLA_FLAGS' host devices)
    env.setdefault(*JAX_GPU_MEMORY_FRACTION)
    log_path = work / "jax.log"
    failure = run_logged([sys.executable, "-m", __spec__.name, "--jax-worker", str(work / "jax-plan.json")], env,
                         log_path, timeout_s)
    steps_path = Path(plan["jax_steps_path"])
    steps = json.loads(steps_path.read_text()) if steps_path.exists() else []
    if failure or len(steps) < plan["warmup"] + plan["steps"]:
        return None, f"the JAX step {failure or 'stopped early'}: {log_tail(log_path, 600)}"
    return row_of(JAX_ROW, plan, [step["seconds"] for step in steps], [step["loss"] for step in steps],
                  steps[0]["grad_norm"], max(max(step["peak_memory_bytes"]) for step in steps)), None


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="twinflash bench train-peer", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3.1-8b", help="a preset or a converted checkpoint (default 8B)")
    parser.add_argument("--seq-len", type=lengths, default=(32768,), help="tokens per sequence, one value (32k)")
    parser.add_argument("--devices", type=integer(2), help="GPUs of the sequence-parallel ring (default: every GPU)")
    parser.add_argument("--activation-checkpointing", choices=tuple(REMAT_MODES), default="full",
                        help="both rows' (default full)")
    parser.add_argument("--checkpointed-layers", type=integer(0), help="of the layers (default: all)")
    parser.add_argument("--rotate-method", choices=ROTATE_METHODS, default="allgather", help="the peer's K/V rotation")
    parser.add_argument("--warmup", type=integer(1), default=2, help="untimed steps (the first compiles)")
    parser.add_argument("--steps", type=integer(1), default=5, help="timed steps")
    parser.add_argument("--seed", type=integer(0), default=0, help="of the random weights and tokens")
    parser.add_argument("--no-jax", action="store_true", help="without the row of our JAX step")
    parser.add_argument("--launch-timeout-s", type=number(0, above=True), default=1800.0)
    parser.add_argument("--out", type=Path, help="JSON path (default out/train-peer-<date>-<gpu>.json)")
    return parser


def measurement_plan(args, rows_path: Path) -> dict:
    """What the workers read; BadInputError for what cannot run (checked before anything launches)."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not gpus:
        raise BadInputError("bench train-peer needs CUDA GPUs: PyTorch's context parallelism has no CPU attention "
                            "(no sharding strategy for the CPU SDPA op)")
    devices = args.devices or gpus
    if devices > gpus:
        raise BadInputError(f"--devices {devices}: this machine has {gpus} GPUs")
    if devices < 2:
        raise BadInputError("bench train-peer needs 2 or more GPUs: the peer is a ring")
    if len(args.seq_len) != 1:
        raise BadInputError(f"--seq-len takes one length, got {len(args.seq_len)}")
    check_split(args.seq_len[0], devices, LAYOUT)
    config = open_weights(args.model, args.seed).config
    checkpointed_layers(args.activation_checkpointing, config.num_layers, args.checkpointed_layers)
    return dict(model=args.model, seq_len=args.seq_len[0], devices=devices, checkpointing=args.activation_checkpointing,
                checkpointed_layers=args.checkpointed_layers, rotate_method=args.rotate_method, warmup=args.warmup,
                steps=args.steps, seed=args.seed, rows_path=str(rows_path))


def render(rows: list[dict]) -> str:
    lines = [f"{'row':42} {'step ms':>9} {'tokens/s':>9} {'MFU':>6} {'peak GiB':>9} {'loss':>9} {'ours/this':>9} "
             f"{'agrees':>6}"]
    for row in rows:
        ratio = f"{1 / row['speed_vs_ours']:9.3f}" if row.get("speed_vs_ours") else f"{'-':>9}"
        lines.append(f"{row['model']:42} {row['step_s'] * 1e3:9.1f} {row['tokens_per_s']:9,.0f} {row['mfu']:6.1%} "
                     f"{row['peak_memory_bytes'] / 2**30:9.2f} {row['loss']:9.5f} {ratio} {str(row.get('agrees')):>6}")
    return "\n".join(lines)


def _measure_rows(plan: dict, work: Path, args) -> tuple[dict, list[dict], list[str]]:
    """(versions, rows as measured, failures in one line each): the torch rows under torchrun, then our JAX row."""
    launcher, env = torchrun_launcher(plan["devices"])
    env["PYTHONUNBUFFERED"] = "1"
    log_path = work / "worker.log"
    failure = run_logged([*launcher, "-m", __spec__.name, "--worker", str(work / "plan.json")], env, log_path,
                         args.launch_timeout_s)
    rows_path = Path(plan["rows_path"])
    records = [json.loads(line) for line in rows_path.read_text().splitlines()] if rows_path.exists() else []
    failures = [f"the workers {failure}: {log_tail(log_path, 600)}"] if failure else []
    rows = [record["row"] for record in records]
    if not args.no_jax:
        row, jax_failure = jax_row(plan, work, args.launch_timeout_s)
        rows += [row] if row else []
        failures += [jax_failure] if jax_failure else []
    return {key: value for record in records for key, value in record["meta"].items()}, rows, failures


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="twinflash-bench-train-peer-") as tmp, interruptible():
        work = Path(tmp)
        plan = measurement_plan(args, work / "rows.jsonl")
        (work / "plan.json").write_text(json.dumps(plan))
        try:
            meta, measured, failures = _measure_rows(plan, work, args)
        except Interrupted as stop:
            print(f"twinflash: bench train-peer interrupted ({stop.signal_name})", file=sys.stderr)
            return stop.exit_code
    return finish_rows("train-peer", argv, meta, compare_rows(measured), failures, AGREEMENT_TOLERANCE["bf16"], render,
                       args.out, plan={k: v for k, v in plan.items() if k != "rows_path"},
                       method=__doc__.split("\n\n")[1])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    workers = {"--worker": run_worker, "--jax-worker": run_jax_worker}
    if argv[:1] and argv[0] in workers:
        workers[argv[0]](json.loads(Path(argv[1]).read_text()))
        return 0
    return with_error_contract(lambda: _main(argv))


if __name__ == "__main__":
    sys.exit(main())
