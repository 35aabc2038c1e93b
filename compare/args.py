"""What every `twinflash` subcommand's arguments share: the one-line parser, the list-valued argument types, the
command line as results record it (no machine paths), and the one error contract (bad input: one line `twinflash: error: <cause>` on stderr, exit code 2, nothing written;
a bug keeps its traceback). A leaf module: every command imports it, it imports no command.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import sys
from collections.abc import Callable

from weights.errors import EXIT_BAD_INPUT, BadInputError


SEED_MAX = 2**32 - 1  # numpy, torch and JAX all take seeds up to here


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (argparse prints the usage block too)."""

    def error(self, message: str):
        raise BadInputError(f"{message} (see `{self.prog} --help`)")


def _distinct_positive(values: list[int], text: str) -> tuple[int, ...]:
    if any(value < 1 for value in values):
        raise argparse.ArgumentTypeError(f"every value must be >= 1, got {text!r}")
    repeated = sorted({value for value in values if values.count(value) > 1})
    if repeated:
        raise argparse.ArgumentTypeError(f"{', '.join(map(str, repeated))} given twice in {text!r}")
    return tuple(values)


def lengths(text: str) -> tuple[int, ...]:
    """'32k,128k' or '32768,131072' -> (32768, 131072): distinct, positive."""
    values = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*([kK]?)\s*", item)
        if not match:
            raise argparse.ArgumentTypeError(f"{item!r} is not a length like 32768 or 32k")
        values.append(int(match[1]) * (1024 if match[2] else 1))
    return _distinct_positive(values, text)


def ints(text: str) -> tuple[int, ...]:
    """'32,8' -> (32, 8): distinct, positive."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    return _distinct_positive(values, text)


def names(choices: tuple[str, ...]) -> Callable[[str], str]:
    """An argument type: a comma-separated list of distinct `choices`, returned as 'a,b' (spaces dropped)."""
    def parse(text: str) -> str:
        items = [x.strip() for x in text.split(",")]
        bad = [x for x in items if x not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"takes a comma-separated list of {', '.join(choices)}; got {text!r}")
        repeated = sorted({x for x in items if items.count(x) > 1})
        if repeated:
            raise argparse.ArgumentTypeError(f"{', '.join(repeated)} given twice in {text!r}")
        return ",".join(items)

    return parse


def integer(least: int, most: int | None = None) -> Callable[[str], int]:
    """An argument type: an integer in least..most (0 is a value like any other, never "the default")."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < least or (most is not None and value > most):
            bounds = f">= {least}" if most is None else f"in {least}..{most}"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {value}")
        return value

    return parse


def number(least: float, *, above: bool = False) -> Callable[[str], float]:
    """An argument type: a finite float >= `least` (> `least` when `above`); nan and inf are refused."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if value < least or (above and value == least):
            raise argparse.ArgumentTypeError(f"must be {'>' if above else '>='} {least:g}, got {value:g}")
        return value

    return parse


def with_error_contract(command: Callable[[], int | None], *, quiet: bool = False) -> int:
    """Runs `command()` and returns its exit code (None: 0); bad input ends as one line on stderr (unless `quiet`:
    a process whose peer reports the same error) and EXIT_BAD_INPUT. So does a file system error on a named path
    (a full disk, a read-only file system, a directory removed under a run), printed by every process: it may be
    one process's alone."""
    try:
        return command() or 0
    except BadInputError as bad:
        if not quiet:
            print(f"twinflash: error: {bad}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as error:
        if error.filename is None:  # not about a path the user gave (a socket, a bug): keep the traceback
            raise
        paths = " -> ".join(str(p) for p in (error.filename, error.filename2) if p is not None)
        print(f"twinflash: error: {paths}: {error.strerror or error}", file=sys.stderr)
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
