"""The equivalence section of `twinflash compare`: each backend against the float32 single-device reference, and
the two backends against each other, from the files their equivalence jobs left (`compare/harness/jobs.py`). Owns the
metrics (logits max-abs, mean-abs and KL divergence, loss, per-parameter gradient max-abs difference and norm
ratio, loss curves, the loaded weights' sums) and their tolerances, each with the reason beside it.

All comparisons are float32 computations of the same math in a different order (ring merge by log-sum-exp, sharded
matmuls and reductions, another framework's kernels): the tolerances are relative to the size of the compared
quantity, a few hundred to a thousand float32 ulps, and far below what a real mistake moves (a weight scaled by
1 % moves the logits by ~1e-2 relative: `--perturb`, tests/test_compare.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from weights.training import BACKENDS

# (tolerance, why); "scale" is the reference's size: max |logits|, max |gradient|, |loss|.
LOGITS_MAX_ABS = (1e-4, "relative to max |reference logits|: float32 sums in another order (ring merge, sharded "
                        "matmuls, other kernels) differ by ~1e-6 relative; 1e-4 leaves room for deep models")
LOGITS_MEAN_ABS = (1e-5, "relative to mean |reference logits|: the typical error, 10x tighter than the worst")
LOGITS_KL = (1e-6, "nats per position, KL(reference || other) of the next-token distributions: float32 noise is "
                   "~1e-10; a 1 % weight change gives ~1e-4")
LOSS_ABS = (1e-5, "relative to the reference loss: the mean of float32 cross-entropies reduced in another order")
GRADIENT_MAX_ABS = (1e-3, "relative to max |reference gradient| of each parameter: gradients pass back through "
                          "every layer and the ring's backward (dK/dV accumulated over the ring), so their float32 "
                          "error grows with depth; a real mismatch moves them by percent")
GRADIENT_NORM_RATIO = (1e-4, "|norm(other) / norm(reference) - 1| per parameter: the gradient's size, summed over "
                             "all its elements")
LOSS_CURVE_ABS = (1e-4, "relative to the reference loss, the worst step: the trained weights drift apart by float32 "
                        "rounding step by step (AdamW divides by sqrt(v), which amplifies tiny gradients' noise)")
WEIGHTS_EXACT = (1e-12, "the same converted weights cast to float32 in both backends: float64 sums of identical values "
                      "agree to ~1e-15 whatever the order; any real difference names a weight loaded, converted or "
                      "perturbed differently")


def _check(metric: str, value: float, rule: tuple[float, str]) -> dict:
    tolerance, why = rule
    value = float(value)
    return {"metric": metric, "value": value, "tolerance": tolerance, "passed": bool(value <= tolerance), "why": why}


# Elements per streamed pass (a float64 chunk of 32 MiB): the 1B shape's gradients hold 1.24e9 values per backend,
# whose whole-array float64 temporaries cost minutes of page faults and memory traffic per comparison.
CHUNK_ELEMENTS = 1 << 22


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _logits_metrics(logits: np.ndarray, reference: np.ndarray) -> tuple[float, float, float, float, float]:
    """(max |diff|, mean |diff|, max |reference|, mean |reference|, worst KL(reference || other)) in float64, a
    band of positions at a time."""
    vocab = reference.shape[-1]
    ours, ref = logits.reshape(-1, vocab), reference.reshape(-1, vocab)
    rows = max(1, CHUNK_ELEMENTS // vocab)
    max_diff = diff_sum = ref_max = ref_sum = kl = 0.0
    for start in range(0, ref.shape[0], rows):
        a, b = ours[start:start + rows].astype(np.float64), ref[start:start + rows].astype(np.float64)
        diff = np.abs(a - b)
        max_diff, diff_sum = max(max_diff, float(diff.max())), diff_sum + float(diff.sum())
        ref_max, ref_sum = max(ref_max, float(np.abs(b).max())), ref_sum + float(np.abs(b).sum())
        ref_logp, logp = _log_softmax(b), _log_softmax(a)
        kl = max(kl, float(np.max(np.sum(np.exp(ref_logp) * (ref_logp - logp), axis=-1))))
    return max_diff, diff_sum / ref.size, ref_max, ref_sum / ref.size, kl


def float64_chunks(array: np.ndarray) -> Iterator[np.ndarray]:
    """`array`'s values in order, as float64 copies of CHUNK_ELEMENTS at a time."""
    flat = array.reshape(-1)
    for start in range(0, flat.size, CHUNK_ELEMENTS):
        yield flat[start:start + CHUNK_ELEMENTS].astype(np.float64)


