"""Tests of the Gluon sm_90 forward (`torch_impl/flash_gluon_forward.py`; backend "triton_gluon") and of how backend
"triton" picks each direction's kernels.

Gluon has no interpreter, so on CPU only the dispatch is tested here (and tests/test_triton_compile.py compiles the
kernel for sm_90 where the installed Triton is the one it is written for). The `gpu` tests hold the kernel to the
flash rule of `test_flash_attention_torch.py` (error against a float64 oracle <= 2x the error of a naive same-dtype
implementation + 1e-4): GQA, lengths that are no multiple of any block, Sq > Sk (causal rows that see no key) and
Sq < Sk, causal and not, both head dims, bf16 and fp16, every config against the portable forward, cuDNN on the
same inputs, and the ring's backward from a global out/lse that the Gluon forward made.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from test_flash_attention_torch import _exact, _inputs, _naive, _ours, _ring_pairs_violations, _rule_violations

from torch_impl.flash_attention import flash_attention
from torch_impl.flash_forward import KernelConfig, TritonConfig, triton_forward
from torch_impl.flash_gluon_forward import GLUON_AVAILABLE, GluonConfig, forward_config, gluon_forward, \
    three_consumers

fa = importlib.import_module("torch_impl.flash_attention")  # the module (the package exports the function)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_HOPPER = DEVICE == "cuda" and torch.cuda.get_device_capability()[0] == 9
needs_gluon_gpu = pytest.mark.skipif(not (ON_HOPPER and GLUON_AVAILABLE),
                                     reason="needs an sm_90 GPU and the Triton release the Gluon kernel is written for")
PORTABLE = TritonConfig(*(KernelConfig(64, 64, 4, 2),) * 3)


def test_forced_gluon_refuses_what_it_cannot_run():
    q, k, v = (torch.randn(1, 16, 2, 32, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
    expected = "head dims" if ON_HOPPER and GLUON_AVAILABLE else "triton_gluon"
    with pytest.raises(ValueError, match=expected):
        flash_attention(q, k, v, backend="triton_gluon")  # D = 32 (and on CPU: no interpreter for Gluon)
    flash_attention(q, k, v, backend="triton")  # "triton" takes the portable kernels instead


def test_gluon_takes_no_portable_config():
    q, k, v = (torch.randn(1, 16, 2, 64, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
    with pytest.raises(ValueError, match="backend='triton_gluon' does not run them"):
        flash_attention(q, k, v, backend="triton_gluon", config=PORTABLE)


def test_triton_backend_picks_per_direction(monkeypatch):
    q, k, v = (torch.randn(1, 16, 2, 64, dtype=torch.bfloat16) for _ in range(3))
    for forced in ("triton_hopper", "triton_portable", "triton_gluon"):
        assert fa._forward_path(forced, q, k, v, None) == forced
        assert fa._backward_path(forced, q, k, v, None) == forced
    monkeypatch.setattr(fa, "gluon_unsupported", lambda *_: None)  # as on an sm_90 GPU with Triton 3.6
    assert fa._forward_path("triton", q, k, v, None) == "triton_gluon"
    assert fa._forward_path("triton", q, k, v, PORTABLE) == "triton_portable"  # a config means the portable kernels
    # The Gluon backward only with the switch on (until measured faster than the portable one); the tl one-kernel
    # Hopper backward trails the portable one on H200, so only forcing it runs it.
    monkeypatch.setattr(fa, "TRITON_PICKS_GLUON_BACKWARD", False)
    assert fa._backward_path("triton", q, k, v, None) == "triton_portable"
    monkeypatch.setattr(fa, "TRITON_PICKS_GLUON_BACKWARD", True)
    assert fa._backward_path("triton", q, k, v, None) == "triton_gluon"
    assert fa._backward_path("triton", q, k, v, PORTABLE) == "triton_portable"
    monkeypatch.setattr(fa, "gluon_unsupported", lambda *_: "needs an sm_90 (Hopper) GPU")
    assert fa._forward_path("triton", q, k, v, None) == "triton_portable"
    assert fa._backward_path("triton", q, k, v, None) == "triton_portable"


# ------------------------------------------------------------------------------------------------------ GPU

def _check_rule(q, k, v, dout, causal, backend="triton_gluon"):
    scale = 1 / math.sqrt(q.shape[-1])
    exact, naive = _exact(q, k, v, dout, causal, scale), _naive(q, k, v, dout, causal, scale)
    violations = _rule_violations(_ours(q, k, v, dout, causal, scale, backend=backend), naive, exact)
    assert not violations, f"({backend}, naive) errors beyond the rule: {violations}"


# (B, Sq, Sk, H, Hkv, D): GQA 1, 4 and 8, lengths that are no multiple of 64 or 128, one key tile only,
# Sq > Sk (causal rows that see no key) and Sq < Sk.
GPU_CASES = [(1, 1000, 1000, 8, 2, 128), (2, 777, 1200, 8, 1, 64), (1, 1200, 777, 4, 4, 128), (1, 200, 90, 4, 4, 64),
             (1, 1, 300, 4, 2, 128)]


@pytest.mark.gpu
@needs_gluon_gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "b{}-sq{}-sk{}-h{}-kv{}-d{}".format(*c))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gpu_gluon_matches_exact_within_twice_naive_error(causal, case):
    _check_rule(*_inputs(*case, torch.bfloat16, device="cuda"), causal)


@pytest.mark.gpu
@needs_gluon_gpu
def test_gpu_gluon_float16():
    _check_rule(*_inputs(1, 700, 900, 8, 2, 128, torch.float16, device="cuda"), True)


@pytest.mark.gpu
@needs_gluon_gpu
def test_gpu_rule_fails_for_wrong_gluon_attention():
    """Negative control: a wrong scale breaks the rule, so the checks above can fail."""
    q, k, v, dout = _inputs(1, 500, 500, 4, 2, 128, torch.bfloat16, device="cuda")
    exact, naive = _exact(q, k, v, dout, True, 1 / 8), _naive(q, k, v, dout, True, 1 / 8)
    ours = _ours(q, k, v, dout, True, 1.25 / 8, backend="triton_gluon")
    assert "out" in _rule_violations(ours, naive, exact)


# Beside each head dim's default (which the rule tests run): the other schedule, 64-key tiles, and (D=64 only) 192-row
# query blocks of three consumers with the K/V ring wrapping at 2 and 4 stages, ping-pong round all three and not.
CONFIGS = [GluonConfig(num_stages=2, pingpong=True), GluonConfig(num_stages=2, pingpong=False),
           GluonConfig(block_n=64, num_stages=3, pingpong=True), three_consumers(num_stages=2, pingpong=True),
           three_consumers(num_stages=4, pingpong=False)]


@pytest.mark.gpu
@needs_gluon_gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_gpu_gluon_configs_agree_with_portable_forward(config, head_dim):
    """Each config against the portable forward, float32 out (a ring's partial output): the same products up to
    the bf16 rounding of P, which depends on the running max and so on the key blocking."""
    if config in (forward_config(head_dim, True, 0), forward_config(head_dim, False, 0)):
        pytest.skip("a default config: the rule tests run it")
    if config.consumers == 3 and head_dim == 128:
        pytest.skip("three consumers are a D=64 shape (160 registers each hold no D=128 tiles)")
    q, k, v, _ = _inputs(2, 1500, 1700, 8, 2, head_dim, torch.bfloat16, device="cuda")
    for causal in (True, False):
        want, want_lse = triton_forward(q, k, v, causal=causal, softmax_scale=0.1, out_dtype=torch.float32)
        got, got_lse = gluon_forward(q, k, v, causal=causal, softmax_scale=0.1, out_dtype=torch.float32,
                                     config=config)
        torch.testing.assert_close(got_lse, want_lse, rtol=0, atol=1e-5)  # float32 sums in another order
        torch.testing.assert_close(got, want, rtol=0, atol=2e-2)  # P rounded to bf16 against another max


@pytest.mark.gpu
@needs_gluon_gpu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gpu_gluon_against_cudnn(causal):
    """Triton (the Gluon forward), the Gluon kernels both ways and cuDNN, each within the rule on the same inputs
    (GQA 4)."""
    q, k, v, dout = _inputs(1, 2048, 2048, 16, 4, 128, torch.bfloat16, device="cuda")
    for backend in ("triton", "triton_gluon", "sdpa_cudnn"):
        _check_rule(q, k, v, dout, causal, backend=backend)


@pytest.mark.gpu
@needs_gluon_gpu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gpu_ring_backward_from_gluon_out_and_lse(causal):
    """A 2-way ring: the Gluon forward's global float32 out/lse feed each pair's backward; the pairs' gradients
    sum to the full ones (the ring's contract)."""
    q, k, v, dout = _inputs(1, 1000, 1000, 8, 2, 128, torch.bfloat16, device="cuda")
    scale = 0.1
    violations = _ring_pairs_violations(q, k, v, dout, causal, scale, backend="triton_gluon")
    assert not violations, f"(ring of gluon pairs, naive) errors beyond the rule: {violations}"
