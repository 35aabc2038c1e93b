"""Tests of the Hopper family's backward (`torch_impl/kernels/hopper/backward.py` and `backward_ws.py`, Gluon sm_90;
backend "triton_hopper", and "triton" where the Hopper family serves the call).

Gluon has no interpreter: on CPU only the refusals are tested here, of what the kernel cannot run and of config
choices outside their lists (tests/test_triton_compile.py compiles the kernel for sm_90 where the installed Triton
is the one it is written for). The `gpu` tests hold it to the flash rule of
`test_flash_attention_torch.py` (error against a float64 oracle <= 2x the error of a naive same-dtype
implementation + KERNEL_ATOL): GQA 4 and 32 (Hkv 8 and 1 of 32 query heads), lengths that are no multiple of any
block, Sq > Sk (causal rows that see no key: zero dq) and Sq < Sk, causal and not, D 64 and 128, bf16 and fp16;
the pair-level backward from an external float32 out/lse (the ring's path) with float32 gradients against the
portable backward on the same inputs, for every config; and a negative control (a wrong delta) that must fail.
"""

from __future__ import annotations

import dataclasses
import math

import kernel_twins as twins
import pytest
import torch
from test_flash_attention_torch import _exact, _inputs, _naive, _numpy, _ours, _rule_violations

from compare.bench.gluon_sweep import backward_candidates
from torch_impl.kernels.flash_attention import flash_attention_backward
from torch_impl.kernels.hopper.backward import dq_from_register_order, hopper_backward
from torch_impl.kernels.hopper.backward_ws import dq_register_order_bases
from torch_impl.kernels.hopper.config import (DQ_REDUCTIONS, DQ_SWIZZLES, GQA_HEAD_SPLITS, HopperBackwardConfig,
                                              lockstep_config)
from torch_impl.kernels.portable.backward import portable_backward
from torch_impl.kernels.portable.forward import portable_forward
from torch_impl.kernels.tiles import GLUON_AVAILABLE, row_delta

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_HOPPER = DEVICE == "cuda" and torch.cuda.get_device_capability()[0] == 9
needs_gluon_gpu = pytest.mark.skipif(not (ON_HOPPER and GLUON_AVAILABLE),
                                     reason="needs an sm_90 GPU and the Triton release the Gluon kernel is written for")


def test_forced_hopper_backward_refuses_what_it_cannot_run():
    q, k, v, dout = (torch.randn(1, 16, 2, 32, device=DEVICE, dtype=torch.bfloat16) for _ in range(4))
    lse = torch.zeros(1, 2, 16, device=DEVICE)
    expected = "head dims" if ON_HOPPER and GLUON_AVAILABLE else "triton_hopper"
    with pytest.raises(ValueError, match=expected):  # D = 32 (and on CPU: no interpreter for Gluon)
        flash_attention_backward(dout, q, k, v, q, lse, causal=True, softmax_scale=None, backend="triton_hopper")


@pytest.mark.parametrize("field, value, message", [("dq_swizzle", 64, "dq_swizzle 64 is none of"),
                                                   ("dq_reduction", "atomics", "dq_reduction 'atomics' is none of")])
def test_a_backward_config_outside_its_choices_is_refused(field, value, message):
    """The config's own checks (its fields reach the kernel as compile-time layouts and branches); every listed
    choice constructing is the negative control."""
    with pytest.raises(ValueError, match=message):
        HopperBackwardConfig(**{field: value})
    choices = DQ_SWIZZLES if field == "dq_swizzle" else DQ_REDUCTIONS
    assert [getattr(HopperBackwardConfig(**{field: c}), field) for c in choices] == list(choices)


def test_head_splits_below_one_are_refused():
    """`head_splits` shares a GQA group's heads among gcd(head_splits, group) programs: 0 would launch none."""
    with pytest.raises(ValueError, match="head_splits must be >= 1, got 0"):
        HopperBackwardConfig(head_splits=0)
    assert HopperBackwardConfig(head_splits=GQA_HEAD_SPLITS).head_splits == GQA_HEAD_SPLITS


