"""torch_impl.ulysses (Ulysses and hybrid Ulysses x ring sequence parallelism) over real torch.distributed process
groups (gloo on CPU, 4 processes; NCCL on 2 and 4 GPUs for the `gpu` tests) against single-device attention on the
same full sequence, judged as tests/test_ring_attention_torch.py judges the ring (the cases, shared with the JAX
twin, and their tolerances: tests/ulysses_twins.py).

One spawn per world size runs every case of that size (a module-scoped fixture; process start costs seconds); each
case returns its local results in the ring layout over all 4 ranks, which the tests assemble and compare. Besides
the twins' cases: the bytes each scheme sends against `weights.sequence_parallel`'s formula, the local-copies
instrument, refused head counts and degrees (the same line on every rank, no hang), a layer's gradients through
shard / gather, and negative controls (a wrong token order or wrong KV heads after the all-to-all must fail).
"""

from __future__ import annotations

import functools
import importlib

import numpy as np
import pytest
import torch
import torch.distributed as dist

from distributed import run_on_ranks
from ring_twins import NAMES, RingCase
from test_ring_attention_torch import (FP32_TOL, _assemble, _inputs, _numpy, _single_device_fp32, _tiny_layer,
                                       _tiny_layer_inputs, assert_matches_single_device)
from torch_impl.attention import reference_attention
from torch_impl.ring_attention import gather_from_ring, shard_for_ring
from torch_impl.ring_comm import CommLog
from torch_impl.ulysses import sequence_parallel_attention, sequence_parallel_groups
from ulysses_twins import FOUR_DEVICES, NEGATIVE_CONTROL, OUR_KERNELS_BF16, TWO_DEVICES, SchemeCase, ids
from weights.layout import gather_sequence
from weights.parallel import MeshShape
from weights.sequence_parallel import scheme_degrees, sequence_parallel_bytes_sent


# ---------------------------------------------------------------------------------------------------------------
# Case functions (run inside the rank processes)
# ---------------------------------------------------------------------------------------------------------------

def _local_inputs(case: SchemeCase, device):
    return [shard_for_ring(x, None, case.attention.layout) for x in _inputs(case.attention, device)]


def case_scheme(rank, world, *, case: SchemeCase, backend="reference", device="cpu"):
    """Local (out, lse, dq, dk, dv) of one sequence-parallel attention call, gradients through autograd."""
    device = f"cuda:{rank}" if device == "cuda" else device
    attention = case.attention
    groups = sequence_parallel_groups(case.scheme, case.ulysses_degree)
    q, k, v, dout = _local_inputs(case, device)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out, lse = sequence_parallel_attention(q, k, v, groups=groups, causal=attention.causal, layout=attention.layout,
                                           variant=attention.variant, return_lse=True, backend=backend)
    out.backward(dout)
    return {name: _numpy(t) for name, t in zip(NAMES, (out, lse, q.grad, k.grad, v.grad))}


def case_training_fn(rank, world, *, case: SchemeCase, mesh: str):
    """`case_scheme` through the training's attention function (`torch_impl.parallel.sequence_parallel_fn` on an
    (fsdp, sp) DeviceMesh): each sp group runs the case on its own."""
    from torch_impl.parallel import make_mesh, sequence_parallel_fn

    device_mesh = make_mesh(MeshShape.parse(mesh), "cpu")
    attention_fn = sequence_parallel_fn(device_mesh, case.scheme, case.ulysses_degree, backend="reference")
    q, k, v, dout = (shard_for_ring(x, device_mesh["sp"].get_group(), case.attention.layout)
                     for x in _inputs(case.attention, "cpu"))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = attention_fn(q, k, v)
    out.backward(dout)
    return {name: _numpy(t) for name, t in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad))}


