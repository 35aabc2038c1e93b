"""`twinflash bench hf`: Hugging Face transformers' LlamaForCausalLM with our ring registered
(`torch_impl.hf_attention`, "twin_ring") beside our own torch model, on the same weights, tokens and devices: each
one's training step (tokens/s, peak memory) and whether the two compute the same. The measurement, its method and
its tolerance are compare/harness/hf_rows.py's (`twinflash compare --model HF_DIR` runs the same one); this module
owns the command: its arguments, the defaults that depend on the machine, the weights in a temporary folder (an HF
directory converted for our model; a converted one or a preset, exported to HF for transformers), the printed rows
and the JSON (default out/hf-<date>-<gpu>.json; `compare/bench/common.py`). Exit code 1 when a launch failed or HF's
model disagrees with ours, 2 for bad input.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from compare.args import (
    OneLineParser,
    integer,
    lengths,
    number,
    with_error_contract,
)
from compare.bench.common import finish_rows
from compare.harness.hf_rows import (AGREEMENT_TOLERANCE, LAYOUT, METHOD, compare_rows, launch_rows, measurement_plan,
                                     prepare_weights)
from compare.launch import Interrupted, interruptible
from weights import BadInputError
from weights.attention import VARIANTS
from weights.layout import check_split
from weights.training import ATTENTION_BACKENDS


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
    return parser


def render(rows: list[dict]) -> str:
    def number(value, spec: str) -> str:  # a row without ours to compare with has None there
        return format(value, spec) if value is not None else format("-", ">" + spec.split(".")[0])

    lines = [f"{'model':40} {'step ms':>10} {'tokens/s':>10} {'vs ours':>8} {'peak GiB':>9} {'loss':>10} "
             f"{'loss diff':>10} {'grad norm diff':>15}"]
    for row in rows:
        lines.append(f"{row['model']:40} {row['step_s'] * 1e3:10.1f} {row['tokens_per_s']:10,.0f} "
                     f"{number(row.get('speed_vs_ours'), '8.3f')} {row['peak_memory_bytes'] / 2**30:9.2f} "
                     f"{row['loss']:10.5f} {number(row.get('loss_rel_diff_vs_ours'), '10.2e')} "
                     f"{number(row.get('grad_norm_rel_diff_vs_ours'), '15.2e')}")
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


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    _settings(args)
    with tempfile.TemporaryDirectory(prefix="twinflash-bench-hf-") as tmp, interruptible():
        work = Path(tmp)
        hf_dir, converted = prepare_weights(args.model, work)
        plan = measurement_plan(hf_dir, converted, work, seq_len=args.seq_len, batch=args.batch, dtype=args.dtype,
                                variant=args.variant, attention_backend=args.attention_backend,
                                warmup=args.warmup, steps=args.steps)
        try:
            meta, rows, failure = launch_rows(plan, work, args.devices, args.launch_timeout_s)
        except Interrupted as stop:
            print(f"twinflash: bench hf interrupted ({stop.signal_name})", file=sys.stderr)
            return stop.exit_code
    return finish_rows("hf", argv, meta, compare_rows(rows), [failure] if failure else [],
                       AGREEMENT_TOLERANCE[args.dtype], render, args.out, devices=args.devices, method=METHOD)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return with_error_contract(lambda: _main(argv))


if __name__ == "__main__":
    sys.exit(main())