def test_register_order_needs_the_warp_specialised_form_with_64_row_blocks():
    """The register order is laid out for one warpgroup's 64-row wgmma accumulator (`dq_register_order_bases`)."""
    for fields in (dict(warp_specialize=False), dict(warp_specialize=True, block_m=128)):
        with pytest.raises(ValueError, match="dq_register_order takes the warp-specialised backward"):
            HopperBackwardConfig(dq_register_order=True, **fields)
    assert HopperBackwardConfig(warp_specialize=True, dq_register_order=True).dq_register_order


def _register_order_accumulator(dq: torch.Tensor, block_m: int, row_major: bool = False) -> torch.Tensor:
    """dQ [B, Sq, H, D] laid out as the kernel's float32 accumulator in register order, [B, H * seq_pad * D], each
    element placed by its offset's bits (`dq_register_order_bases`); `row_major`: each chunk's tile row-major
    instead (the negative control)."""
    batch, seq_q, n_heads, head_dim = dq.shape
    half_dim, n_blocks = head_dim // 2, -(-seq_q // block_m)
    padded = torch.zeros(batch, n_blocks * block_m, n_heads, head_dim)
    padded[:, :seq_q] = dq
    tiles = padded.view(batch, n_blocks, block_m, n_heads, 2, half_dim).permute(0, 3, 1, 4, 2, 5)
    if row_major:
        return tiles.reshape(batch, -1).contiguous()
    bases = dq_register_order_bases(block_m, half_dim)
    rows, cols = torch.zeros(block_m * half_dim, dtype=torch.long), torch.zeros(block_m * half_dim, dtype=torch.long)
    for bit, (row, col) in enumerate(bases):
        is_set = (torch.arange(block_m * half_dim) >> bit) & 1
        rows, cols = rows ^ is_set * row, cols ^ is_set * col
    assert len({(r, c) for r, c in zip(rows.tolist(), cols.tolist())}) == block_m * half_dim  # every element once
    return tiles[..., rows, cols].reshape(batch, -1).contiguous()


@pytest.mark.parametrize("head_dim", [128, 64])
def test_dq_from_register_order_permutes_scales_and_casts(head_dim):
    """The register-order accumulator's postprocess (plain Triton: under the interpreter here) gives back the dQ it
    holds, scaled, in the gradients' dtype, rows past Sq dropped (100 of 128 padded rows, 2 batches, 3 heads); read
    as row-major tiles (the swizzled form's order) it does not: the permutation is no identity."""
    dq = torch.randn(2, 100, 3, head_dim)
    acc = _register_order_accumulator(dq, 64)
    got = dq_from_register_order(acc, 100, 3, head_dim, 64, 0.5, torch.float32)
    assert torch.equal(got, dq * 0.5)  # exact: a float32 scaling by a power of two
    got = dq_from_register_order(acc, 100, 3, head_dim, 64, 0.5, torch.bfloat16)
    # within a bfloat16 step (2^-7 relative): Triton's interpreter casts by truncation where a GPU rounds
    assert got.dtype == torch.bfloat16 and torch.allclose(got.float(), dq * 0.5, rtol=2 ** -7, atol=0)
    wrong = dq_from_register_order(_register_order_accumulator(dq, 64, row_major=True), 100, 3, head_dim, 64, 0.5,
                                   torch.float32)
    assert not torch.allclose(wrong, dq * 0.5)


# ------------------------------------------------------------------------------------------------------ GPU

def _pair_backward_errors(backward, q, k, v, dout, causal, scale, **kwargs):
    """Max |error| of dq, dk, dv (float32) against float64, from the portable forward's float32 out/lse given as
    the external ones (a ring's global out/lse)."""
    out, lse = portable_forward(q, k, v, causal=causal, softmax_scale=scale, out_dtype=torch.float32)
    grads = backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale, grad_dtype=torch.float32, **kwargs)
    assert all(g.dtype == torch.float32 for g in grads)
    exact = _exact(q, k, v, dout, causal, scale)
    return {name: (g.double() - exact[name]).abs().max().item() for name, g in zip(("dq", "dk", "dv"), grads)}


def _beyond_portable(q, k, v, dout, causal, scale, **kwargs):
    """{name: (hopper error, portable error)} breaking hopper error <= 2x portable error + KERNEL_ATOL: both
    round P and dS to the input dtype for their matmuls, so neither is the more exact by more than that."""
    ours = _pair_backward_errors(hopper_backward, q, k, v, dout, causal, scale, **kwargs)
    portable = _pair_backward_errors(portable_backward, q, k, v, dout, causal, scale)
    return {n: (ours[n], portable[n]) for n in ours if not ours[n] <= 2 * portable[n] + twins.KERNEL_ATOL}