def _gradient_metrics(grad: np.ndarray, reference: np.ndarray) -> tuple[float, float, float, float]:
    """(max |grad - reference|, max |reference|, norm(grad), norm(reference)) in float64, a chunk at a time."""
    max_diff = ref_max = squares = ref_squares = 0.0
    for a, b in zip(float64_chunks(grad), float64_chunks(reference), strict=True):
        squares, ref_squares = squares + float(a @ a), ref_squares + float(b @ b)
        max_diff = max(max_diff, float(np.abs(np.subtract(a, b, out=a), out=a).max()))
        ref_max = max(ref_max, float(np.abs(b, out=b).max()))
    return max_diff, ref_max, math.sqrt(squares), math.sqrt(ref_squares)


def load_equivalence(work_dir: Path, job_id: str, result: dict) -> dict:
    """A job's result with its arrays: {"loss", "loss_curve", "weight_sums", "logits", "grads": {name: array}}."""
    arrays = load_file(str(work_dir / f"{job_id}.safetensors"))
    grads = {name.removeprefix("grad/"): a for name, a in arrays.items() if name.startswith("grad/")}
    return {**result, "logits": arrays["logits"], "grads": grads}


def compare_pair(name: str, ours: dict, reference: dict) -> dict:
    """One comparison of the report: `ours` against `reference` (both `load_equivalence` dicts)."""
    max_diff, mean_diff, ref_max, ref_mean, kl = _logits_metrics(ours["logits"], reference["logits"])
    checks = [
        _check("logits max-abs", max_diff / max(1.0, ref_max), LOGITS_MAX_ABS),
        _check("logits mean-abs", mean_diff / max(1e-6, ref_mean), LOGITS_MEAN_ABS),
        _check("logits KL", kl, LOGITS_KL),
        _check("loss abs diff", abs(ours["loss"] - reference["loss"]) / max(1.0, abs(reference["loss"])), LOSS_ABS),
    ]
    parameters = []
    for param, ref_grad in reference["grads"].items():
        grad_diff, grad_max, norm, ref_norm = _gradient_metrics(ours["grads"][param], ref_grad)
        max_diff = grad_diff / max(grad_max, 1e-30)
        ratio = norm / ref_norm if ref_norm > 0 else float(norm == 0)
        ref_sums, sums = reference["weight_sums"][param], ours["weight_sums"][param]
        weight_diff = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(sums, ref_sums))
        passed = (max_diff <= GRADIENT_MAX_ABS[0] and abs(ratio - 1) <= GRADIENT_NORM_RATIO[0]
                  and weight_diff <= WEIGHTS_EXACT[0])
        parameters.append({"name": param, "max_abs_diff": max_diff, "norm_ratio": ratio,
                           "weight_sum_diff": weight_diff, "passed": passed})
    checks.append(_check("loaded weights, worst relative sum difference",
                         max(p["weight_sum_diff"] for p in parameters), WEIGHTS_EXACT))
    checks.append(_check("gradient max-abs (worst parameter)", max(p["max_abs_diff"] for p in parameters),
                         GRADIENT_MAX_ABS))
    checks.append(_check("gradient norm ratio (worst)", max(abs(p["norm_ratio"] - 1) for p in parameters),
                         GRADIENT_NORM_RATIO))
    if ours["loss_curve"] and reference["loss_curve"]:
        curve = np.abs(np.subtract(ours["loss_curve"], reference["loss_curve"]))
        checks.append(_check("loss curve max-abs", float(curve.max()) / max(1.0, abs(reference["loss"])),
                             LOSS_CURVE_ABS))
    return {"name": name, "passed": all(c["passed"] for c in checks), "checks": checks, "parameters": parameters}


def equivalence_section(loaded: dict[str, dict], *, seq_len: int, devices: int, layers: int,
                        reference_description: str) -> dict:
    """The report's "equivalence" dict from `load_equivalence` dicts keyed "reference", "torch", "jax" (the
    backends that ran) and "<backend>-<scheme>" (the sequence-parallel schemes besides the ring, `twinflash compare
    --schemes`): each backend against the reference, then torch against jax, then each scheme's run against the
    reference."""
    backends = [b for b in BACKENDS if b in loaded]
    pairs = [(f"{b} vs reference", b, "reference") for b in backends]
    if len(backends) == 2:
        pairs.append(("torch vs jax", "torch", "jax"))
    pairs += [(f"{name.replace('-', ' ')} vs reference", name, "reference") for name in loaded
              if name not in (*BACKENDS, "reference")]
    with ThreadPoolExecutor(len(pairs)) as pool:  # numpy's loops and BLAS release the GIL: one core per pair
        comparisons = list(pool.map(lambda pair: compare_pair(pair[0], loaded[pair[1]], loaded[pair[2]]), pairs))
    curves = {name: list(run["loss_curve"]) for name, run in loaded.items() if run["loss_curve"]}
    return {"seq_len": seq_len, "devices": devices, "layers": layers, "dtype": "fp32",
            "reference": reference_description, "passed": all(c["passed"] for c in comparisons),
            "comparisons": comparisons, "loss_curves": curves}
