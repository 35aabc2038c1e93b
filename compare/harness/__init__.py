"""The data of `twinflash compare` (the command is compare/commands/compare.py, the report compare/report/): its
plan (plan.py), the jobs and their files (jobs.py), the backend workers (worker_torch.py, worker_jax.py), their
launches and relaunches (launches.py, across_nodes.py for a run spanning nodes), the verdicts (equivalence.py,
fastpath.py, noise_floor.py) and the live progress (progress.py). It never imports the report, the commands, the
CLI or the benches."""
