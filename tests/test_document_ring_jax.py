"""Packed documents through jax_impl.ring_attention (`segment_ids=`, via `ring_attention_sharded`) on 4 emulated
host devices: each layout (contiguous, zigzag, zigzag_stripes), variant and mask against the same documents
attended one at a time (fp32 with the reference pair backend; bf16 through the Pallas kernels, interpreted, by the
flash rule), the negative control (a dropped boundary fails), and the zigzag_stripes layout without documents
against plain causal attention; on 2 GPUs (`gpu`), real sizes. Twin of tests/test_document_ring_torch.py; the
cases, the answer and the tolerances (with their reasons) are tests/document_twins.py's.
"""

from __future__ import annotations

import importlib

import document_twins as twins
import jax
import jax.numpy as jnp
import kernel_twins
import numpy as np
import pytest
import ring_twins
from jax.sharding import Mesh
from test_document_attention_jax import FAST_COMPILE, naive_one_at_a_time

from compare.bench.jax_compile_profile import kernel_hashes
from jax_impl.ring_attention import ring_attention_sharded


def _ring(case: twins.DocumentRingCase, backend: str, *, dropped_boundary=False, with_documents=True,
          devices=None) -> dict:
    """{NAMES: float64 numpy} of one sharded ring call on the case's packed sequences, gradients by jax.vjp."""
    mesh = Mesh(np.array((devices or jax.devices())[:case.world]), ("sp",))
    q, k, v, dout = (jnp.asarray(x).astype(case.dtype) for x in twins.case_inputs(case.documents, case.dtype))
    ids = jnp.asarray(twins.ring_segment_ids(case, dropped_boundary=dropped_boundary)) if with_documents else None

    def run(q, k, v, dout, ids):
        def attend(q, k, v):
            return ring_attention_sharded(q, k, v, mesh, causal=case.causal, layout=case.layout,
                                          variant=case.variant, return_lse=True, backend=backend, segment_ids=ids)
        (out, lse), pullback = jax.vjp(attend, q, k, v)
        return (out, lse, *pullback((dout, jnp.zeros_like(lse))))
    results = jax.jit(run, compiler_options=FAST_COMPILE)(q, k, v, dout, ids)
    return {name: np.asarray(x, np.float64) for name, x in zip(kernel_twins.NAMES, results)}


def _exact(case):
    return twins.exact(case.documents, *twins.case_inputs(case.documents, case.dtype), case.causal)


@pytest.mark.slow
@pytest.mark.parametrize("case", twins.RING_FP32, ids=twins.ids(twins.RING_FP32))
def test_ring_documents_match_one_at_a_time(case):
    kernel_twins.assert_fp32_close(_ring(case, "reference"), _exact(case))


@pytest.mark.slow
@pytest.mark.parametrize("case", twins.RING_OURS_BF16, ids=twins.ids(twins.RING_OURS_BF16))
def test_ring_documents_through_our_kernels_meet_the_flash_rule(case):
    arrays = twins.case_inputs(case.documents, case.dtype)
    naive = naive_one_at_a_time(case.documents, arrays, case.causal, case.dtype)
    ring_twins.assert_flash_rule(_ring(case, "pallas"), naive, _exact(case))


@pytest.mark.slow
def test_a_dropped_boundary_fails():
    """Negative control: the ring with one boundary missing from the segment ids is not the documents' answer."""
    case = twins.RING_NEGATIVE
    with pytest.raises(AssertionError):
        kernel_twins.assert_fp32_close(_ring(case, "reference", dropped_boundary=True), _exact(case))


@pytest.mark.slow
def test_zigzag_stripes_without_documents_is_causal_attention():
    """A zigzag_stripes ring without segment ids runs on the spans of one document: plain causal attention."""
    case = twins.RING_ONE_DOCUMENT
    kernel_twins.assert_fp32_close(_ring(case, "reference", with_documents=False), _exact(case))


@pytest.mark.parametrize("variant", ["ring", "allgather"])
def test_ring_documents_reach_the_mosaic_kernels_where_they_are_the_default(variant, monkeypatch):
    """On an sm90 GPU "pallas" serves documents with the Mosaic kernels: the ring with segment ids, lowered for CUDA
    on the CPU as on a Hopper GPU (the calls switched from the interpreter, the device taken for an sm90), holds
    Mosaic GPU kernels with the document path lowered, three (forward, dK/dV, dQ): every step is the whole block on
    its key spans, one kernel shape (the numbers: the interpreted pair tests of test_document_attention_jax.py)."""
    kernels = importlib.import_module("jax_impl.kernels.flash_attention")
    monkeypatch.setattr(kernels, "_interpret", lambda: False)
    monkeypatch.setattr(kernels, "_on_hopper", lambda: True)
    mesh = Mesh(np.array(jax.devices()[:2]), ("sp",))
    q = jax.ShapeDtypeStruct((1, 512, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 512, 2, 64), jnp.bfloat16)

    def forward_and_backward(q, k, v, ids):
        out, pullback = jax.vjp(lambda q, k, v: ring_attention_sharded(q, k, v, mesh, layout="zigzag_stripes",
                                                                       variant=variant, segment_ids=ids), q, k, v)
        return pullback(out)
    lowered = jax.jit(forward_and_backward).trace(q, kv, kv, jax.ShapeDtypeStruct((1, 512), jnp.int32))
    assert len(kernel_hashes(lowered.lower(lowering_platforms=("cuda",)))) == 3


@pytest.mark.gpu
@pytest.mark.parametrize("case", twins.RING_GPU, ids=twins.ids(twins.RING_GPU))
def test_gpu_ring_documents_meet_the_flash_rule(case):
    """2 GPUs, bf16 through our kernels ("pallas" with documents: the Mosaic kernels on sm90, else the portable
    ones)."""
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if len(gpus) < case.world:
        pytest.skip(f"needs {case.world} GPUs visible to JAX")
    arrays = twins.case_inputs(case.documents, case.dtype)
    naive = naive_one_at_a_time(case.documents, arrays, case.causal, case.dtype)
    ring_twins.assert_flash_rule(_ring(case, "pallas", devices=gpus), naive, _exact(case))
