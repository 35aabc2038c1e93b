"""torch_impl.ring_attention over real torch.distributed process groups (gloo on CPU, 4 and 2 processes; NCCL on
4 GPUs for the `gpu` tests) against single-device attention on the same full sequence.

Process start costs seconds, so each world size is spawned once (a module-scoped fixture) and runs every case of
that size; each case returns its local results, which the tests here assemble with `weights.layout` and compare.
The launcher waits with a timeout, so a hang fails the run instead of stalling it.

The cases the JAX twin runs too, their inputs and tolerances (with their reasons) are tests/ring_twins.py's: fp32
with the reference pair backend against single-device float32 attention, bf16 with the Triton pair kernels by the
flash rule. The torch-only cases (cross-rank agreement, communication volume, process subgroups, NCCL) are here.
"""

from __future__ import annotations

import functools
import importlib
import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

from distributed import run_on_ranks
from ring_twins import (FOUR_DEVICES, FP32_TOL, NAMES, ONE_DEVICE, OUR_KERNELS_BF16, TWO_DEVICES, RingCase,
                        assert_matches, ids, inputs)
from torch_impl.attention import reference_attention, reference_attention_backward, reference_attention_forward
from torch_impl.ring_attention import gather_from_ring, ring_attention, shard_for_ring
from torch_impl.ring_comm import CommLog
from weights.layout import LayoutError, gather_sequence

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


# ---------------------------------------------------------------------------------------------------------------
# Case functions (run inside the rank processes)
# ---------------------------------------------------------------------------------------------------------------

def _inputs(case: RingCase, device="cpu", dtype=None):
    """Full-sequence q, k, v, dout of `case` (tests/ring_twins.py), identical on every process, in the case's dtype
    (or `dtype`)."""
    return [torch.from_numpy(x).to(device=device, dtype=DTYPES[dtype or case.dtype]) for x in inputs(case)]


def _numpy(x):
    return x.detach().float().cpu().numpy()


def case_attention(rank, world, *, case: RingCase, backend="reference", device="cpu", subgroups=False):
    """Local (out, lse, dq, dk, dv) of one ring attention call, gradients through autograd. With `subgroups`
    the world splits into two rings of even and odd ranks (global peers != group ranks)."""
    if device == "cuda":
        device = f"cuda:{rank}"
    group = None
    if subgroups:
        group = [dist.new_group(list(range(parity, world, 2))) for parity in (0, 1)][rank % 2]
    q, k, v, dout = (shard_for_ring(x, group, case.layout) for x in _inputs(case, device))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out, lse = ring_attention(q, k, v, group=group, causal=case.causal, layout=case.layout, variant=case.variant,
                              return_lse=True, backend=backend)
    out.backward(dout)
    return {"out": _numpy(out), "lse": _numpy(lse), "dq": _numpy(q.grad), "dk": _numpy(k.grad),
            "dv": _numpy(v.grad)}


def case_expect_error(rank, world, *, odd_rank=None, change=None):
    """Calls ring_attention with bad arguments (on every rank, or only on `odd_rank`); returns the error it raised
    and whether a correct call afterwards still works (the ranks stayed in step)."""
    layout, variant, seq_local, dtype = "zigzag", "ring", 4, torch.float32
    if rank == odd_rank or odd_rank is None:
        layout = change.get("layout", layout)
        variant = change.get("variant", variant)
        seq_local = change.get("seq_local", seq_local)
        dtype = DTYPES[change.get("dtype", "float32")]
    q, k, v = (torch.randn(1, seq_local, 2, 32, dtype=dtype) for _ in range(3))
    raised = None
    try:
        ring_attention(q, k, v, layout=layout, variant=variant, backend="reference")
    except ValueError as err:
        raised = f"{type(err).__name__}: {err}"
    q, k, v = (torch.randn(1, 4, 2, 32) for _ in range(3))
    recovered = bool(torch.isfinite(ring_attention(q, k, v, backend="reference")).all())
    return {"raised": raised, "recovered": recovered}


