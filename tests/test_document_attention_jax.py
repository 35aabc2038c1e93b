"""Packed documents through the JAX attention (`flash_attention(..., segment_ids=)`, the pair functions' `spans`):
the portable Pallas kernels (interpret mode on CPU) and the reference against the same documents attended one at a
time, by the flash rule (bf16/fp16) and in fp32; the negative control (a dropped boundary fails); blocks with no
pair skipped, not masked; segment ids traced under jit; the families that do not take documents refuse them. Twin
of tests/test_document_attention_torch.py; the cases, the answer and the tolerances (with their reasons) are
tests/document_twins.py's.

The Hopper family (Mosaic GPU kernels, `backend="pallas_hopper"`) runs under Pallas's Mosaic GPU interpreter on the
CPU (tests/test_kernels_hopper_jax.py says what that covers), at one tile of each kernel: its documents by the flash
rule with another document poisoned (skipped blocks never read), causal and full; its negative control; the ring's
pair contract on monotone spans with rows that see no key (HALF_P_TOL, its reason in tests/kernel_twins.py). On the
GPU (`gpu`) every family that takes documents runs real sizes by the flash rule, with a negative control.
"""

from __future__ import annotations

import dataclasses
import importlib
import math

import document_twins as twins
import jax
import jax.numpy as jnp
import kernel_twins
import numpy as np
import pytest

from jax_impl.attention import reference_attention, reference_attention_backward, reference_attention_forward
from jax_impl.documents import Spans
from jax_impl.kernels.flash_attention import flash_attention, flash_attention_backward, flash_attention_forward
from jax_impl.kernels.hopper.config import HopperConfig, default_config
from jax_impl.kernels.portable.config import KernelConfig, PortableConfig

