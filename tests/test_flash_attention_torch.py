"""Tests of the PyTorch FlashAttention (`torch_impl/kernels/flash_attention.py` and its Triton kernels). Twin of
`tests/test_flash_attention_jax.py`: the cases both run, their inputs, the float64 answer and the tolerances
(with their reasons) are tests/kernel_twins.py's.

Without CUDA the kernels run in Triton's interpreter, so shapes stay small; with CUDA every test here runs on the
GPU and the `gpu`-marked tests add real sizes and the CUDA-only backends.

Accuracy rule (FlashAttention's own test criterion, kernel_twins' docstring): against the exact float64 answer,
each of out, lse, dq, dk, dv from the kernel must be within 2x the error of a naive implementation computing in
the same dtype (`reference_attention`: matmuls in the input dtype, softmax in float32), plus KERNEL_ATOL.
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys

import kernel_twins as twins
import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_impl.attention import reference_attention
from torch_impl.kernels import flash_attention as flash_attention_module
from torch_impl.kernels.flash_attention import (BACKENDS, flash_attention, flash_attention_backward,
                                                flash_attention_forward)
from torch_impl.kernels.hopper.config import HopperConfig
from torch_impl.kernels.portable import backward as portable_bwd
from torch_impl.kernels.portable import config as portable_config
from torch_impl.kernels.portable import forward as portable_fwd
from torch_impl.kernels.portable.config import (DKDV_SHAPES, DQ_SHAPES, FORWARD_SHAPES, KernelConfig, PortableConfig,
                                                dkdv_shared_bytes, dq_shared_bytes, fitting, forward_shared_bytes)
from torch_impl.kernels.tiles import INTERPRETED, round_to

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HALF = (torch.bfloat16, torch.float16)
NAMES = twins.NAMES
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def _inputs(batch, seq_q, seq_k, heads, kv_heads, head_dim, dtype, seed=0, device=DEVICE):
    """The twins' inputs (kernel_twins.inputs) as `dtype` tensors: q, k, v and an output cotangent."""
    case = twins.KernelCase(seq_q, seq_k, heads, kv_heads, head_dim, batch=batch)
    return [torch.from_numpy(x).to(device=device, dtype=dtype) for x in twins.inputs(case, _DTYPE_NAMES[dtype], seed)]


def _case_inputs(case: twins.KernelCase, dtype, seed=0):
    return _inputs(case.batch, case.seq_q, case.seq_k, case.heads, case.kv_heads, case.dim, dtype, seed)


def _exact(q, k, v, dout, causal, scale):
    """The float64 answer (kernel_twins.float64_attention) as float64 tensors on q's device."""
    exact = twins.float64_attention(*(x.detach().double().cpu().numpy() for x in (q, k, v, dout)), causal, scale)
    return {name: torch.from_numpy(x).to(q.device) for name, x in exact.items()}


def _with_grads(attend, q, k, v, dout):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out, lse = attend(q, k, v)
    out.backward(dout)
    return dict(out=out.detach(), lse=lse, dq=q.grad, dk=k.grad, dv=v.grad)


def _ours(q, k, v, dout, causal, scale, backend="triton"):
    return _with_grads(lambda *x: flash_attention(*x, causal=causal, softmax_scale=scale, return_lse=True,
                                                  backend=backend), q, k, v, dout)


def _naive(q, k, v, dout, causal, scale):
    return _with_grads(lambda *x: reference_attention(*x, causal=causal, softmax_scale=scale, return_lse=True),
                       q, k, v, dout)


def _numpy(result: dict) -> dict:
    return {name: x.detach().double().cpu().numpy() for name, x in result.items()}


def _rule_violations(ours, naive, exact):
    """{name: (our error, naive error)} breaking the flash rule (kernel_twins.flash_rule_violations)."""
    return twins.flash_rule_violations(_numpy(ours), _numpy(naive), _numpy(exact))


