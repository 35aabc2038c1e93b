"""The median-of-n wall-clock timer both GPU probes (probe1.py, probe2.py) time their JAX calls with. The probes
run as scripts (`python compare/results/hopper-probe-2026-11-22-h200/probe1.py`), so this folder is on their path."""
import time

import jax


def bench(fn, *a, n=10):
    """Median milliseconds of `fn(*a)` over n calls, after two warm-up calls (compilation)."""
    for _ in range(2): jax.block_until_ready(fn(*a))
    ts = []
    for _ in range(n):
        t = time.perf_counter(); jax.block_until_ready(fn(*a)); ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2] * 1e3
