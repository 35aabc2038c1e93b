"""`twinflash bench hf`: Hugging Face transformers' LlamaForCausalLM with our ring registered
(`torch_impl.hf_attention`, "twin_ring") beside our own torch model (`torch_impl.model.Llama`, the same ring as its
attention function), on the same weights, tokens and devices: each one's training step (tokens/s, peak memory)
and whether the two compute the same (the first step's full-sequence loss and gradient norm, against ours).

Both rows run one step the same way, so that the difference is the model code: batch sharded over the ranks in the
zigzag layout (`HFRing.shard`: positions, labels shifted before sharding), our kernels and ring (`--variant`,
`--attention-backend`), eager modules, the loss over all local logits, every gradient summed over the ranks
(`HFRing.sum_gradients`), torch's AdamW; parameters, gradients and optimizer state in `--dtype`. `twinflash train`'s
own step (FSDP2, compiled modules, chunked loss, fused AdamW, float32 master weights) is not this one: the README's
table has its numbers.

Roles of `python -m compare.bench.hf_bench`:
  plain invocation  prepares the weights in a temporary folder (an HF directory converted for our model; a
                    converted one or a preset, exported to HF for transformers), launches `torchrun
                    --nproc-per-node=N -m compare.bench.hf_bench --plan FILE` (gloo processes without GPUs, the
                    kernels in Triton's interpreter), prints the rows and writes the JSON (default
                    out/hf-<date>-<gpu>.json; `compare/bench/common.py`).
  under torchrun    with --plan: measures both rows; rank 0 appends each row to the plan's rows file as it ends.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

from compare.args import OneLineParser, integer, lengths, number, recorded_command, with_error_contract
from compare.bench.common import default_out_path, write_json
from compare.launch import Interrupted, interruptible, log_tail, run_logged, torchrun_launcher
from weights import BadInputError, ConvertedCheckpoint, convert_hf_checkpoint, export_hf_checkpoint, open_weights
from weights.attention import VARIANTS
from weights.checkpoint import write_converted_checkpoint
from weights.layout import check_split
from weights.training import ATTENTION_BACKENDS

ROWS = {"hf": "HF LlamaForCausalLM + twin_ring", "ours": "twinflash torch Llama + ring_attention"}
LAYOUT = "zigzag"
SEED = 0


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="twinflash bench hf", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="an HF Llama directory, a converted one, or a preset "
                        "(default tiny)")
    parser.add_argument("--seq-len", type=lengths, help="tokens per sequence, one value (default 32k on GPUs, 128 "
                        "on CPU)")
    parser.add_argument("--batch", type=integer(1), default=1)
    parser.add_argument("--devices", type=integer(1), help="ranks of the ring (default: every GPU; 2 CPU "
                        "processes without GPUs)")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), help="default bf16 on GPUs, fp32 on CPU")
    parser.add_argument("--variant", choices=VARIANTS, default="ring")
    parser.add_argument("--attention-backend", choices=ATTENTION_BACKENDS["torch"], default="triton")
    parser.add_argument("--warmup", type=integer(1), default=2, help="untimed steps (the first compiles kernels)")
    parser.add_argument("--steps", type=integer(1), default=5, help="timed steps")
    parser.add_argument("--launch-timeout-s", type=number(0, above=True), default=1800.0)
    parser.add_argument("--out", type=Path, help="JSON path (default out/hf-<date>-<gpu>.json)")
    parser.add_argument("--plan", type=Path, help=argparse.SUPPRESS)
    return parser


# ---------------------------------------------------------------------------------------------------------------
# The worker (under torchrun)
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
    import torch
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
    if (path / "config.json").is_file() and "model_type" in json.loads((path / "config.json").read_text()):
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


def compare_rows(rows: list[dict]) -> list[dict]:
    """Each row with its loss, gradient norm and speed against ours (relative differences and a ratio)."""
    ours = next((row for row in rows if row["kind"] == "ours"), None)
    if ours is None:
        return rows
    return [dict(row, loss_rel_diff_vs_ours=abs(row["loss"] - ours["loss"]) / abs(ours["loss"]),
                 grad_norm_rel_diff_vs_ours=abs(row["grad_norm"] - ours["grad_norm"]) / ours["grad_norm"],
                 speed_vs_ours=row["tokens_per_s"] / ours["tokens_per_s"]) for row in rows]


def render(rows: list[dict]) -> str:
    lines = [f"{'model':40} {'step ms':>10} {'tokens/s':>10} {'vs ours':>8} {'peak GiB':>9} {'loss':>10} "
             f"{'loss diff':>10} {'grad norm diff':>15}"]
    for row in rows:
        lines.append(f"{row['model']:40} {row['step_s'] * 1e3:10.1f} {row['tokens_per_s']:10,.0f} "
                     f"{row.get('speed_vs_ours', 1.0):8.3f} {row['peak_memory_bytes'] / 2**30:9.2f} "
                     f"{row['loss']:10.5f} {row.get('loss_rel_diff_vs_ours', 0.0):10.2e} "
                     f"{row.get('grad_norm_rel_diff_vs_ours', 0.0):15.2e}")
    return "\n".join(lines)


def _settings(args) -> None:
    """Fills the defaults that depend on the machine; BadInputError for what cannot run."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus and args.devices and args.devices > gpus:
        raise BadInputError(f"--devices {args.devices}: this machine has {gpus} GPUs")
    args.devices = args.devices or gpus or 2
    if args.seq_len is not None and len(args.seq_len) != 1:
        raise BadInputError(f"--seq-len takes one length, got {len(args.seq_len)}")
    args.seq_len = args.seq_len[0] if args.seq_len else (32768 if gpus else 128)
    args.dtype = args.dtype or ("bf16" if gpus else "fp32")
    check_split(args.seq_len, args.devices, LAYOUT)