def case_comm_volume(rank, world, *, variant, heads, kv_heads):
    """Bytes this rank sends for one forward and one backward, and whether local-copy mode changes the output."""
    case = RingCase(world, True, "zigzag", variant, heads=heads, kv_heads=kv_heads, batch=1, seq=16, seed=3)
    q, k, v, dout = (shard_for_ring(x, None, "zigzag") for x in _inputs(case))
    q.requires_grad_()
    attend = functools.partial(ring_attention, variant=variant, backend="reference")
    log, copies_log = CommLog(), CommLog()
    out = attend(q, k, v, comm_log=log)
    forward_bytes, forward_kinds = log.bytes_sent(), sorted({r.kind for r in log.records})
    out.backward(dout)  # the backward logs into the forward's log
    copied = attend(q, k, v, comm_log=copies_log, local_copies=True)
    return {"forward_bytes": forward_bytes, "backward_bytes": log.bytes_sent() - forward_bytes,
            "forward_kinds": forward_kinds, "copies_bytes": copies_log.bytes_sent(),
            "copies_differ": bool((copied - out).abs().max() > 1e-3), "copies_finite": bool(copied.isfinite().all())}


def case_sdpa_stand_ins(rank, world, *, case: RingCase, compile_merge: bool):
    """`case_attention` with backend "sdpa_cudnn" on CPU: the CUDA-only cuDNN ops replaced by the stand-ins of
    tests/test_flash_attention_adapters.py (same signatures, same output layouts), the CUDA check lifted for the
    call. bf16 partials in bf16 accumulators at P = 2 (`exact_output_dtype`), the merge eager or compiled."""
    from test_flash_attention_adapters import _cpu_sdpa_stand_ins

    flash = importlib.import_module("torch_impl.kernels.flash_attention")
    saved = flash.aten, flash._check_backend_limits
    flash.aten, flash._check_backend_limits = _cpu_sdpa_stand_ins(), lambda *args: None
    try:
        q, k, v, dout = (shard_for_ring(x, None, case.layout) for x in _inputs(case))
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        out, lse = ring_attention(q, k, v, causal=case.causal, layout=case.layout, variant=case.variant,
                                  return_lse=True, backend="sdpa_cudnn", compile_merge=compile_merge)
        out.backward(dout)
    finally:
        flash.aten, flash._check_backend_limits = saved
    return {name: _numpy(t) for name, t in zip(NAMES, (out, lse, q.grad, k.grad, v.grad))}


def _tiny_layer(x, weights, attention_fn, heads, kv_heads, dim):
    """A projection -> attention -> projection layer, enough to carry gradients through ring_attention."""
    wq, wk, wv, wo = weights
    b, s, _ = x.shape
    q = (x @ wq).view(b, s, heads, dim)
    k, v = ((x @ w).view(b, s, kv_heads, dim) for w in (wk, wv))
    return attention_fn(q, k, v).flatten(2) @ wo


def _tiny_layer_inputs(seed=5, batch=2, seq=32, width=16, heads=4, kv_heads=2, dim=32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, width, generator=gen)
    weights = [torch.randn(width, n * dim, generator=gen) / math.sqrt(width) for n in (heads, kv_heads, kv_heads)]
    weights.append(torch.randn(heads * dim, width, generator=gen) / math.sqrt(heads * dim))
    target = torch.randn(batch, seq, width, generator=gen)
    return x, weights, target


def case_end_to_end(rank, world, *, layout, variant):
    """Loss and full gradients of `_tiny_layer` run sequence-parallel: tokens scattered with shard_for_ring,
    outputs gathered with gather_from_ring, the same loss on every rank, gradients summed over ranks."""
    x, weights, target = _tiny_layer_inputs()
    x.requires_grad_()
    for w in weights:
        w.requires_grad_()
    attention_fn = functools.partial(ring_attention, group=None, layout=layout, variant=variant, backend="reference")
    y_local = _tiny_layer(shard_for_ring(x, None, layout), weights, attention_fn, 4, 2, 32)
    y = gather_from_ring(y_local, None, layout)
    loss = (y * target).sum()
    loss.backward()
    grads = [x.grad] + [w.grad for w in weights]
    for grad in grads:
        dist.all_reduce(grad)
    return {"y": _numpy(y), "loss": loss.item(), "grads": [_numpy(g) for g in grads]}


# ---------------------------------------------------------------------------------------------------------------
# Expected values (single device, full sequence)
# ---------------------------------------------------------------------------------------------------------------

def _attention_case(case: RingCase, **extra):
    return ("case_attention", dict(case=case, **extra))


def _assemble(per_rank, layout):
    """Full-sequence arrays from each rank's local results (lse has the sequence on axis 2)."""
    return {key: gather_sequence([r[key] for r in per_rank], layout, axis=2 if key == "lse" else 1) for key in NAMES}


