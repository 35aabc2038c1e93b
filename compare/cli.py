"""The `twinflash` command line, its one entry: the subcommands and their dispatch, under the one error contract of
`compare/args.py` (bad input of any kind, a `weights.errors.BadInputError` or an argument error, ends as one line on
stderr, `twinflash: error: ...`, and exit code 2, with nothing written; bugs keep their traceback). Each subcommand
is a module of compare/commands/ that owns its arguments (`add_arguments`), its help line (`HELP`) and its body
(`run_command`); this module only lists and dispatches them.

Subcommands: `convert` and `export` (weights/), `run`, `train`, `compare` (which drives compare/harness/ and writes
compare/report/), `check` and `bench kernels|ring` (compare/bench/).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from compare.args import OneLineParser, with_error_contract
from compare.commands import bench, check, compare, convert, export, run, train

COMMANDS = {"convert": convert, "export": export, "run": run, "train": train, "compare": compare, "check": check,
            "bench": bench}  # in the order `twinflash --help` lists them


def interpret_triton_without_cuda() -> None:
    """Selects Triton's interpreter (TRITON_INTERPRET=1, unless set) when there is no CUDA GPU, so that the torch
    backend's Triton kernels run on CPU in this process and in every process it starts. Call it before anything
    imports triton: Triton reads the variable when it decorates each kernel, its own library's at import."""
    if "TRITON_INTERPRET" in os.environ or importlib.util.find_spec("torch") is None:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="twinflash", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    for name, command in COMMANDS.items():
        subparser = subparsers.add_parser(name, help=command.HELP)
        command.add_arguments(subparser)
        subparser.set_defaults(func=command.run_command)
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