def _ring_pairs_violations(q, k, v, dout, causal, scale, backend):
    """A 2-way ring over equal halves: each pair's backward given `backend`'s GLOBAL float32 out/lse, the pairs'
    gradients summed (the ring's contract); {name: (error, naive error)} breaking the flash rule."""
    out, lse = flash_attention_forward(q, k, v, causal=causal, softmax_scale=scale, out_dtype=torch.float32,
                                       backend=backend)
    grads = [torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in (q, k, v)]
    first, second = slice(0, q.shape[1] // 2), slice(q.shape[1] // 2, None)
    pairs = ([(first, first, True), (second, first, False), (second, second, True)] if causal
             else [(slice(None), first, False), (slice(None), second, False)])
    for rows, keys, pair_causal in pairs:
        dq, dk, dv = flash_attention_backward(dout[:, rows], q[:, rows], k[:, keys], v[:, keys], out[:, rows],
                                              lse[:, :, rows].contiguous(), causal=pair_causal,
                                              softmax_scale=scale, backend=backend)
        grads[0][:, rows] += dq
        grads[1][:, keys] += dk
        grads[2][:, keys] += dv
    ring = dict(out=out, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2])
    return _rule_violations(ring, _naive(q, k, v, dout, causal, scale), _exact(q, k, v, dout, causal, scale))


def _check_rule(q, k, v, dout, causal, scale=None):
    scale = scale or 1 / math.sqrt(q.shape[-1])
    exact = _exact(q, k, v, dout, causal, scale)
    ours = _ours(q, k, v, dout, causal, scale)
    violations = _rule_violations(ours, _naive(q, k, v, dout, causal, scale), exact)
    assert not violations, f"(ours, naive) errors beyond the rule: {violations}"
    return ours, exact


def _assert_fp32_close(ours, exact):
    twins.assert_fp32_close(_numpy(ours), _numpy(exact))


@pytest.mark.parametrize("case", twins.HALF_CASES, ids=twins.ids(twins.HALF_CASES))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_matches_exact_within_twice_naive_error(dtype, causal, case):
    # Under the interpreter this is the proof that the bf16 path is right: the kernels upcast tiles and round
    # operands themselves there (kernels/tiles.py's docstring), and must still meet the rule.
    ours, exact = _check_rule(*_case_inputs(case, dtype), causal)
    assert ours["out"].dtype == dtype and ours["lse"].dtype == torch.float32
    twins.assert_unseen_rows_zero(_numpy(ours), _numpy(exact))


@pytest.mark.parametrize("mistake", ["wrong_scale", "swapped_kv"])
def test_rule_fails_for_wrong_attention(mistake):
    """Negative control: the comparison above would catch a wrong scale or swapped k/v."""
    q, k, v, dout = _case_inputs(twins.NEGATIVE_CONTROL, torch.bfloat16)
    scale = 1 / math.sqrt(q.shape[-1])
    exact, naive = _exact(q, k, v, dout, True, scale), _naive(q, k, v, dout, True, scale)
    wrong = (_ours(q, k, v, dout, True, scale * twins.WRONG_SCALE_FACTOR) if mistake == "wrong_scale"
             else _ours(q, v, k, dout, True, scale))
    assert "out" in _rule_violations(wrong, naive, exact)


def test_fully_masked_rows_are_zero_with_lse_minus_inf():
    q, k, v, dout = _case_inputs(twins.UNSEEN_ROWS, torch.bfloat16)
    result, exact = _numpy(_ours(q, k, v, dout, True, 0.2)), _numpy(_exact(q, k, v, dout, True, 0.2))
    twins.assert_unseen_rows_zero(result, exact)
    assert (exact["lse"][:, :, :30] == -math.inf).all()  # query i sees key j iff j <= i - 30
    twins.max_errors(result, exact)  # lse -inf exactly on those rows, everything else finite