def _single_device_fp32(case: RingCase):
    q, k, v, dout = _inputs(case, dtype="float32")
    scale = 1.0 / math.sqrt(q.shape[-1])
    out, lse = reference_attention_forward(q, k, v, causal=case.causal, softmax_scale=scale)
    dq, dk, dv = reference_attention_backward(dout, q, k, v, out, lse, causal=case.causal, softmax_scale=scale)
    return {name: _numpy(t) for name, t in zip(NAMES, (out, lse, dq, dk, dv))}


def _naive(case: RingCase, device="cpu"):
    """(out, lse, dq, dk, dv) of the naive `reference_attention` through autograd in the case's dtype."""
    q, k, v, dout = _inputs(case, device)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out, lse = reference_attention(q, k, v, causal=case.causal, return_lse=True)
    out.backward(dout)
    return {name: _numpy(t) for name, t in zip(NAMES, (out, lse, q.grad, k.grad, v.grad))}


def assert_matches_single_device(per_rank, case: RingCase, device="cpu"):
    assert_matches(case, _assemble(per_rank, case.layout), lambda: _single_device_fp32(case),
                   lambda: _naive(case, device))


def _check_no_errors(per_rank, name):
    for rank, results in enumerate(per_rank):
        assert "error" not in results[name], f"rank {rank}: {results[name]['error']}"


# ---------------------------------------------------------------------------------------------------------------
# P = 4, gloo, reference pair backend, float32
# ---------------------------------------------------------------------------------------------------------------

ATTENTION_P4 = {case.id: _attention_case(case) for case in FOUR_DEVICES}
SUBGROUP_RING = {variant: RingCase(2, True, "zigzag", variant) for variant in ("ring", "allgather")}
ERRORS_P4 = {
    "odd-local-length": ("case_expect_error", dict(change={"seq_local": 3})),
    "length-differs-on-rank-2": ("case_expect_error", dict(odd_rank=2, change={"seq_local": 6})),
    "dtype-differs-on-rank-1": ("case_expect_error", dict(odd_rank=1, change={"dtype": "float64"})),
    "layout-differs-on-rank-3": ("case_expect_error", dict(odd_rank=3, change={"layout": "contiguous"})),
    "variant-differs-on-rank-0": ("case_expect_error", dict(odd_rank=0, change={"variant": "allgather"})),
}
OTHER_P4 = {
    "volume-ring-h4kv1": ("case_comm_volume", dict(variant="ring", heads=4, kv_heads=1)),
    "volume-allgather-h4kv2": ("case_comm_volume", dict(variant="allgather", heads=4, kv_heads=2)),
    "layer-zigzag-ring": ("case_end_to_end", dict(layout="zigzag", variant="ring")),
    "layer-contiguous-allgather": ("case_end_to_end", dict(layout="contiguous", variant="allgather")),
    "subgroups-ring": _attention_case(SUBGROUP_RING["ring"], subgroups=True),
    "subgroups-allgather": _attention_case(SUBGROUP_RING["allgather"], subgroups=True),
}


@pytest.fixture(scope="module")
def p4():
    return run_on_ranks(4, {**ATTENTION_P4, **ERRORS_P4, **OTHER_P4}, module=__name__)


@pytest.mark.slow
@pytest.mark.parametrize("case", FOUR_DEVICES, ids=ids(FOUR_DEVICES))
def test_p4_matches_single_device(p4, case):
    _check_no_errors(p4, case.id)
    assert_matches_single_device([r[case.id] for r in p4], case)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["subgroups-ring", "subgroups-allgather"])
def test_two_rings_in_one_world(p4, name):
    """Ranks {0, 2} and {1, 3} form two independent rings of 2: peers are global ranks, not group ranks."""
    for ranks in ((0, 2), (1, 3)):
        _check_no_errors([p4[r] for r in ranks], name)
        assert_matches_single_device([p4[r][name] for r in ranks], OTHER_P4[name][1]["case"])