# Interpret-mode kernels are tiny loops; XLA's CPU optimisation passes dominate their compile time.
FAST_COMPILE = ({"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
                if jax.default_backend() == "cpu" else {})
NAMES = kernel_twins.NAMES


def _arrays(arrays, dtype):
    return [jnp.asarray(x).astype(dtype) for x in arrays]


def _with_grads(attention, q, k, v, dout, *extra):
    """{NAMES: float64 numpy} of `attention(q, k, v, *extra) -> (out, lse)` under jit, gradients of
    sum(out * dout)."""
    def run(q, k, v, dout, *extra):
        (out, lse), pullback = jax.vjp(lambda q, k, v: attention(q, k, v, *extra), q, k, v)
        return (out, lse, *pullback((dout, jnp.zeros_like(lse))))
    results = jax.jit(run, compiler_options=FAST_COMPILE)(q, k, v, dout, *extra)
    return {name: np.asarray(x, np.float64) for name, x in zip(NAMES, results)}


def _ours(q, k, v, dout, causal, segment_ids, backend="pallas", config=None):
    """flash_attention with the segment ids traced (a jit argument)."""
    def attend(q, k, v, ids):
        return flash_attention(q, k, v, causal=causal, return_lse=True, backend=backend, config=config,
                               segment_ids=ids)
    return _with_grads(attend, q, k, v, dout, jnp.asarray(segment_ids))


def naive_one_at_a_time(case, arrays, causal, dtype):
    """The naive same-dtype attention (`reference_attention`), one document at a time."""
    def attend(q, k, v, dout):
        return _with_grads(lambda q, k, v: reference_attention(q, k, v, causal=causal, return_lse=True),
                           *_arrays((q, k, v, dout), dtype))
    return twins.one_at_a_time(case, attend, *arrays)


def _violations(case, dtype, causal, segment_ids):
    arrays = twins.case_inputs(case, dtype)
    ours = _ours(*_arrays(arrays, dtype), causal, segment_ids)
    return kernel_twins.flash_rule_violations(ours, naive_one_at_a_time(case, arrays, causal, dtype),
                                              twins.exact(case, *arrays, causal))


@pytest.mark.parametrize("case", twins.CASES, ids=twins.ids(twins.CASES))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_documents_match_one_at_a_time_by_the_flash_rule(dtype, causal, case):
    violations = _violations(case, dtype, causal, twins.segment_ids(case))
    assert not violations, f"(ours, naive) errors beyond the rule: {violations}"


@pytest.mark.parametrize("backend", ["pallas_portable", "reference"])
@pytest.mark.parametrize("case", twins.FP32_CASES, ids=twins.ids(twins.FP32_CASES))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_documents_fp32_match_one_at_a_time(causal, case, backend):
    arrays = twins.case_inputs(case, "float32")
    ours = _ours(*_arrays(arrays, jnp.float32), causal, twins.segment_ids(case), backend=backend)
    kernel_twins.assert_fp32_close(ours, twins.exact(case, *arrays, causal))


def test_a_dropped_boundary_fails_the_rule():
    """Negative control: the same comparison catches one boundary missing from the segment ids."""
    case = twins.NEGATIVE_CONTROL
    merged = twins.merged_boundary(twins.segment_ids(case), twins.DROPPED_BOUNDARY)
    assert _violations(case, "bfloat16", True, merged)


@pytest.mark.parametrize("poisoned", [0, 1], ids=["first-poisoned", "second-poisoned"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_blocks_without_a_pair_are_skipped(causal, poisoned):
    """NaN in one document's q, k, v and dout leaves the other's results finite and unchanged: no kernel loads a
    tile of it (a masked tile would still multiply its NaN V or dO by a zero P)."""
    case = twins.SKIP_CASE
    config = PortableConfig(*(KernelConfig(*twins.SKIP_BLOCKS[name], 4, 1)
                              for name in ("forward", "backward_dkdv", "backward_dq")))
    ids = twins.segment_ids(case)
    arrays = twins.case_inputs(case, "float32")
    clean = _ours(*_arrays(arrays, jnp.float32), causal, ids, config=config)
    rows = ids[0] == poisoned
    for x in arrays:
        x[:, rows] = np.nan
    dirty = _ours(*_arrays(arrays, jnp.float32), causal, ids, config=config)
    for name in NAMES:
        tokens = 2 if name == "lse" else 1  # lse is [B, H, S]
        assert not np.isfinite(np.compress(rows, dirty[name], tokens)).any(), name  # the poison took
        np.testing.assert_array_equal(np.compress(~rows, dirty[name], tokens), np.compress(~rows, clean[name], tokens),
                                      err_msg=name)


def _random_spans(batch, seq_q, seq_k, seed):
    """Monotone key spans that are no documents' (empty rows, rows with end < start, a span ending at seq_k)."""
    rng = np.random.default_rng(seed)
    start = np.sort(rng.integers(0, seq_k, (batch, seq_q)), axis=1)
    end = np.sort(rng.integers(0, seq_k + 1, (batch, seq_q)), axis=1)
    end[:, -1] = seq_k
    return Spans(*(jnp.asarray(x, jnp.int32) for x in (start, end)))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_pair_functions_take_any_monotone_spans(causal):
    """The ring's contract: the pair forward and backward on spans of any monotone shape, Sq != Sk, the causal rule
    folded in, match the reference pair functions (fp32, FP32_TOL) with the kernels' block ranges exercised."""
    case = kernel_twins.KernelCase(45, 70, 4, 2, 32, batch=2)
    q, k, v, dout = _arrays(kernel_twins.inputs(case, "float32"), jnp.float32)
    spans = _random_spans(2, 45, 70, seed=1)
    scale = 1 / math.sqrt(32)
    got, want = {}, {}
    for result, backend in ((got, "pallas_portable"), (want, "reference")):
        out, lse = flash_attention_forward(q, k, v, causal=causal, softmax_scale=scale, out_dtype=jnp.float32,
                                           backend=backend, spans=spans)
        dq, dk, dv = flash_attention_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale,
                                              backend=backend, spans=spans)
        result.update(zip(NAMES, (np.asarray(x, np.float64) for x in (out, lse, dq, dk, dv))))
    assert np.isneginf(want["lse"]).any()  # some rows see no key: their lse -inf, out and dq 0
    kernel_twins.assert_fp32_close(got, want)


def test_reference_pair_functions_mask_by_spans():
    """The reference's span mask is the contract's: a span covering every key changes nothing."""
    q, k, v, dout = _arrays(kernel_twins.inputs(kernel_twins.KernelCase(20, 20, 2, 1, 32), "float32"), jnp.float32)
    full = Spans(jnp.zeros((1, 20), jnp.int32), jnp.full((1, 20), 20, jnp.int32))
    with_spans = reference_attention_forward(q, k, v, causal=True, softmax_scale=0.2, spans=full)
    plain = reference_attention_forward(q, k, v, causal=True, softmax_scale=0.2)
    for got, want in zip(with_spans, plain):
        np.testing.assert_array_equal(got, want)
    grads = reference_attention_backward(dout, q, k, v, *plain, causal=True, softmax_scale=0.2, spans=full)
    for got, want in zip(grads, reference_attention_backward(dout, q, k, v, *plain, causal=True, softmax_scale=0.2)):
        np.testing.assert_array_equal(got, want)


def test_span_kernels_lower_through_triton_for_cuda(monkeypatch):
    """The interpreter never lowers the kernels: lowered for CUDA on the CPU (the calls switched from interpret
    mode), the forward, dK/dV and dQ kernels with spans go through Pallas's Triton lowering (the span bounds' int
    reductions and their one-trip loop included) into three Triton calls."""
    monkeypatch.setattr(importlib.import_module("jax_impl.kernels.flash_attention"), "_interpret", lambda: False)
    q = jax.ShapeDtypeStruct((1, 1024, 4, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 1024, 2, 128), jnp.bfloat16)

    def forward_and_backward(q, k, v, ids):
        out, pullback = jax.vjp(lambda q, k, v: flash_attention(q, k, v, backend="pallas_portable",
                                                                segment_ids=ids), q, k, v)
        return pullback(out)
    lowered = jax.jit(forward_and_backward).trace(q, kv, kv, jax.ShapeDtypeStruct((1, 1024), jnp.int32))
    assert lowered.lower(lowering_platforms=("cuda",)).as_text().count("__gpu$xla.gpu.triton") == 3


def test_families_without_documents_refuse_them():
    q = jnp.zeros((1, 8, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="backend 'cudnn' does not take documents; these do: 'pallas', "
                                         "'pallas_portable', 'pallas_hopper', 'reference'"):
        flash_attention(q, q, q, backend="cudnn", segment_ids=jnp.zeros((1, 8), jnp.int32))


# ---------------------------------------------------------------------------------------------------------------
# The Hopper family (Mosaic GPU kernels) under Pallas's GPU interpreter
# ---------------------------------------------------------------------------------------------------------------

# 128 tokens: documents of length 1 (at 0 and 54), odd lengths, GQA 2:1, D=64 (a Mosaic head dim); the last document
# fills the second half, one 64-row warpgroup of the tile, and is the one poisoned. 64-key blocks for the forward and
# dQ kernels, so a tile (2 warpgroups x 64 rows) streams two blocks and each warpgroup runs one and drains the other,
# as the dK/dV kernel's warpgroups do with the two 64-row query blocks (the skipped blocks the poison must not reach).
MOSAIC_CASE = twins.DocumentCase(((1, 20, 33, 1, 9, 64),), heads=2, kv_heads=1, dim=64)
MOSAIC_POISONED = 5
MOSAIC_BLOCKS = HopperConfig(block_kv=64, dq_block_kv=64)


def _positions(result: dict, tokens) -> dict:
    """`result` at the query/key positions `tokens` (lse is [B, H, S], the rest [B, S, heads, D])."""
    return {name: np.compress(tokens, x, 2 if name == "lse" else 1) for name, x in result.items()}


@pytest.mark.parametrize("causal,head_splits", [(True, 1), (False, 1), (True, 2)],
                         ids=["causal", "full", "causal-head-splits"])
def test_mosaic_documents_meet_the_rule_and_skip_other_documents(causal, head_splits):
    """Forward and backward of the Mosaic kernels with documents, NaN in one document's q, k, v and dout: its own
    results are NaN (the poison took), every other document's are finite and meet the flash rule against the clean
    documents one at a time (so no kernel read a tile of the poisoned document for them: a masked tile would still
    multiply its NaN V or dO by a zero P). `head_splits` 2: each dK/dV CTA walks one of the GQA pair's heads
    (`HopperConfig.bwd_head_splits`), draining the other warpgroup's blocks on its own."""
    case = MOSAIC_CASE
    ids = twins.segment_ids(case)
    clean = twins.case_inputs(case, "bfloat16")
    poisoned = [x.copy() for x in clean]
    rows = ids[0] == MOSAIC_POISONED
    for x in poisoned:
        x[:, rows] = np.nan
    ours = _ours(*_arrays(poisoned, jnp.bfloat16), causal, ids, backend="pallas_hopper",
                 config=dataclasses.replace(MOSAIC_BLOCKS, bwd_head_splits=head_splits))
    for name, x in _positions(ours, rows).items():
        assert not np.isfinite(x).any(), name  # the poison took (NaN; lse -inf: a NaN row sum counts as no key)
    naive = naive_one_at_a_time(case, clean, causal, "bfloat16")
    exact = twins.exact(case, *clean, causal)
    violations = kernel_twins.flash_rule_violations(*(_positions(x, ~rows) for x in (ours, naive, exact)))
    assert not violations, f"(ours, naive) errors beyond the rule: {violations}"


def test_mosaic_documents_dropped_boundary_fails_the_rule():
    """Negative control of the Mosaic kernels' documents (forward, default blocks: one 128-key block, masked per
    row): one boundary missing from the segment ids breaks the rule."""
    case = MOSAIC_CASE
    arrays = twins.case_inputs(case, "bfloat16")
    merged = jnp.asarray(twins.merged_boundary(twins.segment_ids(case), twins.DROPPED_BOUNDARY))
    out, lse = jax.jit(lambda q, k, v, ids: flash_attention(q, k, v, return_lse=True, backend="pallas_hopper",
                                                             segment_ids=ids))(*_arrays(arrays[:3], jnp.bfloat16),
                                                                               merged)
    exact = twins.exact(case, *arrays, True)
    naive = naive_one_at_a_time(case, arrays, True, "bfloat16")
    forward = {"out": np.asarray(out, np.float64), "lse": np.asarray(lse, np.float64)}
    assert kernel_twins.flash_rule_violations(forward | {name: exact[name] for name in ("dq", "dk", "dv")}, naive,
                                              exact)


def test_mosaic_pair_functions_take_any_monotone_spans():
    """The ring's contract on the Mosaic kernels: the pair forward (fp32 out, as the ring's partials) and backward
    on monotone spans that are no documents' (rows that see no key, Sq != Sk, a span ending at Sk) match the
    reference pair functions on the same bf16 inputs within HALF_P_TOL (the kernel rounds P to bf16 before P V,
    the reference does not: kernel_twins' reason); rows that see no key get lse -inf and out 0 in both."""
    case = kernel_twins.KernelCase(77, 120, 2, 1, 64)  # one tile of every kernel: the interpreter's cost
    q, k, v, dout = _arrays(kernel_twins.inputs(case, "bfloat16"), jnp.bfloat16)
    spans = _random_spans(1, 77, 120, seed=2)
    results = {}
    for backend in ("pallas_hopper", "reference"):
        def pairs(q, k, v, dout, spans):
            out, lse = flash_attention_forward(q, k, v, causal=False, out_dtype=jnp.float32, backend=backend,
                                               spans=spans)
            grads = flash_attention_backward(dout, q, k, v, out.astype(jnp.bfloat16), lse, causal=False,
                                             backend=backend, spans=spans)
            return out, lse, *grads
        results[backend] = jax.jit(pairs, compiler_options=FAST_COMPILE)(q, k, v, dout, spans)
    assert np.isneginf(np.asarray(results["reference"][1])).any()  # some rows see no key
    for name, got, want in zip(NAMES, results["pallas_hopper"], results["reference"]):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), **kernel_twins.HALF_P_TOL, err_msg=name)


def test_mosaic_one_kernel_backward_refuses_documents_and_the_heuristic_takes_two_kernels():
    """The one-kernel forms add a step's dQ from both warpgroups' dS tiles; a warpgroup skipping another
    document's query blocks would leave its tile stale, so they refuse documents (at trace time, in one line).
    The heuristic's backward is one kernel without documents, so with them it must take the two-kernel form: the
    same call with config=None traces (the refusal above is its negative control)."""
    q = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 128, 1, 64), jnp.bfloat16)
    lse = jax.ShapeDtypeStruct((1, 2, 128), jnp.float32)
    spans = Spans(*(jax.ShapeDtypeStruct((1, 128), jnp.int32),) * 2)

    def backward(config):
        return jax.eval_shape(lambda q, k, v, out, lse, spans: flash_attention_backward(
            q, q, k, v, out, lse, causal=True, backend="pallas_hopper", config=config, spans=Spans(*spans)),
            q, kv, kv, q, lse, spans)
    with pytest.raises(ValueError, match="bwd_form='one_kernel' takes no documents"):
        backward(HopperConfig(bwd_form="one_kernel"))
    assert {default_config(64, dtype=dtype).bwd_form for dtype in (jnp.bfloat16, jnp.float16)} == {"one_kernel"}
    assert default_config(64, documents=True).bwd_form == "two_kernel"
    assert [g.shape for g in backward(None)] == [q.shape, kv.shape, kv.shape]


