"""The `twinflash` command line, its one entry: the subcommands and their dispatch, under the one error contract of
`compare/args.py` (bad input of any kind, a `weights.errors.BadInputError` or an argument error, ends as one line on
stderr, `twinflash: error: ...`, and exit code 2, with nothing written; bugs keep their traceback).

Subcommands: `convert` and `export` (weights/), `run` (compare/commands/run.py), `train`
(compare/commands/train.py), `compare` (compare/harness/), `check` (compare/commands/check.py), `bench
kernels|ring` (compare/bench/).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

from compare.args import SEED_MAX, OneLineParser, integer, with_error_contract
from compare.commands import check, train
from compare.harness import across_nodes, command as compare_command
from compare.harness.launches import side_launcher
from compare.harness.plan import gpu_count, gpu_memory_bytes, plan_settings
from compare.nodes import add_arguments as add_node_arguments, from_args as nodes_from_args
from weights import PRESETS, BadInputError
from weights.atomic import atomic_file, check_new_file, check_output_dir


def interpret_triton_without_cuda() -> None:
    """Selects Triton's interpreter (TRITON_INTERPRET=1, unless set) when there is no CUDA GPU, so that the torch
    backend's Triton kernels run on CPU in this process and in every process it starts. Call it before anything
    imports triton: Triton reads the variable when it decorates each kernel, its own library's at import."""
    if "TRITON_INTERPRET" in os.environ or importlib.util.find_spec("torch") is None:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def _plural(count: int, noun: str) -> str:
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


def _save_npy_new(path: Path, array) -> None:
    """Writes a .npy file that must not exist yet, atomically (a crash leaves no partial file)."""
    import numpy as np

    check_new_file(path, "--dump-logits")  # again: the forward pass took a while
    with atomic_file(path, "wb") as handle:
        np.save(handle, array)


def cmd_convert(args) -> None:
    from weights import convert_hf_checkpoint

    check_output_dir(args.out_dir, "OUT_DIR", empty=True)
    config = convert_hf_checkpoint(args.hf_dir, args.out_dir)
    print(f"converted {args.hf_dir} -> {args.out_dir} ({_plural(config.num_layers, 'layer')}, "
          f"{_plural(config.num_params, 'parameter')})")


def cmd_export(args) -> None:
    from weights import export_hf_checkpoint

    check_output_dir(args.hf_dir, "HF_DIR", empty=True)
    config = export_hf_checkpoint(args.converted_dir, args.hf_dir)
    print(f"exported {args.converted_dir} -> {args.hf_dir} ({_plural(config.num_params, 'parameter')})")


def cmd_run(args) -> None:
    from compare.commands.run import prepare_tokens, run_forward

    if args.dump_logits is not None:
        check_new_file(args.dump_logits, "--dump-logits")
    tokens = prepare_tokens(args.model, args.seed, args.tokens, args.batch, args.seq_len)
    result = run_forward(args.backend, args.model, tokens, args.dtype, args.seed)
    batch, seq_len = tokens.shape
    print(f"backend     {result.backend} ({result.device}), model {args.model}, dtype {args.dtype}")
    print(f"tokens      batch {batch} x seq_len {seq_len}")
    print(f"loss        {result.loss:.6f} (next-token cross-entropy)")
    print(f"perplexity  {result.perplexity:.4f}")
    print(f"wall time   {result.wall_s * 1e3:.2f} ms (steady state; first call incl. compilation "
          f"{result.first_call_s * 1e3:.2f} ms)")
    print(f"peak memory {result.peak_memory_bytes / 2**20:.1f} MiB ({result.peak_memory_kind})")
    if args.dump_logits is not None:
        _save_npy_new(args.dump_logits, result.logits.astype("float32"))
        print(f"logits      float32 {list(result.logits.shape)} -> {args.dump_logits}")


BENCHMARKS = {"kernels": "1 GPU: our Triton and Pallas kernels beside the vendors'",
              "ring": "4 GPUs: both rings beside one GPU and PyTorch's context parallelism"}


def cmd_bench(args) -> int:
    if args.what is None:
        raise BadInputError("bench needs a benchmark: " + "; ".join(f"`twinflash bench {name}` ({what})"
                                                                    for name, what in BENCHMARKS.items()))
    if args.what == "kernels":
        from compare.bench.kernel_bench import main as bench_main
    else:
        from compare.bench.ring_bench import main as bench_main
    return bench_main(args.bench_args)


