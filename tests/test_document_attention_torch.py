"""Packed documents through the PyTorch attention (`flash_attention(..., segment_ids=)`, the pair functions'
`spans`): the portable Triton kernels (interpreted on CPU) and the reference against the same documents attended one
at a time, by the flash rule (bf16/fp16) and in fp32; the negative control (a dropped boundary fails); blocks with
no pair skipped, not masked; the backends that do not take documents refuse them. On a GPU (`gpu`): every family
that takes documents (the Hopper one on sm_90, the portable one, and "triton" picking) at real sizes, the Hopper
family's negative control and its skipped blocks. Twin of tests/test_document_attention_jax.py; the cases, the
answer and the tolerances (with their reasons) are tests/document_twins.py's.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import document_twins as twins
import kernel_twins
import numpy as np
import pytest
import torch

from torch_impl.attention import reference_attention, reference_attention_backward, reference_attention_forward
from torch_impl.documents import Spans
from torch_impl.kernels.flash_attention import flash_attention, flash_attention_backward, flash_attention_forward
from torch_impl.kernels.hopper.config import forward_config, lockstep_config
from torch_impl.kernels.portable.config import KernelConfig, PortableConfig
from torch_impl.kernels.tiles import GLUON_AVAILABLE

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_HOPPER = DEVICE == "cuda" and torch.cuda.get_device_capability()[0] == 9
needs_gluon_gpu = pytest.mark.skipif(not (ON_HOPPER and GLUON_AVAILABLE), reason="needs an sm_90 GPU and the "
                                     "Triton release the Gluon kernels are written for")
# The portable family at one launch shape on the GPU, so its tests do not autotune (the Hopper family's shapes are
# picked per call class, without autotuning).
PORTABLE_GPU = PortableConfig(*(KernelConfig(64, 64, 4, 2),) * 3)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _tensors(arrays, dtype):
    return [torch.from_numpy(np.asarray(x)).to(device=DEVICE, dtype=DTYPES[dtype]) for x in arrays]


def _ours(q, k, v, dout, causal, segment_ids, backend="triton", config=None):
    """{NAMES: float64 numpy} of flash_attention with gradients through autograd."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out, lse = flash_attention(q, k, v, causal=causal, return_lse=True, backend=backend, config=config,
                               segment_ids=torch.from_numpy(segment_ids).to(DEVICE))
    out.backward(dout)
    return {name: x.detach().double().cpu().numpy() for name, x in zip(kernel_twins.NAMES, (out, lse, q.grad, k.grad,
                                                                                              v.grad))}


def naive_one_at_a_time(case, arrays, causal, dtype):
    """The naive same-dtype attention (`reference_attention`), one document at a time."""
    def attend(q, k, v, dout):
        q, k, v, dout = _tensors((q, k, v, dout), dtype)
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        out, lse = reference_attention(q, k, v, causal=causal, return_lse=True)
        out.backward(dout)
        return {name: x.detach().double().cpu().numpy()
                for name, x in zip(kernel_twins.NAMES, (out, lse, q.grad, k.grad, v.grad))}
    return twins.one_at_a_time(case, attend, *arrays)


@functools.lru_cache(maxsize=4)
def _answers(case, dtype, causal):
    """(inputs, naive, exact) of a case, kept for the next backend on the same case (the float64 answer of real
    sizes is the slow part of the GPU tests)."""
    arrays = twins.case_inputs(case, dtype)
    return arrays, naive_one_at_a_time(case, arrays, causal, dtype), twins.exact(case, *arrays, causal)


def _violations(case, dtype, causal, segment_ids, backend="triton", config=None):
    arrays, naive, exact = _answers(case, dtype, causal)
    ours = _ours(*_tensors(arrays, dtype), causal, segment_ids, backend=backend, config=config)
    return kernel_twins.flash_rule_violations(ours, naive, exact)


@pytest.mark.parametrize("case", twins.CASES, ids=twins.ids(twins.CASES))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_documents_match_one_at_a_time_by_the_flash_rule(dtype, causal, case):
    violations = _violations(case, dtype, causal, twins.segment_ids(case))
    assert not violations, f"(ours, naive) errors beyond the rule: {violations}"


@pytest.mark.parametrize("backend", ["triton_portable", "reference"])
@pytest.mark.parametrize("case", twins.FP32_CASES, ids=twins.ids(twins.FP32_CASES))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_documents_fp32_match_one_at_a_time(causal, case, backend):
    arrays = twins.case_inputs(case, "float32")
    ours = _ours(*_tensors(arrays, "float32"), causal, twins.segment_ids(case), backend=backend)
    kernel_twins.assert_fp32_close(ours, twins.exact(case, *arrays, causal))


def test_a_dropped_boundary_fails_the_rule():
    """Negative control: the same comparison catches one boundary missing from the segment ids."""
    case = twins.NEGATIVE_CONTROL
    merged = twins.merged_boundary(twins.segment_ids(case), twins.DROPPED_BOUNDARY)
    assert _violations(case, "bfloat16", True, merged)


