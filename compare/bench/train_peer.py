"""`twinflash bench train-peer`: issue 40's live training peer once (compare/harness/peer_rows.py: PyTorch's own
context parallelism with cuDNN SDPA as the attention of our torch training step, beside that step with our ring and
our JAX step, on the same GPUs, model, weights and tokens). This module owns the command: its arguments and their
checks, the table (ours / each row) and the JSON (default out/train-peer-<date>-<gpu>.json; `compare/bench/common.py`).
Exit 1 when a launch fails or a row disagrees with our torch row, 2 for bad input (without CUDA GPUs: PyTorch's
context parallelism has no CPU attention to dispatch to).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from compare.args import OneLineParser, integer, lengths, number, with_error_contract
from compare.bench.common import finish_rows
from compare.harness.hf_rows import AGREEMENT_TOLERANCE, compare_rows
from compare.harness.peer_rows import LAYOUT, METHOD, ROTATE_METHODS, launch_peer_rows, peer_plan
from compare.launch import Interrupted, interruptible
from weights import BadInputError, open_weights
from weights.layout import check_split
from weights.parallel import REMAT_MODES, checkpointed_layers


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="twinflash bench train-peer", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3.1-8b", help="a preset or a converted checkpoint (default 8B)")
    parser.add_argument("--seq-len", type=lengths, default=(32768,), help="tokens per sequence, one value (32k)")
    parser.add_argument("--devices", type=integer(2), help="GPUs of the sequence-parallel ring (default: every GPU)")
    parser.add_argument("--activation-checkpointing", choices=tuple(REMAT_MODES), default="full",
                        help="both rows' (default full)")
    parser.add_argument("--checkpointed-layers", type=integer(0), help="of the layers (default: all)")
    parser.add_argument("--jax-checkpointed-layers", type=integer(0),
                        help="our JAX row's own, each stack at its fastest form (default: --checkpointed-layers)")
    parser.add_argument("--rotate-method", choices=ROTATE_METHODS, default="allgather", help="the peer's K/V rotation")
    parser.add_argument("--warmup", type=integer(1), default=2, help="untimed steps (the first compiles)")
    parser.add_argument("--steps", type=integer(1), default=5, help="timed steps")
    parser.add_argument("--seed", type=integer(0), default=0, help="of the random weights and tokens")
    parser.add_argument("--no-jax", action="store_true", help="without the row of our JAX step")
    parser.add_argument("--launch-timeout-s", type=number(0, above=True), default=1800.0)
    parser.add_argument("--out", type=Path, help="JSON path (default out/train-peer-<date>-<gpu>.json)")
    return parser


def measurement_plan(args, work: Path) -> dict:
    """`peer_plan` of the arguments; BadInputError for what cannot run (checked before anything launches)."""
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
    for layers in (args.checkpointed_layers, args.jax_checkpointed_layers):
        checkpointed_layers(args.activation_checkpointing, config.num_layers, layers)
    return peer_plan(args.model, args.seq_len[0], devices, checkpointing=args.activation_checkpointing,
                     checkpointed_layers=args.checkpointed_layers, rotate_method=args.rotate_method,
                     warmup=args.warmup, steps=args.steps, seed=args.seed, work=work,
                     jax_checkpointed_layers=args.jax_checkpointed_layers)


def render(rows: list[dict]) -> str:
    lines = [f"{'row':42} {'ckpt':>5} {'step ms':>9} {'tokens/s':>9} {'MFU':>6} {'peak GiB':>9} {'loss':>9} "
             f"{'ours/this':>9} {'agrees':>6}"]
    for row in rows:
        ratio = f"{1 / row['speed_vs_ours']:9.3f}" if row.get("speed_vs_ours") else f"{'-':>9}"
        lines.append(f"{row['model']:42} {row.get('checkpointed_layers', '-'):>5} {row['step_s'] * 1e3:9.1f} "
                     f"{row['tokens_per_s']:9,.0f} {row['mfu']:6.1%} "
                     f"{row['peak_memory_bytes'] / 2**30:9.2f} {row['loss']:9.5f} {ratio} {str(row.get('agrees')):>6}")
    return "\n".join(lines)


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="twinflash-bench-train-peer-") as tmp, interruptible():
        work = Path(tmp)
        plan = measurement_plan(args, work)
        try:
            meta, measured, failures = launch_peer_rows(plan, work, args.launch_timeout_s, jax=not args.no_jax)
        except Interrupted as stop:
            print(f"twinflash: bench train-peer interrupted ({stop.signal_name})", file=sys.stderr)
            return stop.exit_code
    return finish_rows("train-peer", argv, meta, compare_rows(measured), failures, AGREEMENT_TOLERANCE["bf16"], render,
                       args.out, plan={k: v for k, v in plan.items() if k != "rows_path"},
                       method=METHOD)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return with_error_contract(lambda: _main(argv))


if __name__ == "__main__":
    sys.exit(main())