@pytest.mark.slow
def test_negative_control_wrong_layout_fails(p4):
    """Zigzag results assembled as if contiguous must not match: the comparison can tell layouts apart."""
    case = RingCase(4, True, "zigzag", "ring")
    per_rank = [r[case.id] for r in p4]
    wrong = gather_sequence([r["out"] for r in per_rank], "contiguous", axis=1)
    assert np.abs(wrong - _single_device_fp32(case)["out"]).max() > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("name, expected", [
    ("odd-local-length", "LayoutError: q has 3 tokens on each of 4 devices, so the sequence length 12 does not "
                         "split into the zigzag layout over 4 devices: it must be a multiple of 8"),
    ("length-differs-on-rank-2", "ValueError: ring_attention arguments differ across the 4 ranks: q shape is "
                                 "(1, 4, 2, 32) on rank 0, (1, 4, 2, 32) on rank 1, (1, 6, 2, 32) on rank 2"),
    ("dtype-differs-on-rank-1", "q dtype is torch.float32 on rank 0, torch.float64 on rank 1"),
    ("layout-differs-on-rank-3", "layout is 'zigzag' on rank 0, 'zigzag' on rank 1, 'zigzag' on rank 2, "
                                 "'contiguous' on rank 3"),
    ("variant-differs-on-rank-0", "variant is 'allgather' on rank 0, 'ring' on rank 1"),
])
def test_bad_arguments_raise_on_every_rank_without_hanging(p4, name, expected):
    for rank, results in enumerate(p4):
        result = results[name]
        assert "error" not in result, f"rank {rank}: {result.get('error')}"
        assert result["raised"] is not None and expected in result["raised"], f"rank {rank}: {result['raised']}"
        assert result["recovered"], f"rank {rank}: a correct call after the error failed"


@pytest.mark.slow
def test_only_kv_heads_travel(p4):
    world, local_tokens, dim, fp32 = 4, 4, 32, 4
    kv_block = local_tokens * dim * fp32  # bytes of one K or V block per KV head (batch 1)
    ring = p4[0]["volume-ring-h4kv1"]
    assert ring["forward_kinds"] == ["exchange"]
    assert ring["forward_bytes"] == (world - 1) * 2 * kv_block * 1
    assert ring["backward_bytes"] == (world - 1 + world) * 2 * kv_block * 1  # K/V P-1 hops, dK/dV P hops
    gathered = p4[0]["volume-allgather-h4kv2"]
    assert gathered["forward_kinds"] == ["all_gather"]
    assert gathered["forward_bytes"] == (world - 1) * 2 * kv_block * 2
    assert gathered["backward_bytes"] == 2 * (world - 1) * 2 * kv_block * 2  # gather again, reduce-scatter
    for result in (ring, gathered):
        assert result["copies_bytes"] == 0 and result["copies_finite"] and result["copies_differ"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["layer-zigzag-ring", "layer-contiguous-allgather"])
def test_gradients_end_to_end_through_shard_and_gather(p4, name):
    _check_no_errors(p4, name)
    x, weights, target = _tiny_layer_inputs()
    x.requires_grad_()
    for w in weights:
        w.requires_grad_()
    y = _tiny_layer(x, weights, functools.partial(reference_attention, causal=True), 4, 2, 32)
    (y * target).sum().backward()
    expected = [_numpy(t.grad) for t in [x, *weights]]
    for rank, results in enumerate(p4):
        result = results[name]
        np.testing.assert_allclose(result["y"], _numpy(y), **FP32_TOL, err_msg=f"rank {rank} y")
        for i, (got, want) in enumerate(zip(result["grads"], expected)):
            np.testing.assert_allclose(got, want, **FP32_TOL, err_msg=f"rank {rank} grad {i}")


# ---------------------------------------------------------------------------------------------------------------
# P = 2 (gloo) and P = 1 (no process group)
# ---------------------------------------------------------------------------------------------------------------

SDPA_BF16_P2 = RingCase(2, True, "zigzag", "ring", batch=1, dtype="bfloat16")
SDPA_P2 = {f"sdpa-stand-ins-{mode}": ("case_sdpa_stand_ins", dict(case=SDPA_BF16_P2, compile_merge=mode == "compiled"))
           for mode in ("eager", "compiled")}


@pytest.fixture(scope="module")
def p2():
    return run_on_ranks(2, {**{case.id: _attention_case(case) for case in TWO_DEVICES}, **SDPA_P2}, module=__name__)


@pytest.mark.slow
@pytest.mark.parametrize("case", TWO_DEVICES, ids=ids(TWO_DEVICES))
def test_p2_matches_single_device(p2, case):
    _check_no_errors(p2, case.id)
    assert_matches_single_device([r[case.id] for r in p2], case)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SDPA_P2))
def test_p2_sdpa_adapter_in_the_ring_flash_rule(p2, name):
    """The cuDNN route inside the ring (stand-in ops on CPU): sliced blocks as strided views, GQA, bf16 partial
    outputs merged into a bf16 accumulator (each merged row rounded once), eager or compiled merge."""
    _check_no_errors(p2, name)
    assert_matches_single_device([r[name] for r in p2], SDPA_BF16_P2)


