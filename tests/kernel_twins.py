"""The one test base of the twin FlashAttention kernels, read by tests/test_flash_attention_torch.py and
tests/test_flash_attention_jax.py (and the Hopper kernel tests through them): the cases both run (lengths odd,
equal and unequal, a single query and a single key, MHA and GQA, head dims 32 to 256, causal and full, bf16 and
fp16; fp32 cases), the inputs (numpy, so both backends compute on the same numbers), the exact float64 answer, and
the comparisons with their tolerances. A case or a tolerance changed here changes both sides, so the twins cannot
drift. tests/ring_twins.py is the ring's twin of this module and takes its float64 answer from here.

Semantics the answer encodes (both backends' contract): causal aligns the last query with the last key (query i
sees key j iff j <= i + Sk - Sq); a query that sees no key has out 0, lse -inf and zero gradients.

Tolerances:
  The flash rule (bf16/fp16 through our kernels; FlashAttention's own test criterion): each of out, lse, dq, dk,
    dv has a max error against the float64 answer at most twice the error of the naive attention computing in the
    same dtype (matmuls in the input dtype, softmax in float32) plus KERNEL_ATOL. Both round matmul inputs and P
    to the input dtype, in different orders and blockings; the factor 2 absorbs that, while a real defect (a lost
    block, a wrong scale or wrong row statistics) costs whole score terms, far more: the negative control asserts
    the rule fails for a scale WRONG_SCALE_FACTOR off and for k and v swapped. KERNEL_ATOL = 1e-4 only matters
    where the naive result is exact (a single key: out = v, dq = 0) and ours differs by float32 summation order,
    ~1e-6; the two sides had 1e-4 (torch) and 1e-3 (JAX), both kernels meet the tighter one. The naive error is
    floored at the ROUNDING FLOOR, half an ulp of the answer's largest magnitude in the result's 16-bit dtype: every
    implementation returning that dtype rounds the answer once, and over a tensor of a few elements the naive one can
    land under that by luck (1 query, 2 keys: naive dk 0.0022 where half an ulp is 0.0039, ours 0.0045), which no
    kernel could be held to; over larger tensors the naive error is above the floor and the rule is unchanged.
  FP32_TOL (fp32 inputs; kernel against the float64 answer, or against our fp32 reference attention): both sides
    do exact float32 arithmetic (IEEE dots, no TF32) and differ only in summation order, a few ulps: observed
    <= 2e-6 absolute on results up to ~6 (FP32_CASES); rtol = atol = 2e-5 leaves 10x (torch had 1e-4 both, JAX
    atol 2e-5 alone; the relative term keeps the bound honest for the larger dk/dv of longer sequences). TF32, at
    ~1e-3, fails it.
  HALF_P_TOL (two of our own bf16 computations of the same attention that round P at different row maxima: pair
    partials merged by lse against one full pass, or the kernel against the fp32 reference pair functions on the
    same bf16 inputs): the kernel rounds P to bf16 (eps 2^-8 ~ 4e-3 relative) before the PV matmul, relative to
    the running row max of its own pass, so the two differ by a few bf16 ulps of P summed over keys, an error
    relative to the result: observed <= 3.2e-3 (torch, merged pairs) and <= 8.7e-3 on values up to 4.6 (JAX,
    kernel vs reference pairs); rtol = atol = 1e-2 (torch's; JAX had atol 3e-2 alone, looser for every value
    below 2). A dropped block moves results by whole score terms (>= 1e-1).
"""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np

NAMES = ("out", "lse", "dq", "dk", "dv")  # lse is [B, H, Sq]; out, dq [B, Sq, H, D]; dk, dv [B, Sk, Hkv, D]
KERNEL_ATOL = 1e-4  # the flash rule's absolute floor (module docstring)
FP32_TOL = dict(rtol=2e-5, atol=2e-5)  # float32 math in another summation order (module docstring)
HALF_P_TOL = dict(rtol=1e-2, atol=1e-2)  # bf16 P rounded at different row maxima (module docstring)
WRONG_SCALE_FACTOR = 1.1  # the negative control's scale error: 10 %
HALF_DTYPES = ("bfloat16", "float16")
_NUMPY_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}


