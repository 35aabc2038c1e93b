"""Packed documents (`segment_ids=`) through torch_impl.ulysses's Ulysses and hybrid schemes, over 4 gloo processes
in one launch: Ulysses over 4 and over 2 (ranks {0, 1} and {2, 3}, each pair on its own), the hybrid U=2 x R=2
(both ring variants), fp32 on the reference pair math against the same documents attended one at a time (forward,
lse and gradients), one bf16 case through our kernels (interpreted on CPU) by the flash rule, the negative control
(a dropped boundary fails) and the refusal of zigzag_stripes (one line on every rank); over NCCL on 2 GPUs (`gpu`),
real sizes, by the flash rule. The documents, the answer and the tolerances (with their reasons) are
tests/document_twins.py's, judged as tests/test_document_ring_torch.py judges the ring.
"""

from __future__ import annotations

import dataclasses

import document_twins as twins
import kernel_twins
import pytest
import ring_twins
import torch
import torch.distributed as dist
from distributed import run_on_ranks
from test_document_attention_torch import naive_one_at_a_time

from torch_impl.ulysses import sequence_parallel_attention, sequence_parallel_groups
from weights.layout import gather_sequence, layout_order

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class SchemeDocumentCase:
    """One call of `scheme` with Ulysses degree `ulysses_degree` over `ring.world` devices on `ring`'s documents
    (the world is all 4 ranks, or each pair of them for a world of 2)."""

    scheme: str
    ulysses_degree: int
    ring: twins.DocumentRingCase

    @property
    def id(self) -> str:
        return f"{self.scheme}-u{self.ulysses_degree}-{self.ring.id}"


# 48 tokens (document_twins' ring documents: lengths 1, 7 and 13 split into no number of chunks, 20 and 30 longer
# than a device's shard of 12 over 4 devices, and 30 longer than a shard of 24 over 2); heads 4, KV heads 2: U = 4
# repeats each KV head, U = 2 splits them
FP32 = ([SchemeDocumentCase("ulysses", 4, twins.DocumentRingCase(4, layout, "ring", causal))
         for layout in ("zigzag", "contiguous") for causal in (True, False)]
        + [SchemeDocumentCase("ulysses", 2, twins.DocumentRingCase(2, "zigzag", "ring", causal))
           for causal in (True, False)]
        + [SchemeDocumentCase("hybrid", 2, twins.DocumentRingCase(4, layout, variant, causal))
           for layout, variant, causal in (("zigzag", "ring", True), ("zigzag", "allgather", True),
                                           ("contiguous", "ring", False), ("zigzag", "ring", False))])
OURS_BF16 = [SchemeDocumentCase("ulysses", 4, twins.DocumentRingCase(4, "zigzag", "ring", dtype="bfloat16")),
             SchemeDocumentCase("hybrid", 2, twins.DocumentRingCase(4, "zigzag", "ring", dtype="bfloat16"))]
NEGATIVE = [SchemeDocumentCase("ulysses", 4, twins.DocumentRingCase(4, "zigzag", "ring")),
            SchemeDocumentCase("hybrid", 2, twins.DocumentRingCase(4, "zigzag", "ring"))]
# 2 GPUs, bf16, our kernels: document_twins' 8k tokens as the corpus packs them, Llama-like heads at both head dims
GPU_P2 = [SchemeDocumentCase("ulysses", 2, twins.DocumentRingCase(
    2, "zigzag", "ring", dtype="bfloat16", documents=twins.DocumentCase(twins.GPU_DOCUMENTS, heads=16, kv_heads=kv,
                                                                       dim=dim)))
          for kv, dim in ((4, 64), (1, 128))]


def _ids(cases) -> list[str]:
    return [case.id for case in cases]


# ---------------------------------------------------------------------------------------------------------------
# Case functions (run inside the rank processes)
# ---------------------------------------------------------------------------------------------------------------