# ---------------------------------------------------------------------------------------------------------------
# P = 4, gloo, the triton pair backend (interpreted on CPU: slow, hence tiny shapes), bfloat16
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def p4_triton():
    return run_on_ranks(4, {case.id: _attention_case(case, backend="triton") for case in OUR_KERNELS_BF16},
                        module=__name__)


@pytest.mark.slow
@pytest.mark.parametrize("case", OUR_KERNELS_BF16, ids=ids(OUR_KERNELS_BF16))
def test_p4_triton_bf16_flash_rule(p4_triton, case):
    _check_no_errors(p4_triton, case.id)
    assert_matches_single_device([r[case.id] for r in p4_triton], case)


@pytest.mark.parametrize("case", ONE_DEVICE, ids=ids(ONE_DEVICE))
def test_p1_is_single_device_attention(case):
    assert not dist.is_initialized()
    assert_matches_single_device([case_attention(0, 1, case=case)], case)


def test_p1_odd_length_refused_for_zigzag():
    q, k, v = (torch.randn(1, 7, 2, 32) for _ in range(3))
    with pytest.raises(LayoutError, match="q has 7 tokens on each of 1 devices, so the sequence length 7 does not"
                                          " split into the zigzag layout over 1 devices: it must be a multiple of 2"):
        ring_attention(q, k, v, backend="reference")
    assert ring_attention(q, k, v, layout="contiguous", backend="reference").shape == q.shape


def _qkv(seq_q=8, heads=4, seq_kv=8, kv_heads=2):
    return torch.randn(1, seq_q, heads, 32), torch.randn(1, seq_kv, kv_heads, 32), torch.randn(1, seq_kv, kv_heads, 32)


@pytest.mark.parametrize("tensors, keywords, message", [
    (_qkv(), dict(layout="striped"), "layout must be one of contiguous, zigzag, zigzag_stripes, got 'striped'"),
    (_qkv(), dict(variant="ulysses"), "variant must be one of ring, allgather, got 'ulysses'"),
    (_qkv(kv_heads=3), {}, "q's 4 heads must be a multiple of k's 3 heads"),
    (_qkv(seq_q=6), {}, "must agree in batch, local sequence length and head_dim"),
    (_qkv()[:2] + (torch.randn(1, 8, 2, 4),), {}, "k and v must have the same shape"),
])
def test_p1_bad_arguments(tensors, keywords, message):
    with pytest.raises(ValueError, match=message):
        ring_attention(*tensors, backend="reference", **keywords)


# ---------------------------------------------------------------------------------------------------------------
# 4 GPUs, NCCL, the compiled triton kernels, bf16 (the `gpu` marker: skipped without CUDA, not run in CI)
# ---------------------------------------------------------------------------------------------------------------

def case_ring_vs_one_gpu(rank, world, *, seq, heads, kv_heads, dim, layout, variant, repeats=3, device="cuda"):
    """Max |ring - one GPU| and max |one GPU| over this rank's positions for out, lse, dq, dk, dv at a real size; the
    one-GPU side is the same kernel on the full sequence. The ring runs `repeats` times back to back without a
    host synchronisation and the last result is checked, so a stream or buffer-reuse race would show."""
    from torch_impl.kernels.flash_attention import flash_attention_backward, flash_attention_forward

    device = torch.device(device, rank) if device == "cuda" else torch.device(device)
    case = RingCase(world, True, layout, variant, heads=heads, kv_heads=kv_heads, batch=1, seq=seq, dim=dim,
                    dtype="bfloat16")
    q, k, v, dout = _inputs(case, device)
    scale = dim ** -0.5
    out, lse = flash_attention_forward(q, k, v, causal=True, softmax_scale=scale)
    grads = flash_attention_backward(dout, q, k, v, out, lse, causal=True, softmax_scale=scale)
    single = {"out": out, "lse": lse.transpose(1, 2), "dq": grads[0], "dk": grads[1], "dv": grads[2]}
    local = [shard_for_ring(x, None, layout).requires_grad_() for x in (q, k, v)]
    for _ in range(repeats):
        ring_out, ring_lse = ring_attention(*local, layout=layout, variant=variant, return_lse=True)
        ring_grads = torch.autograd.grad(ring_out, local, shard_for_ring(dout, None, layout))
    ring = {"out": ring_out, "lse": ring_lse.transpose(1, 2), "dq": ring_grads[0], "dk": ring_grads[1],
            "dv": ring_grads[2]}
    single = {name: shard_for_ring(x, None, layout).float() for name, x in single.items()}
    return {name: (float((ring[name].detach().float() - single[name]).abs().max()), float(single[name].abs().max()))
            for name in ring}


