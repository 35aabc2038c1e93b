"""The live training peer (issue 40) as a measurement: PyTorch's own context parallelism (the ring of
`torch.distributed.tensor.experimental.context_parallel`, cuDNN SDPA at each of its steps) as the attention of our torch
training step, beside the same step with our ring and kernels, and our JAX step: the same GPUs, model, weights, tokens,
FSDP2 sharding, compiled modules, chunked loss, fused AdamW and checkpointing (`torch_impl.train.build_training`,
`jax_impl.train.run_training`), so the torch rows differ in the sequence-parallel attention alone. Why not torchtitan
itself: neither it nor its dependencies (torchdata, tyro, ...) are in the GPU image, and its Llama would differ from
ours in more than the attention; this is the stack its documentation runs (FSDP2 + context parallel + cuDNN SDPA), on
our model. `twinflash bench train-peer` (compare/bench/train_peer.py) runs it once; `twinflash compare` on 2 or more
GPUs once per context length, after its own jobs, and compare/report/peer.py makes the report's section of it.

Each row, on every rank: the plan's warmup steps untimed, then its timed steps, of random tokens (the same global
batches in every row), each step's device time between CUDA events as `twinflash train` takes it; tokens/s, TFLOP/s per
GPU and MFU from the median timed step (`weights.flops`), the peak memory of the slowest rank, the first step's loss and
gradient norm (before any update: the same weights in both rows). The peer's step runs inside `context_parallel(sp mesh,
buffers=[tokens, targets, positions])`: PyTorch shards the full sequence itself, in its head-tail order (rank r holds
chunks r and 2W-1-r of 2W, our zigzag), and patches `F.scaled_dot_product_attention`, which `pytorch_cp_attention` calls
with the KV heads repeated to the query heads (as torchtitan does); the backward is PyTorch's ring backward (DTensor's
dispatch). Its rotation: the plan's (PyTorch's `set_rotate_method`). Checkpointing: the plan's for every row (the
bench's default "full": torchtitan's published 8B runs recompute fully); with "save-attention" ours keeps its
attention's out and log-sum-exp while the peer's attention, which keeps nothing, is recomputed.

Then our JAX step on the same GPUs, weights and tokens (`run_jax_worker`: `jax_impl.train.run_training` as `twinflash
train --backend jax` runs it, the same seed), the issue's goal being ours at 1.1x the peer in both backends.
`hf_rows.compare_rows` adds each row's speed against our torch row and whether its first loss and gradient norm agree
with it within `AGREEMENT_TOLERANCE`.

Owns the measurement: the peer's attention (`pytorch_cp_attention`), the plan (`peer_plan`) and its launch
(`launch_peer_rows`: `torchrun -m compare.harness.peer_rows --worker PLAN`, then `--jax-worker`; rank 0 appends each row
to the plan's rows file), the rows (`row_of`); and for the compare which measurements run (`plan_peer_rows`: GPUs, 2 or
more devices, torch in --backends, bf16, train mode, one node) and running them (`run_peer_rows`).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from compare.harness.hf_rows import compare_rows
from compare.harness.plan import CompareSettings
from compare.launch import (JAX_GPU_MEMORY_FRACTION, end_process, host_devices_env, log_tail, run_logged,
                            torchrun_launcher)
from weights import open_weights

METHOD = " ".join(__doc__.split("\n\n")[1].split())
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


def row_of(kind: tuple[str, str], plan: dict, config, seconds: list[float], losses: list[float],
           first_grad_norm: float, peak_memory_bytes: int) -> dict:
    """A row of the table and the JSON from one run's step times and losses: the median timed step's rates (model
    FLOPs of `config`: `weights.flops.batch_model_flops`), the first step's loss and gradient norm, and how many of
    the layers it checkpointed."""
    from weights.flops import PEAK_FLOPS_PER_DEVICE, batch_model_flops
    from weights.parallel import checkpointed_layers

    step_s = statistics.median(seconds[plan["warmup"]:])
    layers = checkpointed_layers(plan["checkpointing"], config.num_layers, row_checkpointed_layers(plan, kind[0]))
    tflops = batch_model_flops(config, 1, plan["seq_len"]) / step_s / plan["devices"] / 1e12
    return dict(kind=kind[0], model=kind[1], dtype="bf16", seq_len=plan["seq_len"], devices=plan["devices"],
                checkpointed_layers=layers.count, step_s=step_s, tokens_per_s=plan["seq_len"] / step_s,
                tflops_per_device=tflops, mfu=tflops * 1e12 / PEAK_FLOPS_PER_DEVICE,
                peak_memory_bytes=peak_memory_bytes, loss=losses[0], grad_norm=first_grad_norm, step_seconds=seconds,
                losses=losses)


# ---------------------------------------------------------------------------------------------------------------
# The workers (under torchrun, one per GPU)
# ---------------------------------------------------------------------------------------------------------------

ATTENTION_BACKENDS = {"ours": ("torch", "triton"), "peer": ("torch", "sdpa_cudnn"), JAX_ROW[0]: ("jax", "pallas")}


def row_checkpointed_layers(plan: dict, kind: str) -> int | None:
    """How many layers row `kind` checkpoints (None: the checkpointing mode's default, every layer): the plan's,
    except our JAX row where the plan gives it its own (`jax_checkpointed_layers`): each stack at its fastest form
    that fits. XLA plans JAX's step's memory itself (at 8B, 32k on 2 H200s it fits with none checkpointed, and
    asked 72 GiB of temporaries with 4: compare/results/train-peer-2026-11-29-h200x2/), while the peer, whose
    attention keeps nothing, needs the torch rows' checkpointing."""
    own = plan.get("jax_checkpointed_layers") if kind == JAX_ROW[0] else None
    return plan["checkpointed_layers"] if own is None else own


def _settings(plan: dict, kind: str):
    """The `twinflash train` settings of row `kind` (its backend and attention backend) on the plan's devices."""
    from weights.parallel import MeshShape
    from weights.settings import TrainSettings

    backend, attention_backend = ATTENTION_BACKENDS[kind]
    return TrainSettings(backend=backend, model=plan["model"], seq_len=plan["seq_len"],
                         steps=plan["warmup"] + plan["steps"], mesh=MeshShape(fsdp=1, sp=plan["devices"]), batch=1,
                         dtype="bf16", data="random", seed=plan["seed"], activation_checkpointing=plan["checkpointing"],
                         checkpointed_layers=row_checkpointed_layers(plan, kind), attention_backend=attention_backend)


def _batches(plan: dict, settings, config):
    """The plan's global batches: random tokens of the model's (`config`) vocabulary, the same for every row."""
    from weights.data import random_batches

    return random_batches(settings.steps, 1, plan["seq_len"], config.vocab_size, seed=plan["seed"])


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
    config = run.source.config
    for step, batch in enumerate(_batches(plan, settings, config)):
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
    return row_of((kind, ROWS[kind]), plan, config, seconds, losses, grad_norms[0], max(peaks))


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
    batches = _batches(plan, settings, open_weights(plan["model"], plan["seed"]).config)
    run_training(settings, batches, on_step=lambda **numbers: steps.append(numbers),
                 devices=jax.devices()[:plan["devices"]])
    Path(plan["jax_steps_path"]).write_text(json.dumps(steps))


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
    return row_of(JAX_ROW, plan, open_weights(plan["model"], plan["seed"]).config, [step["seconds"] for step in steps],
                  [step["loss"] for step in steps], steps[0]["grad_norm"],
                  max(max(step["peak_memory_bytes"]) for step in steps)), None


def launch_peer_rows(plan: dict, work: Path, timeout_s: float, *, jax: bool = True
                     ) -> tuple[dict, list[dict], list[str]]:
    """(versions, rows as measured, failures in one line each) of `plan` (`peer_plan`) in the folder `work`: the
    torch rows under torchrun (`run_worker`), then with `jax` our JAX row (`jax_row`)."""
    (work / "plan.json").write_text(json.dumps(plan))
    launcher, env = torchrun_launcher(plan["devices"])
    env["PYTHONUNBUFFERED"] = "1"
    log_path = work / "worker.log"
    failure = run_logged([*launcher, "-m", __spec__.name, "--worker", str(work / "plan.json")], env, log_path,
                         timeout_s)
    rows_path = Path(plan["rows_path"])
    records = [json.loads(line) for line in rows_path.read_text().splitlines()] if rows_path.exists() else []
    failures = [f"the workers {failure}: {log_tail(log_path, 600)}"] if failure else []
    rows = [record["row"] for record in records]
    if jax:
        row, jax_failure = jax_row(plan, work, timeout_s)
        rows += [row] if row else []
        failures += [jax_failure] if jax_failure else []
    return {key: value for record in records for key, value in record["meta"].items()}, rows, failures


def peer_plan(model: str, seq_len: int, devices: int, *, checkpointing: str, checkpointed_layers: int | None,
              rotate_method: str, warmup: int, steps: int, seed: int, work: Path,
              jax_checkpointed_layers: int | None = None) -> dict:
    """What the workers read (validated by the caller), their rows file in `work`; `jax_checkpointed_layers`: our
    JAX row's own (`row_checkpointed_layers`), None for the torch rows'."""
    return dict(model=model, seq_len=seq_len, devices=devices, checkpointing=checkpointing,
                checkpointed_layers=checkpointed_layers, jax_checkpointed_layers=jax_checkpointed_layers,
                rotate_method=rotate_method, warmup=warmup, steps=steps, seed=seed,
                rows_path=str(work / "rows.jsonl"))


# ---------------------------------------------------------------------------------------------------------------
# In twinflash compare
# ---------------------------------------------------------------------------------------------------------------

PEER_WORK_DIR = "peer-rows"  # under the run's work directory: one folder per context length
COMPARE_WARMUP_STEPS = 2


@dataclasses.dataclass(frozen=True)
class PeerMeasurement:
    """One context length's rows to measure, or the reason it is not measured (`skip`)."""

    seq_len: int
    devices: int
    skip: str | None = None


def plan_peer_rows(settings: CompareSettings, spans_hosts: bool, skipped_points: dict[int, str]
                   ) -> tuple[list[PeerMeasurement], str | None]:
    """(the measurements, None) or ([], why none runs). `skipped_points`: {seq_len: reason} of the torch points of
    our kernels on the run's devices skipped up front (the peer's step needs no less memory)."""
    why = ("it needs GPUs (PyTorch's context parallelism has no CPU attention)" if settings.platform != "gpu" else
           "the benchmark is off (--no-bench)" if not settings.bench else
           "it is a ring: it needs 2 or more devices" if settings.devices < 2 else
           "the torch backend is not in --backends" if "torch" not in settings.backends else
           f"it runs bf16 (cuDNN's attention), the run {settings.dtype}" if settings.dtype != "bf16" else
           "they are training steps (--mode train)" if settings.mode != "train" else
           "a run spanning nodes has no launch of them" if spans_hosts else None)
    if why is not None:
        return [], f"PyTorch's context parallelism not measured: {why}"
    return [PeerMeasurement(seq_len, settings.devices, skipped_points.get(seq_len))
            for seq_len in settings.seq_lens], None


def run_peer_rows(measurements: list[PeerMeasurement], settings: CompareSettings, work_dir: Path, timeout_s: float,
                  deadline: float, announce: Callable[[str], None]) -> list[dict]:
    """Each measurement's record: seq_len, devices, status ("ok", "failed", "skipped"), message, versions and the
    rows (`compare_rows`: each with its agreement with our torch row), our JAX row with them when "jax" is in the
    run's backends. The run's checkpointing and steps; the compare's weights. Stops launching at `deadline`
    (time.monotonic()), the rest recorded as skipped."""
    records = []
    for measurement in measurements:
        record = {"seq_len": measurement.seq_len, "devices": measurement.devices, "status": "skipped",
                  "message": measurement.skip, "versions": {}, "rows": []}
        if measurement.skip is None and time.monotonic() >= deadline:
            record["message"] = "not run: --time-limit-s reached"
        if record["message"] is None:
            work = work_dir / PEER_WORK_DIR / f"s{measurement.seq_len}-d{measurement.devices}"
            work.mkdir(parents=True, exist_ok=True)
            plan = peer_plan(settings.weights, measurement.seq_len, measurement.devices,
                             checkpointing=settings.activation_checkpointing, checkpointed_layers=None,
                             rotate_method="allgather", warmup=COMPARE_WARMUP_STEPS, steps=settings.steps, seed=0,
                             work=work)
            announce(f"PyTorch's context parallelism at S={measurement.seq_len} on {measurement.devices} GPUs ...")
            versions, rows, failures = launch_peer_rows(plan, work, min(timeout_s, deadline - time.monotonic()),
                                                        jax="jax" in settings.backends)
            record.update(status="failed" if failures else "ok", message="; ".join(failures) or None,
                          versions=versions, rows=compare_rows(rows))
        records.append(record)
    return records


def main(argv: list[str]) -> int:
    """The workers' entry: `--worker PLAN` (under torchrun) or `--jax-worker PLAN` (what `launch_peer_rows` runs)."""
    workers = {"--worker": run_worker, "--jax-worker": run_jax_worker}
    if len(argv) != 2 or argv[0] not in workers:
        print("usage: python -m compare.harness.peer_rows --worker|--jax-worker PLAN (launched by twinflash bench "
              "train-peer / compare)", file=sys.stderr)
        return 2
    workers[argv[0]](json.loads(Path(argv[1]).read_text()))
    return 0


if __name__ == "__main__":
    end_process(main(sys.argv[1:]))
