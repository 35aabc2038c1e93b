"""The routes of torch_impl.kernels.flash_attention to other kernels (PyTorch's SDPA cuDNN/FA2 ops, the optional
flash-attn package), checked on CPU against stand-ins with those kernels' exact signatures; the real CUDA ops run in the
GPU tests of tests/test_flash_attention_torch.py. Tolerance: float32 math on both sides, 1e-4."""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
import types

import pytest
import torch
from test_flash_attention_torch import NAMES, _exact, _good, _inputs

from torch_impl.kernels.flash_attention import flash_attention


def _cpu_sdpa_stand_ins(seen: list | None = None):
    """CPU stand-ins with the exact signatures of the CUDA-only SDPA ops (the adapters call them positionally),
    computing with torch's CPU flash attention: they check the adapters' layout, GQA and lse handling here. Like
    the CUDA ops they write out and the gradients in the memory order of q, k, v. `seen` collects the tensors each
    call got."""
    cpu_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    cpu_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    seen = [] if seen is None else seen

    def like(template, result):  # the CUDA ops allocate outputs with empty_like(q) / a matching layout
        return torch.empty_like(template).copy_(result)

    def cudnn(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
              return_debug_mask=False, *, scale=None):
        assert attn_bias is None and compute_log_sumexp and dropout_p == 0.0 and not return_debug_mask
        seen.append(dict(query=query, key=key, value=value))
        out, lse = cpu_fwd(query, key, value, dropout_p, is_causal, scale=scale)
        return like(query, out), lse[..., None], None, None, query.shape[2], key.shape[2], None, None, None

    def cudnn_backward(grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset, attn_bias,
                       cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, *, scale=None):
        assert logsumexp.shape == (*query.shape[:3], 1) and (max_q, max_k) == (query.shape[2], key.shape[2])
        seen.append(dict(grad_out=grad_out, query=query, key=key, value=value, out=out))
        grads = cpu_bwd(grad_out, query, key, value, out, logsumexp[..., 0], dropout_p, is_causal, scale=scale)
        return tuple(like(x, g) for x, g in zip((query, key, value), grads))

    def flash(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
        seen.append(dict(query=query, key=key, value=value))
        out, lse = cpu_fwd(query, key, value, dropout_p, is_causal, scale=scale)
        return like(query, out), lse, None, None, query.shape[2], key.shape[2], None, None, None

    def flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                       is_causal, philox_seed, philox_offset, *, scale=None):
        assert (max_q, max_k) == (query.shape[2], key.shape[2])
        seen.append(dict(grad_out=grad_out, query=query, key=key, value=value, out=out))
        grads = cpu_bwd(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, scale=scale)
        return tuple(like(x, g) for x, g in zip((query, key, value), grads))

    return types.SimpleNamespace(_scaled_dot_product_cudnn_attention=cudnn,
                                 _scaled_dot_product_cudnn_attention_backward=cudnn_backward,
                                 _scaled_dot_product_flash_attention=flash,
                                 _scaled_dot_product_flash_attention_backward=flash_backward)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests run the real ops")
