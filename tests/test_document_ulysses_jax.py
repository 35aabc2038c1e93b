"""Packed documents through the JAX Ulysses and hybrid schemes (`jax_impl/ulysses.py`, `segment_ids=` via
`sequence_parallel_sharded`) on emulated host devices (conftest requests 4): Ulysses over 2 and 4 devices and the
hybrid 2 x 2, against the same documents attended one at a time (fp32, the reference pair backend and once the
portable Pallas kernels interpreted; forward and gradients), tests/document_twins.py's documents (lengths 1, odd
lengths, documents longer than a device's shard); the group's token order after the all-to-all for the
zigzag_stripes layout against `weights.layout`; the hybrid's refused zigzag_stripes lengths; the negative control (a
dropped boundary fails); and on 2 GPUs (`gpu`), real sizes in bf16 by the flash rule. The ring's own documents are
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

from jax_impl import ulysses
from jax_impl.ulysses import sequence_parallel_sharded
from weights.layout import rank_positions, stripe_tokens


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
FP32_CASES = [_case("ulysses", 2, 2, "zigzag_stripes"), _case("ulysses", 2, 2, "zigzag", causal=False),
              _case("ulysses", 4, 4, "zigzag_stripes"), _case("ulysses", 4, 4, "contiguous"),
              _case("hybrid", 2, 4, "zigzag_stripes"), _case("hybrid", 2, 4, "zigzag", "allgather"),
              _case("hybrid", 2, 4, "contiguous", causal=False)]
PALLAS_CASE = _case("ulysses", 2, 2, "zigzag_stripes")  # the portable kernels' document path, interpreted
NEGATIVE = _case("ulysses", 4, 4, "zigzag_stripes")
ONE_DOCUMENT = SchemeDocuments("hybrid", 2, twins.RING_ONE_DOCUMENT)  # zigzag_stripes without segment ids


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
def test_scheme_documents_match_one_at_a_time(case):
    kernel_twins.assert_fp32_close(_scheme(case, "reference"), _exact(case))


def test_scheme_documents_through_the_portable_kernels():
    kernel_twins.assert_fp32_close(_scheme(PALLAS_CASE, "pallas"), _exact(PALLAS_CASE))


def test_zigzag_stripes_without_documents_is_causal_attention():
    kernel_twins.assert_fp32_close(_scheme(ONE_DOCUMENT, "reference", with_documents=False), _exact(ONE_DOCUMENT))


def test_a_dropped_boundary_fails():
    """Negative control: the documents with one boundary missing from the segment ids are not the answer."""
    with pytest.raises(AssertionError):
        kernel_twins.assert_fp32_close(_scheme(NEGATIVE, "reference", dropped_boundary=True), _exact(NEGATIVE))


@pytest.mark.parametrize("degree, ring, seq_len", [(2, 1, 2048), (4, 1, 4096), (2, 2, 1536), (2, 2, 4096)])
def test_stripes_reach_position_order_after_the_all_to_all(degree, ring, seq_len):
    """zigzag_stripes with several stripe groups per device: the group's gathered positions (device after device)
    come out increasing, each group's the positions `weights.layout` gives its rank of a ring over R (where the
    hybrid takes the length), and back."""
    world = degree * ring
    local = seq_len // world
    to_positions, to_devices = ulysses._group_order(degree, world, local, "zigzag_stripes")
    assert local // (2 * stripe_tokens(seq_len, world)) > 1  # several stripe groups per device
    for r in range(ring):
        gathered = np.concatenate([rank_positions(seq_len, world, r * degree + u, "zigzag_stripes")
                                   for u in range(degree)])[None, :, None]
        ordered = np.asarray(to_positions(jnp.asarray(gathered)))[0, :, 0]
        assert np.all(np.diff(ordered) > 0)
        if ring > 1 and stripe_tokens(seq_len, ring) == degree * stripe_tokens(seq_len, world):  # 1536, not 4096
            np.testing.assert_array_equal(ordered, rank_positions(seq_len, ring, r, "zigzag_stripes"))
        np.testing.assert_array_equal(np.asarray(to_devices(jnp.asarray(ordered[None, :, None]))), gathered)


def test_hybrid_refuses_zigzag_stripes_its_ring_cannot_take():
    """4096 tokens over 2 x 2: the groups hold stripes of 2 x 128, the ring over 2 runs stripes of 128."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("sp",))
    x = jnp.zeros((1, 4096, 2, 8), jnp.float32)
    with pytest.raises(ValueError, match="zigzag_stripes needs its groups' stripes") as error:
        sequence_parallel_sharded(x, x, x, mesh, scheme="hybrid", ulysses_degree=2, layout="zigzag_stripes",
                                  backend="reference", segment_ids=jnp.zeros((1, 4096), jnp.int32))
    assert "\n" not in str(error.value)


GPU_CASES = [SchemeDocuments("ulysses", 2, twins.DocumentRingCase(
    2, "zigzag_stripes", "ring", dtype="bfloat16",
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

