"""JAX Ulysses and hybrid Ulysses x ring sequence parallelism (`jax_impl/ulysses.py`) on emulated host devices
(conftest requests 4) against single-device attention on identical inputs, judged as tests/test_ring_attention_jax.py
judges the ring (the cases, shared with the torch twin, and their tolerances: tests/ulysses_twins.py).

Besides the twins' cases: a 2-D (fsdp x sp) mesh, the training's attention function inside a jitted program on
arrays placed on the (fsdp, sp) mesh (no transfer but the scheme's collectives), the all-to-all bytes of the lowered
program against `weights.sequence_parallel`'s formula, the local-copies instrument, refused heads and axes, negative
controls (a wrong token order or wrong KV heads after the all-to-all must fail), and real sizes on 2 and 4 GPUs under
the `gpu` marker.
"""

from __future__ import annotations

import functools
import importlib
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jax_impl.parallel import make_mesh, sequence_parallel_fn
from jax_impl.ring_attention import gather_from_ring, shard_for_ring
from jax_impl.ulysses import sequence_parallel_attention, sequence_parallel_sharded
from ring_twins import NAMES, RingCase, assert_flash_rule, assert_matches
from test_ring_attention_jax import (_arrays, _assert_fp32_close, _gpu_references, _inputs, _mesh, _named,
                                     _results_with_grads, _single_device_results, _with_grads)
from ulysses_twins import FOUR_DEVICES, NEGATIVE_CONTROL, OUR_KERNELS_BF16, TWO_DEVICES, SchemeCase, ids
from weights.parallel import MeshShape
from weights.sequence_parallel import scheme_degrees, sequence_parallel_bytes_sent


def _scheme_results(q, k, v, dout, mesh, **kwargs):
    kwargs.setdefault("backend", "reference")
    return _with_grads(functools.partial(sequence_parallel_sharded, mesh=mesh, return_lse=True, **kwargs), q, k, v,
                       dout)


def _assert_twin_case(case: SchemeCase, backend: str):
    """One case of tests/ulysses_twins.py on `case.attention.world` emulated devices, judged as the torch twin."""
    attention = case.attention
    q, k, v, dout = _arrays(attention)
    got = _scheme_results(q, k, v, dout, _mesh((attention.world, "sp")), scheme=case.scheme,
                          ulysses_degree=case.ulysses_degree, layout=attention.layout, variant=attention.variant,
                          causal=attention.causal, backend=backend)
    naive = functools.partial(_single_device_results, q, k, v, dout, attention.causal)
    assert_matches(attention, _named(got), lambda: _named(naive()), lambda: _named(naive()))


# ---------------------------------------------------------------------------------------------------------------
# Against single-device attention
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", FOUR_DEVICES + TWO_DEVICES, ids=ids(FOUR_DEVICES + TWO_DEVICES))
def test_schemes_match_single_device(case):
    _assert_twin_case(case, "reference")


@pytest.mark.parametrize("case", OUR_KERNELS_BF16, ids=ids(OUR_KERNELS_BF16))
def test_pallas_bf16_meets_the_flash_rule(case):
    _assert_twin_case(case, "pallas")


def test_two_dimensional_mesh_batch_over_fsdp():
    """fsdp=2 x sp=2 with Ulysses over sp: each device holds one batch row's zigzag half of the sequence."""
    q, k, v, dout = _inputs(2, 16, 4, 1, 8, seed=2)
    got = _scheme_results(q, k, v, dout, _mesh((2, "fsdp"), (2, "sp")), scheme="ulysses", batch_axis="fsdp")
    _assert_fp32_close(got, _single_device_results(q, k, v, dout, True))


def _lowered_text(fn, *args) -> str:
    return jax.jit(fn).lower(*args).as_text()


def _collectives(text: str) -> list[tuple[str, list[int]]]:
    """(op, result shape) of each collective of a lowered program."""
    found = re.findall(r"stablehlo\.(all_to_all|collective_permute|all_gather|reduce_scatter|all_reduce)\b.*?->\s*"
                       r"tensor<([0-9x]+)x[a-z]", text, flags=re.DOTALL)
    return [(op, [int(n) for n in shape.split("x")]) for op, shape in found]