def _group(world: int):
    """The case's ranks: the world, or this rank's pair ({0, 1} or {2, 3}) for a case of 2 devices; new_group is a
    collective of every rank, so both pairs are made on every rank."""
    if world == dist.get_world_size():
        return None, dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    return pairs[dist.get_rank() // 2], dist.get_rank() % 2


def case_documents(rank, world, *, case: SchemeDocumentCase, backend: str, dropped_boundary=False, device="cpu"):
    """Local (out, lse, dq, dk, dv) of one call on the case's packed sequences, gradients through autograd."""
    ring_case = case.ring
    group, local_rank = _group(ring_case.world)
    device = f"cuda:{rank}" if device == "cuda" else device
    groups = sequence_parallel_groups(case.scheme, case.ulysses_degree, group)

    def shard(x):  # shard_for_ring on the case's ranks, which need not be the world
        order = torch.from_numpy(layout_order(x.shape[1], ring_case.world, ring_case.layout))
        return x[:, order].chunk(ring_case.world, dim=1)[local_rank].contiguous()

    q, k, v, dout = (shard(torch.from_numpy(x).to(device, DTYPES[ring_case.dtype]))
                     for x in twins.case_inputs(ring_case.documents, ring_case.dtype))
    ids = shard(torch.from_numpy(twins.ring_segment_ids(ring_case, dropped_boundary=dropped_boundary)).to(device))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out, lse = sequence_parallel_attention(q, k, v, groups=groups, causal=ring_case.causal, layout=ring_case.layout,
                                           variant=ring_case.variant, return_lse=True, backend=backend,
                                           segment_ids=ids)
    out.backward(dout)
    return {name: x.detach().double().cpu().numpy() for name, x in zip(kernel_twins.NAMES, (out, lse, q.grad,
                                                                                              k.grad, v.grad))}


def case_stripes_refused(rank, world, *, scheme: str, ulysses_degree: int):
    """The error zigzag_stripes with documents raises (every rank the same), and whether a correct call then works."""
    groups = sequence_parallel_groups(scheme, ulysses_degree)
    q, k, v = (torch.randn(1, 12, 4, 32) for _ in range(3))
    ids = torch.zeros(1, 12, dtype=torch.int32)
    raised = None
    try:
        sequence_parallel_attention(q, k, v, groups=groups, layout="zigzag_stripes", backend="reference",
                                    segment_ids=ids)
    except ValueError as err:
        raised = str(err)
    out = sequence_parallel_attention(q, k, v, groups=groups, backend="reference", segment_ids=ids)
    return {"raised": raised, "recovered": bool(torch.isfinite(out).all())}


CASES = {f"reference-{case.id}": ("case_documents", dict(case=case, backend="reference")) for case in FP32}
CASES |= {f"ours-{case.id}": ("case_documents", dict(case=case, backend="triton")) for case in OURS_BF16}
CASES |= {f"negative-{case.id}": ("case_documents", dict(case=case, backend="reference", dropped_boundary=True))
          for case in NEGATIVE}
CASES |= {f"stripes-{scheme}": ("case_stripes_refused", dict(scheme=scheme, ulysses_degree=degree))
          for scheme, degree in (("ulysses", 4), ("hybrid", 2))}


# ---------------------------------------------------------------------------------------------------------------
# 4 processes, gloo
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def p4():
    return run_on_ranks(4, CASES, module=__name__)


def _results(per_rank_all: list, name: str, case: SchemeDocumentCase) -> dict:
    """The case's results gathered in position order, from ranks 0 .. world-1 (a 2-device case's pair {2, 3} ran
    the same call: its results must be the same)."""
    errors = [r[name]["error"] for r in per_rank_all if "error" in r[name]]
    assert not errors, errors[0]
    world, layout = case.ring.world, case.ring.layout
    parts = [per_rank_all[r][name] for r in range(world)]
    for rank in range(world, len(per_rank_all)):
        for key in kernel_twins.NAMES:
            assert (per_rank_all[rank][name][key] == parts[rank % world][key]).all(), (rank, key)
    return {key: gather_sequence([p[key] for p in parts], layout, axis=2 if key == "lse" else 1)
            for key in kernel_twins.NAMES}


def _exact(case: SchemeDocumentCase):
    ring = case.ring
    return twins.exact(ring.documents, *twins.case_inputs(ring.documents, ring.dtype), ring.causal)


@pytest.mark.slow
@pytest.mark.parametrize("case", FP32, ids=_ids(FP32))
def test_documents_match_one_at_a_time(p4, case):
    kernel_twins.assert_fp32_close(_results(p4, f"reference-{case.id}", case), _exact(case))


@pytest.mark.slow
@pytest.mark.parametrize("case", OURS_BF16, ids=_ids(OURS_BF16))
def test_documents_through_our_kernels_meet_the_flash_rule(p4, case):
    arrays = twins.case_inputs(case.ring.documents, case.ring.dtype)
    naive = naive_one_at_a_time(case.ring.documents, arrays, case.ring.causal, case.ring.dtype)
    ring_twins.assert_flash_rule(_results(p4, f"ours-{case.id}", case), naive, _exact(case))


@pytest.mark.slow
@pytest.mark.parametrize("case", NEGATIVE, ids=_ids(NEGATIVE))
def test_a_dropped_boundary_fails(p4, case):
    """Negative control: the scheme with one boundary missing from the segment ids is not the documents' answer."""
    got = _results(p4, f"negative-{case.id}", case)
    with pytest.raises(AssertionError):
        kernel_twins.assert_fp32_close(got, _exact(case))


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["ulysses", "hybrid"])
def test_zigzag_stripes_is_refused_on_every_rank(p4, scheme):
    results = [r[f"stripes-{scheme}"] for r in p4]
    assert all("error" not in r for r in results), results
    assert {r["raised"] for r in results} == {
        "sequence_parallel_attention with a Ulysses degree above 1 takes the contiguous or zigzag layout, got "
        "'zigzag_stripes': a group's stripes over P are not the stripes of a ring over R"}
    assert all(r["recovered"] for r in results)


# ---------------------------------------------------------------------------------------------------------------
# 2 GPUs, NCCL, our compiled kernels, bf16 (the `gpu` marker: skipped without CUDA, not run in CI)
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def p2_gpu():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    cases = {case.id: ("case_documents", dict(case=case, backend="triton", device="cuda")) for case in GPU_P2}
    return run_on_ranks(2, cases, module=__name__, comm_backend="nccl")


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_P2, ids=_ids(GPU_P2))
def test_gpu_p2_documents_meet_the_flash_rule(p2_gpu, case):
    """Ulysses over 2 GPUs, bf16 through our kernels on 8k tokens of documents, by the flash rule."""
    arrays = twins.case_inputs(case.ring.documents, case.ring.dtype)
    naive = naive_one_at_a_time(case.ring.documents, arrays, case.ring.causal, case.ring.dtype)
    ring_twins.assert_flash_rule(_results(p2_gpu, case.id, case), naive, _exact(case))
