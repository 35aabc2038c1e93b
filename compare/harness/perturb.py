"""`--perturb`, the harness's negative controls a user can run: what they mean, their parsing, and which jobs of a
run carry them. Framework-neutral; the backends' halves apply them (`fastpath_torch.py`, `fastpath_jax.py`).

Two kinds:
  BACKEND:PARAM                  one weight of the model scaled by 1 + `jobs.PERTURBATION` once loaded, in the
                                 backend's float32 equivalence job and its noise-floor runs (both of them, so that
                                 its floor stays clean and only the cross pair moves): the float32 checks must fail
                                 and name the parameter.
  BACKEND:attention-T=FACTOR     T one of out, dq, dk, dv: that output of our attention function scaled by FACTOR
                                 (default 1 + `jobs.PERTURBATION`) on the path the benchmark points take, a wrapper
                                 around the attention function the model is given (the ring over our kernels), so
                                 the kernels stay untouched: "out" scales the forward's output (its gradient passes
                                 as it is), "dq" / "dk" / "dv" the gradient the backward returns for q / k / v. It
                                 acts in the backend's bf16 jobs of our kernels that time nothing, as a bf16 kernel
                                 bug would: the fast path's attention check and bf16 step, and the noise floor's
                                 run of our kernels. The float32 checks (float32 math, another path) and the timed
                                 points are left as they are. The fast path must fail naming the backend and T;
                                 the noise floor names the backend's run of our kernels where the error moves
                                 training beyond bf16 noise (out x 1.1 does; 1 % of one output does not: AdamW
                                 divides a gradient by its own scale, tests/test_noise_floor.py).
A job carries its perturbation as one string (`Job.perturb`): the weight's name, or "attention-T=FACTOR".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from compare.harness.jobs import PERTURBATION
from weights import BadInputError

ATTENTION_TENSORS = ("out", "dq", "dk", "dv")
ATTENTION_PREFIX = "attention-"


@dataclasses.dataclass(frozen=True)
class Perturbation:
    """`target`: a parameter name, or "attention-T" with `factor`."""

    backend: str
    target: str
    factor: float = 1 + PERTURBATION

    @property
    def on_attention(self) -> bool:
        return self.target.startswith(ATTENTION_PREFIX)

    def for_job(self, backend: str, kind: str, attention: str, dtype: str) -> str | None:
        """What a job of `backend` and `kind` with `attention` kernels in `dtype` carries (module docstring)."""
        if backend != self.backend:
            return None
        if self.on_attention:
            wanted = kind in ("attention", "gradients", "curve") and attention == "ours" and dtype == "bf16"
            return f"{self.target}={self.factor!r}" if wanted else None
        return self.target if kind in ("equivalence", "curve") else None


@dataclasses.dataclass(frozen=True)
class ScaledAttention:
    """Wraps an attention function `fn(q, k, v) -> out`: its output ("out": the forward's value alone) or the
    gradient it returns for q, k or v ("dq", "dk", "dv") scaled by `factor`. Hashable by value (a JAX step's jit
    cache key). Each backend's subclass gives its two primitives: `constant(x)` (x without a gradient) and
    `scaled_gradient(x, factor)` (the identity whose backward scales the gradient)."""

    tensor: str
    factor: float

    @staticmethod
    def constant(x):
        raise NotImplementedError

    @staticmethod
    def scaled_gradient(x, factor: float):
        raise NotImplementedError

    def __call__(self, fn: Callable) -> Callable:
        def attend(q, k, v):
            if self.tensor == "out":
                out = fn(q, k, v)
                return out + (self.factor - 1) * self.constant(out)
            q, k, v = (self.scaled_gradient(x, self.factor) if f"d{name}" == self.tensor else x
                       for name, x in zip("qkv", (q, k, v)))
            return fn(q, k, v)

        return attend


def attention_scaling(value: str | None) -> tuple[str, float] | None:
    """(tensor, factor) of a job's attention perturbation, None for none or a weight's."""
    if value is None or not value.startswith(ATTENTION_PREFIX):
        return None
    tensor, _, factor = value.removeprefix(ATTENTION_PREFIX).partition("=")
    return tensor, float(factor)


def weight_scaling(value: str | None) -> str | None:
    """The parameter a job's perturbation scales, None for none or an attention perturbation."""
    return None if value is None or value.startswith(ATTENTION_PREFIX) else value


def parse(text: str, backends: tuple[str, ...] | list[str], parameters) -> Perturbation:
    """`--perturb` validated against the run's backends and the model's parameter names (BadInputError)."""
    backend, _, target = text.partition(":")
    if backend not in backends:
        raise BadInputError(f"--perturb takes BACKEND:PARAM or BACKEND:attention-{{{','.join(ATTENTION_TENSORS)}}}"
                            f"=FACTOR with a backend of {list(backends)}, got {text!r}")
    if not target.startswith(ATTENTION_PREFIX):
        if target not in parameters:
            raise BadInputError(f"--perturb {text!r}: {target!r} is no parameter of the model (e.g. "
                                f"{backend}:layers.0.attention.wq.weight) nor attention-T=FACTOR with T one of "
                                f"{', '.join(ATTENTION_TENSORS)}")
        return Perturbation(backend, target)
    tensor, equals, factor_text = target.removeprefix(ATTENTION_PREFIX).partition("=")
    try:
        factor = float(factor_text) if equals else 1 + PERTURBATION
    except ValueError:
        factor = math.nan
    if tensor not in ATTENTION_TENSORS or not (math.isfinite(factor) and factor > 0):
        raise BadInputError(f"--perturb {text!r}: expected {backend}:attention-T=FACTOR with T one of "
                            f"{', '.join(ATTENTION_TENSORS)} and a positive FACTOR, e.g. {backend}:attention-dq=1.01")
    return Perturbation(backend, f"{ATTENTION_PREFIX}{tensor}", factor)
