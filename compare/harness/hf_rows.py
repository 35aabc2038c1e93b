"""Hugging Face transformers' LlamaForCausalLM with our ring registered ("twin_ring", torch_impl/hf_attention.py)
beside our own torch model (`torch_impl.model.Llama`, the same ring as its attention function), on the same weights,
tokens and devices: each one's training step (tokens/s, peak memory) and whether the two compute the same (the first
step's full-sequence loss and gradient norm within `AGREEMENT_TOLERANCE` of ours). `twinflash bench hf`
(compare/bench/hf_bench.py) runs it once; `twinflash compare --model HF_DIR` once per context length of the run, on
the run's devices, after its own jobs (never side by side with them: they would share the devices), and
compare/report/hf.py makes the report's section of it.

Both rows run one step the same way, so that the difference is the model code: batch sharded over the ranks in the
zigzag layout (`HFRing.shard`: positions, labels shifted before sharding), our kernels and ring (variant and
attention backend), eager modules, the loss over all local logits, every gradient summed over the ranks
(`HFRing.sum_gradients`), torch's AdamW; parameters, gradients and optimizer state in the run's dtype. `twinflash
train`'s own step (FSDP2, compiled modules, chunked loss, fused AdamW, float32 master weights) is not this one.

Owns the measurement: the weights both ways (`prepare_weights`), its plan and launch (`measurement_plan`,
`launch_rows`: `torchrun --nproc-per-node=N -m compare.harness.hf_rows --plan FILE`, gloo processes without GPUs,
the kernels in Triton's interpreter; rank 0 appends each row to the plan's rows file as it ends), the workers
(`run_worker`) and the agreement (`compare_rows`); and for the compare which measurements run (`plan_hf_rows`: an HF
checkpoint, the torch backend, train mode, one node; a length whose torch point was skipped for memory is skipped
too, with its reason) and running them (`run_hf_rows`).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from compare.harness.plan import KERNELS, CompareSettings
from compare.launch import end_process, log_tail, run_logged, torchrun_launcher
from weights import ConvertedCheckpoint, convert_hf_checkpoint, export_hf_checkpoint, is_hf_checkpoint, open_weights
from weights.checkpoint import write_converted_checkpoint

METHOD = " ".join(__doc__.split("\n\n")[1].split())

ROWS = {"hf": "HF LlamaForCausalLM + twin_ring", "ours": "twinflash torch Llama + ring_attention"}
LAYOUT = "zigzag"
SEED = 0
HF_WORK_DIR = "hf-rows"  # under the run's work directory: one folder per measurement (plan, rows, worker log)
WARMUP_STEPS = {"gpu": 2, "cpu": 1}  # untimed steps: the first compiles the kernels; on CPU nothing compiles


# ---------------------------------------------------------------------------------------------------------------
# The workers (under torchrun)
# ---------------------------------------------------------------------------------------------------------------

def _step(model, optimizer, ring, loss_share) -> tuple:
    """One training step; returns (this rank's loss share, the summed gradients' norm)."""
    import torch

    loss = loss_share()
    loss.backward()
    ring.sum_gradients(model)
    grads = [p.grad.float().pow(2).sum() for p in model.parameters() if p.grad is not None]
    norm = torch.stack(grads).sum().sqrt()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, norm


def _model_and_loss(kind: str, plan: dict, device, dtype, ring, tokens):
    """(model, loss_share()): transformers' with our ring, or ours with the same ring and the same batch."""
    import torch.nn.functional as F

    batch = ring.shard(tokens, labels=tokens)
    if kind == "hf":
        from transformers import LlamaForCausalLM

        from torch_impl.hf_attention import RING

        model = LlamaForCausalLM.from_pretrained(plan["hf_dir"], attn_implementation=RING).to(device, dtype)
        return model.train(), lambda: model(**batch).loss
    from torch_impl.model import load_model
    from torch_impl.ring_attention import ring_attention

    attention = functools.partial(ring_attention, layout=ring.layout, variant=ring.variant, backend=ring.backend,
                                  check_ranks=False)
    llama = load_model(plan["converted_dir"], dtype=dtype, device=device, attention_fn=attention).train()

    def loss_share():
        logits = llama(batch["input_ids"], batch["position_ids"][0])
        return F.cross_entropy(logits.flatten(0, 1), batch["shift_labels"].flatten(), reduction="sum") \
            / batch["num_items_in_batch"]

    return llama, loss_share


