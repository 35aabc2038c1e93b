"""The one test base of packed documents in the twin kernels and rings, read by tests/test_document_attention_*.py
and tests/test_document_ring_*.py (torch and JAX): the cases both run (documents of length 1, odd lengths, one
document, a batch whose rows pack different documents; in the rings every layout and variant, documents longer than
a device's shard and lengths that split into no number of chunks), the inputs (tests/kernel_twins.py's), the exact
answer of the same documents attended ONE AT A TIME (float64, `kernel_twins.float64_attention` on each document's
slice, so it shares no masking code with the kernels), the negative control's documents and the block-skip case.

Tolerances (kernel_twins' docstring has the reasons; each applies per document, as the answer is made):
  The flash rule (bf16/fp16): each of out, lse, dq, dk, dv within 2x the error of the naive same-dtype attention,
    also attending one document at a time, plus KERNEL_ATOL (1e-4: a document of length 1 has the exact answer
    out = v, dq = dk = 0, which the naive attention reproduces exactly and ours up to float32 summation order).
  FP32_TOL (fp32 inputs): exact float32 arithmetic in another summation order (the rings' partials merged by lse
    in float32 too: observed <= 3e-6).
  The rings' bf16 results by `ring_twins.assert_flash_rule` (its BF16_ATOL, reasons there): one bf16 rounding of
    the float32-merged output, as the kernels'.
A dropped boundary lets a query see a whole other document's keys, so it moves results by whole score terms; the
negative control asserts the flash rule fails for it.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from kernel_twins import NAMES, KernelCase, float64_attention, inputs

from weights.attention import VARIANTS
from weights.documents import segment_ids_from_lengths
from weights.layout import LAYOUTS


@dataclasses.dataclass(frozen=True)
class DocumentCase:
    """Self-attention over packed sequences: row b of the batch packs documents of `lengths[b]` (each row's sum is
    the sequence length)."""

    lengths: tuple[tuple[int, ...], ...]
    heads: int = 4
    kv_heads: int = 2
    dim: int = 32

    @property
    def seq(self) -> int:
        return sum(self.lengths[0])

    @property
    def kernel_case(self) -> KernelCase:
        return KernelCase(self.seq, self.seq, self.heads, self.kv_heads, self.dim, batch=len(self.lengths))

    @property
    def id(self) -> str:
        documents = "-".join("_".join(map(str, row)) for row in self.lengths)
        return f"{documents}-h{self.heads}kv{self.kv_heads}-d{self.dim}"


CASES = [
    DocumentCase(((1, 20, 33, 1, 20), (40, 35))),      # length 1 at both ends of a document run, odd lengths, batch
    DocumentCase(((75,),), heads=2, kv_heads=2),       # one document: the plain causal / full attention
    DocumentCase(((1,) * 9 + (40,),), kv_heads=1, dim=64),  # a run of single tokens, then a long document, GQA 4:1
    DocumentCase(((37, 2, 58),), heads=2, kv_heads=1, dim=128),  # documents crossing every block boundary
]
FP32_CASES = [DocumentCase(((1, 20, 33, 1, 20), (40, 35))), DocumentCase(((9, 50, 1),), dim=96)]
NEGATIVE_CONTROL = DocumentCase(((30, 40, 27),))
DROPPED_BOUNDARY = 1  # the negative control merges documents 1 and 2 of its only row
# Two documents of 64, each a whole number of every kernel's blocks (`SKIP_BLOCKS`): NaN in one document must not
# reach the other's results, which it would through P V (0 * NaN) if a kernel loaded a tile of it.
SKIP_CASE = DocumentCase(((64, 64),), heads=2, kv_heads=1)
SKIP_BLOCKS = {"forward": (64, 32), "backward_dkdv": (32, 64), "backward_dq": (64, 32)}  # (query, key) rows


@dataclasses.dataclass(frozen=True)
class DocumentRingCase:
    """One ring call over `world` devices on the packed sequences of `documents`."""

    world: int
    layout: str
    variant: str
    causal: bool = True
    dtype: str = "float32"
    documents: DocumentCase = DocumentCase(((1, 13, 7, 20, 7), (30, 18)))

    @property
    def id(self) -> str:
        return (f"p{self.world}-{self.layout}-{self.variant}-{'causal' if self.causal else 'full'}-{self.dtype}"
                f"-d{self.documents.dim}")


# 48 tokens on 4 devices: shards of 12, zigzag chunks of 6; documents of length 1, lengths that split into no
# number of chunks (7, 13), longer than a shard (20, 30). fp32 with the reference pair backend: every layout,
# variant and mask; bf16 through our kernels (interpreted on CPU): one case per layout.
RING_FP32 = [DocumentRingCase(4, layout, variant, causal) for layout in LAYOUTS for variant in VARIANTS
             for causal in (True, False)]
RING_OURS_BF16 = [DocumentRingCase(4, "zigzag_stripes", "ring", dtype="bfloat16"),
                  DocumentRingCase(4, "zigzag", "ring", dtype="bfloat16"),
                  DocumentRingCase(4, "contiguous", "allgather", dtype="bfloat16"),
                  DocumentRingCase(4, "zigzag_stripes", "allgather", causal=False, dtype="bfloat16")]
RING_NEGATIVE = DocumentRingCase(4, "zigzag_stripes", "ring")  # its second row's boundary dropped: must fail FP32_TOL
# 2 GPUs, bf16, our kernels by the flash rule: 8k tokens of documents as the corpus packs them (one as long as a
# shard, lengths of no tile multiple), Llama-like heads at both head dims
GPU_DOCUMENTS = ((1, 777, 3000, 318, 4096),)
RING_GPU = [DocumentRingCase(2, layout, variant, dtype="bfloat16",
                             documents=DocumentCase(GPU_DOCUMENTS, heads=16, kv_heads=4, dim=dim))
            for layout, variant in (("zigzag_stripes", "ring"), ("zigzag", "allgather")) for dim in (64, 128)]
# run without segment ids: zigzag_stripes on the spans of one document
RING_ONE_DOCUMENT = DocumentRingCase(4, "zigzag_stripes", "ring", documents=DocumentCase(((48,), (48,))))


def ids(cases: list) -> list[str]:
    return [case.id for case in cases]


def ring_segment_ids(case: DocumentRingCase, *, dropped_boundary: bool = False) -> np.ndarray:
    """The ring case's segment ids [B, S]; with `dropped_boundary` its last row's two documents made one."""
    ids = segment_ids(case.documents)
    if dropped_boundary:
        ids[-1] = ids[-1, 0]
    return ids


def segment_ids(case: DocumentCase) -> np.ndarray:
    """int32 [B, S]: the case's documents as segment ids."""
    return np.stack([segment_ids_from_lengths(list(row)) for row in case.lengths])