def case_negative_control(rank, world, *, wrong: str):
    """`case_scheme` of NEGATIVE_CONTROL with the all-to-all's token order (`gathered_chunk_order`) replaced by the
    device order, or its KV head slots (`kv_head_slots`) reversed."""
    ulysses = importlib.import_module("torch_impl.ulysses")
    saved = ulysses.gathered_chunk_order, ulysses.kv_head_slots
    if wrong == "token-order":
        ulysses.gathered_chunk_order = lambda degree, layout: tuple(range(2 * degree))
    else:
        ulysses.kv_head_slots = lambda heads, kv_heads, degree: saved[1](heads, kv_heads, degree)[::-1].copy()
    ulysses._kv_slot_index.cache_clear()  # made from the right slots by an earlier case
    try:
        return case_scheme(rank, world, case=NEGATIVE_CONTROL)
    finally:
        ulysses.gathered_chunk_order, ulysses.kv_head_slots = saved
        ulysses._kv_slot_index.cache_clear()


def case_comm_volume(rank, world, *, case: SchemeCase):
    """Bytes this rank sends for one forward and one backward (bf16: the compute dtype's 2 bytes and the ring's
    float32 dK/dV tell apart), and what local-copy mode changes."""
    attention = case.attention
    q, k, v, dout = _local_inputs(case, "cpu")
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    attend = functools.partial(sequence_parallel_attention, groups=sequence_parallel_groups(case.scheme,
                                                                                            case.ulysses_degree),
                               layout=attention.layout, variant=attention.variant, backend="reference")
    log, copies_log = CommLog(), CommLog()
    out = attend(q, k, v, comm_log=log)
    forward_bytes, kinds = log.bytes_sent(), sorted({r.kind for r in log.records})
    out.backward(dout)
    copied = attend(q, k, v, comm_log=copies_log, local_copies=True)
    return {"forward_bytes": forward_bytes, "total_bytes": log.bytes_sent(), "kinds": kinds,
            "copies_bytes": copies_log.bytes_sent(), "copies_finite": bool(copied.isfinite().all()),
            "copies_differ": bool((copied.float() - out.float()).abs().max() > 1e-2)}


def case_expect_error(rank, world, *, scheme, ulysses_degree, heads, kv_heads):
    """The error a call with these heads (or degrees) raises, and whether a correct call afterwards still works."""
    raised = None
    try:
        groups = sequence_parallel_groups(scheme, ulysses_degree)
        q = torch.randn(1, 4, heads, 32)
        k, v = (torch.randn(1, 4, kv_heads, 32) for _ in range(2))
        sequence_parallel_attention(q, k, v, groups=groups, backend="reference")
    except ValueError as err:
        raised = f"{type(err).__name__}: {err}"
    q, k, v = (torch.randn(1, 4, 4, 32) for _ in range(3))
    out = sequence_parallel_attention(q, k, v, groups=sequence_parallel_groups("ulysses"), backend="reference")
    return {"raised": raised, "recovered": bool(torch.isfinite(out).all())}


def case_differs_on_one_rank(rank, world, *, scheme, ulysses_degree):
    """Rank 2 alone passes a longer local sequence: the error every rank raises (the check runs over all four ranks,
    so a hybrid's ranks 0 and 1, whose all-to-all group agrees, stop too), and whether a correct call then works."""
    groups = sequence_parallel_groups(scheme, ulysses_degree)
    raised = None
    try:
        q, k, v = (torch.randn(1, 8 if rank == 2 else 4, 4, 32) for _ in range(3))
        sequence_parallel_attention(q, k, v, groups=groups, backend="reference")
    except ValueError as err:
        raised = f"{type(err).__name__}: {err}"
    q, k, v = (torch.randn(1, 4, 4, 32) for _ in range(3))
    out = sequence_parallel_attention(q, k, v, groups=groups, backend="reference")
    return {"raised": raised, "recovered": bool(torch.isfinite(out).all())}


def case_end_to_end(rank, world, *, scheme, ulysses_degree):
    """Loss and full gradients of tests/test_ring_attention_torch.py's tiny layer run sequence-parallel in `scheme`:
    tokens scattered with shard_for_ring, outputs gathered, gradients summed over ranks."""
    x, weights, target = _tiny_layer_inputs()
    for tensor in (x, *weights):
        tensor.requires_grad_()
    attention_fn = functools.partial(sequence_parallel_attention, groups=sequence_parallel_groups(scheme,
                                                                                                  ulysses_degree),
                                     backend="reference")
    y = gather_from_ring(_tiny_layer(shard_for_ring(x, None, "zigzag"), weights, attention_fn, 4, 2, 32), None,
                         "zigzag")
    (y * target).sum().backward()
    grads = [x.grad] + [w.grad for w in weights]
    for grad in grads:
        dist.all_reduce(grad)
    return {"y": _numpy(y), "grads": [_numpy(g) for g in grads]}


