"""GPU acceptance of the bf16 fast path (issue 32, item 3; issue 33): `twinflash check` of the Llama-3.2-1B shape on
2 GPUs (fsdp=1 x sp=2) in each backend, i.e. our attention kernels in the ring (Gluon in torch, Mosaic in JAX) and
one bf16 training step of the whole model with them, every parameter's gradient distance to the float32 step within
2x the vendor kernel's (cuDNN) in the same ring; and its negative control: JAX's dq scaled by 1.01 must fail, named.

Run through the CLI as a user does (one launch per backend: torchrun over the GPUs, or one JAX process), so what is
checked is the code the benchmarks time. The `gpu` marker: skipped without 2 CUDA GPUs, not run in CI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from weights import PRESETS, parameter_shapes

ROOT = Path(__file__).resolve().parent.parent
MODEL = "llama3.2-1b"
TIMEOUT_S = 420  # one launch: the float32 step, then the attention and the bf16 step with each kernel (~2 min seen)


def _gpus() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count()


needs_two_gpus = pytest.mark.skipif(_gpus() < 2, reason="needs 2 CUDA GPUs")


def _check(backend: str, out: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    done = subprocess.run([sys.executable, "-m", "compare.cli", "check", "--backend", backend, "--model", MODEL,
                           "--mesh", "fsdp=1,sp=2", "--out", str(out), *extra], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    report = out / "check.json"
    return done, json.loads(report.read_text()) if report.exists() else None


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_gpu_bf16_step_of_the_1b_shape_on_two_gpus_within_twice_the_vendor(backend, tmp_path):
    done, section = _check(backend, tmp_path / "check")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    parameters = len(parameter_shapes(PRESETS[MODEL]))
    (step,) = [s for s in section["steps"] if s["devices"] == 2]
    per_parameter = [c for c in step["checks"] if c.get("statistic") != "vendor_relative"]
    assert len(per_parameter) >= parameters, "a parameter's gradient was not compared"
    assert step["passed"] and section["passed"]
    attention = [a for a in section["attention"] if a["devices"] == 2]
    assert attention and all(a["passed"] for a in attention)


@pytest.mark.gpu
@needs_two_gpus
def test_gpu_check_fails_naming_a_scaled_jax_dq(tmp_path):
    """Negative control: the same check with JAX's dq from our kernel scaled by 1.01 fails and names jax and dq."""
    done, section = _check("jax", tmp_path / "check", "--perturb", "jax:attention-dq=1.01")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert section is not None and not section["passed"]
    named = [line for line in section["failures"] if line.startswith("jax attention") and " dq " in line]
    assert named, section["failures"]
    assert not [line for line in section["failures"] if any(f" {t} " in line for t in ("out", "dk", "dv"))]
