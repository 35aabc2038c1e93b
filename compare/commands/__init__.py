"""The subcommands of `twinflash` with more than a few lines of their own: `run` (run.py) and `train` (train.py)."""
