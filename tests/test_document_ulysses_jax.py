"""Packed documents through the JAX Ulysses and hybrid schemes (`jax_impl/ulysses.py`, `segment_ids=` via
`sequence_parallel_sharded`) on emulated host devices (conftest requests 4): Ulysses over 2 and 4 devices and the
hybrid 2 x 2, against the same documents attended one at a time (fp32, the reference pair backend and once the
portable Pallas kernels interpreted; forward and gradients), tests/document_twins.py's documents (lengths 1, odd
lengths, documents longer than a device's shard); one document without segment ids; the refusal of zigzag_stripes
(torch's one line, `weights.sequence_parallel.check_gathered_layout`); the negative control (a dropped boundary
fails); and on 2 GPUs (`gpu`), real sizes in bf16 by the flash rule. The cases mirror
tests/test_document_ulysses_torch.py's (zigzag and contiguous: the layouts Ulysses takes). The ring's own documents are
tests/test_document_ring_jax.py's; the tolerances are tests/document_twins.py's.
"""

from __future__ import annotations

import dataclasses

import document_twins as twins
import jax
import jax.numpy as jnp
import kernel_twins
import numpy as np
import pytest
import ring_twins
from jax.sharding import Mesh
from test_document_attention_jax import FAST_COMPILE, naive_one_at_a_time

from jax_impl.ulysses import sequence_parallel_sharded


@dataclasses.dataclass(frozen=True)
class SchemeDocuments:
    """One sequence-parallel call on packed documents: `scheme` with Ulysses degree `degree` over `ring`'s world."""

    scheme: str
    degree: int
    ring: twins.DocumentRingCase

    @property
    def id(self) -> str:
        return f"{self.scheme}-u{self.degree}-{self.ring.id}"


def _case(scheme, degree, world, layout, variant="ring", **kwargs):
    return SchemeDocuments(scheme, degree, twins.DocumentRingCase(world, layout, variant, **kwargs))


# 48 tokens (twins' ring documents: 1, 13, 7, 20, 7 and 30, 18): shards of 24 (U=2) or 12 (U=4, 2 x 2), so the
# documents of 20 and 30 are longer than a shard and 7 and 13 split into no number of chunks
FP32_CASES = [_case("ulysses", 2, 2, "zigzag"), _case("ulysses", 2, 2, "zigzag", causal=False),
              _case("ulysses", 4, 4, "zigzag"), _case("ulysses", 4, 4, "contiguous"),
              _case("hybrid", 2, 4, "zigzag"), _case("hybrid", 2, 4, "zigzag", "allgather"),
              _case("hybrid", 2, 4, "contiguous", causal=False)]
PALLAS_CASE = _case("ulysses", 2, 2, "zigzag")  # the portable kernels' document path, interpreted
NEGATIVE = _case("ulysses", 4, 4, "zigzag")
# one document per row, run without segment ids, in the hybrid's training layout
ONE_DOCUMENT = SchemeDocuments("hybrid", 2, dataclasses.replace(twins.RING_ONE_DOCUMENT, layout="zigzag"))


def _scheme(case: SchemeDocuments, backend: str, *, dropped_boundary=False, with_documents=True,
            devices=None) -> dict:
    """{NAMES: float64 numpy} of one sharded call on the case's packed sequences, gradients by jax.vjp."""
    ring = case.ring
    mesh = Mesh(np.array((devices or jax.devices())[:ring.world]), ("sp",))
    q, k, v, dout = (jnp.asarray(x).astype(ring.dtype) for x in twins.case_inputs(ring.documents, ring.dtype))
    ids = jnp.asarray(twins.ring_segment_ids(ring, dropped_boundary=dropped_boundary)) if with_documents else None

    def run(q, k, v, dout, ids):
        def attend(q, k, v):
            return sequence_parallel_sharded(q, k, v, mesh, scheme=case.scheme, ulysses_degree=case.degree,
                                             causal=ring.causal, layout=ring.layout, variant=ring.variant,
                                             return_lse=True, backend=backend, segment_ids=ids)
        (out, lse), pullback = jax.vjp(attend, q, k, v)
        return (out, lse, *pullback((dout, jnp.zeros_like(lse))))
    results = jax.jit(run, compiler_options=FAST_COMPILE)(q, k, v, dout, ids)
    return {name: np.asarray(x, np.float64) for name, x in zip(kernel_twins.NAMES, results)}


def _exact(case: SchemeDocuments) -> dict:
    ring = case.ring
    return twins.exact(ring.documents, *twins.case_inputs(ring.documents, ring.dtype), ring.causal)


@pytest.mark.parametrize("case", FP32_CASES, ids=[case.id for case in FP32_CASES])
def test_documents_match_one_at_a_time(case):
    kernel_twins.assert_fp32_close(_scheme(case, "reference"), _exact(case))


def test_documents_through_the_portable_kernels():
    kernel_twins.assert_fp32_close(_scheme(PALLAS_CASE, "pallas"), _exact(PALLAS_CASE))


def test_one_document_without_segment_ids_is_causal_attention():
    kernel_twins.assert_fp32_close(_scheme(ONE_DOCUMENT, "reference", with_documents=False), _exact(ONE_DOCUMENT))


def test_a_dropped_boundary_fails():
    """Negative control: the documents with one boundary missing from the segment ids are not the answer."""
    with pytest.raises(AssertionError):
        kernel_twins.assert_fp32_close(_scheme(NEGATIVE, "reference", dropped_boundary=True), _exact(NEGATIVE))


REFUSED = "sequence_parallel_attention with a Ulysses degree above 1 takes the contiguous or zigzag layout, got " \
          "'zigzag_stripes': a group's stripes over P are not the stripes of a ring over R"


@pytest.mark.parametrize("scheme, degree", [("ulysses", 4), ("hybrid", 2)])
def test_zigzag_stripes_is_refused(scheme, degree):
    """zigzag_stripes with documents over 4 devices raises torch's one line (`check_gathered_layout`) at trace
    time; the same call in zigzag then works."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("sp",))
    x, ids = jnp.ones((1, 48, 4, 32), jnp.float32), jnp.zeros((1, 48), jnp.int32)
    with pytest.raises(ValueError) as error:
        sequence_parallel_sharded(x, x, x, mesh, scheme=scheme, ulysses_degree=degree, layout="zigzag_stripes",
                                  backend="reference", segment_ids=ids)
    assert str(error.value) == REFUSED
    out = sequence_parallel_sharded(x, x, x, mesh, scheme=scheme, ulysses_degree=degree, layout="zigzag",
                                    backend="reference", segment_ids=ids)
    assert bool(jnp.isfinite(out).all())


GPU_CASES = [SchemeDocuments("ulysses", 2, twins.DocumentRingCase(
    2, "zigzag", "ring", dtype="bfloat16",
    documents=twins.DocumentCase(twins.GPU_DOCUMENTS, heads=16, kv_heads=4, dim=dim))) for dim in (64, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[case.id for case in GPU_CASES])
def test_gpu_ulysses_documents_meet_the_flash_rule(case):
    """2 GPUs, 8k tokens of documents as the corpus packs them, bf16 through our kernels (the default backend)."""
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if len(gpus) < case.ring.world:
        pytest.skip(f"needs {case.ring.world} GPUs visible to JAX")
    ring = case.ring
    arrays = twins.case_inputs(ring.documents, ring.dtype)
    naive = naive_one_at_a_time(ring.documents, arrays, ring.causal, ring.dtype)
    ring_twins.assert_flash_rule(_scheme(case, "pallas", devices=gpus), naive, _exact(case))

