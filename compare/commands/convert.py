"""`twinflash convert`: a Hugging Face Llama safetensors checkpoint -> a twinflash converted checkpoint
(`weights.convert_hf_checkpoint`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from weights.atomic import check_output_dir

HELP = "HF Llama safetensors checkpoint -> twinflash converted checkpoint"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("hf_dir", type=Path)
    parser.add_argument("out_dir", type=Path, help="must not exist or be empty")


def _plural(count: int, noun: str) -> str:
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


def run_command(args: argparse.Namespace) -> None:
    from weights import convert_hf_checkpoint

    check_output_dir(args.out_dir, "OUT_DIR", empty=True)
    config = convert_hf_checkpoint(args.hf_dir, args.out_dir)
    print(f"converted {args.hf_dir} -> {args.out_dir} ({_plural(config.num_layers, 'layer')}, "
          f"{_plural(config.num_params, 'parameter')})")