@pytest.mark.parametrize("case", twins.FP32_CASES, ids=twins.ids(twins.FP32_CASES))
def test_float32_matches_exact_with_any_strides(case):
    # float32 runs IEEE dots (no TF32) so the model's float32 tests can use this kernel. The tensors are
    # [B, H, S, D] in memory (as after a transpose) and dout has a non-unit last stride.
    q, k, v, dout = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in _case_inputs(case, torch.float32))
    dout = dout.transpose(2, 3).contiguous().transpose(2, 3)
    assert dout.stride(-1) != 1
    scale = 1 / math.sqrt(case.dim)
    _assert_fp32_close(_ours(q, k, v, dout, True, scale), _exact(q, k, v, dout, True, scale))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_pair_functions_with_global_out_and_lse_sum_to_full_gradients(dtype, causal):
    """A ring step's contract: pairs of (query chunk, key chunk) computed with float32 partial outputs, merged by
    lse, and differentiated with the merged (global) out/lse, add up to full attention."""
    seq, half = 96, 48
    q, k, v, dout = _inputs(1, seq, seq, 4, 2, 64, dtype)
    kw = dict(causal=causal, softmax_scale=0.125)
    full_out, full_lse = flash_attention_forward(q, k, v, out_dtype=torch.float32, **kw)
    full_grads = flash_attention_backward(dout, q, k, v, full_out, full_lse, **kw)

    chunks = [slice(0, half), slice(half, seq)]
    # causal ring: chunk i attends to earlier chunks in full and to itself causally; full: to every chunk.
    pairs = [(i, j, causal and i == j) for i in range(2) for j in range(2) if not causal or j <= i]
    partial = {}
    for i, j, pair_causal in pairs:
        partial[i, j] = flash_attention_forward(q[:, chunks[i]], k[:, chunks[j]], v[:, chunks[j]], causal=pair_causal,
                                                softmax_scale=0.125, out_dtype=torch.float32)
    merged = {}
    for i in range(2):
        outs, lses = zip(*(partial[p[:2]] for p in pairs if p[0] == i))
        lse = torch.logsumexp(torch.stack(lses), dim=0)
        out = sum(o * torch.exp(part - lse).transpose(1, 2)[..., None] for o, part in zip(outs, lses))
        merged[i] = out, lse
    # float32: merging changes only the summation order; bf16: P rounded at each pass's own row max
    # (kernel_twins: FP32_TOL, HALF_P_TOL)
    tol = twins.FP32_TOL if dtype == torch.float32 else twins.HALF_P_TOL
    torch.testing.assert_close(torch.cat([merged[i][0] for i in range(2)], 1), full_out, **tol)
    torch.testing.assert_close(torch.cat([merged[i][1] for i in range(2)], 2), full_lse, **tol)

    dq, dk, dv = (torch.zeros_like(x, dtype=torch.float32) for x in (q, k, v))
    for i, j, pair_causal in pairs:
        out, lse = merged[i]
        grads = flash_attention_backward(dout[:, chunks[i]], q[:, chunks[i]], k[:, chunks[j]], v[:, chunks[j]],
                                         out, lse, causal=pair_causal, softmax_scale=0.125)
        assert all(g.dtype == torch.float32 for g in grads)
        dq[:, chunks[i]] += grads[0]
        dk[:, chunks[j]] += grads[1]
        dv[:, chunks[j]] += grads[2]
    for got, want in zip((dq, dk, dv), full_grads):
        torch.testing.assert_close(got, want, **tol)


