"""Packed documents through torch_impl.ring_attention (`segment_ids=`) over 4 gloo processes, one launch for every
case: each layout (contiguous, zigzag, zigzag_stripes), variant and mask against the same documents attended one
at a time (fp32 with the reference pair backend; bf16 through the Triton kernels by the flash rule), the negative
control (a dropped boundary fails), and the zigzag_stripes layout without documents against plain causal
attention; over NCCL on 2 GPUs (`gpu`), real sizes, through the kernels "triton" picks (on sm_90 the Hopper
family, which the test asserts). Twin of
tests/test_document_ring_jax.py; the cases, the answer and the tolerances (with their reasons) are
tests/document_twins.py's.
"""

from __future__ import annotations

import document_twins as twins
import kernel_twins
import numpy as np
import pytest
import ring_twins
import torch
from distributed import run_on_ranks
from test_document_attention_torch import naive_one_at_a_time

from torch_impl.kernels import flash_attention as fa
from torch_impl.kernels.tiles import GLUON_AVAILABLE
from torch_impl.ring_attention import ring_attention, shard_for_ring
from weights.layout import gather_sequence

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def case_documents(rank, world, *, case: twins.DocumentRingCase, backend: str, dropped_boundary=False,
                   with_documents=True, device="cpu"):
    """Local (out, lse, dq, dk, dv) of one ring call on the case's packed sequences, gradients through autograd."""
    device = f"cuda:{rank}" if device == "cuda" else device
    arrays = twins.case_inputs(case.documents, case.dtype)
    q, k, v, dout = (shard_for_ring(torch.from_numpy(x).to(device, DTYPES[case.dtype]), None, case.layout)
                     for x in arrays)
    ids = shard_for_ring(torch.from_numpy(twins.ring_segment_ids(case, dropped_boundary=dropped_boundary)).to(device),
                         None, case.layout)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out, lse = ring_attention(q, k, v, causal=case.causal, layout=case.layout, variant=case.variant,
                              return_lse=True, backend=backend, segment_ids=ids if with_documents else None)
    out.backward(dout)
    results = {name: x.detach().double().cpu().numpy() for name, x in zip(kernel_twins.NAMES, (out, lse, q.grad,
                                                                                                 k.grad, v.grad))}
    results["hopper"] = backend == "triton" and fa._uses_hopper(backend, q, k, v)  # the family that served it
    return results


CASES = {f"reference-{case.id}": ("case_documents", dict(case=case, backend="reference"))
         for case in twins.RING_FP32}
CASES |= {f"ours-{case.id}": ("case_documents", dict(case=case, backend="triton"))
          for case in twins.RING_OURS_BF16}
CASES["negative"] = ("case_documents", dict(case=twins.RING_NEGATIVE, backend="reference", dropped_boundary=True))
CASES["stripes-without-documents"] = ("case_documents", dict(case=twins.RING_ONE_DOCUMENT, backend="reference",
                                                             with_documents=False))


@pytest.fixture(scope="module")
def p4():
    return run_on_ranks(4, CASES, module=__name__)


def _results(p4, name, layout) -> dict:
    per_rank = [r[name] for r in p4]
    errors = [r["error"] for r in per_rank if "error" in r]
    assert not errors, errors[0]
    return {key: gather_sequence([r[key] for r in per_rank], layout, axis=2 if key == "lse" else 1)
            for key in kernel_twins.NAMES}


def _exact(case):
    return twins.exact(case.documents, *twins.case_inputs(case.documents, case.dtype), case.causal)


@pytest.mark.slow
@pytest.mark.parametrize("case", twins.RING_FP32, ids=twins.ids(twins.RING_FP32))
def test_ring_documents_match_one_at_a_time(p4, case):
    kernel_twins.assert_fp32_close(_results(p4, f"reference-{case.id}", case.layout), _exact(case))


@pytest.mark.slow
@pytest.mark.parametrize("case", twins.RING_OURS_BF16, ids=twins.ids(twins.RING_OURS_BF16))
def test_ring_documents_through_our_kernels_meet_the_flash_rule(p4, case):
    arrays = twins.case_inputs(case.documents, case.dtype)
    naive = naive_one_at_a_time(case.documents, arrays, case.causal, case.dtype)
    ring_twins.assert_flash_rule(_results(p4, f"ours-{case.id}", case.layout), naive, _exact(case))


@pytest.mark.slow
def test_a_dropped_boundary_fails(p4):
    """Negative control: the ring with one boundary missing from the segment ids is not the documents' answer."""
    case = twins.RING_NEGATIVE
    with pytest.raises(AssertionError):
        kernel_twins.assert_fp32_close(_results(p4, "negative", case.layout), _exact(case))


@pytest.mark.slow
def test_zigzag_stripes_without_documents_is_causal_attention(p4):
    """A zigzag_stripes ring without segment ids runs on the spans of one document: plain causal attention."""
    got = _results(p4, "stripes-without-documents", "zigzag_stripes")
    kernel_twins.assert_fp32_close(got, _exact(twins.RING_ONE_DOCUMENT))


@pytest.fixture(scope="module")
def p2_gpu():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    cases = {case.id: ("case_documents", dict(case=case, backend="triton", device="cuda")) for case in twins.RING_GPU}
    return run_on_ranks(2, cases, module=__name__, comm_backend="nccl")


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.parametrize("case", twins.RING_GPU, ids=twins.ids(twins.RING_GPU))
def test_gpu_ring_documents_meet_the_flash_rule(p2_gpu, case):
    """2 GPUs over NCCL, bf16 through the kernels "triton" picks: on sm_90 with the Triton the Gluon kernels are
    written for, the Hopper family (asserted), else the portable one."""
    got = _results(p2_gpu, case.id, case.layout)
    if torch.cuda.get_device_capability()[0] == 9 and GLUON_AVAILABLE:
        assert all(r[case.id]["hopper"] for r in p2_gpu), "the ring's documents did not run the Hopper family"
    arrays = twins.case_inputs(case.documents, case.dtype)
    naive = naive_one_at_a_time(case.documents, arrays, case.causal, case.dtype)
    ring_twins.assert_flash_rule(got, naive, _exact(case))
