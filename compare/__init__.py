"""The `twinflash` command line and everything it drives; the backends never import it. By job:

  cli.py            the one entry (`twinflash`, `python -m compare.cli`): lists the commands and dispatches
  commands/         one module per subcommand, each owning its arguments and body: convert, export, run, train,
                    compare, check, bench
  harness/          the data of `twinflash compare` and `check`: the plan, the jobs, the backend workers, their
                    launches, the verdicts; HF transformers with our ring beside our model (also `bench hf`'s)
  report/           the compare report: its data from the harness's results, renderings, plots, schema, the peers
  bench/            the GPU benchmarks (kernels, ring, the block-size sweeps) and the GPU stage scripts (*.sh)
  args.py           what every command's arguments share and the one error contract (bad input: one line, exit 2)
  launch.py         starting processes: torchrun, JAX with emulated host devices, the settings hand-off
  nodes.py          a run spanning nodes: its arguments, its rendezvous, its failures
  results/          data only: every GPU measurement with a RUN.md naming its command, GPU and commit

The arrows, one way (tests/test_layering.py checks them):

  cli -> commands -> bench ----> harness
                  -> report ---> harness
                  -> harness
  every layer -> args (a leaf), launch, nodes, weights/, and the backends (torch_impl/, jax_impl/)

The harness never imports the report, the commands, the CLI or the benches: the compare command asks the harness for
the data and the report to write it. The report imports from compare/ only the harness (its data types) and args.
The benches read the harness's trace helpers (`ring_bench_workers`) and its HF measurement (`hf_bench`) and never the report or the commands. Only cli.py
imports the commands, and no command imports another. No module is reached by a string: a process of ours runs
`python -m` with the module object's own name (`module.__name__`, `__spec__.name`).
"""
