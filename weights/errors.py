"""The failure side of the run contract, shared by every command and both backends: the bad-input errors and the
exit codes (`compare/args.py` turns a bad-input error into the CLI's one line).

Bad input is what a user can fix (an argument, a mesh that does not match the devices, a sequence length the layout
cannot split, a missing or corrupt checkpoint, token ids outside the vocabulary): `BadInputError`, printed as
`twinflash: error: <cause>` with exit code 2, nothing written. A bug stays an ordinary exception with its traceback.
"""

EXIT_OK = 0
EXIT_CHECK_FAILED = 1  # the command ran, and what it checks did not hold (`twinflash compare`: equivalence)
EXIT_BAD_INPUT = 2


class BadInputError(ValueError):
    """Bad user input: the message names the cause and is printed as it is."""


class CheckpointError(BadInputError):
    """A checkpoint (converted, HF or training) that is missing, corrupt or does not fit the run."""