@dataclasses.dataclass(frozen=True)
class KernelCase:
    """One attention call both backends make: q [batch, seq_q, heads, dim], k/v [batch, seq_k, kv_heads, dim]."""

    seq_q: int
    seq_k: int
    heads: int
    kv_heads: int
    dim: int
    batch: int = 1

    @property
    def id(self) -> str:
        return f"b{self.batch}-q{self.seq_q}-k{self.seq_k}-h{self.heads}kv{self.kv_heads}-d{self.dim}"


# bf16/fp16, causal and full, by the flash rule. Each case names what it covers; kept small because both
# backends interpret their kernels on CPU (every case here runs 4 times per backend).
HALF_CASES = [
    KernelCase(97, 97, 2, 2, 64),     # odd tails, MHA
    KernelCase(200, 200, 4, 1, 32),   # several blocks each way, GQA 4:1
    KernelCase(1, 1, 1, 1, 128),      # a single query and key: the naive result is exact (KERNEL_ATOL)
    KernelCase(1, 200, 2, 2, 128),    # one query against many keys
    KernelCase(97, 200, 4, 1, 64),    # Sq < Sk
    KernelCase(200, 97, 2, 2, 64),    # Sq > Sk: causal rows that see no key
    KernelCase(64, 80, 2, 1, 128),    # GQA 2:1, head dim 128
    KernelCase(37, 37, 1, 1, 96),     # head dim 96, padded inside the kernels
    KernelCase(40, 24, 2, 1, 256),    # the widest head dim, Sq > Sk
]
# fp32 (the CPU model tests' path), causal with Sq != Sk, within FP32_TOL of the float64 answer
FP32_CASES = [KernelCase(45, 70, 4, 2, 32, batch=2), KernelCase(45, 70, 6, 2, 96, batch=2),
              KernelCase(33, 20, 2, 1, 256)]
NEGATIVE_CONTROL = KernelCase(97, 97, 4, 2, 32)  # bf16, causal: the rule must fail for a wrong kernel
UNSEEN_ROWS = KernelCase(50, 20, 2, 1, 32)  # causal: queries 0..29 see no key


def ids(cases: list[KernelCase]) -> list[str]:
    return [case.id for case in cases]


def inputs(case: KernelCase, dtype: str, seed: int = 0) -> list[np.ndarray]:
    """q, k, v and an output cotangent, standard normal (scores of O(1): the softmax neither flat nor one-hot),
    as float32 arrays holding values of `dtype` (each backend then casts them exactly)."""
    rng = np.random.default_rng(seed)
    q_shape = (case.batch, case.seq_q, case.heads, case.dim)
    kv_shape = (case.batch, case.seq_k, case.kv_heads, case.dim)
    arrays = [rng.standard_normal(shape, dtype=np.float32) for shape in (q_shape, kv_shape, kv_shape, q_shape)]
    return [a.astype(_NUMPY_DTYPES[dtype]).astype(np.float32) for a in arrays]


