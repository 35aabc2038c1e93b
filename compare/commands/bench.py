"""`twinflash bench kernels|ring|hf|train-peer`: the GPU benchmarks of compare/bench/ (`kernel_bench.py`,
`ring_bench.py`, `hf_bench.py`, `train_peer.py`), each with arguments of its own: what follows the benchmark's name
goes to it."""

from __future__ import annotations

import argparse

from weights import BadInputError

HELP = ("GPU benchmarks: `bench kernels` (1 GPU), `bench ring` (4 GPUs), `bench hf` (HF's Llama with our ring), "
        "`bench train-peer` (our training step with PyTorch's context parallelism)")
BENCHMARKS = {"kernels": "1 GPU: our Triton and Pallas kernels beside the vendors'",
              "ring": "4 GPUs: both rings beside one GPU and PyTorch's context parallelism",
              "hf": "HF transformers' Llama with our ring beside our torch model: same weights, tokens, step",
              "train-peer": "2+ GPUs: our torch training step with PyTorch's context parallelism + cuDNN as its "
                            "attention, beside the same step with our ring"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "arguments after the benchmark's name go to it: `twinflash bench kernels --help`"
    parser.add_argument("what", nargs="?", choices=tuple(BENCHMARKS))
    parser.add_argument("bench_args", nargs=argparse.REMAINDER)


def run_command(args: argparse.Namespace) -> int:
    if args.what is None:
        raise BadInputError("bench needs a benchmark: " + "; ".join(f"`twinflash bench {name}` ({what})"
                                                                    for name, what in BENCHMARKS.items()))
    if args.what == "kernels":
        from compare.bench.kernel_bench import main as bench_main
    elif args.what == "ring":
        from compare.bench.ring_bench import main as bench_main
    elif args.what == "train-peer":
        from compare.bench.train_peer import main as bench_main
    else:
        from compare.bench.hf_bench import main as bench_main
    return bench_main(args.bench_args)