def _poisoned_runs(case, dtype, causal, poisoned, **ours):
    """(clean, dirty, rows): our results on the case's documents, and again with NaN in q, k, v and dout of
    document `poisoned` (its `rows`)."""
    ids = twins.segment_ids(case)
    arrays = twins.case_inputs(case, dtype)
    clean = _ours(*_tensors(arrays, dtype), causal, ids, **ours)
    rows = ids[0] == poisoned
    for x in arrays:
        x[:, rows] = np.nan
    return clean, _ours(*_tensors(arrays, dtype), causal, ids, **ours), rows


def _assert_poison_stays(clean, dirty, rows, tolerance=None):
    """For each result in `clean`: the poisoned document's are NaN (the poison took); the other's finite and equal to
    the clean run's (within `tolerance`, assert_allclose's rtol/atol, where given)."""
    for name in clean:
        tokens = 2 if name == "lse" else 1  # lse is [B, H, S]
        assert not np.isfinite(np.compress(rows, dirty[name], tokens)).any(), name  # the poison took
        kept, want = np.compress(~rows, dirty[name], tokens), np.compress(~rows, clean[name], tokens)
        assert np.isfinite(kept).all(), name
        if tolerance is None:
            np.testing.assert_array_equal(kept, want, err_msg=name)
        else:
            np.testing.assert_allclose(kept, want, **tolerance, err_msg=name)


