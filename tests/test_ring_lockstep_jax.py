"""The JAX ring's NUMBERS through the Mosaic GPU kernels on the CPU, and the type check that would have caught
issue 32 (the Mosaic ring's gradients off by up to 11 on 2 GPUs while its out and lse were right).

Pallas's Mosaic GPU interpreter cannot run inside a multi-device `jax.shard_map` on the CPU (it sat idle for 15
minutes at P=2), so each rank's exact schedule (`jax_impl.ring_attention.schedule_forward` / `schedule_backward`:
the same pieces, LSE slices, merges and accumulations) runs on one device through the lockstep ring of
tests/ring_lockstep.py, with the interpreted Mosaic kernels (`backend="pallas_hopper"`), judged by the flash rule
against float64 (tests/ring_twins.py, its tolerance's reason stated there). The lockstep run does NOT go through
`shard_map`, which is where issue 32's bug lived: the Mosaic forward's outputs were typed invariant over the mesh
axis, so JAX's autodiff summed the output cotangent over the devices (`psum_invariant`, the transpose of the
implicit broadcast) before the ring's backward. That is a property of the traced program, checked here without
running it, for every pair backend and both variants, with a negative control; the GPU tests run the whole ring.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec
from kernel_twins import float64_attention

pytest.importorskip("greenlet", reason="the lockstep ring runs its ranks as greenlets (the dev extras install it; "
                    "the GPU image lacks it)")
from ring_lockstep import ring_results  # noqa: E402  (after the skip: it imports greenlet)
from ring_twins import NAMES, RingCase, assert_flash_rule, ids, inputs

from jax_impl.attention import reference_attention
from jax_impl.kernels.flash_attention import flash_attention_backward, flash_attention_forward
from jax_impl.ring_attention import gather_from_ring, ring_attention, ring_config, shard_for_ring

# Tiny shapes the interpreter runs in one to two minutes each: D=64 (a Mosaic head dim), GQA 2:1, the smallest local
# length whose zigzag halves fill one 64-row wgmma tile (so the off-diagonal squares are 64 x 64). Two ranks, issue
# 32's mesh: every piece kind (the diagonal's causal pair, the off-diagonal full ones, the all-gather's) and the
# merges and accumulations across steps run there. Four ranks only add more steps of the same pieces, and took 806
# and 518 s on 2 cores under two pytest workers (about half that alone) of CI's 90 minutes; their schedule runs at
# P=4 through the portable kernels inside shard_map (tests/test_ring_attention_jax.py), the Mosaic kernels at P=4 in
# the GPU tests.
LOCKSTEP_CASES = [RingCase(2, True, "zigzag", variant, heads=2, kv_heads=1, batch=1, seq=256, dim=64, dtype="bfloat16",
                           seed=3) for variant in ("ring", "allgather")]


def _lockstep_results(case: RingCase, backend: str) -> dict:
    """(out, lse, dq, dk, dv) of `case`'s ring run rank by rank in lockstep, gathered into natural order."""
    arrays = [jnp.asarray(x, jnp.bfloat16) for x in inputs(case)]
    cfg = ring_config(arrays[0], causal=case.causal, layout=case.layout, variant=case.variant, backend=backend)
    parts = [jnp.split(shard_for_ring(x, case.world, case.layout), case.world, axis=1) for x in arrays]
    per_rank = ring_results(cfg, case.world, *parts)
    gathered = {}
    for index, name in enumerate(NAMES):
        axis = 2 if name == "lse" else 1
        whole = jnp.concatenate([results[index] for results in per_rank], axis=axis)
        gathered[name] = gather_from_ring(whole, case.world, case.layout, axis=axis)
    return gathered


def _naive_and_exact(case: RingCase) -> tuple[dict, dict]:
    q, k, v, dout = (jnp.asarray(x, jnp.bfloat16) for x in inputs(case))
    (out, lse), pullback = jax.vjp(functools.partial(reference_attention, causal=case.causal, return_lse=True),
                                   q, k, v)
    naive = dict(zip(NAMES, (out, lse, *pullback((dout, jnp.zeros_like(lse))))))
    return naive, float64_attention(*inputs(case), case.causal)