# Every config the sweep times, per head dim (the default first): the lockstep form and the warp-specialised one
# (64- and 128-row query blocks, 2 to 4 stages, one or two dQ tiles per consumer, a GQA group's heads shared among
# programs), dQ by vector atomics, and the lockstep form with the heads shared. The inputs' GQA 4:1 splits 4 ways.
CONFIGS = [(head_dim, config) for head_dim in (128, 64) for config in backward_candidates(head_dim, False)]
CONFIGS.append((128, HopperBackwardConfig(**{**vars(lockstep_config(128)), "dq_reduction": "vector_atomics"})))
CONFIGS.append((128, dataclasses.replace(lockstep_config(128), head_splits=GQA_HEAD_SPLITS)))  # the walk both share


@pytest.mark.gpu
@needs_gluon_gpu
@pytest.mark.parametrize("head_dim, config", CONFIGS, ids=lambda x: str(x))
def test_gpu_hopper_backward_from_external_out_lse_against_portable(head_dim, config):
    q, k, v, dout = _inputs(2, 1000, 1300, 8, 2, head_dim, torch.bfloat16, device="cuda")
    for causal in (True, False):
        beyond = _beyond_portable(q, k, v, dout, causal, 0.1, config=config)
        assert not beyond, f"(hopper, portable) errors beyond 2x: {beyond}"


@pytest.mark.gpu
@needs_gluon_gpu
def test_gpu_wrong_delta_breaks_the_check():
    """Negative control: delta shifted by 0.5 (dS = P (dP - delta)) breaks dq and dk but not dv, so the checks
    above can fail."""
    q, k, v, dout = _inputs(1, 700, 900, 8, 2, 128, torch.bfloat16, device="cuda")
    out, lse = portable_forward(q, k, v, causal=True, softmax_scale=0.1, out_dtype=torch.float32)
    beyond = _beyond_portable(q, k, v, dout, True, 0.1, delta=row_delta(out, dout) + 0.5)
    assert set(beyond) == {"dq", "dk"}, beyond


# (B, Sq, Sk, H, Hkv, D): GQA 4 and 32 (Hkv 8 and 1 of 32), odd lengths with Sq < Sk and Sq == Sk, Sq > Sk
# (causal rows that see no key), and a batch of 2 with one partial key block.
GPU_CASES = [(1, 1000, 1500, 32, 8, 128), (1, 1000, 1500, 32, 1, 64), (1, 777, 777, 32, 1, 128),
             (1, 777, 777, 32, 8, 64), (1, 1500, 1000, 8, 8, 128), (2, 200, 90, 4, 2, 64)]


def _case_id(case):
    return "b{}-sq{}-sk{}-h{}-kv{}-d{}".format(*case)


@pytest.mark.gpu
@needs_gluon_gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gpu_hopper_backward_matches_exact_within_twice_naive_error(causal, case):
    q, k, v, dout = _inputs(*case, torch.bfloat16, device="cuda")
    scale = 1 / math.sqrt(q.shape[-1])
    exact = _exact(q, k, v, dout, causal, scale)
    ours = _ours(q, k, v, dout, causal, scale, backend="triton_hopper")
    violations = _rule_violations(ours, _naive(q, k, v, dout, causal, scale), exact)
    assert not violations, f"(triton_hopper, naive) errors beyond the rule: {violations}"
    twins.assert_unseen_rows_zero(_numpy(ours), _numpy(exact))


@pytest.mark.gpu
@needs_gluon_gpu
@pytest.mark.parametrize("case", [GPU_CASES[0], GPU_CASES[3]], ids=_case_id)
def test_gpu_hopper_backward_float16(case):
    q, k, v, dout = _inputs(*case, torch.float16, device="cuda")
    scale = 1 / math.sqrt(q.shape[-1])
    for causal in (True, False):
        ours = _ours(q, k, v, dout, causal, scale, backend="triton_hopper")
        violations = _rule_violations(ours, _naive(q, k, v, dout, causal, scale), _exact(q, k, v, dout, causal, scale))
        assert not violations, f"(triton_hopper fp16, naive) errors beyond the rule: {violations}"
