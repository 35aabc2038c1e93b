"""The subcommands of `twinflash`, one module each, every one with its help line (`HELP`), its arguments
(`add_arguments(parser)`) and its body (`run_command(args)`): `convert`, `export`, `run` (one forward pass), `train`
(distributed training), `compare` (both backends: the harness's data, the report's rendering), `check` (the fast
path on a mesh) and `bench` (the GPU benchmarks of compare/bench/). Only compare/cli.py imports them."""