# ---------------------------------------------------------------------------------------------------------------
# 4 processes, gloo, reference pair math, float32 (and the bf16 volume case)
# ---------------------------------------------------------------------------------------------------------------

VOLUME = {f"volume-{case.id}": ("case_comm_volume", dict(case=case)) for case in (
    SchemeCase("ulysses", 4, RingCase(4, True, "zigzag", "ring", kv_heads=1, batch=1, seq=16, dtype="bfloat16")),
    SchemeCase("hybrid", 2, RingCase(4, True, "zigzag", "ring", kv_heads=1, batch=1, seq=16, dtype="bfloat16")),
    SchemeCase("hybrid", 2, RingCase(4, True, "zigzag", "allgather", heads=8, kv_heads=4, batch=1, seq=16,
                                     dtype="bfloat16")))}
ERRORS = {
    "ulysses-heads": ("case_expect_error", dict(scheme="ulysses", ulysses_degree=None, heads=6, kv_heads=6)),
    "hybrid-kv-heads": ("case_expect_error", dict(scheme="hybrid", ulysses_degree=2, heads=6, kv_heads=3)),
    "hybrid-degree": ("case_expect_error", dict(scheme="hybrid", ulysses_degree=4, heads=4, kv_heads=4)),
    **{f"{scheme}-length-differs-on-rank-2": ("case_differs_on_one_rank", dict(scheme=scheme, ulysses_degree=degree))
       for scheme, degree in (("ulysses", 4), ("hybrid", 2))},
}
TRAINING_FN = {  # (mesh, case): the training's attention function; the sp groups of fsdp=2 x sp=2 are {0, 1}, {2, 3}
    "training-fn-hybrid": ("fsdp=1,sp=4", SchemeCase("hybrid", 2, RingCase(4, True, "zigzag", "ring", kv_heads=1))),
    "training-fn-ulysses": ("fsdp=2,sp=2", SchemeCase("ulysses", 2, RingCase(2, True, "zigzag", "ring", kv_heads=1))),
}
OTHER = {**VOLUME, **ERRORS,
         **{name: ("case_training_fn", dict(mesh=mesh, case=case)) for name, (mesh, case) in TRAINING_FN.items()},
         **{f"negative-{wrong}": ("case_negative_control", dict(wrong=wrong)) for wrong in ("token-order", "kv-heads")},
         **{f"layer-{scheme}": ("case_end_to_end", dict(scheme=scheme, ulysses_degree=degree))
            for scheme, degree in (("ulysses", 4), ("hybrid", 2))}}


@pytest.fixture(scope="module")
def p4():
    cases = {case.id: ("case_scheme", dict(case=case)) for case in FOUR_DEVICES}
    return run_on_ranks(4, {**cases, **OTHER}, module=__name__)


def _check_no_errors(per_rank, name):
    for rank, results in enumerate(per_rank):
        assert "error" not in results[name], f"rank {rank}: {results[name]['error']}"


@pytest.mark.slow
@pytest.mark.parametrize("case", FOUR_DEVICES, ids=ids(FOUR_DEVICES))
def test_p4_matches_single_device(p4, case):
    _check_no_errors(p4, case.id)
    assert_matches_single_device([r[case.id] for r in p4], case.attention)


@pytest.mark.slow
@pytest.mark.parametrize("wrong", ["token-order", "kv-heads"])
def test_negative_control_wrong_order_or_kv_heads_fails(p4, wrong):
    """The device order of the gathered chunks instead of positions' (the causal mask then hides the wrong keys), or
    the KV heads sent to the wrong devices, must move the output far outside the tolerance."""
    name = f"negative-{wrong}"
    _check_no_errors(p4, name)
    got = _assemble([r[name] for r in p4], NEGATIVE_CONTROL.attention.layout)
    assert np.abs(got["out"] - _single_device_fp32(NEGATIVE_CONTROL.attention)["out"]).max() > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(VOLUME))