@pytest.mark.parametrize("backend", ["sdpa_cudnn", "sdpa_flash"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_sdpa_adapters_on_cpu_stand_ins(monkeypatch, backend, causal):
    module = importlib.import_module("torch_impl.kernels.flash_attention")

    monkeypatch.setattr(module, "aten", _cpu_sdpa_stand_ins())
    q, k, v, dout = _inputs(2, 24, 24, 4, 2, 32, torch.float32)
    out, lse = module._sdpa_forward(q, k, v, causal, 0.2, torch.float32, backend)
    grads = module._sdpa_backward(dout, q, k, v, out, lse, causal, 0.2, backend, torch.float32)
    exact = _exact(q, k, v, dout, causal, 0.2)
    for name, got in zip(NAMES, (out, lse, *grads)):
        assert got.shape == exact[name].shape and got.dtype == torch.float32
        assert got.is_contiguous() or name == "lse"  # lse keeps the op's layout (the stand-in's is tokens-major)
        torch.testing.assert_close(got.double(), exact[name], rtol=1e-4, atol=1e-4, msg=name)  # float32 math


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests run the real ops")
@pytest.mark.parametrize("backend", ["sdpa_cudnn", "sdpa_flash"])
def test_sdpa_adapters_pass_tokens_major_views(monkeypatch, backend):
    """The ops get q, out and dout as views of the callers' memory (no copy; only GQA's repeated K/V heads are
    new), and a bf16 call returns bf16 results, no float32 round trip."""
    module = importlib.import_module("torch_impl.kernels.flash_attention")

    seen = []
    monkeypatch.setattr(module, "aten", _cpu_sdpa_stand_ins(seen))
    q, k, v, dout = _inputs(1, 32, 32, 4, 2, 32, torch.bfloat16)
    rows = slice(16, 32)  # the ring's half blocks are slices of the sequence
    out, lse = module._sdpa_forward(q[:, rows], k, v, False, 0.2, torch.bfloat16, backend)
    grads = module._sdpa_backward(dout[:, rows], q[:, rows], k, v, out, lse, False, 0.2, backend, torch.bfloat16)
    forward, backward = seen
    for got, given in ((forward["query"], q[:, rows]), (backward["query"], q[:, rows]),
                       (backward["grad_out"], dout[:, rows]), (backward["out"], out)):
        assert got.data_ptr() == given.data_ptr() and got.shape == given.transpose(1, 2).shape
    assert backward["key"].shape[1] == 4  # the 2 KV heads repeated for the 4 query heads
    exact = _exact(q[:, rows], k, v, dout[:, rows], False, 0.2)
    for name, got in zip(NAMES, (out, lse, *grads)):
        assert got.dtype == (torch.float32 if name == "lse" else torch.bfloat16)
        assert got.is_contiguous() or name == "lse"
        # bf16 inputs and results: a few bf16 roundings (2^-8 relative) of values of order 1
        torch.testing.assert_close(got.double(), exact[name], rtol=0.05, atol=0.05, msg=name)
    # negative control: the float32 answer of the same call differs from the bf16 one by bf16 rounding, not 0
    out32, _ = module._sdpa_forward(q[:, rows].float(), k.float(), v.float(), False, 0.2, torch.float32, backend)
    assert not torch.equal(out32, out.float())


def _flash_attn_stand_in(version):
    """A stand-in `flash_attn` package with flash-attn 2.x's signatures, computing with the reference functions:
    `_flash_attn_backward` as 2.6 wrote it (window_size tuple) or as 2.7+ registers it (a torch custom op whose
    Python function is `_init_fn`, separate window sizes). Empty rows carry lse +inf, as flash-attn's do."""
    from torch_impl.attention import reference_attention_backward, reference_attention_forward

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                        alibi_slopes=None, deterministic=False, return_attn_probs=False):
        out, lse = reference_attention_forward(q, k, v, causal=causal, softmax_scale=softmax_scale)
        return out, lse.masked_fill(lse == -math.inf, math.inf), None

    def compute(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal, window):
        assert window == (-1, -1) and not (softmax_lse == -math.inf).any()  # flash-attn: +inf for empty rows
        lse = softmax_lse.masked_fill(softmax_lse == math.inf, -math.inf)
        grads = reference_attention_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale)
        for buffer, grad in zip((dq, dk, dv), grads):
            buffer.copy_(grad)

    def backward_2_6(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size,
                     softcap, alibi_slopes, deterministic, rng_state=None):
        compute(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal, window_size)

    def backward_2_7(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                     window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
        compute(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal,
                (window_size_left, window_size_right))

    backward = backward_2_6 if version == "2.6" else _CustomOpDef(backward_2_7)
    return types.SimpleNamespace(flash_attn_interface=types.SimpleNamespace(flash_attn_func=flash_attn_func,
                                                                            _flash_attn_backward=backward))


class _CustomOpDef:
    """Like torch.library's CustomOpDef: callable, its signature hidden, the Python function kept as `_init_fn`."""

    def __init__(self, init_fn):
        self._init_fn = init_fn

    def __call__(self, *args, **kwargs):
        return self._init_fn(*args, **kwargs)


@pytest.mark.parametrize("version", ["2.6", "2.7"])
def test_flash_attn_adapter_on_a_stand_in_package(monkeypatch, version):
    module = importlib.import_module("torch_impl.kernels.flash_attention")

    package = _flash_attn_stand_in(version)
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", package.flash_attn_interface)
    q, k, v, dout = _inputs(1, 30, 20, 4, 2, 32, torch.float32)  # Sq > Sk: causal rows that see no key
    out, lse = module._flash_attn_forward(q, k, v, True, 0.2, torch.float32)
    grads = module._flash_attn_backward(dout, q, k, v, out, lse, True, 0.2)
    exact = _exact(q, k, v, dout, True, 0.2)
    assert torch.all(lse[:, :, :10] == -math.inf)
    for name, got in zip(NAMES, (out, lse, *grads)):
        torch.testing.assert_close(got.double(), exact[name], rtol=1e-4, atol=1e-4, msg=name)  # float32 math


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU message")
@pytest.mark.parametrize("backend", ["sdpa_cudnn", "sdpa_flash"])
def test_sdpa_backends_need_cuda(backend):
    with pytest.raises(ValueError, match=f"backend '{backend}' needs CUDA"):
        flash_attention(*_good()[:3], backend=backend)


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed")
def test_missing_flash_attn_package_is_a_clean_error():
    message = r"needs the optional flash-attn package: pip install 'twinflash\[flash-attn\]'"
    with pytest.raises(ValueError, match=message):
        flash_attention(*_good()[:3], backend="flash_attn")