def cmd_train(args) -> int:
    return train.run_command(args)


def cmd_check(args) -> int:
    return check.run_command(args)


def cmd_compare(args) -> int:
    """One node's command; spanning nodes, node 0 runs the compare (`across_nodes.lead_run`) and the others their
    side of the launches that span them (`across_nodes.follow`)."""
    nodes = nodes_from_args(args)
    if not nodes.spans_hosts:
        return compare_command.run_command(args, args.argv)
    if args.out is None:
        raise BadInputError(f"--nnodes {nodes.count}: give --out, the same directory on every node, on a file system "
                            "all nodes see (node 0 writes the report there; the nodes exchange their work through it)")
    if nodes.rank == 0:
        return across_nodes.lead_run(args, nodes, compare_command.run_command)
    gpus = gpu_count()  # the same plan as node 0's, so that bad input ends every node at once
    settings = plan_settings(args, gpus * nodes.count, gpu_memory_bytes() if gpus else None)
    across_nodes.check_placement(settings, nodes, gpus)
    out = args.out.resolve()

    def launcher(backend: str, devices: int, rendezvous, launch_id: str):
        return side_launcher(backend, devices, settings.platform, out / "work", rendezvous, launch_id)

    return across_nodes.follow(args, nodes, out, launcher)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="twinflash", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    convert = commands.add_parser("convert", help="HF Llama safetensors checkpoint -> twinflash converted checkpoint")
    convert.add_argument("hf_dir", type=Path)
    convert.add_argument("out_dir", type=Path, help="must not exist or be empty")
    convert.set_defaults(func=cmd_convert)

    export = commands.add_parser("export", help="twinflash converted checkpoint -> HF Llama checkpoint")
    export.add_argument("converted_dir", type=Path)
    export.add_argument("hf_dir", type=Path, help="must not exist or be empty")
    export.set_defaults(func=cmd_export)

    run = commands.add_parser("run", help="one forward pass: loss, perplexity, wall time, peak memory")
    run.add_argument("--backend", choices=("torch", "jax"), default="torch")
    run.add_argument("--model", default="tiny", help=f"converted checkpoint dir or preset ({', '.join(PRESETS)})")
    source = run.add_mutually_exclusive_group()
    source.add_argument("--tokens", type=Path, help="int .npy of shape [batch, seq_len]")
    source.add_argument("--seq-len", type=integer(2), default=128, help="random tokens: sequence length")
    run.add_argument("--batch", type=integer(1), default=1, help="random tokens: batch size")
    run.add_argument("--seed", type=integer(0, SEED_MAX), default=0,
                     help="random tokens and preset weights seed")
    run.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    run.add_argument("--dump-logits", type=Path, help="write float32 [batch, seq_len, vocab] logits to this new "
                     ".npy file (its directory must exist)")
    run.set_defaults(func=cmd_run)

    training = commands.add_parser("train", help="distributed Llama training (fsdp x sp mesh), train.jsonl per step")
    train.add_arguments(training)
    training.set_defaults(func=cmd_train)

    compare = commands.add_parser("compare", help="both backends, same weights and devices: equivalence + benchmark "
                                  "report (no arguments on a CPU machine: tiny model, 4 emulated devices)")
    compare_command.add_arguments(compare)
    add_node_arguments(compare, "--devices counts every node's devices (default on GPUs: all of them); a launch "
                       "of more devices than a node has spans nodes, the others run on node 0; --out is required, "
                       "on a file system every node sees (node 0 writes the report there)")
    compare.set_defaults(func=cmd_compare)

    checking = commands.add_parser("check", help="the fast path for one backend on a mesh: our attention kernels and "
                                   "a bf16 step against the vendor's and exact answers (a minute after a kernel change)")
    check.add_arguments(checking)
    checking.set_defaults(func=cmd_check)

    bench = commands.add_parser("bench", help="GPU benchmarks: `bench kernels` (1 GPU), `bench ring` (4 GPUs)",
                                description="arguments after the benchmark's name go to it: "
                                            "`twinflash bench kernels --help`")
    bench.add_argument("what", nargs="?", choices=tuple(BENCHMARKS))
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    interpret_triton_without_cuda()  # before any backend import; the workers and torchrun ranks inherit it

    def command() -> int | None:
        args = build_parser().parse_args(argv)
        args.argv = argv[1:]  # recorded in reports: the arguments after the subcommand
        return args.func(args)

    return with_error_contract(command)


if __name__ == "__main__":
    sys.exit(main())