def test_bytes_sent_follow_the_formula(p4, name):
    case = VOLUME[name][1]["case"]
    attention = case.attention
    shapes = dict(batch=1, local_tokens=attention.seq // 4, heads=attention.heads, kv_heads=attention.kv_heads,
                  head_dim=attention.dim, compute_bytes=2, variant=attention.variant)
    degrees = scheme_degrees(case.scheme, 4, case.ulysses_degree)
    for rank, results in enumerate(p4):
        result = results[name]
        assert "error" not in result, f"rank {rank}: {result.get('error')}"
        assert result["forward_bytes"] == sequence_parallel_bytes_sent(degrees, backward=False, **shapes)
        assert result["total_bytes"] == sequence_parallel_bytes_sent(degrees, backward=True, **shapes)
        assert "all_to_all" in result["kinds"]
        assert result["copies_bytes"] == 0 and result["copies_finite"] and result["copies_differ"]


@pytest.mark.slow
@pytest.mark.parametrize("name, expected", [
    ("ulysses-heads", "BadInputError: Ulysses degree 4 must divide the 6 query heads; degrees that work for 6 "
                      "query and 6 KV heads: 1, 2, 3, 6"),
    ("hybrid-kv-heads", "BadInputError: Ulysses degree 2 and the 3 KV heads must be multiples one of the other"),
    ("hybrid-degree", "BadInputError: hybrid Ulysses degree 4 over sp=4 must divide sp and lie strictly between 1 and "
                      "sp (one of 2)"),
])
def test_odd_heads_and_degrees_raise_one_line_on_every_rank(p4, name, expected):
    """BadInputError is a ValueError: the CLI prints it as its one line."""
    for rank, results in enumerate(p4):
        result = results[name]
        assert "error" not in result, f"rank {rank}: {result.get('error')}"
        assert result["raised"] is not None and result["raised"].startswith(expected), f"rank {rank}: {result}"
        assert "\n" not in result["raised"] and result["recovered"]


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["ulysses", "hybrid"])
def test_arguments_differing_on_one_rank_raise_one_line_on_every_rank(p4, scheme):
    expected = ("ValueError: sequence_parallel_attention arguments differ across the 4 ranks: q shape is "
                "(1, 4, 4, 32) on rank 0, (1, 4, 4, 32) on rank 1, (1, 8, 4, 32) on rank 2, (1, 4, 4, 32) on rank 3")
    for rank, results in enumerate(p4):
        result = results[f"{scheme}-length-differs-on-rank-2"]
        assert "error" not in result, f"rank {rank}: {result.get('error')}"
        assert result == {"raised": expected, "recovered": True}, f"rank {rank}: {result}"


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["ulysses", "hybrid"])
def test_layer_gradients_end_to_end(p4, scheme):
    name = f"layer-{scheme}"
    _check_no_errors(p4, name)
    x, weights, target = _tiny_layer_inputs()
    for tensor in (x, *weights):
        tensor.requires_grad_()
    y = _tiny_layer(x, weights, functools.partial(reference_attention, causal=True), 4, 2, 32)
    (y * target).sum().backward()
    expected = [_numpy(t.grad) for t in (x, *weights)]
    for rank, results in enumerate(p4):
        np.testing.assert_allclose(results[name]["y"], _numpy(y), **FP32_TOL, err_msg=f"rank {rank} y")
        for i, (got, want) in enumerate(zip(results[name]["grads"], expected)):
            np.testing.assert_allclose(got, want, **FP32_TOL, err_msg=f"rank {rank} grad {i}")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TRAINING_FN))
def test_training_attention_fn_matches_single_device(p4, name):
    """`sequence_parallel_fn` on the training's DeviceMesh: the scheme over each sp group, the hybrid's subgroups
    made by the sp ranks (out and gradients; the model's attention function returns no lse)."""
    mesh, case = TRAINING_FN[name]
    expected = _single_device_fp32(case.attention)
    sp = MeshShape.parse(mesh).sp
    for ranks in (range(r, r + sp) for r in range(0, 4, sp)):
        _check_no_errors([p4[r] for r in ranks], name)
        for key in ("out", "dq", "dk", "dv"):
            got = gather_sequence([p4[r][name][key] for r in ranks], case.attention.layout, axis=1)
            np.testing.assert_allclose(got, expected[key], **FP32_TOL, err_msg=f"ranks {list(ranks)} {key}")