GPU = dict(heads=16, batch=1, seq=4096, dim=128, dtype="bfloat16")
GPU_WORLDS = (2, 4)  # every GPU count the ring runs at on the lent machines
GPU_CASES = [case for world in GPU_WORLDS for case in (
    RingCase(world, True, "zigzag", "ring", kv_heads=4, **GPU),
    RingCase(world, True, "zigzag", "allgather", kv_heads=4, **GPU),
    RingCase(world, True, "contiguous", "ring", kv_heads=16, **GPU),
    RingCase(world, False, "zigzag", "ring", kv_heads=2, **GPU))]
REAL_SIZES = ((32768, "ring"), (32768, "allgather"), (131072, "ring"))
REAL_SIZE_GPU = {f"p{world}-S{seq // 1024}k-{variant}": (world, dict(seq=seq, heads=32, kv_heads=8, dim=128,
                                                                     layout="zigzag", variant=variant))
                 for world in GPU_WORLDS for seq, variant in REAL_SIZES}


@pytest.fixture(scope="module")
def gpu_ranks():
    """`of(world)`: every GPU task of that GPU count (the flash-rule cases and the real sizes), run in one NCCL
    launch on first use; skips when the machine has fewer GPUs."""
    runs = {}

    def of(world: int):
        if torch.cuda.device_count() < world:
            pytest.skip(f"needs {world} CUDA GPUs")
        if world not in runs:
            tasks = {case.id: _attention_case(case, backend="triton", device="cuda")
                     for case in GPU_CASES if case.world == world}
            tasks.update({name: ("case_ring_vs_one_gpu", kwargs)
                          for name, (size_world, kwargs) in REAL_SIZE_GPU.items() if size_world == world})
            runs[world] = run_on_ranks(world, tasks, module=__name__, comm_backend="nccl")
        return runs[world]
    return of


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=ids(GPU_CASES))
def test_gpu_nccl_flash_rule(gpu_ranks, case):
    per_rank = gpu_ranks(case.world)
    _check_no_errors(per_rank, case.id)
    assert_matches_single_device([r[case.id] for r in per_rank], case, device="cuda")


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(REAL_SIZE_GPU))
def test_gpu_nccl_real_size_matches_one_gpu(gpu_ranks, name):
    """Tolerance: two bf16 ulps of the largest magnitude (2^-6 x max) for out and the gradients -- both sides round
    fp32 results once, but the kernels round P to bf16 against different running maxima, so elements may differ
    by a couple of ulps; a missing or misplaced block changes them by O(max). lse is float32 on both sides, summed
    in another order: 1e-4 absolute."""
    per_rank = gpu_ranks(REAL_SIZE_GPU[name][0])
    _check_no_errors(per_rank, name)
    for rank, results in enumerate(per_rank):
        for tensor, (err, scale) in results[name].items():
            bound = 1e-4 if tensor == "lse" else 2.0 ** -6 * scale
            assert err <= bound, f"rank {rank} {tensor}: max error {err:.3g} > {bound:.3g}"


def test_compiled_merge_is_one_wrapper_for_every_call(monkeypatch):
    """`compile_merge` must not build a torch.compile wrapper per call: a fresh wrapper hits dynamo's cache but costs
    milliseconds of host time per layer (the 1B step at 8k on 2×H200 was 58 % idle). Two ring forwards on a stand-in
    two-rank ring (its exchange hands the same block back: the numbers are beside the point) wrap once."""
    ring_module = importlib.import_module("torch_impl.ring_attention")  # the package's name is the function

    class StandInRing:
        world, rank = 2, 1

        def exchange(self, tensors):
            return type("Done", (), {"wait": lambda self: tensors})()

    wrapped = []
    monkeypatch.setattr(ring_module.torch, "compile", lambda fn: wrapped.append(fn) or fn)
    ring_module._compiled_merge.cache_clear()
    cfg = ring_module._RingConfig(causal=True, layout="zigzag", variant="ring", softmax_scale=0.25,
                                  backend="reference", compile_merge=True, documents=False)
    q, k, v = (torch.randn(1, 8, 2, 32) for _ in range(3))
    for _ in range(2):
        out, lse = ring_module._ring_forward(StandInRing(), cfg, q, k, v, None)
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert wrapped == [ring_module._merge]
    ring_module._compiled_merge.cache_clear()  # the next user compiles for real