def _launch(args, plan: dict, work: Path) -> tuple[dict, list[dict], str | None]:
    launcher, env = torchrun_launcher(args.devices)
    env["PYTHONUNBUFFERED"] = "1"
    plan_path = work / "plan.json"
    plan_path.write_text(json.dumps(plan))
    command = [*launcher, "-m", __spec__.name, "--plan", str(plan_path)]
    log_path = work / "worker.log"
    failure = run_logged(command, env, log_path, args.launch_timeout_s)
    meta, rows = {}, []
    rows_path = Path(plan["rows_path"])
    for line in rows_path.read_text().splitlines() if rows_path.exists() else []:
        record = json.loads(line)
        meta.update(record["meta"])
        rows.append(record["row"])
    if failure:
        failure = f"the workers {failure}: {log_tail(log_path, 600)}"
    return meta, rows, failure


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.plan is not None:
        run_worker(json.loads(args.plan.read_text()))
        return 0
    _settings(args)
    with tempfile.TemporaryDirectory(prefix="twinflash-bench-hf-") as tmp, interruptible():
        work = Path(tmp)
        hf_dir, converted = prepare_weights(args.model, work)
        plan = dict(hf_dir=str(hf_dir), converted_dir=str(converted), seq_len=args.seq_len, batch=args.batch,
                    dtype=args.dtype, variant=args.variant, attention_backend=args.attention_backend,
                    warmup=args.warmup, steps=args.steps, rows_path=str(work / "rows.jsonl"))
        try:
            meta, rows, failure = _launch(args, plan, work)
        except Interrupted as stop:
            print(f"twinflash: bench hf interrupted ({stop.signal_name})", file=sys.stderr)
            return stop.exit_code
    rows = compare_rows(rows)
    path = args.out or default_out_path("hf", meta, datetime.date.today())
    write_json(path, {"command": recorded_command(["twinflash", "bench", "hf", *argv]),
                      "date": datetime.datetime.now().isoformat(timespec="seconds"), "devices": args.devices,
                      "versions": meta, "method": __doc__.split("\n\n")[1].replace("\n", " "), "rows": rows,
                      "failure": failure})
    if rows:
        print(render(rows))
    print(f"[hf bench] wrote {path}" + (f"; {failure}" if failure else ""))
    return 1 if failure else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return with_error_contract(lambda: _main(argv))


if __name__ == "__main__":
    sys.exit(main())