# ---------------------------------------------------------------------------------------------------------------
# 4 processes, gloo, our Triton kernels (interpreted: tiny shapes), bfloat16, the flash rule
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def p4_triton():
    return run_on_ranks(4, {case.id: ("case_scheme", dict(case=case, backend="triton")) for case in OUR_KERNELS_BF16},
                        module=__name__)


@pytest.mark.slow
@pytest.mark.parametrize("case", OUR_KERNELS_BF16, ids=ids(OUR_KERNELS_BF16))
def test_p4_triton_bf16_flash_rule(p4_triton, case):
    _check_no_errors(p4_triton, case.id)
    assert_matches_single_device([r[case.id] for r in p4_triton], case.attention)


# ---------------------------------------------------------------------------------------------------------------
# 2 processes, gloo: Ulysses over 2 (KV heads below and above U)
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def p2():
    return run_on_ranks(2, {case.id: ("case_scheme", dict(case=case)) for case in TWO_DEVICES}, module=__name__)


@pytest.mark.slow
@pytest.mark.parametrize("case", TWO_DEVICES, ids=ids(TWO_DEVICES))
def test_p2_matches_single_device(p2, case):
    _check_no_errors(p2, case.id)
    assert_matches_single_device([r[case.id] for r in p2], case.attention)


# ---------------------------------------------------------------------------------------------------------------
# One process: the schemes without torch.distributed
# ---------------------------------------------------------------------------------------------------------------

def test_single_process_schemes_are_single_device_attention():
    assert not dist.is_initialized()
    case = RingCase(1, True, "zigzag", "ring", seq=10)
    q, k, v, _ = _inputs(case)
    expected = reference_attention(q, k, v, causal=True)
    for scheme in ("ring", "ulysses"):
        got = sequence_parallel_attention(q, k, v, groups=sequence_parallel_groups(scheme), backend="reference")
        np.testing.assert_allclose(_numpy(got), _numpy(expected), **FP32_TOL)
    with pytest.raises(ValueError, match=r"hybrid Ulysses degree 2 over sp=1 .*sp=1 has none"):
        sequence_parallel_groups("hybrid", 2)


# ---------------------------------------------------------------------------------------------------------------
# 2 and 4 GPUs, NCCL, our compiled kernels, bf16 (the `gpu` marker: skipped without CUDA, not run in CI)
# ---------------------------------------------------------------------------------------------------------------

GPU = dict(heads=16, batch=1, seq=4096, dim=128, dtype="bfloat16")
GPU_P2 = [SchemeCase("ulysses", 2, RingCase(2, True, "zigzag", "ring", kv_heads=kv_heads, **GPU))
          for kv_heads in (1, 4)]
GPU_P4 = [SchemeCase("ulysses", 4, RingCase(4, True, "zigzag", "ring", kv_heads=kv_heads, **GPU))
          for kv_heads in (2, 8)] + [
          SchemeCase("hybrid", 2, RingCase(4, True, layout, variant, kv_heads=kv_heads, **GPU))
          for layout, variant, kv_heads in (("zigzag", "ring", 1), ("zigzag", "allgather", 8),
                                            ("contiguous", "ring", 4))]


def _gpu_world(world: int, cases: list[SchemeCase]):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    return run_on_ranks(world, {case.id: ("case_scheme", dict(case=case, backend="triton", device="cuda"))
                                for case in cases}, module=__name__, comm_backend="nccl")


@pytest.fixture(scope="module")
def p2_gpu():
    return _gpu_world(2, GPU_P2)


@pytest.fixture(scope="module")
def p4_gpu():
    return _gpu_world(4, GPU_P4)


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_P2, ids=ids(GPU_P2))
def test_gpu_p2_nccl_flash_rule(p2_gpu, case):
    _check_no_errors(p2_gpu, case.id)
    assert_matches_single_device([r[case.id] for r in p2_gpu], case.attention, device="cuda")


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_P4, ids=ids(GPU_P4))
def test_gpu_p4_nccl_flash_rule(p4_gpu, case):
    _check_no_errors(p4_gpu, case.id)
    assert_matches_single_device([r[case.id] for r in p4_gpu], case.attention, device="cuda")
