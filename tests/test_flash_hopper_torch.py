"""Tests of the Hopper Triton path (`torch_impl/flash_hopper_forward.py`, `flash_hopper_backward.py`; backend
"triton_hopper") and of how backend "triton" chooses between it and the portable kernels.

The Hopper kernels run under Triton's interpreter too (descriptor loads are emulated there; dq accumulates with
`tl.atomic_add`, the descriptor reduce-add being GPU-only), so the CPU tests hold them to the same rule as the
portable kernels (`test_flash_attention_torch.py`): error against a float64 oracle <= 2x the error of a naive
same-dtype implementation + 1e-4. The `gpu` tests add real sizes, the descriptor reduce-add and cuDNN.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from test_flash_attention_torch import NAMES, _exact, _inputs, _naive, _ours, _ring_pairs_violations, _rule_violations

from torch_impl.flash_attention import flash_attention
from torch_impl.flash_backward import triton_backward
from torch_impl.flash_forward import INTERPRETED, triton_forward
from torch_impl.flash_hopper_backward import backward_config, backward_configs, hopper_backward
from torch_impl.flash_hopper_forward import Config, autotune, forward_config, forward_configs, hopper_forward

fa = importlib.import_module("torch_impl.flash_attention")  # the module (the package exports the function)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_HOPPER = DEVICE == "cuda" and torch.cuda.get_device_capability()[0] == 9
needs_hopper = pytest.mark.skipif(not (INTERPRETED or ON_HOPPER), reason="needs an sm_90 GPU or the interpreter")

# (Sq, Sk, H, Hkv, D): GQA 1, 2 and 4, the two head dims of the path, lengths that are no multiple of any block,
# Sq > Sk (causal rows that see no key) and Sq < Sk.
CASES = [(97, 97, 2, 2, 64), (64, 80, 4, 1, 128), (130, 70, 2, 1, 64)]


def _check_rule(q, k, v, dout, causal, scale=None, backend="triton_hopper"):
    scale = scale or 1 / math.sqrt(q.shape[-1])
    exact = _exact(q, k, v, dout, causal, scale)
    violations = _rule_violations(_ours(q, k, v, dout, causal, scale, backend=backend),
                                  _naive(q, k, v, dout, causal, scale), exact)
    assert not violations, f"(hopper, naive) errors beyond the rule: {violations}"


@needs_hopper
@pytest.mark.parametrize("case", CASES, ids=lambda c: "sq{}-sk{}-h{}-kv{}-d{}".format(*c))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_hopper_matches_exact_within_twice_naive_error(causal, case):
    seq_q, seq_k, heads, kv_heads, head_dim = case
    _check_rule(*_inputs(1, seq_q, seq_k, heads, kv_heads, head_dim, torch.bfloat16), causal)


@needs_hopper
def test_hopper_float16():
    _check_rule(*_inputs(2, 70, 90, 4, 2, 64, torch.float16), True)


@needs_hopper
def test_rule_fails_for_wrong_hopper_attention():
    """Negative control: a wrong scale breaks the rule, so the checks above can fail."""
    q, k, v, dout = _inputs(1, 97, 97, 2, 2, 64, torch.bfloat16)
    exact, naive = _exact(q, k, v, dout, True, 1 / 8), _naive(q, k, v, dout, True, 1 / 8)
    assert "out" in _rule_violations(_ours(q, k, v, dout, True, 1.25 / 8, backend="triton_hopper"), naive, exact)


@needs_hopper
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_hopper_ring_backward_from_global_out_and_lse(causal):
    """A 2-way ring's pairs, each given the GLOBAL out/lse, sum to the full gradients (the ring's contract)."""
    q, k, v, dout = _inputs(1, 96, 96, 4, 2, 64, torch.bfloat16)
    scale = 0.125
    violations = _ring_pairs_violations(q, k, v, dout, causal, scale, backend="triton_hopper")
    assert not violations, f"(ring of hopper pairs, naive) errors beyond the rule: {violations}"


@needs_hopper
@pytest.mark.parametrize("config", [Config(32, 64, 4, 1, dq_transposed=True), Config(32, 64, 4, 1),
                                    Config(64, 32, 4, 2, dq_transposed=True)], ids=str)
def test_hopper_configs_compute_the_portable_result(config):
    """Every dq layout and block shape gives the portable kernels' backward up to float32 summation order and a
    rare flipped bf16 rounding (P comes from the given lse, so the blocking does not change the products, up to the
    last bit of exp2, which on some CPUs depends on the interpreter's block shape: on an AVX2-only AMD EPYC one dS
    element rounds to the other bf16 neighbour, moving one row of dq or dk by up to 8.8e-5 at |dq| <= 1.4)."""
    q, k, v, dout = _inputs(1, 100, 130, 4, 2, 64, torch.bfloat16)
    out, lse = triton_forward(q, k, v, causal=True, softmax_scale=0.125, out_dtype=torch.float32)
    want = triton_backward(dout, q, k, v, out, lse, causal=True, softmax_scale=0.125, grad_dtype=torch.float32)
    got = hopper_backward(dout, q, k, v, out, lse, causal=True, softmax_scale=0.125, grad_dtype=torch.float32,
                          config=config)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        # a flipped bf16 rounding of one dS element moves a row by 2^-8 |dS_ij K_j|: 1e-3 of the largest gradient is
        # ~16x the flip measured (docstring), while a wrong layout or block moves gradients by their own size
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-3 * b.abs().max().item(), msg=name)
    if not INTERPRETED:
        return  # the GPU's portable forward picks its own blocks; the rule tests cover the Hopper forward there
    # The forward rounds P to bf16 against the running row max, which depends on the key blocking: compare it at
    # the portable kernel's interpreter blocks (64 x 32), where the products are the same.
    got_out, got_lse = hopper_forward(q, k, v, causal=True, softmax_scale=0.125, out_dtype=torch.float32,
                                      config=Config(64, 32, 4, 1))
    torch.testing.assert_close(got_out, out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_lse, lse, rtol=1e-5, atol=1e-5)


def test_configs_are_spaces_of_distinct_entries():
    for space in (forward_configs(128), backward_configs(128)):
        assert len(set(space)) == len(space) > 1
    if not INTERPRETED:
        assert forward_config(128, True, 65536) in forward_configs(128)
        assert backward_config(128, True, 65536) in backward_configs(128)


def test_forced_hopper_refuses_what_it_cannot_run():
    q, k, v = (torch.randn(1, 16, 2, 32, device=DEVICE) for _ in range(3))
    with pytest.raises(ValueError, match="triton_hopper"):
        flash_attention(q, k, v, backend="triton_hopper")  # float32
    q, k, v = (x.bfloat16() for x in (q, k, v))
    with pytest.raises(ValueError, match="head dims" if INTERPRETED or ON_HOPPER else "sm_90"):
        flash_attention(q, k, v, backend="triton_hopper")  # D = 32
    flash_attention(q, k, v, backend="triton")  # "triton" takes the portable kernels instead


def test_triton_backend_never_picks_the_hopper_kernels():
    # On H200 the portable kernels measured as fast (forward, D=128) or faster (backward; forward at D=64).
    q, k, v = (torch.randn(1, 16, 2, 64, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
    assert fa._forward_path("triton", q, k, v, None) in ("triton_portable", "triton_gluon")
    assert fa._backward_path("triton", q, k, v, None) in ("triton_portable", "triton_gluon")


# ------------------------------------------------------------------------------------------------------ GPU

GPU_CASES = [(2, 2048, 2048, 32, 8, 128), (1, 4096, 4096, 16, 16, 64), (1, 1000, 3001, 8, 2, 128),
             (1, 3001, 1000, 8, 8, 64)]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "b{}-sq{}-sk{}-h{}-kv{}-d{}".format(*c))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_hopper_real_sizes(dtype, causal, case):
    _check_rule(*_inputs(*case, dtype, device="cuda"), causal)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("config", backward_configs(128), ids=str)
def test_gpu_hopper_backward_configs_agree_with_portable(config):
    """Each config of the autotune space (descriptor reduce-add included) against the portable backward."""
    q, k, v, dout = _inputs(1, 1500, 1500, 8, 2, 128, torch.bfloat16, device="cuda")
    out, lse = triton_forward(q, k, v, causal=True, softmax_scale=0.1, out_dtype=torch.bfloat16)
    want = triton_backward(dout, q, k, v, out, lse, causal=True, softmax_scale=0.1, grad_dtype=torch.float32)
    got = hopper_backward(dout, q, k, v, out, lse, causal=True, softmax_scale=0.1, grad_dtype=torch.float32,
                          config=config)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=name)  # float32 sums in another order


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gpu_hopper_against_cudnn(causal):
    """Hopper path and cuDNN, both within the rule on the same inputs (GQA 4)."""
    q, k, v, dout = _inputs(1, 2048, 2048, 16, 4, 128, torch.bfloat16, device="cuda")
    scale = 1 / math.sqrt(128)
    exact, naive = _exact(q, k, v, dout, causal, scale), _naive(q, k, v, dout, causal, scale)
    for backend in ("triton_hopper", "sdpa_cudnn"):
        violations = _rule_violations(_ours(q, k, v, dout, causal, scale, backend=backend), naive, exact)
        assert not violations, f"({backend}, naive) errors beyond the rule: {violations}"
    assert set(NAMES) == {"out", "lse", "dq", "dk", "dv"}


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
def test_gpu_autotune_returns_a_config_of_the_space():
    q, k, v, _ = _inputs(1, 4096, 4096, 8, 8, 128, torch.bfloat16, device="cuda")
    space = forward_configs(128)
    best = autotune(lambda c: hopper_forward(q, k, v, causal=True, softmax_scale=0.1, out_dtype=q.dtype, config=c),
                    space)
    assert best in space
