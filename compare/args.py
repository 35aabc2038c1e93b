"""What every `twinflash` subcommand's arguments share: the one-line parser, the list-valued argument types, the
command line as results record it (no machine paths), and the one error contract (bad input: one line `twinflash: error: <cause>` on stderr, exit code 2, nothing written;
a bug keeps its traceback). A leaf module: every command imports it, it imports no command.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from collections.abc import Callable

from weights.errors import EXIT_BAD_INPUT, BadInputError


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (argparse prints the usage block too)."""

    def error(self, message: str):
        raise BadInputError(f"{message} (see `{self.prog} --help`)")


def lengths(text: str) -> tuple[int, ...]:
    """'32k,128k' or '32768,131072' -> (32768, 131072)."""
    values = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*([kK]?)\s*", item)
        if not match:
            raise argparse.ArgumentTypeError(f"{item!r} is not a length like 32768 or 32k")
        values.append(int(match[1]) * (1024 if match[2] else 1))
    return tuple(values)


def ints(text: str) -> tuple[int, ...]:
    """'32,8' -> (32, 8)."""
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def with_error_contract(command: Callable[[], int | None], *, quiet: bool = False) -> int:
    """Runs `command()` and returns its exit code (None: 0); bad input ends as one line on stderr (unless `quiet`:
    a process whose peer reports the same error) and EXIT_BAD_INPUT."""
    try:
        return command() or 0
    except BadInputError as bad:
        if not quiet:
            print(f"twinflash: error: {bad}", file=sys.stderr)
        return EXIT_BAD_INPUT


def recorded_command(words: list[str]) -> str:
    """The command line a result records, in terms that hold on any machine: a path inside the working directory
    (the checkout) relative to it, one inside the device's output folder ($OUT) as `$OUT/...`."""
    roots = [(os.getcwd() + os.sep, "")]
    if os.environ.get("OUT"):
        roots.insert(0, (os.environ["OUT"].rstrip(os.sep) + os.sep, "$OUT/"))
    portable = []
    for word in words:
        for root, replacement in roots:
            word = word.replace(root, replacement)
        portable.append(word)
    return shlex.join(portable)
