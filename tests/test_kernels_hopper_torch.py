"""Tests of the Hopper family's forward (`torch_impl/kernels/hopper/forward.py`, Gluon sm_90; backend
"triton_hopper") and of how backend "triton" picks one kernel family for both directions, and routes `config=` to it.

Gluon has no interpreter, so on CPU only the dispatch is tested here (and tests/test_triton_compile.py compiles the
kernel for sm_90 where the installed Triton is the one it is written for). The `gpu` tests hold the kernel to the
flash rule of `test_flash_attention_torch.py` (error against a float64 oracle <= 2x the error of a naive same-dtype
implementation + 1e-4): GQA, lengths that are no multiple of any block, Sq > Sk (causal rows that see no key) and
Sq < Sk, causal and not, both head dims, bf16 and fp16, every config against the portable forward, cuDNN on the
same inputs, and the ring's backward from a global out/lse that the Hopper forward made.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_flash_attention_torch import _exact, _inputs, _naive, _ours, _ring_pairs_violations, _rule_violations

from torch_impl.kernels import flash_attention as fa
from torch_impl.kernels.flash_attention import flash_attention
from torch_impl.kernels.hopper.config import HopperBackwardConfig, HopperConfig, forward_config, three_consumers
from torch_impl.kernels.hopper.forward import hopper_forward
from torch_impl.kernels.portable.backward import portable_backward
from torch_impl.kernels.portable.config import KernelConfig, PortableConfig
from torch_impl.kernels.portable.forward import portable_forward
from torch_impl.kernels.tiles import GLUON_AVAILABLE

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_HOPPER = DEVICE == "cuda" and torch.cuda.get_device_capability()[0] == 9
needs_gluon_gpu = pytest.mark.skipif(not (ON_HOPPER and GLUON_AVAILABLE),
                                     reason="needs an sm_90 GPU and the Triton release the Gluon kernel is written for")
PORTABLE = PortableConfig(*(KernelConfig(64, 64, 4, 2),) * 3)


def test_forced_hopper_refuses_what_it_cannot_run():
    q, k, v = (torch.randn(1, 16, 2, 32, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
    expected = "head dims" if ON_HOPPER and GLUON_AVAILABLE else "triton_hopper"
    with pytest.raises(ValueError, match=expected):
        flash_attention(q, k, v, backend="triton_hopper")  # D = 32 (and on CPU: no interpreter for Gluon)
    flash_attention(q, k, v, backend="triton")  # "triton" takes the portable kernels instead


def test_hopper_takes_no_portable_config():
    q, k, v = (torch.randn(1, 16, 2, 64, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
    with pytest.raises(ValueError, match="config is a PortableConfig, the portable family's, but the hopper family"):
        flash_attention(q, k, v, backend="triton_hopper", config=PORTABLE)


def test_triton_backend_picks_one_family_for_both_directions(monkeypatch):
    q, k, v = (torch.randn(1, 16, 2, 64, dtype=torch.bfloat16) for _ in range(3))
    assert fa._uses_hopper("triton_hopper", q, k, v) and not fa._uses_hopper("triton_portable", q, k, v)
    monkeypatch.setattr(fa, "hopper_unsupported", lambda *_: None)  # as on an sm_90 GPU with Triton 3.6
    assert fa._uses_hopper("triton", q, k, v)  # with documents or without: both families take key spans
    assert not fa._uses_hopper("triton_portable", q, k, v)
    monkeypatch.setattr(fa, "hopper_unsupported", lambda *_: "needs an sm_90 (Hopper) GPU")
    assert not fa._uses_hopper("triton", q, k, v)


def test_hopper_config_reaches_both_hopper_kernels(monkeypatch):
    """Where the Hopper family serves the call, its forward gets the HopperConfig and its backward the config's
    `backward` (recorded here with the portable kernels computing, as Gluon has no interpreter)."""
    seen = {}

    def forward(q, k, v, *, causal, softmax_scale, out_dtype, config, spans):
        seen["forward"] = config
        return portable_forward(q, k, v, causal=causal, softmax_scale=softmax_scale, out_dtype=out_dtype, spans=spans)

    def backward(dout, q, k, v, out, lse, *, causal, softmax_scale, grad_dtype, config, spans):
        seen["backward"] = config
        return portable_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
                                 grad_dtype=grad_dtype, spans=spans)

    monkeypatch.setattr(fa, "hopper_unsupported", lambda *_: None)
    monkeypatch.setattr(fa, "hopper_forward", forward)
    monkeypatch.setattr(fa, "hopper_backward", backward)
    q, k, v = (torch.randn(1, 16, 2, 64, requires_grad=True) for _ in range(3))
    config = HopperConfig(num_stages=3, backward=HopperBackwardConfig(block_m=128))
    flash_attention(q, k, v, config=config).sum().backward()
    assert seen == {"forward": config, "backward": config.backward}
    flash_attention(q, k, v).sum().backward()
    assert seen == {"forward": None, "backward": None}  # the kernels' own choice per call class


def test_documents_reach_the_hopper_kernels_as_spans(monkeypatch):
    """With documents, "triton" on sm_90 runs the Hopper family both ways and hands its kernels the key spans, the
    causal rule folded in (causal off): recorded with the portable kernels computing in their place, the results
    are those of the portable family given the same documents."""
    seen = []

    def forward(q, k, v, *, causal, softmax_scale, out_dtype, config, spans):
        seen.append(("forward", causal, spans))
        return portable_forward(q, k, v, causal=causal, softmax_scale=softmax_scale, out_dtype=out_dtype, spans=spans)

    def backward(dout, q, k, v, out, lse, *, causal, softmax_scale, grad_dtype, config, spans):
        seen.append(("backward", causal, spans))
        return portable_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
                                 grad_dtype=grad_dtype, spans=spans)

    inputs = [torch.randn(1, 24, 2, 64) for _ in range(4)]
    ids = torch.tensor([[0] * 5 + [1] * 12 + [2] * 7])
    results = {}
    for backend in ("triton_portable", "triton"):
        if backend == "triton":
            monkeypatch.setattr(fa, "hopper_unsupported", lambda *_: None)
            monkeypatch.setattr(fa, "hopper_forward", forward)
            monkeypatch.setattr(fa, "hopper_backward", backward)
        q, k, v = (x.clone().requires_grad_() for x in inputs[:3])
        out = flash_attention(q, k, v, backend=backend, segment_ids=ids)
        out.backward(inputs[3])
        results[backend] = (out, q.grad, k.grad, v.grad)
    assert [(name, causal, spans is not None) for name, causal, spans in seen] == [("forward", False, True),
                                                                                    ("backward", False, True)]
    for got, want in zip(results["triton"], results["triton_portable"]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------------ GPU

def _check_rule(q, k, v, dout, causal, backend="triton_hopper"):
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
def test_gpu_hopper_matches_exact_within_twice_naive_error(causal, case):
    _check_rule(*_inputs(*case, torch.bfloat16, device="cuda"), causal)


@pytest.mark.gpu
@needs_gluon_gpu
def test_gpu_hopper_float16():
    _check_rule(*_inputs(1, 700, 900, 8, 2, 128, torch.float16, device="cuda"), True)


@pytest.mark.gpu
@needs_gluon_gpu
def test_gpu_rule_fails_for_wrong_hopper_attention():
    """Negative control: a wrong scale breaks the rule, so the checks above can fail."""
    q, k, v, dout = _inputs(1, 500, 500, 4, 2, 128, torch.bfloat16, device="cuda")
    exact, naive = _exact(q, k, v, dout, True, 1 / 8), _naive(q, k, v, dout, True, 1 / 8)
    ours = _ours(q, k, v, dout, True, 1.25 / 8, backend="triton_hopper")
    assert "out" in _rule_violations(ours, naive, exact)


# Beside each head dim's default (which the rule tests run): the other schedule, 64-key tiles, and (D=64 only) 192-row
# query blocks of three consumers with the K/V ring wrapping at 2 and 4 stages, ping-pong round all three and not.
CONFIGS = [HopperConfig(num_stages=2, pingpong=True), HopperConfig(num_stages=2, pingpong=False),
           HopperConfig(block_n=64, num_stages=3, pingpong=True), three_consumers(num_stages=2, pingpong=True),
           three_consumers(num_stages=4, pingpong=False)]


@pytest.mark.gpu
@needs_gluon_gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_gpu_hopper_configs_agree_with_portable_forward(config, head_dim):
    """Each config against the portable forward, float32 out (a ring's partial output): the same products up to
    the bf16 rounding of P, which depends on the running max and so on the key blocking."""
    if config in (forward_config(head_dim, True, 0), forward_config(head_dim, False, 0)):
        pytest.skip("a default config: the rule tests run it")
    if config.consumers == 3 and head_dim == 128:
        pytest.skip("three consumers are a D=64 shape (160 registers each hold no D=128 tiles)")
    q, k, v, _ = _inputs(2, 1500, 1700, 8, 2, head_dim, torch.bfloat16, device="cuda")
    for causal in (True, False):
        want, want_lse = portable_forward(q, k, v, causal=causal, softmax_scale=0.1, out_dtype=torch.float32)
        got, got_lse = hopper_forward(q, k, v, causal=causal, softmax_scale=0.1, out_dtype=torch.float32,
                                      config=config)
        torch.testing.assert_close(got_lse, want_lse, rtol=0, atol=1e-5)  # float32 sums in another order
        torch.testing.assert_close(got, want, rtol=0, atol=2e-2)  # P rounded to bf16 against another max


@pytest.mark.gpu
@needs_gluon_gpu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gpu_hopper_against_cudnn(causal):
    """Triton (the Hopper family), the Hopper kernels forced and cuDNN, each within the rule on the same inputs
    (GQA 4)."""
    q, k, v, dout = _inputs(1, 2048, 2048, 16, 4, 128, torch.bfloat16, device="cuda")
    for backend in ("triton", "triton_hopper", "sdpa_cudnn"):
        _check_rule(q, k, v, dout, causal, backend=backend)


@pytest.mark.gpu
@needs_gluon_gpu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gpu_ring_backward_from_hopper_out_and_lse(causal):
    """A 2-way ring: the Hopper forward's global float32 out/lse feed each pair's backward; the pairs' gradients
    sum to the full ones (the ring's contract)."""
    q, k, v, dout = _inputs(1, 1000, 1000, 8, 2, 128, torch.bfloat16, device="cuda")
    scale = 0.1
    violations = _ring_pairs_violations(q, k, v, dout, causal, scale, backend="triton_hopper")
    assert not violations, f"(ring of hopper pairs, naive) errors beyond the rule: {violations}"