def float64_attention(q, k, v, dout, causal: bool, scale: float | None = None) -> dict[str, np.ndarray]:
    """The exact answer in float64 numpy from the (already rounded) inputs: {out, lse, dq, dk, dv} of
    softmax(scale q k^T) v, scale 1/sqrt(D) by default; GQA by repeating K/V heads (their gradients folded back);
    causal bottom-right aligned; a row that sees no key gets out 0, lse -inf, zero gradients. Batched matmuls
    (BLAS) rather than einsum, so the GPU tests' real sizes stay quick."""
    q, k, v, dout = (np.asarray(x, np.float64) for x in (q, k, v, dout))
    seq_q, seq_k, group = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    qh, doh = q.transpose(0, 2, 1, 3), dout.transpose(0, 2, 1, 3)  # [B, H, S, D]
    kh, vh = (np.repeat(x, group, axis=2).transpose(0, 2, 1, 3) for x in (k, v))
    scores = qh @ kh.swapaxes(-1, -2) * scale  # [B, H, Sq, Sk]
    if causal:
        scores = np.where(np.arange(seq_k)[None, :] <= np.arange(seq_q)[:, None] + seq_k - seq_q, scores, -np.inf)
    row_max = scores.max(-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    total = np.exp(scores - row_max).sum(-1)
    with np.errstate(divide="ignore"):
        lse = np.where(total > 0, np.log(total) + row_max[..., 0], -np.inf)
    probs = np.where(total[..., None] > 0, np.exp(scores - np.where(np.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    out = probs @ vh
    dscores = probs * (doh @ vh.swapaxes(-1, -2) - np.sum(doh * out, -1)[..., None]) * scale

    def rows_major(x):  # [B, H, S, D] -> [B, S, H, D]
        return x.transpose(0, 2, 1, 3)

    def fold(x):  # gradients of the repeated K/V heads, [B, H, Sk, D], summed back to [B, Sk, Hkv, D]
        return rows_major(x).reshape(x.shape[0], seq_k, k.shape[2], group, x.shape[-1]).sum(3)

    return {"out": rows_major(out), "lse": lse, "dq": rows_major(dscores @ kh),
            "dk": fold(dscores.swapaxes(-1, -2) @ qh), "dv": fold(probs.swapaxes(-1, -2) @ doh)}


def max_errors(got: dict, exact: dict) -> dict[str, float]:
    """Max abs error per result against the float64 answer. lse must be -inf exactly where the answer's is (rows
    that see no key) and is compared elsewhere; every other result must be finite."""
    errors = {}
    for name in NAMES:
        g, e = np.asarray(got[name], np.float64), exact[name]
        if name == "lse":
            np.testing.assert_array_equal(np.isneginf(g), np.isneginf(e), err_msg="lse: rows that see no key")
            g, e = np.where(np.isfinite(e), g, 0.0), np.where(np.isfinite(e), e, 0.0)
        assert np.all(np.isfinite(g)), f"{name} has NaN/inf"
        errors[name] = float(np.max(np.abs(g - e))) if g.size else 0.0
    return errors


def rounding_floor(naive, exact) -> float:
    """Half an ulp of the answer's largest finite magnitude in the naive result's dtype, the narrowest 16-bit float
    (bfloat16, float16) holding every naive value exactly (the results arrive as float64); 0 for a wider result."""
    naive, exact = np.asarray(naive, np.float64), np.asarray(exact, np.float64)
    finite = exact[np.isfinite(exact)]
    if not finite.size or not np.all(np.isfinite(naive)):
        return 0.0
    for dtype in (ml_dtypes.bfloat16, np.float16):
        if np.array_equal(naive.astype(dtype).astype(np.float64), naive):
            return float(np.spacing(np.abs(finite).max().astype(dtype)).astype(np.float64)) / 2
    return 0.0


def flash_rule_violations(got: dict, naive: dict, exact: dict) -> dict[str, tuple[float, float]]:
    """{name: (our error, naive error)} for each result breaking err <= 2 * max(naive err, rounding floor) +
    KERNEL_ATOL (module docstring)."""
    ours, theirs = max_errors(got, exact), max_errors(naive, exact)
    bounds = {name: 2 * max(theirs[name], rounding_floor(naive[name], exact[name])) + KERNEL_ATOL for name in NAMES}
    return {name: (ours[name], theirs[name]) for name in NAMES if not ours[name] <= bounds[name]}


def assert_fp32_close(got: dict, expected: dict) -> None:
    """Every result `expected` holds within FP32_TOL (lse compared where finite, -inf where the answer's is)."""
    for name in expected:
        np.testing.assert_allclose(np.asarray(got[name], np.float64), np.asarray(expected[name], np.float64),
                                   **FP32_TOL, err_msg=name)


def assert_unseen_rows_zero(got: dict, exact: dict) -> None:
    """Query rows that see no key (the answer's lse -inf) have out and dq exactly 0."""
    unseen = np.isneginf(exact["lse"]).transpose(0, 2, 1)  # [B, Sq, H]
    for name in ("out", "dq"):
        assert not np.any(np.asarray(got[name], np.float32)[unseen]), f"{name} nonzero on rows that see no key"