@settings(max_examples=12, deadline=None)
@given(batch=st.integers(1, 2), seq_q=st.integers(1, 70), seq_k=st.integers(1, 70), kv_heads=st.integers(1, 2),
       group=st.sampled_from([1, 3]), head_dim=st.sampled_from([32, 64]), causal=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_random_shapes(batch, seq_q, seq_k, kv_heads, group, head_dim, causal, dtype, seed):
    q, k, v, dout = _inputs(batch, seq_q, seq_k, kv_heads * group, kv_heads, head_dim, dtype, seed)
    if dtype == torch.float32:
        _assert_fp32_close(_ours(q, k, v, dout, causal, 0.2), _exact(q, k, v, dout, causal, 0.2))
    else:
        _check_rule(q, k, v, dout, causal, 0.2)


def test_reference_backend_agrees_with_triton():
    q, k, v, dout = _inputs(1, 33, 40, 4, 2, 32, torch.float32)
    ours, ref = _ours(q, k, v, dout, True, 0.2), _ours(q, k, v, dout, True, 0.2, backend="reference")
    twins.assert_fp32_close(_numpy(ours), _numpy(ref))  # both float32 math on identical inputs


@triton.jit
def _round_kernel(X, Y, N: tl.constexpr, EMULATE: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Y + offs, round_to(tl.load(X + offs), Y.dtype.element_ty, EMULATE).to(Y.dtype.element_ty))


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_round_to_rounds_to_nearest_even(dtype):
    """The kernels' operand rounding equals torch's casts, ties included (the interpreter's own fp32 -> bf16
    cast truncates, which is what `round_to` replaces)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1024, generator=gen) * 8
    bits = x.view(torch.int32)
    ties = ((bits & ~0xFFFF) | 0x8000).view(torch.float32)  # exactly halfway between two bf16 values
    x = torch.cat([x, ties]).to(DEVICE)
    y = torch.empty_like(x, dtype=dtype)
    _round_kernel[(1,)](x, y, N=x.numel(), EMULATE=INTERPRETED)
    assert torch.equal(y, x.to(dtype))


def test_autotuning_keeps_the_configs_that_fit_in_shared_memory(monkeypatch):
    """The pruning the GPU autotuner runs, here on CPU: the expected sets are what an ahead-of-time compile for
    sm_90 (triton 3.9 and 3.6, bf16) allocated, against the 227 KB an H100/H200 block may use."""
    monkeypatch.setattr(portable_config, "_max_shared_memory", lambda device_index: 232448)

    def kept(shared_bytes, shapes, head_dim, dtype=torch.bfloat16, seq_bucket=65536):
        configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in shapes]
        named_args = {"Q": torch.empty(0, dtype=dtype), "SEQ_BUCKET": seq_bucket}
        pruned = fitting(shared_bytes)(configs, named_args, HEAD_DIM=head_dim)
        return [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in pruned]

    for shapes, shared_bytes in ((FORWARD_SHAPES, forward_shared_bytes), (DKDV_SHAPES, dkdv_shared_bytes),
                                 (DQ_SHAPES, dq_shared_bytes)):
        assert kept(shared_bytes, shapes, 128) == shapes
        assert kept(shared_bytes, shapes, 64, torch.float32) == [s for s in shapes if s[0] * s[1] <= 64 * 64]
    assert kept(forward_shared_bytes, FORWARD_SHAPES, 256) == [(64, 64, 4, 3), (64, 32, 4, 3)]
    assert kept(dkdv_shared_bytes, DKDV_SHAPES, 256) == [(32, 128, 8, 2), (32, 128, 8, 3), (32, 64, 4, 3),
                                                         (32, 64, 4, 4), (16, 64, 8, 2)]
    assert kept(dq_shared_bytes, DQ_SHAPES, 256) == [(128, 32, 8, 3), (64, 32, 4, 4)]
    # short calls are not tuned: the first fitting config
    assert kept(dq_shared_bytes, DQ_SHAPES, 256, seq_bucket=2048) == [(128, 32, 8, 3)]


def _recorded_grids(monkeypatch) -> dict:
    """{kernel: grid} of the portable kernels' launches from now on, whoever launches them (autotuner or config)."""
    grids = {}
    for name, kernel in (("forward", portable_fwd._forward_kernel), ("dkdv", portable_bwd._dkdv_kernel),
                         ("dq", portable_bwd._dq_kernel)):
        def recording(*args, grid, _name=name, _run=kernel.fn.run, **kwargs):
            grids[_name] = grid(kwargs) if callable(grid) else grid
            return _run(*args, grid=grid, **kwargs)
        monkeypatch.setattr(kernel.fn, "run", recording)
    return grids


CUSTOM_CONFIG = PortableConfig(KernelConfig(16, 32, 4, 1), KernelConfig(32, 16, 4, 1), KernelConfig(16, 16, 4, 1))


def test_config_is_an_argument_and_none_means_the_autotuner(monkeypatch):
    """A PortableConfig reaches each kernel (its blocks set the grids) and computes the same attention; no config
    launches what the autotuner picks (the interpreter's one config: forward and dQ 64 x 32, dK/dV 32 x 64)."""
    q, k, v, dout = _inputs(1, 40, 40, 2, 1, 32, torch.float32, seed=9)
    scale = 1 / math.sqrt(32)
    grids = _recorded_grids(monkeypatch)
    default = _ours(q, k, v, dout, True, scale)
    if INTERPRETED:
        assert grids == {"forward": (1, 2), "dkdv": (1, 1), "dq": (1, 2)}
    custom = _with_grads(lambda *x: flash_attention(*x, causal=True, softmax_scale=scale, return_lse=True,
                                                    config=CUSTOM_CONFIG), q, k, v, dout)
    # 40 rows: 3 forward/dQ query blocks of 16 per (batch, head), 3 dK/dV key blocks of 16 per KV head
    assert grids == {"forward": (3, 2), "dkdv": (3, 1), "dq": (3, 2)}
    exact = _exact(q, k, v, dout, True, scale)
    _assert_fp32_close(custom, exact)
    _assert_fp32_close(default, exact)
    grids.clear()
    flash_attention_forward(q, k, v, causal=True, softmax_scale=None, config=CUSTOM_CONFIG)
    assert grids == {"forward": (3, 2)}


@pytest.mark.parametrize("backend, config, message", [
    ("triton", KernelConfig(16, 16, 4, 1), "config must be a PortableConfig, a HopperConfig or None, got KernelConfig"),
    ("triton_portable", HopperConfig(), "config is a HopperConfig, the hopper family's, but the portable family "
                                        "serves this call"),
    ("triton", HopperConfig(), "config is a HopperConfig, the hopper family's, but the portable family serves"),
    ("reference", CUSTOM_CONFIG, "backend='reference' takes none"),
    ("triton_hopper", CUSTOM_CONFIG, "config is a PortableConfig, the portable family's, but the hopper family "
                                     "serves this call"),
    ("triton_hopper", HopperConfig(backward=CUSTOM_CONFIG), "config.backward must be a HopperBackwardConfig"),
    ("triton", dataclasses.replace(CUSTOM_CONFIG, backward_dq=KernelConfig(24, 16, 4, 1)),
     r"config.backward_dq = KernelConfig\(block_m=24, .*\): blocks must be powers of two"),
    ("triton", dataclasses.replace(CUSTOM_CONFIG, forward=(16, 16, 4, 1)), "config.forward must be a .*KernelConfig"),
])
def test_config_of_the_wrong_kind_is_refused(backend, config, message):
    q, k, v, dout = _good()
    with pytest.raises(ValueError, match=message):
        flash_attention(q, k, v, backend=backend, config=config)
    out, lse = flash_attention_forward(q, k, v, causal=True, softmax_scale=None)
    with pytest.raises(ValueError, match=message):
        flash_attention_backward(dout, q, k, v, out, lse, causal=True, softmax_scale=None, backend=backend,
                                 config=config)


def test_config_of_the_portable_family_is_refused_where_triton_picks_the_hopper_family(monkeypatch):
    """Under the automatic "triton" the family is the inputs' (here as on an sm_90 GPU with Triton 3.6): a
    PortableConfig is then a ValueError naming both families, not a silent switch to the portable kernels."""
    q, k, v, dout = _good()
    monkeypatch.setattr(flash_attention_module, "hopper_unsupported", lambda *_: None)
    message = "config is a PortableConfig, the portable family's, but the hopper family serves this call"
    with pytest.raises(ValueError, match=message):
        flash_attention(q, k, v, backend="triton", config=CUSTOM_CONFIG)
    with pytest.raises(ValueError, match=message):
        flash_attention_forward(q, k, v, causal=True, softmax_scale=None, config=CUSTOM_CONFIG)


# ------------------------------------------------------------------------------------------------ validation

def _good():
    return _inputs(1, 8, 8, 4, 2, 32, torch.float32)


@pytest.mark.parametrize("mutate, message", [
    (lambda q, k, v: (q[0], k, v), "q must be 4-D"),
    (lambda q, k, v: (q, k.double(), v), "k has dtype torch.float64"),
    (lambda q, k, v: (q.double(), k.double(), v.double()), "q has dtype torch.float64"),
    (lambda q, k, v: (q, k.half(), v.half()), "share one dtype"),
    (lambda q, k, v: (q[..., :16], k[..., :16], v[..., :16]), "head_dim 16 is not supported"),
    (lambda q, k, v: (q, k[..., :16], v[..., :16]), "head_dim mismatch"),
    (lambda q, k, v: (q[:, :, :3], k, v), "multiple of KV heads"),
    (lambda q, k, v: (q.expand(2, -1, -1, -1), k, v), "batch size mismatch"),
    (lambda q, k, v: (q, k, v[:, :4]), "k and v must have the same shape"),
    (lambda q, k, v: (q, k.to("meta"), v.to("meta")), "one device"),
    (lambda q, k, v: (q[:, :0], k, v), "empty input"),
])
def test_bad_inputs_raise_value_error(mutate, message):
    q, k, v = mutate(*_good()[:3])
    with pytest.raises(ValueError, match=message):
        flash_attention(q, k, v)


@pytest.mark.parametrize("kwargs, message", [
    (dict(softmax_scale=0.0), "softmax_scale"), (dict(softmax_scale=float("nan")), "softmax_scale"),
    (dict(backend="cudnn"), "choose one of 'triton', 'triton_portable', 'triton_hopper', 'reference'"),
])
def test_bad_options_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        flash_attention(*_good()[:3], **kwargs)


def test_bad_pair_arguments_raise_value_error():
    q, k, v, dout = _good()
    out, lse = flash_attention_forward(q, k, v, causal=True, softmax_scale=None)
    kw = dict(causal=True, softmax_scale=None)
    with pytest.raises(ValueError, match="out_dtype"):
        flash_attention_forward(q, k, v, out_dtype=torch.int32, **kw)
    with pytest.raises(ValueError, match="dout must have q's shape"):
        flash_attention_backward(dout[:, :4], q, k, v, out, lse, **kw)
    with pytest.raises(ValueError, match="out must have q's shape"):
        flash_attention_backward(dout, q, k, v, out[..., :16], lse, **kw)
    with pytest.raises(ValueError, match=r"lse must have shape \[B, H, Sq\]"):
        flash_attention_backward(dout, q, k, v, out, lse[:, :2], **kw)
    with pytest.raises(ValueError, match="lse must be float32"):
        flash_attention_backward(dout, q, k, v, out, lse.double(), **kw)


# ------------------------------------------------------------------------------------------------------ GPU

GPU_CASES = [(2, 2048, 2048, 32, 8, 128, torch.bfloat16), (1, 4096, 4096, 16, 16, 64, torch.bfloat16),
             (1, 1000, 3001, 8, 2, 128, torch.bfloat16), (1, 3001, 1000, 8, 8, 128, torch.float16),
             (1, 1024, 1024, 8, 4, 256, torch.bfloat16), (1, 1500, 1500, 8, 8, 96, torch.float16),
             (1, 2048, 2048, 8, 1, 32, torch.bfloat16)]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "b{}-sq{}-sk{}-h{}-kv{}-d{}-{}".format(*c[:6], str(c[6])[6:]))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gpu_real_sizes(case, causal):
    batch, seq_q, seq_k, heads, kv_heads, head_dim, dtype = case
    _check_rule(*_inputs(batch, seq_q, seq_k, heads, kv_heads, head_dim, dtype, device="cuda"), causal)