@pytest.mark.parametrize("scheme, degree, expected", [("ulysses", 4, {"all_to_all"}),
                                                      ("hybrid", 2, {"all_to_all", "collective_permute"})])
def test_training_attention_fn_moves_only_the_schemes_collectives(scheme, degree, expected):
    """The model's attention function of `sequence_parallel_fn` on arrays placed on the training's (fsdp, sp) mesh
    in a jitted program: its shard_map runs over the split mesh without a transfer in or out (no gather, no
    all-reduce), and matches single-device attention."""
    mesh = make_mesh(MeshShape(fsdp=1, sp=4))
    attention = sequence_parallel_fn(mesh, scheme=scheme, ulysses_degree=degree, backend="reference")
    q, k, v, dout = _inputs(1, 32, 4, 2, 8, seed=9)
    sharding = NamedSharding(mesh, PartitionSpec("fsdp", "sp", None, None))
    placed = [jax.device_put(x, sharding) for x in (q, k, v)]

    def attend(q, k, v):
        return jax.lax.with_sharding_constraint(attention(q, k, v), sharding)

    compiled = jax.jit(attend).lower(*placed).compile().as_text()
    assert set(re.findall(r"\b(all-to-all|collective-permute|all-gather|all-reduce|reduce-scatter)\b",
                          compiled)) == {op.replace("_", "-") for op in expected}
    world, layout = 4, "zigzag"
    got = gather_from_ring(jax.jit(attend)(*(shard_for_ring(x, world, layout) for x in placed)), world, layout)
    np.testing.assert_allclose(got, _single_device_results(q, k, v, dout, True)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads, kv_heads", [(8, 1), (8, 4), (8, 8)])
def test_all_to_all_bytes_of_the_program_follow_the_formula(heads, kv_heads):
    """Ulysses over 4, forward + backward in bf16: the all-to-alls of the lowered program (per device, each sends
    (U - 1) / U of its operand) add up to `sequence_parallel_bytes_sent`; K/V carry max(Hkv, U) heads."""
    world, batch, seq, dim = 4, 1, 32, 8
    q, k, v, dout = (x.astype(jnp.bfloat16) for x in _inputs(batch, seq, heads, kv_heads, dim))
    attend = functools.partial(sequence_parallel_sharded, mesh=_mesh((world, "sp")), scheme="ulysses",
                               backend="reference")

    def forward_and_backward(q, k, v, dout):
        out, pullback = jax.vjp(attend, q, k, v)
        return out, pullback(dout)

    found = _collectives(_lowered_text(forward_and_backward, q, k, v, dout))
    assert {op for op, _ in found} == {"all_to_all"}
    sent = sum(math.prod(shape) * 2 * (world - 1) // world for _, shape in found)
    degrees = scheme_degrees("ulysses", world)
    assert sent == sequence_parallel_bytes_sent(degrees, batch=batch, local_tokens=seq // world, heads=heads,
                                                kv_heads=kv_heads, head_dim=dim, compute_bytes=2, variant="ring",
                                                backward=True)
    to_heads = {shape[2] for _, shape in found if shape[1] == seq}  # [B, S, heads of one device, D]
    assert to_heads == {heads // world, max(kv_heads, world) // world}


def test_local_copies_mode_removes_every_collective():
    q, k, v, dout = _inputs(1, 16, 4, 2, 8)
    mesh = _mesh((4, "sp"))
    for scheme, degree in (("ulysses", 4), ("hybrid", 2)):
        attend = functools.partial(sequence_parallel_sharded, mesh=mesh, scheme=scheme, ulysses_degree=degree,
                                   backend="reference", return_lse=True)
        copying = _results_with_grads(functools.partial(attend, local_copies=True))
        assert not _collectives(_lowered_text(copying, q, k, v, dout)), scheme
        local, real = jax.jit(copying)(q, k, v, dout), _scheme_results(q, k, v, dout, mesh, scheme=scheme,
                                                                        ulysses_degree=degree)
        assert float(jnp.abs(local[0] - real[0]).max()) > 1e-2, scheme  # it did skip the other devices' tokens


# ---------------------------------------------------------------------------------------------------------------
# Refused input and negative controls
# ---------------------------------------------------------------------------------------------------------------

def test_bad_heads_degrees_and_axes_are_refused_with_one_line():
    mesh = _mesh((4, "sp"))
    q, k, v, _ = _inputs(1, 16, 6, 6, 8)
    with pytest.raises(ValueError, match=r"^Ulysses degree 4 must divide the 6 query heads; degrees that work for 6 "
                                         r"query and 6 KV heads: 1, 2, 3, 6"):
        sequence_parallel_sharded(q, k, v, mesh, scheme="ulysses", backend="reference")
    with pytest.raises(ValueError, match="Ulysses degree 2 and the 3 KV heads must be multiples one of the other"):
        sequence_parallel_sharded(q, k[:, :, :3], v[:, :, :3], mesh, scheme="hybrid", ulysses_degree=2)
    with pytest.raises(ValueError, match=r"hybrid Ulysses degree 4 over sp=4 .* \(one of 2\)"):
        sequence_parallel_sharded(q, k, v, mesh, scheme="hybrid", ulysses_degree=4)
    with pytest.raises(ValueError, match="not both in scope"):
        sequence_parallel_attention(q, k, v)


@pytest.mark.parametrize("wrong", ["token-order", "kv-heads"])
def test_negative_control_wrong_order_or_kv_heads_fails(wrong, monkeypatch):
    """The device order of the gathered chunks instead of positions', or the KV heads sent to the wrong devices,
    must move the output far outside the tolerance (so the passing tests above are not vacuous)."""
    ulysses = importlib.import_module("jax_impl.ulysses")
    if wrong == "token-order":
        monkeypatch.setattr(ulysses, "gathered_chunk_order", lambda degree, layout: tuple(range(2 * degree)))
    else:
        right = ulysses.kv_head_slots
        monkeypatch.setattr(ulysses, "kv_head_slots", lambda *args: right(*args)[::-1].copy())
    case = NEGATIVE_CONTROL
    q, k, v, dout = _arrays(case.attention)
    got = _scheme_results(q, k, v, dout, _mesh((4, "sp")), scheme=case.scheme)
    assert float(jnp.abs(got[0] - _single_device_results(q, k, v, dout, True)[0]).max()) > 1e-2


# ---------------------------------------------------------------------------------------------------------------
# Real sizes on 2 and 4 GPUs
# ---------------------------------------------------------------------------------------------------------------

GPU_CASES = [(2, "ulysses", 2, 128), (4, "ulysses", 4, 128), (4, "hybrid", 2, 128), (4, "hybrid", 2, 64)]


@pytest.mark.gpu
@pytest.mark.parametrize("world, scheme, degree, head_dim", GPU_CASES)
def test_gpu_schemes_bf16_meet_the_flash_rule(world, scheme, degree, head_dim):
    """tests/test_ring_attention_jax.py's GPU inputs (32 query and 8 KV heads over 8192 tokens, bf16) with the
    default backend (the Mosaic kernels on sm90) in each scheme; prints each result's error beside the naive bf16
    attention's."""
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if len(gpus) < world:
        pytest.skip(f"needs {world} GPUs visible to JAX")
    (q, k, v, dout), naive, exact = _gpu_references(head_dim)
    got = _named(_scheme_results(q, k, v, dout, _mesh((world, "sp"), devices=gpus), scheme=scheme,
                                 ulysses_degree=degree, backend="pallas"))
    errors = {name: float(np.max(np.abs(np.asarray(got[name], np.float64) - exact[name]))) for name in NAMES}
    print(f"scheme-errors P={world} {scheme} U={degree} D={head_dim}: ours {errors}")
    assert_flash_rule(got, naive, exact)


def test_a_ring_case_is_the_ring():
    """scheme "ring" through `sequence_parallel_sharded` is the ring itself (Ulysses degree 1)."""
    case = SchemeCase("ring", 1, RingCase(4, True, "zigzag", "allgather", kv_heads=1))
    _assert_twin_case(case, "reference")
