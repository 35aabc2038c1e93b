"""`twinflash compare`: the command (command.py), its plan (plan.py), the jobs and their files (jobs.py), the
backend workers (worker_torch.py, worker_jax.py), their launches and relaunches (launches.py), and the equivalence
verdicts (equivalence.py)."""