@pytest.mark.parametrize("case", LOCKSTEP_CASES, ids=ids(LOCKSTEP_CASES))
def test_mosaic_ring_schedule_meets_the_flash_rule(case):
    naive, exact = _naive_and_exact(case)
    assert_flash_rule(_lockstep_results(case, "pallas_hopper"), naive, exact)


def test_lockstep_rule_fails_a_piece_lse_off_by_one_row_block(monkeypatch):
    """Negative control: every pair backward given its LSE slice rolled by one 64-row block breaks the rule (the
    reference pair math, so the control costs seconds: the harness and the rule are what it checks)."""
    ring_module = importlib.import_module("jax_impl.ring_attention")

    def shifted(dout, q, k, v, out, lse, **kwargs):
        return flash_attention_backward(dout, q, k, v, out, jnp.roll(lse, 64, axis=2), **kwargs)
    case = LOCKSTEP_CASES[0]
    naive, exact = _naive_and_exact(case)
    assert_flash_rule(_lockstep_results(case, "reference"), naive, exact)  # the unshifted run passes
    monkeypatch.setattr(ring_module, "flash_attention_backward", shifted)
    with pytest.raises(AssertionError, match="dq|dk|dv"):
        assert_flash_rule(_lockstep_results(case, "reference"), naive, exact)


# ---------------------------------------------------------------------------------------------------------------
# The traced program inside shard_map: outputs typed as varying, no cotangent summed over the devices
# ---------------------------------------------------------------------------------------------------------------

def _mesh():
    return jax.make_mesh((2,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])


SPEC = PartitionSpec(None, "sp", None, None)
Q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
KV = jax.ShapeDtypeStruct((1, 256, 1, 64), jnp.bfloat16)


@pytest.mark.parametrize("backend", ["pallas_hopper", "pallas_portable", "reference"])
def test_pair_kernels_outputs_vary_over_the_mesh_axis_like_their_inputs(backend):
    varying = {}

    def pairs(q, k, v):
        out, lse = flash_attention_forward(q, k, v, causal=True, out_dtype=jnp.float32, backend=backend)
        grads = flash_attention_backward(q, q, k, v, out, lse, causal=True, backend=backend)
        varying.update(zip(("out", "lse", "dq", "dk", "dv"),
                           (jax.typeof(x).manual_axis_type.varying for x in (out, lse, *grads))))
        return out
    jax.eval_shape(jax.shard_map(pairs, mesh=_mesh(), in_specs=(SPEC,) * 3, out_specs=SPEC), Q, KV, KV)
    assert varying == dict.fromkeys(("out", "lse", "dq", "dk", "dv"), frozenset({"sp"}))


def _primitives(jaxpr) -> set[str]:
    """Names of every primitive in a jaxpr and the jaxprs nested in its equations' parameters."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    names |= _primitives(inner)
    return names


def _ring_gradient_primitives(backend: str, variant: str) -> set[str]:
    attention = jax.shard_map(functools.partial(ring_attention, axis_name="sp", backend=backend, variant=variant),
                              mesh=_mesh(), in_specs=(SPEC,) * 3, out_specs=SPEC)

    def forward_and_backward(q, k, v):
        out, pullback = jax.vjp(attention, q, k, v)
        return pullback(out)
    return _primitives(jax.make_jaxpr(forward_and_backward)(Q, KV, KV).jaxpr)


@pytest.mark.parametrize("variant", ["ring", "allgather"])
@pytest.mark.parametrize("backend", ["pallas_hopper", "pallas_portable"])
def test_ring_gradient_sums_no_cotangent_over_the_devices(backend, variant):
    # every collective of the program is the ring's own (ppermute; all_gather and reduce_scatter for allgather)
    assert not {name for name in _ring_gradient_primitives(backend, variant) if "psum" in name}


def test_ring_gradient_check_sees_an_invariant_kernel_output(monkeypatch):
    """Negative control: the Mosaic outputs left typed as the unchecked call types them (issue 32's bug) put a
    psum of the cotangent into the gradient program, which the check above then finds."""
    monkeypatch.setattr(importlib.import_module("jax_impl.kernels.tiles"), "declared_varying",
                        lambda result, declared: result)
    jax.clear_caches()  # the kernels' jitted wrappers would otherwise keep their correct traces
    try:
        assert {name for name in _ring_gradient_primitives("pallas_hopper", "ring") if "psum" in name}
    finally:
        monkeypatch.undo()
        jax.clear_caches()