def _measure(kind: str, plan: dict, device, ring, tokens) -> dict:
    import torch
    import torch.distributed as dist

    from torch_impl.train import peak_memory_bytes

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[plan["dtype"]]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model, loss_share = _model_and_loss(kind, plan, device, dtype, ring, tokens)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    loss, norm = _step(model, optimizer, ring, loss_share)
    first = {"loss": ring.full_loss(loss).item(), "grad_norm": norm.item()}
    for _ in range(plan["warmup"] - 1):
        _step(model, optimizer, ring, loss_share)
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(plan["steps"]):
        _step(model, optimizer, ring, loss_share)
    synchronize()
    slowest = torch.tensor([time.perf_counter() - start, peak_memory_bytes(device)], dtype=torch.float64,
                           device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    step_s = slowest[0].item() / plan["steps"]
    del model, optimizer
    return dict(first, step_s=step_s, tokens_per_s=plan["batch"] * plan["seq_len"] / step_s,
                peak_memory_bytes=int(slowest[1].item()),
                peak_memory_kind="GPU allocated" if device.type == "cuda" else "host RSS")


def run_worker(plan: dict) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    import transformers

    from torch_impl.hf_attention import register
    from torch_impl.train import init_distributed

    device = init_distributed()
    ring = register(layout=LAYOUT, variant=plan["variant"], backend=plan["attention_backend"])
    vocab = open_weights(plan["converted_dir"]).config.vocab_size
    ids = np.random.default_rng(SEED).integers(0, vocab, (plan["batch"], plan["seq_len"]))
    tokens = torch.from_numpy(ids).to(device)
    meta = {"torch": torch.__version__, "transformers": transformers.__version__,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    for kind in ROWS:
        row = dict(kind=kind, model=ROWS[kind], seq_len=plan["seq_len"], batch=plan["batch"],
                   devices=dist.get_world_size(), dtype=plan["dtype"], variant=plan["variant"],
                   attention_backend=plan["attention_backend"])
        row.update(_measure(kind, plan, device, ring, tokens))
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if dist.get_rank() == 0:
            with open(plan["rows_path"], "a") as handle:
                handle.write(json.dumps({"meta": meta, "row": row}) + "\n")
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------------
# The parent
# ---------------------------------------------------------------------------------------------------------------

def prepare_weights(model: str, work: Path) -> tuple[Path, Path]:
    """(HF directory, converted directory) of the same weights, what is missing written under `work`."""
    path = Path(model)
    if is_hf_checkpoint(path):
        convert_hf_checkpoint(path, work / "converted")
        return path, work / "converted"
    source = open_weights(model, SEED)  # a converted directory, or a preset's random weights (CheckpointError)
    if isinstance(source, ConvertedCheckpoint):
        converted = source.directory
    else:
        converted = work / "converted"
        write_converted_checkpoint(dict(source), source.config, converted)
    export_hf_checkpoint(converted, work / "hf")
    return work / "hf", converted


# The rows agree when the first step's full-sequence loss and gradient norm of HF's model are within these relative
# differences of ours. The two run the same kernels and ring on the same tokens and weights; only the model code's
# operation order differs, so they differ by rounding: measured 1.7e-7 / 0 in float32 (tiny, 2 CPU ranks) and
# 4.4e-5 / 4.5e-4 in bf16 (Llama-3.2-1B at 32k on 2 H200s, compare/results/hf-and-8k-profile-2026-11-27-h200x2);
# float32's bound is ~60x and bf16's ~11x those. A model that drops or misplaces the causal mask, a position or a
# shard moves the loss by far more (tests/test_hf_attention_torch.py's negative controls).
AGREEMENT_TOLERANCE = {"fp32": 1e-5, "bf16": 5e-3}


def compare_rows(rows: list[dict]) -> list[dict]:
    """Each row with its loss, gradient norm and speed against ours (relative differences and a ratio) and whether
    it agrees with ours (`AGREEMENT_TOLERANCE` of its dtype); None for each without a row of ours."""
    ours = next((row for row in rows if row["kind"] == "ours"), None)
    if ours is None:  # ours did not finish (its launch failed after HF's row): nothing to hold HF's against
        return [dict(row, loss_rel_diff_vs_ours=None, grad_norm_rel_diff_vs_ours=None, agreement_tolerance=None,
                     agrees=None, speed_vs_ours=None) for row in rows]
    compared = []
    for row in rows:
        loss_diff = abs(row["loss"] - ours["loss"]) / abs(ours["loss"])
        norm_diff = abs(row["grad_norm"] - ours["grad_norm"]) / ours["grad_norm"]
        tolerance = AGREEMENT_TOLERANCE[row["dtype"]]
        compared.append(dict(row, loss_rel_diff_vs_ours=loss_diff, grad_norm_rel_diff_vs_ours=norm_diff,
                             agreement_tolerance=tolerance, agrees=max(loss_diff, norm_diff) <= tolerance,
                             speed_vs_ours=row["tokens_per_s"] / ours["tokens_per_s"]))
    return compared


def measurement_plan(hf_dir: Path, converted_dir: Path, work: Path, *, seq_len: int, batch: int, dtype: str,
                     variant: str, attention_backend: str, warmup: int, steps: int) -> dict:
    """What the workers of `launch_rows` read: the weights both ways, the step's shape and kernels, where to write."""
    return dict(hf_dir=str(hf_dir), converted_dir=str(converted_dir), seq_len=seq_len, batch=batch, dtype=dtype,
                variant=variant, attention_backend=attention_backend, warmup=warmup, steps=steps,
                rows_path=str(work / "rows.jsonl"))


def launch_rows(plan: dict, work: Path, devices: int, timeout_s: float) -> tuple[dict, list[dict], str | None]:
    """Runs the workers on `devices` ranks; (versions, rows as measured, the failure in one line or None)."""
    launcher, env = torchrun_launcher(devices)
    env["PYTHONUNBUFFERED"] = "1"
    plan_path = work / "plan.json"
    plan_path.write_text(json.dumps(plan))
    command = [*launcher, "-m", __spec__.name, "--plan", str(plan_path)]
    log_path = work / "worker.log"
    failure = run_logged(command, env, log_path, timeout_s)
    meta, rows = {}, []
    rows_path = Path(plan["rows_path"])
    for line in rows_path.read_text().splitlines() if rows_path.exists() else []:
        record = json.loads(line)
        meta.update(record["meta"])
        rows.append(record["row"])
    if failure:
        failure = f"the workers {failure}: {log_tail(log_path, 600)}"
    return meta, rows, failure


# ---------------------------------------------------------------------------------------------------------------
# In twinflash compare
# ---------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class HFMeasurement:
    """One context length's rows to measure, or the reason it is not measured (`skip`)."""

    seq_len: int
    devices: int
    skip: str | None = None


def plan_hf_rows(settings: CompareSettings, hf_dir: str | None, spans_hosts: bool,
                 skipped_points: dict[int, str]) -> tuple[list[HFMeasurement], str | None]:
    """(the measurements, None), or ([], why none runs); ([], None) when the run's model is no HF checkpoint
    (`hf_dir` None). `skipped_points`: {seq_len: reason} of the torch points of our kernels on the run's devices skipped up front."""
    if hf_dir is None:
        return [], None
    why = ("the benchmark is off (--no-bench)" if not settings.bench else
           "the torch backend is not in --backends" if "torch" not in settings.backends else
           "they are training steps (--mode train)" if settings.mode != "train" else
           "a run spanning nodes has no launch of them" if spans_hosts else None)
    if why is not None:
        return [], f"HF rows not measured: {why}"
    return [HFMeasurement(seq_len, settings.devices, skipped_points.get(seq_len)) for seq_len in settings.seq_lens], None


def run_hf_rows(measurements: list[HFMeasurement], settings: CompareSettings, hf_dir: str, work_dir: Path,
                timeout_s: float, deadline: float, announce: Callable[[str], None]) -> list[dict]:
    """Each measurement's record: seq_len, devices, dtype, status ("ok", "failed", "skipped"), message, versions
    and the rows (`compare_rows`: each with its agreement with ours). Stops launching at `deadline`
    (time.monotonic()), the rest recorded as skipped."""
    records = []
    for measurement in measurements:
        record = {"seq_len": measurement.seq_len, "devices": measurement.devices, "dtype": settings.dtype,
                  "status": "skipped", "message": measurement.skip, "versions": {}, "rows": []}
        if measurement.skip is None and time.monotonic() >= deadline:
            record["message"] = "not run: --time-limit-s reached"
        if record["message"] is None:
            work = work_dir / HF_WORK_DIR / f"s{measurement.seq_len}-d{measurement.devices}"
            work.mkdir(parents=True, exist_ok=True)
            plan = measurement_plan(
                Path(hf_dir), Path(settings.weights), work, seq_len=measurement.seq_len, batch=1,
                dtype=settings.dtype, variant="ring", attention_backend=KERNELS["torch"]["ours"],
                warmup=WARMUP_STEPS[settings.platform], steps=settings.steps)
            announce(f"HF rows at S={measurement.seq_len} on {measurement.devices} device(s) ...")
            versions, rows, failure = launch_rows(plan, work, measurement.devices,
                                                  min(timeout_s, deadline - time.monotonic()))
            record.update(status="failed" if failure else "ok", message=failure, versions=versions,
                          rows=compare_rows(rows))
        records.append(record)
    return records


def main(argv: list[str]) -> int:
    """The workers' entry: `--plan FILE` (what `launch_rows` runs under torchrun)."""
    if len(argv) != 2 or argv[0] != "--plan":
        print("usage: python -m compare.harness.hf_rows --plan FILE (launched by twinflash bench hf / compare)",
              file=sys.stderr)
        return 2
    run_worker(json.loads(Path(argv[1]).read_text()))
    return 0


if __name__ == "__main__":
    end_process(main(sys.argv[1:]))