@pytest.mark.parametrize("poisoned", [0, 1], ids=["first-poisoned", "second-poisoned"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_blocks_without_a_pair_are_skipped(causal, poisoned):
    """NaN in one document's q, k, v and dout leaves the other's results finite and unchanged: no kernel loads a
    tile of it (a masked tile would still multiply its NaN V or dO by a zero P)."""
    config = PortableConfig(*(KernelConfig(*twins.SKIP_BLOCKS[name], 4, 1)
                              for name in ("forward", "backward_dkdv", "backward_dq")))
    _assert_poison_stays(*_poisoned_runs(twins.SKIP_CASE, "float32", causal, poisoned, config=config))


def _random_spans(batch, seq_q, seq_k, seed):
    """Monotone key spans that are no documents' (empty rows, rows with end < start, a span ending at seq_k)."""
    rng = np.random.default_rng(seed)
    start = np.sort(rng.integers(0, seq_k, (batch, seq_q)), axis=1)
    end = np.sort(rng.integers(0, seq_k + 1, (batch, seq_q)), axis=1)
    end[:, -1] = seq_k
    return Spans(*(torch.from_numpy(x.astype(np.int32)).to(DEVICE) for x in (start, end)))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_pair_functions_take_any_monotone_spans(causal):
    """The ring's contract: the pair forward and backward on spans of any monotone shape, Sq != Sk, the causal rule
    folded in, match the reference pair functions (fp32, FP32_TOL) with the kernels' block ranges exercised."""
    case = kernel_twins.KernelCase(45, 70, 4, 2, 32, batch=2)
    q, k, v, dout = _tensors(kernel_twins.inputs(case, "float32"), "float32")
    spans = _random_spans(2, 45, 70, seed=1)
    scale = 1 / math.sqrt(32)
    got, want = {}, {}
    for result, backend in ((got, "triton_portable"), (want, "reference")):
        out, lse = flash_attention_forward(q, k, v, causal=causal, softmax_scale=scale, out_dtype=torch.float32,
                                           backend=backend, spans=spans)
        dq, dk, dv = flash_attention_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale,
                                              backend=backend, spans=spans)
        result.update(zip(kernel_twins.NAMES, (x.cpu().double().numpy() for x in (out, lse, dq, dk, dv))))
    assert np.isneginf(want["lse"]).any()  # some rows see no key: their lse -inf, out and dq 0
    kernel_twins.assert_fp32_close(got, want)


def test_reference_pair_functions_mask_by_spans():
    """The reference's span mask is the contract's: a span covering every key changes nothing."""
    q, k, v, dout = _tensors(kernel_twins.inputs(kernel_twins.KernelCase(20, 20, 2, 1, 32), "float32"), "float32")
    full = Spans(torch.zeros(1, 20, dtype=torch.int32), torch.full((1, 20), 20, dtype=torch.int32))
    with_spans = reference_attention_forward(q, k, v, causal=True, softmax_scale=0.2, spans=full)
    plain = reference_attention_forward(q, k, v, causal=True, softmax_scale=0.2)
    torch.testing.assert_close(with_spans, plain, rtol=0, atol=0)
    grads = reference_attention_backward(dout, q, k, v, *plain, causal=True, softmax_scale=0.2, spans=full)
    for got, want in zip(grads, reference_attention_backward(dout, q, k, v, *plain, causal=True, softmax_scale=0.2)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("backend, message", [
    ("sdpa_cudnn", "backend 'sdpa_cudnn' does not take documents; these do: 'triton', 'triton_portable', "
                   "'triton_hopper', 'reference'"),
    ("flash_attn", "backend 'flash_attn' does not take documents"),
])
def test_backends_without_documents_refuse_them(backend, message):
    q = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=message):
        flash_attention(q, q, q, backend=backend, segment_ids=torch.zeros(1, 8, dtype=torch.int32))


@pytest.mark.parametrize("segment_ids, message", [
    (torch.tensor([[0, 0, 1, 0]]), "non-decreasing .* decrease after position 2"),
    (torch.zeros(1, 3, dtype=torch.int32), r"shape \[batch, seq\] = \(1, 4\)"),
    (torch.zeros(1, 4), "must be integers"),
])
def test_bad_segment_ids_are_one_line(segment_ids, message):
    q = torch.zeros(1, 4, 2, 32)
    with pytest.raises(ValueError, match=message):
        flash_attention(q, q, q, backend="reference", segment_ids=segment_ids)


def test_documents_need_self_attention():
    q, k = torch.zeros(1, 4, 2, 32), torch.zeros(1, 5, 2, 32)
    with pytest.raises(ValueError, match="Sq == Sk"):
        flash_attention(q, k, k, segment_ids=torch.zeros(1, 4, dtype=torch.int32))


# ------------------------------------------------------------------------------------------------------ GPU

# The families that take documents, each forced, and "triton" picking one (the Hopper family on sm_90).
GPU_BACKENDS = [pytest.param("triton_hopper", None, marks=needs_gluon_gpu, id="hopper"),
                pytest.param("triton_portable", PORTABLE_GPU, id="portable"),
                pytest.param("triton", None, id="triton")]


@pytest.mark.gpu
@pytest.mark.parametrize("backend, config", GPU_BACKENDS)
@pytest.mark.parametrize("lengths", [(4096,), (1, 777, 3000, 318), (128,) * 32], ids=["one", "mixed", "short"])
@pytest.mark.parametrize("dim", [64, 128])
def test_documents_on_the_gpu_by_the_flash_rule(dim, lengths, backend, config):
    """Real sizes: bf16, every family that takes documents, documents as the corpus packs them and many short ones,
    by the flash rule against the documents one at a time (causal, as the model runs them)."""
    case = twins.DocumentCase((lengths,), heads=8, kv_heads=2, dim=dim)
    violations = _violations(case, "bfloat16", True, twins.segment_ids(case), backend=backend, config=config)
    assert not violations, f"({backend}, naive) errors beyond the rule: {violations}"


@pytest.mark.gpu
@needs_gluon_gpu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dim", [64, 128])
def test_gpu_hopper_documents_meet_the_rule_and_a_dropped_boundary_fails_it(dim, causal):
    """The Hopper family at the negative control's documents (lengths of no block multiple): the flash rule holds
    with the right segment ids, and fails with one boundary dropped."""
    case = dataclasses.replace(twins.NEGATIVE_CONTROL, heads=8, kv_heads=2, dim=dim)
    ids = twins.segment_ids(case)
    assert not _violations(case, "bfloat16", causal, ids, backend="triton_hopper")
    assert _violations(case, "bfloat16", causal, twins.merged_boundary(ids, twins.DROPPED_BOUNDARY),
                       backend="triton_hopper")


# Two documents of 384 tokens: a whole number of every Hopper block (forward 128 or 192 query rows and 128 keys,
# backward 128 keys and 64 or 128 query rows), so no tile holds both.
HOPPER_SKIP_CASE = twins.DocumentCase(((384, 384),), heads=4, kv_heads=2)


@pytest.mark.gpu
@needs_gluon_gpu
@pytest.mark.parametrize("poisoned", [0, 1], ids=["first-poisoned", "second-poisoned"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dim", [64, 128])
def test_gpu_hopper_skips_blocks_without_a_pair(dim, causal, poisoned):
    """`test_blocks_without_a_pair_are_skipped` for the Hopper family (its default shapes at both head dims, and
    the lockstep backward): NaN in one document does not reach the other's results. Out, lse, dk, dv are computed
    in a fixed order, so they must be equal. dq sums the 3 key blocks' float32 shares by TMA reduce-adds in whatever
    order the programs finish: held to rtol 2^-6 (a reordered float32 sum moves the bf16 result by at most one ulp,
    2^-7 relative at worst) and atol 1e-5 of its largest value (a sum that nearly cancels: 3 float32 roundings of
    the largest share, 2^-22, with margin); a leaked NaN would still show as non-finite."""
    case = dataclasses.replace(HOPPER_SKIP_CASE, dim=dim)
    # documents run non-causal shapes (the causal rule is in the spans)
    for config in (None, dataclasses.replace(forward_config(dim, False, 0), backward=lockstep_config(dim))):
        clean, dirty, rows = _poisoned_runs(case, "bfloat16", causal, poisoned, backend="triton_hopper",
                                            config=config)
        _assert_poison_stays({k: x for k, x in clean.items() if k != "dq"}, dirty, rows)
        dq_tolerance = dict(rtol=2 ** -6, atol=1e-5 * np.abs(clean["dq"]).max())
        _assert_poison_stays({"dq": clean["dq"]}, dirty, rows, tolerance=dq_tolerance)
