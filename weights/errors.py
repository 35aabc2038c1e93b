"""The error type for bad input that the CLI reports as one line with exit code 2.

Raised for what a user can fix (a missing or corrupt checkpoint, a shape that disagrees with the config, an
unknown preset, token ids outside the vocabulary); a bug stays an ordinary exception with its traceback.
"""


class CheckpointError(ValueError):
    """Bad user input: the message names the cause and is printed as it is."""