@pytest.mark.parametrize("segment_ids, message", [
    (np.array([[0, 0, 1, 0]]), "non-decreasing .* decrease after position 2"),
    (np.zeros((1, 3), np.int32), r"shape \[batch, seq\] = \(1, 4\)"),
    (np.zeros((1, 4), np.float32), "must be integers"),
])
def test_bad_segment_ids_are_one_line(segment_ids, message):
    q = jnp.zeros((1, 4, 2, 32))
    with pytest.raises(ValueError, match=message):
        flash_attention(q, q, q, backend="reference", segment_ids=jnp.asarray(segment_ids))


def test_documents_need_self_attention():
    q, k = jnp.zeros((1, 4, 2, 32)), jnp.zeros((1, 5, 2, 32))
    with pytest.raises(ValueError, match="Sq == Sk"):
        flash_attention(q, k, k, segment_ids=jnp.zeros((1, 4), jnp.int32))


def _on_hopper() -> bool:
    return jax.default_backend() == "gpu" and getattr(jax.devices()[0], "compute_capability", None) == "9.0"


GPU_LENGTHS = {"one": (4096,), "mixed": (1, 777, 3000, 318), "short": (128,) * 32}


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", GPU_LENGTHS.values(), ids=GPU_LENGTHS.keys())
@pytest.mark.parametrize("dim", [64, 128])
def test_documents_on_the_gpu_by_the_flash_rule(dim, lengths):
    """Real sizes, bf16, through every family that takes documents: the Mosaic kernels ("pallas_hopper", on an
    sm90 GPU), the portable ones ("pallas_portable") and the dispatcher ("pallas": the Mosaic kernels on sm90);
    documents as the corpus packs them and many short ones, by the flash rule against the documents one at a time
    (the naive and exact answers made once for all three)."""
    case = twins.DocumentCase((lengths,), heads=8, kv_heads=2, dim=dim)
    arrays = twins.case_inputs(case, "bfloat16")
    naive, exact = naive_one_at_a_time(case, arrays, True, "bfloat16"), twins.exact(case, *arrays, True)
    backends = (["pallas_hopper"] if _on_hopper() else []) + ["pallas_portable", "pallas"]
    for backend in backends:
        ours = _ours(*_arrays(arrays, jnp.bfloat16), True, twins.segment_ids(case), backend=backend)
        violations = kernel_twins.flash_rule_violations(ours, naive, exact)
        assert not violations, f"{backend}: (ours, naive) errors beyond the rule: {violations}"


@pytest.mark.gpu
@pytest.mark.skipif(not _on_hopper(), reason="needs an sm90 (Hopper) GPU")
def test_mosaic_documents_dropped_boundary_fails_on_the_gpu():
    """Negative control of the GPU rule on the Mosaic kernels: the mixed documents with one boundary dropped."""
    case = twins.DocumentCase((GPU_LENGTHS["mixed"],), heads=8, kv_heads=2, dim=128)
    arrays = twins.case_inputs(case, "bfloat16")
    merged = twins.merged_boundary(twins.segment_ids(case), twins.DROPPED_BOUNDARY)
    ours = _ours(*_arrays(arrays, jnp.bfloat16), True, merged, backend="pallas_hopper")
    assert kernel_twins.flash_rule_violations(ours, naive_one_at_a_time(case, arrays, True, "bfloat16"),
                                              twins.exact(case, *arrays, True))
