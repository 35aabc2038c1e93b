"""`twinflash export`: a twinflash converted checkpoint -> a Hugging Face Llama checkpoint
(`weights.export_hf_checkpoint`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from weights.atomic import check_output_dir

HELP = "twinflash converted checkpoint -> HF Llama checkpoint"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("converted_dir", type=Path)
    parser.add_argument("hf_dir", type=Path, help="must not exist or be empty")


def run_command(args: argparse.Namespace) -> None:
    from weights import export_hf_checkpoint

    check_output_dir(args.hf_dir, "HF_DIR", empty=True)
    config = export_hf_checkpoint(args.converted_dir, args.hf_dir)
    print(f"exported {args.converted_dir} -> {args.hf_dir} ({config.num_params:,} parameters)")
