"""The `twinflash` command line and everything it drives; the backends never import it. By job:

  cli.py, args.py   the one entry (`twinflash`, `python -m compare.cli`), the subcommands' dispatch and the one
                    error contract (bad input: one line, exit 2)
  commands/         `twinflash run` (one forward pass) and `twinflash train` (distributed training)
  launch.py         starting processes: torchrun, JAX with emulated host devices, the settings hand-off
  harness/          `twinflash compare`: the plan, the jobs, the backend workers, their launches, equivalence
  report/           the compare report: its data, renderings, plots, schema and the peers' numbers
  bench/            the GPU benchmarks (kernels, ring, the Pallas block-size sweep) and gpu_suite.sh
  results/          every GPU measurement, with its command and machine
"""
