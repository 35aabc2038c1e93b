"""What both backward kernels of the Hopper family (`backward.py`'s dK/dV kernel, `backward_dq.py`'s dQ kernel) run
per step and at the end: one step's wgmmas around its elementwise math (`gradient_step`), and the fp32 results'
way out through shared memory (`store_fp32`). Split from `backward.py` by responsibility: the kernels own their
loops, producers and masks, this module the step both share.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_impl.kernels.tiles import wgmma_nt


def store_fp32(results, out_smem, out_refs):
    """Write fp32 register tiles [rows, D] to global memory [..., rows, ..., D] through one shared-memory tile
    [rows, width], one column chunk of `width` after the other."""
    width = out_smem.shape[-1]
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # a reduce-add of the one-kernel form may still read it
    for result, out_ref in zip(results, out_refs):
        for first in range(0, result.shape[-1], width):
            out_smem[...] = result[:, first:first + width] if width < result.shape[-1] else result
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem, out_ref.at[..., pl.ds(first, width)])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    plgpu.wait_smem_to_gmem(0)


def gradient_step(scores_pair, dprobs_pair, probs_of, dscores_of, probs_acc, dscores_acc, *, overlap: bool,
                  interpret: bool, lhs_smem=None, dscores_stored=None):
    """One backward step's matmuls around its elementwise math, all fp32-accumulating:
    S = a b^T and dP = c d^T from the shared-memory pairs `scores_pair` and `dprobs_pair`, P = probs_of(S),
    probs_acc = (acc, rhs): acc + P rhs (None: no such product), dS = dscores_of(P, dP),
    dscores_acc = (acc, rhs): acc + dS rhs. Returns the updated accumulators (None for an absent one).
    `lhs_smem`: shared-memory tiles (P's, dS's) shaped as S. P and dS are stored there, and the products read them
    transposed: acc + P^T rhs, acc + dS^T rhs (the dK/dV kernel with query rows, `HopperConfig.bwd_query_rows`: no
    register tile is a wgmma operand, which would stay live until its wgmma completes). `dscores_stored()` runs once dS
    is in lhs_smem, before its product is issued (the one-kernel form signals the other warpgroup there).

    `overlap` (HopperConfig.bwd_overlap): S and dP are issued together and each product is awaited only where
    its result is read (S while dP runs, dP while P rhs runs), so the tensor cores have the next wgmma queued
    while the warpgroup computes P or dS; without it, every wgmma is awaited as soon as it is issued."""
    accs = tuple(pair[0] for pair in (probs_acc, dscores_acc) if pair is not None)

    def lhs(value, which: int, dtype):
        """The left operand of an accumulating product: the register tile, or (lhs_smem) its stored tile, read
        transposed."""
        if lhs_smem is None:
            return value.astype(dtype)
        lhs_smem[which][...] = value.astype(dtype)
        if not interpret:
            plgpu.commit_smem()  # the wgmma reads through the async proxy what the threads stored
        if which == 1 and dscores_stored is not None:
            dscores_stored()
        if interpret:  # INTERPRET: the stored tile, transposed in registers
            return lhs_smem[which][...].T
        return plgpu.transpose_ref(lhs_smem[which], (1, 0))

    if interpret:  # INTERPRET: plain dots (see tiles.py); no asynchrony to express
        def dot(a, b):
            return jnp.dot(a, b[...], preferred_element_type=jnp.float32)
        probs = probs_of(wgmma_nt(*scores_pair, interpret=True))
        dprobs = wgmma_nt(*dprobs_pair, interpret=True)
        new_probs_acc = None if probs_acc is None else probs_acc[0] + dot(lhs(probs, 0, probs_acc[1].dtype),
                                                                            probs_acc[1])
        dscores = dscores_of(probs, dprobs)
        return new_probs_acc, dscores_acc[0] + dot(lhs(dscores, 1, dscores_acc[1].dtype), dscores_acc[1])

    def settle():
        if not overlap:
            plgpu.wgmma_wait(0)

    def compute(acc_refs):
        def scoped(scores_ref, dprobs_ref):
            plgpu.wgmma(scores_ref, scores_pair[0], plgpu.transpose_ref(scores_pair[1], (1, 0)))
            settle()
            plgpu.wgmma(dprobs_ref, dprobs_pair[0], plgpu.transpose_ref(dprobs_pair[1], (1, 0)))
            settle()
            with jax.named_scope("probs"):
                probs = probs_of(plgpu.wgmma_accumulator_load(scores_ref, wait_n=1 if overlap else 0))
            if probs_acc is not None:
                plgpu.wgmma(acc_refs[0], lhs(probs, 0, probs_acc[1].dtype), probs_acc[1])
                settle()
            with jax.named_scope("dscores"):
                dprobs = plgpu.wgmma_accumulator_load(dprobs_ref,
                                                      wait_n=1 if overlap and probs_acc is not None else 0)
                dscores = dscores_of(probs, dprobs)
            plgpu.wgmma(acc_refs[-1], lhs(dscores, 1, dscores_acc[1].dtype), dscores_acc[1])
        shape = (scores_pair[0].shape[0], scores_pair[1].shape[0])
        pl.run_scoped(scoped, plgpu.ACC(shape, jnp.float32), plgpu.ACC(shape, jnp.float32))
    results = pl.run_state(compute)(tuple(plgpu.ACC.init(acc) for acc in accs))  # awaits every wgmma
    return (results[0] if probs_acc is not None else None), results[-1]