@pytest.mark.gpu
def test_gpu_float32_is_ieee():
    q, k, v, dout = _inputs(1, 700, 900, 8, 2, 128, torch.float32, device="cuda")
    _assert_fp32_close(_ours(q, k, v, dout, True, 0.1), _exact(q, k, v, dout, True, 0.1))  # TF32: ~1e-3 off


@pytest.mark.gpu
def test_gpu_deterministic():
    q, k, v, dout = _inputs(1, 2048, 2048, 16, 4, 128, torch.bfloat16, device="cuda")
    first, second = _ours(q, k, v, dout, True, 0.1), _ours(q, k, v, dout, True, 0.1)
    assert all(torch.equal(first[n], second[n]) for n in NAMES)  # no atomics anywhere


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "triton"])
@pytest.mark.parametrize("kv_heads", [8, 2])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gpu_other_backends(backend, kv_heads, causal):
    if backend == "flash_attn":
        pytest.importorskip("flash_attn")
    q, k, v, dout = _inputs(2, 1024, 1024, 8, kv_heads, 128, torch.bfloat16, device="cuda")
    scale = 1 / math.sqrt(128)
    exact, naive = _exact(q, k, v, dout, causal, scale), _naive(q, k, v, dout, causal, scale)
    violations = _rule_violations(_ours(q, k, v, dout, causal, scale, backend=backend), naive, exact)
    assert not violations, f"(backend, naive) errors beyond the rule: {violations}"
    # and the pair-level functions (float32 out and gradients)
    out, lse = flash_attention_forward(q, k, v, causal=causal, softmax_scale=scale, out_dtype=torch.float32,
                                       backend=backend)
    grads = flash_attention_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale, backend=backend)
    assert lse.shape == (2, 8, 1024) and all(x.dtype == torch.float32 for x in (out, lse, *grads))
    pair = dict(out=out, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2])
    violations = _rule_violations(pair, naive, exact)
    assert not violations, f"(pair-level backend, naive) errors beyond the rule: {violations}"


