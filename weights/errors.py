"""The failure side of the run contract, shared by every command and both backends: the bad-input errors, the exit
codes, and the one place that turns a bad-input error into the CLI's one line.

Bad input is what a user can fix (an argument, a mesh that does not match the devices, a sequence length the layout
cannot split, a missing or corrupt checkpoint, token ids outside the vocabulary): `BadInputError`, printed as
`twinflash: error: <cause>` with exit code 2, nothing written. A bug stays an ordinary exception with its traceback.
"""

from __future__ import annotations

import sys

EXIT_OK = 0
EXIT_CHECK_FAILED = 1  # the command ran, and what it checks did not hold (`twinflash compare`: equivalence)
EXIT_BAD_INPUT = 2


class BadInputError(ValueError):
    """Bad user input: the message names the cause and is printed as it is."""


class CheckpointError(BadInputError):
    """A checkpoint (converted, HF or training) that is missing, corrupt or does not fit the run."""


def report_bad_input(error: BadInputError, *, quiet: bool = False) -> int:
    """Prints `twinflash: error: <cause>` on stderr (unless `quiet`: a process whose peer reports it) and returns
    EXIT_BAD_INPUT, the code every command ends with on bad input."""
    if not quiet:
        print(f"twinflash: error: {error}", file=sys.stderr)
    return EXIT_BAD_INPUT
