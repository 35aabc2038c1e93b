"""The one test base of the twin Ulysses / hybrid sequence parallelisms (`torch_impl/ulysses.py`,
`jax_impl/ulysses.py`), read by tests/test_ulysses_torch.py and tests/test_ulysses_jax.py: the cases both run (a
scheme and its Ulysses degree around one tests/ring_twins.py `RingCase`, whose inputs, exact answer and verdicts they
reuse). A case changed here changes both sides, so the twins cannot drift.

Tolerances are ring_twins.py's, for the same reasons: fp32 with the reference pair math against single-device float32
attention (`FP32_TOL`: the same float32 math in another summation order; the all-to-alls only move numbers), bf16
with our kernels by the flash rule (error against float64 at most twice the naive same-dtype attention's plus
1e-3). A wrong token order or a wrong KV head after the all-to-all moves outputs by >= 1e-2 (the negative controls
of both files assert that), far outside both.
"""

from __future__ import annotations

import dataclasses

from ring_twins import RingCase


@dataclasses.dataclass(frozen=True)
class SchemeCase:
    """One sequence-parallel attention call both backends make: `scheme` with Ulysses degree `ulysses_degree` over
    `attention.world` devices, on `attention`'s inputs."""

    scheme: str
    ulysses_degree: int
    attention: RingCase

    @property
    def id(self) -> str:
        return f"{self.scheme}-u{self.ulysses_degree}-{self.attention.id}"


def ids(cases: list[SchemeCase]) -> list[str]:
    return [case.id for case in cases]


# fp32, reference pair math, 4 devices: Ulysses over 4 and hybrid 2 x 2; KV heads below, at and above U (8 query
# heads where Hkv > U needs them), both layouts, both ring variants inside the hybrid, causal and not
FOUR_DEVICES = [
    SchemeCase("ulysses", 4, RingCase(4, True, "zigzag", "ring", heads=8, kv_heads=8)),
    SchemeCase("ulysses", 4, RingCase(4, True, "zigzag", "ring", kv_heads=4)),
    SchemeCase("ulysses", 4, RingCase(4, True, "zigzag", "ring", kv_heads=2)),
    SchemeCase("ulysses", 4, RingCase(4, True, "contiguous", "ring", kv_heads=1)),
    SchemeCase("ulysses", 4, RingCase(4, False, "zigzag", "ring", kv_heads=2)),
    SchemeCase("hybrid", 2, RingCase(4, True, "zigzag", "ring", kv_heads=4)),
    SchemeCase("hybrid", 2, RingCase(4, True, "zigzag", "ring", kv_heads=2)),
    SchemeCase("hybrid", 2, RingCase(4, True, "zigzag", "allgather", kv_heads=1)),
    SchemeCase("hybrid", 2, RingCase(4, True, "contiguous", "ring", kv_heads=1)),
    SchemeCase("hybrid", 2, RingCase(4, True, "contiguous", "allgather", kv_heads=4)),
    SchemeCase("hybrid", 2, RingCase(4, False, "zigzag", "ring", kv_heads=2)),
]
TWO_DEVICES = [SchemeCase("ulysses", 2, RingCase(2, True, "zigzag", "ring", kv_heads=1)),
               SchemeCase("ulysses", 2, RingCase(2, True, "contiguous", "ring", kv_heads=4))]
# bf16 through our kernels (interpreted on CPU: slow, hence batch 1), the flash rule
OUR_KERNELS_BF16 = [SchemeCase("ulysses", 4, RingCase(4, True, "zigzag", "ring", kv_heads=2, batch=1,
                                                      dtype="bfloat16")),
                    SchemeCase("hybrid", 2, RingCase(4, True, "zigzag", "ring", kv_heads=2, batch=1,
                                                     dtype="bfloat16")),
                    SchemeCase("hybrid", 2, RingCase(4, True, "contiguous", "allgather", kv_heads=4, batch=1,
                                                     dtype="bfloat16"))]
# the negative controls' case: causal zigzag (a token order other than positions' changes the mask's answer) with
# KV heads repeated over the Ulysses group (a wrong KV head changes every output of the heads that read it)
NEGATIVE_CONTROL = SchemeCase("ulysses", 4, RingCase(4, True, "zigzag", "ring", kv_heads=2, seed=8))
