"""The one test base of the twin ring attentions, read by tests/test_ring_attention_torch.py and
tests/test_ring_attention_jax.py: the cases both run (ring size, mask, layout, variant, heads, shapes, dtype), the
inputs (numpy, so both backends compute on the same numbers), the exact float64 answer (tests/kernel_twins.py's),
and the two comparisons with their tolerances. A case or a tolerance changed here changes both sides, so the twins
cannot drift.

Tolerances:
  FP32_TOL (fp32 inputs, the "reference" pair backend, against single-device float32 attention on the whole
    sequence): both sides do exact float32 math and differ only in summation order (per-block softmax merged by
    log-sum-exp against one softmax; per-pair gradient sums and dK/dV summed over ring steps against one einsum),
    a few ulps of O(1) values, observed <= 1e-6. A wrong mask or a lost block moves results by >= 1e-2 (the
    negative controls of both files assert that).
  The flash rule (bf16, our own kernels: Triton / Pallas): each result's max error against the float64 answer on
    the same bf16-valued inputs is at most twice the error of the naive same-dtype attention (`reference_attention`
    in bf16) plus BF16_ATOL = 1e-3: a bf16 ulp of an O(1) value is ~4e-3, so the absolute term only matters where
    both errors are ~0. Both sides round matmul inputs and P to bf16 in different orders and blockings; a ring that
    drops or double-counts a block is off by whole score terms, far more.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
from kernel_twins import float64_attention  # the exact answer, shared with the kernel tests

FP32_TOL = dict(rtol=1e-5, atol=1e-5)  # same float32 math in another summation order (module docstring)
BF16_ATOL = 1e-3  # the flash rule's absolute term (module docstring)
NAMES = ("out", "lse", "dq", "dk", "dv")  # what every case compares; lse is [B, H, S], the rest [B, S, heads, D]
LAYOUTS = ("zigzag", "contiguous")
VARIANTS = ("ring", "allgather")


@dataclasses.dataclass(frozen=True)
class RingCase:
    """One ring attention call both backends make: `world` devices, the full sequence of `seq` tokens."""

    world: int
    causal: bool
    layout: str
    variant: str
    heads: int = 4
    kv_heads: int = 2
    batch: int = 2
    seq: int = 32
    dim: int = 32
    dtype: str = "float32"
    seed: int = 0

    @property
    def id(self) -> str:
        return (f"p{self.world}-{'causal' if self.causal else 'full'}-{self.layout}-{self.variant}-"
                f"h{self.heads}kv{self.kv_heads}-s{self.seq}-{self.dtype}")


# fp32, reference pair math: every mask x layout x variant, MHA and two GQA ratios, on 4 devices
FOUR_DEVICES = [RingCase(4, causal, layout, variant, kv_heads=kv_heads) for causal in (True, False)
                for layout in LAYOUTS for variant in VARIANTS for kv_heads in (4, 2, 1)]
TWO_DEVICES = [RingCase(2, True, "zigzag", "ring"), RingCase(2, True, "contiguous", "ring", kv_heads=1),
               RingCase(2, True, "contiguous", "allgather", kv_heads=4),
               RingCase(2, False, "zigzag", "allgather", kv_heads=1)]
ONE_DEVICE = [RingCase(1, causal, layout, variant, seq=10) for causal in (True, False) for layout in LAYOUTS
              for variant in VARIANTS]
# bf16 through our kernels (interpreted on CPU: slow, hence batch 1 and tiny shapes), the flash rule
OUR_KERNELS_BF16 = [RingCase(4, True, "zigzag", "ring", batch=1, dtype="bfloat16"),
                    RingCase(4, True, "zigzag", "allgather", kv_heads=4, batch=1, dtype="bfloat16"),
                    RingCase(4, True, "contiguous", "ring", kv_heads=1, batch=1, dtype="bfloat16"),
                    RingCase(4, False, "zigzag", "ring", batch=1, dtype="bfloat16")]


def ids(cases: list[RingCase]) -> list[str]:
    return [case.id for case in cases]


def inputs(case: RingCase) -> list[np.ndarray]:
    """Full-sequence q, k, v and an output cotangent, standard normal float32 (scores of O(1): the softmax neither
    flat nor one-hot), rounded to bf16 values for a bf16 case (each backend then casts them exactly)."""
    rng = np.random.default_rng(case.seed)
    q_shape, kv_shape = (case.batch, case.seq, case.heads, case.dim), (case.batch, case.seq, case.kv_heads, case.dim)
    arrays = [rng.standard_normal(shape, dtype=np.float32) for shape in (q_shape, kv_shape, kv_shape, q_shape)]
    if case.dtype == "bfloat16":
        arrays = [a.astype(ml_dtypes.bfloat16).astype(np.float32) for a in arrays]
    return arrays


def assert_fp32_close(got: dict, expected: dict) -> None:
    """Every result `expected` holds (NAMES, or fewer) within FP32_TOL."""
    for name in expected:
        np.testing.assert_allclose(np.asarray(got[name]), np.asarray(expected[name]), **FP32_TOL, err_msg=name)


def assert_flash_rule(got: dict, naive: dict, exact: dict) -> None:
    """Each result's max error against `exact` at most twice the naive same-dtype attention's, plus BF16_ATOL."""
    for name in NAMES:
        err = np.max(np.abs(np.asarray(got[name], np.float64) - exact[name]))
        naive_err = np.max(np.abs(np.asarray(naive[name], np.float64) - exact[name]))
        assert err <= 2 * naive_err + BF16_ATOL, f"{name}: error {err:.3g} vs naive same-dtype {naive_err:.3g}"


def assert_matches(case: RingCase, got: dict, single_device_fp32, naive_same_dtype) -> None:
    """The verdict of one case: fp32 against the backend's single-device float32 attention (`single_device_fp32()`,
    a dict of NAMES), low precision by the flash rule with the backend's naive same-dtype attention
    (`naive_same_dtype()`) and the float64 answer."""
    if case.dtype == "float32":
        assert_fp32_close(got, single_device_fp32())
    else:
        assert_flash_rule(got, naive_same_dtype(), float64_attention(*inputs(case), case.causal))