def merged_boundary(ids: np.ndarray, document: int) -> np.ndarray:
    """`ids` with documents `document` and `document + 1` of every row made one (the negative control)."""
    return np.where(ids > document, ids - 1, ids)


def document_slices(case: DocumentCase) -> list[tuple[int, slice]]:
    """(batch row, positions) of every document of the case."""
    slices = []
    for row, lengths in enumerate(case.lengths):
        ends = np.cumsum(lengths)
        slices += [(row, slice(int(end - length), int(end))) for length, end in zip(lengths, ends)]
    return slices


def case_inputs(case: DocumentCase, dtype: str, seed: int = 0) -> list[np.ndarray]:
    """q, k, v, dout (kernel_twins.inputs) of the case's packed sequences."""
    return inputs(case.kernel_case, dtype, seed)


def one_at_a_time(case: DocumentCase, attend, q, k, v, dout) -> dict[str, np.ndarray]:
    """{NAMES: float64 numpy} of `attend(q, k, v, dout) -> {NAMES}` run on each document's slice alone and put back
    in place (lse [B, H, S], the rest [B, S, heads, D])."""
    result = {"out": np.zeros(q.shape), "dq": np.zeros(q.shape), "dk": np.zeros(k.shape), "dv": np.zeros(v.shape),
              "lse": np.zeros((q.shape[0], q.shape[2], q.shape[1]))}
    for row, positions in document_slices(case):
        part = attend(*(x[row:row + 1, positions] for x in (q, k, v, dout)))
        for name in NAMES:
            index = (row, slice(None), positions) if name == "lse" else (row, positions)
            result[name][index] = np.asarray(part[name], np.float64)[0]
    return result


def exact(case: DocumentCase, q, k, v, dout, causal: bool) -> dict[str, np.ndarray]:
    """The float64 answer of the documents attended one at a time."""
    return one_at_a_time(case, lambda *x: float64_attention(*x, causal), q, k, v, dout)