@pytest.mark.parametrize("set_up, expected", [
    ("cli", "ok"),  # the CLI's set-up (which tests/conftest.py runs too) before triton is imported: kernels run
    ("none", "Triton's interpreter is off; move them to CUDA, or set TRITON_INTERPRET=1 before anything imports"),
    ("late", "TRITON_INTERPRET=1 was set after triton was imported"),  # tl.sum etc. stayed compiled
])
def test_cpu_tensors_need_the_interpreter_chosen_before_triton_is_imported(tmp_path, set_up, expected):
    """The library sets no TRITON_INTERPRET itself: without CUDA the entry point chooses it before triton is
    imported, and a CPU call without it fails with one line naming the fix."""
    script = tmp_path / "interpret.py"
    script.write_text(
        "import os, sys\n"
        "if sys.argv[1] == 'cli':\n"
        "    from compare.cli import interpret_triton_without_cuda\n"
        "    interpret_triton_without_cuda()\n"
        "elif sys.argv[1] == 'late':\n"
        "    import triton.language\n"
        "    os.environ['TRITON_INTERPRET'] = '1'\n"
        "import torch\n"
        "from torch_impl.attention import reference_attention\n"
        "from torch_impl.kernels.flash_attention import flash_attention\n"
        "q, k, v = torch.randn(1, 40, 2, 32), torch.randn(1, 40, 1, 32), torch.randn(1, 40, 1, 32)\n"
        "try:\n"
        "    out = flash_attention(q, k, v)\n"
        "except ValueError as error:\n"
        "    sys.exit(str(error))\n"
        "# float32 both ways, only the summation order differs\n"
        "torch.testing.assert_close(out, reference_attention(q, k, v), rtol=1e-4, atol=1e-4)\n"
        "print('ok')\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # no GPU, whatever this machine has
    done = subprocess.run([sys.executable, str(script), set_up], env=env, capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if expected == "ok":
        assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
    else:
        assert done.returncode == 1 and expected in done.stderr.strip().splitlines()[-1], done.stderr[-2000:]
