"""JAX ring attention (`jax_impl/ring_attention.py`) against single-device attention on identical inputs: out, lse,
dq, dk, dv for both layouts, both variants, causal and not, MHA and GQA, rings of 1, 2 and 4 emulated host devices
(conftest requests 4), a 2-D (fsdp x sp) mesh, the model's `attention_fn` use inside a user's shard_map, refused
lengths and arguments, negative controls, and the per-pair Pallas kernels (interpreted on CPU; real sizes on 4 GPUs
under the `gpu` marker).

Tolerances:
  FP32_* (fp32 inputs, backend="reference", vs autodiff of the naive fp32 attention on the whole sequence): both
    sides do exact float32 math and differ only in summation order (per-block softmax merged by log-sum-exp vs one
    softmax; per-pair gradient sums vs one einsum), a few ulps of O(1) values; observed <= 1e-6. A wrong mask or
    block loses whole score terms and moves results by >= 1e-2 (the negative controls assert that).
  Low precision (bf16 / Pallas): the flash-attention rule. The error against a float64 reference may be at most
    twice the error of the naive same-dtype attention (`reference_attention`, bf16 matmuls) plus BF16_ATOL (1e-3,
    a fraction of one bf16 ulp at the O(1) magnitudes here, as in the kernel tests) for results the naive path
    happens to get exactly right. Both sides round matmul inputs and P to bf16 in different orders and blockings;
    a ring that drops or double-counts a block is off by whole score terms, far more.
"""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from jax_impl.attention import reference_attention
from jax_impl.ring_attention import (_merge, gather_from_ring, ring_attention, ring_attention_sharded,
                                     shard_for_ring)
from weights.layout import LayoutError

FP32_ATOL = 2e-5
FP32_RTOL = 1e-5
BF16_ATOL = 1e-3
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
NAMES = ("out", "lse", "dq", "dk", "dv")


def _mesh(*sizes_and_names: tuple[int, str], devices=None):
    sizes, names = zip(*sizes_and_names)
    devices = (devices or jax.devices())[:math.prod(sizes)]
    return jax.make_mesh(sizes, names, axis_types=(jax.sharding.AxisType.Auto,) * len(sizes), devices=devices)


def _inputs(batch, seq, heads, kv_heads, head_dim, dtype=jnp.float32, seed=0):
    """q, k, v and an output cotangent, standard normal (scores of O(1), softmax neither flat nor one-hot)."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    shapes = [(batch, seq, heads, head_dim), (batch, seq, kv_heads, head_dim), (batch, seq, kv_heads, head_dim),
              (batch, seq, heads, head_dim)]
    return [jax.random.normal(key, shape, jnp.float32).astype(dtype) for key, shape in zip(keys, shapes)]


def _jit(fn):
    """jax.jit; on CPU with XLA's cheap optimisation level: these tests are dominated by compile time, and the
    programs are tiny (the compile options are XLA:CPU's, so GPUs keep the defaults)."""
    return jax.jit(fn, compiler_options=FAST_COMPILE if jax.default_backend() == "cpu" else None)


def _results_with_grads(attention):
    """fn(q, k, v, dout) -> (out, lse, dq, dk, dv) of `attention(q, k, v) -> (out, lse)`, gradients of
    sum(out * dout)."""
    def run(q, k, v, dout):
        (out, lse), pullback = jax.vjp(attention, q, k, v)
        return (out, lse, *pullback((dout, jnp.zeros_like(lse))))
    return run


def _with_grads(attention, q, k, v, dout):
    return _jit(_results_with_grads(attention))(q, k, v, dout)


def _ring_results(q, k, v, dout, mesh, **kwargs):
    kwargs.setdefault("backend", "reference")
    return _with_grads(functools.partial(ring_attention_sharded, mesh=mesh, return_lse=True, **kwargs), q, k, v, dout)


def _single_device_results(q, k, v, dout, causal):
    return _with_grads(functools.partial(reference_attention, causal=causal, return_lse=True), q, k, v, dout)


def _assert_fp32_close(got, expected):
    for name, a, b in zip(NAMES, got, expected):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=FP32_ATOL, rtol=FP32_RTOL, err_msg=name)


def _float64_attention(q, k, v, dout, causal):
    """(out, lse, dq, dk, dv) in float64 numpy, the exact answer the low-precision results are judged against."""
    q, k, v, dout = (np.asarray(x, np.float64) for x in (q, k, v, dout))
    group = q.shape[2] // k.shape[2]
    kr, vr = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    scores = np.einsum("bqhd,bkhd->bhqk", q, kr) / math.sqrt(q.shape[-1])
    if causal:
        scores = np.where(np.tril(np.ones(scores.shape[-2:], bool)), scores, -np.inf)
    lse = np.log(np.sum(np.exp(scores - scores.max(-1, keepdims=True)), -1)) + scores.max(-1)
    probs = np.exp(scores - lse[..., None])
    out = np.einsum("bhqk,bkhd->bqhd", probs, vr)
    dprobs = np.einsum("bqhd,bkhd->bhqk", dout, vr)
    dscores = probs * (dprobs - np.einsum("bqhd,bqhd->bhq", dout, out)[..., None]) / math.sqrt(q.shape[-1])
    dq = np.einsum("bhqk,bkhd->bqhd", dscores, kr)
    dk = np.einsum("bhqk,bqhd->bkhd", dscores, q)
    dv = np.einsum("bhqk,bqhd->bkhd", probs, dout)
    fold = lambda x: x.reshape(*x.shape[:2], k.shape[2], group, x.shape[-1]).sum(3)  # noqa: E731 (GQA heads)
    return out, lse, dq, fold(dk), fold(dv)


def _assert_flash_rule(got, naive, exact):
    """Each result's max error vs float64 at most twice the naive same-dtype attention's, plus BF16_ATOL."""
    for name, g, n, e in zip(NAMES, got, naive, exact):
        err = np.max(np.abs(np.asarray(g, np.float64) - e))
        naive_err = np.max(np.abs(np.asarray(n, np.float64) - e))
        assert err <= 2 * naive_err + BF16_ATOL, f"{name}: error {err:.3g} vs naive same-dtype {naive_err:.3g}"


# ---------------------------------------------------------------------------------------------------------------
# Exactness against single-device attention (fp32, reference per-pair math)
# ---------------------------------------------------------------------------------------------------------------

# Every layout x variant causal with GQA; MHA and non-causal on a spread of the others (non-causal work is a full
# block at every step whatever the layout, so it needs no full product).
FOUR_DEVICE_CASES = [
    ("zigzag", "ring", True, 2), ("zigzag", "allgather", True, 2), ("contiguous", "ring", True, 2),
    ("contiguous", "allgather", True, 2), ("zigzag", "ring", True, 4), ("contiguous", "allgather", True, 4),
    ("zigzag", "ring", False, 4), ("contiguous", "allgather", False, 2),
]


@pytest.mark.parametrize("layout,variant,causal,kv_heads", FOUR_DEVICE_CASES)
def test_four_device_ring_matches_single_device(layout, variant, causal, kv_heads):
    q, k, v, dout = _inputs(2, 32, 4, kv_heads, 8)
    got = _ring_results(q, k, v, dout, _mesh((4, "sp")), layout=layout, variant=variant, causal=causal)
    _assert_fp32_close(got, _single_device_results(q, k, v, dout, causal))


@pytest.mark.parametrize("world,layout,variant", [(1, "zigzag", "ring"), (1, "contiguous", "allgather"),
                                                  (2, "zigzag", "allgather"), (2, "contiguous", "ring")])
def test_small_rings_match_single_device(world, layout, variant):
    q, k, v, dout = _inputs(1, 8, 4, 2, 8, seed=1)
    got = _ring_results(q, k, v, dout, _mesh((world, "sp")), layout=layout, variant=variant, causal=True)
    _assert_fp32_close(got, _single_device_results(q, k, v, dout, True))


@pytest.mark.parametrize("variant", ["ring", "allgather"])
def test_two_dimensional_mesh_batch_over_fsdp(variant):
    """fsdp=2 x sp=2: each device holds one batch row's zigzag quarter; the ring runs over "sp" only."""
    q, k, v, dout = _inputs(2, 16, 4, 2, 8, seed=2)
    mesh = _mesh((2, "fsdp"), (2, "sp"))
    got = _ring_results(q, k, v, dout, mesh, batch_axis="fsdp", variant=variant)
    _assert_fp32_close(got, _single_device_results(q, k, v, dout, True))


@pytest.mark.parametrize("check_vma", [True, False])
def test_partial_is_a_model_attention_fn_inside_shard_map(check_vma):
    """The model's use: `partial(ring_attention, ...)` as `fn(q, k, v) -> out` inside the caller's own jitted
    shard_map, with the caller sharding and gathering through shard_for_ring / gather_from_ring."""
    q, k, v, dout = _inputs(2, 16, 4, 2, 8, seed=3)
    mesh, world = _mesh((4, "sp")), 4
    attention_fn = functools.partial(ring_attention, axis_name="sp", layout="zigzag", backend="reference")
    spec = PartitionSpec(None, "sp", None, None)
    sharded_fn = jax.shard_map(attention_fn, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=check_vma)

    def attend(q, k, v):
        out = sharded_fn(*(shard_for_ring(x, world, "zigzag") for x in (q, k, v)))
        return gather_from_ring(out, world, "zigzag"), jnp.zeros(q.shape[:1])  # no lse on this path

    got = _with_grads(attend, q, k, v, dout)
    expected = _single_device_results(q, k, v, dout, True)
    _assert_fp32_close(got[:1] + got[2:], expected[:1] + expected[2:])


def test_collectives_move_only_kv_heads():
    """GQA on the wire: every collective of either variant carries Hkv heads, never H; the ring variant only
    permutes, the allgather variant only gathers and reduce-scatters."""
    q, k, v, dout = _inputs(1, 16, 8, 2, 8)
    mesh = _mesh((4, "sp"))

    def collectives(variant):
        attend = functools.partial(ring_attention_sharded, mesh=mesh, variant=variant, backend="reference",
                                   return_lse=True)
        text = jax.jit(_results_with_grads(attend)).lower(q, k, v, dout).as_text()
        # (op, result shape) of each collective; a reduce_scatter's reduction region precedes its result type.
        return re.findall(r"stablehlo\.(collective_permute|all_gather|reduce_scatter)\b.*?->\s*tensor<([0-9x]+)x[a-z]",
                          text, flags=re.DOTALL)

    for variant, expected_ops in (("ring", {"collective_permute"}), ("allgather", {"all_gather", "reduce_scatter"})):
        found = collectives(variant)
        assert {op for op, _ in found} == expected_ops, (variant, found)
        assert all(shape.split("x")[-2] == "2" for _, shape in found), (variant, found)  # [..., heads, dim]


def test_local_copies_mode_removes_every_collective_and_only_where_asked():
    """The benchmark's compute-only twin of a ring call: no collective in the program, results wrong by design (a
    rank never sees the others' K/V); the same function without `local_copies` communicates."""
    q, k, v, dout = _inputs(1, 16, 4, 2, 8)
    mesh = _mesh((4, "sp"))
    for variant in ("ring", "allgather"):
        ring = functools.partial(ring_attention_sharded, mesh=mesh, variant=variant, backend="reference",
                                 return_lse=True)
        attend = _results_with_grads(ring)
        copying = _results_with_grads(functools.partial(ring, local_copies=True))
        local_text = jax.jit(copying).lower(q, k, v, dout).as_text()
        local = jax.jit(copying)(q, k, v, dout)
        assert not re.search(r"collective_permute|all_gather|reduce_scatter", local_text), variant
        assert re.search(r"collective_permute|all_gather", jax.jit(attend).lower(q, k, v, dout).as_text())
        real = _ring_results(q, k, v, dout, mesh, variant=variant)
        assert float(jnp.abs(local[0] - real[0]).max()) > 1e-2, variant  # it did skip the other ranks' blocks


# ---------------------------------------------------------------------------------------------------------------
# Refused input and negative controls
# ---------------------------------------------------------------------------------------------------------------

def test_unsplittable_lengths_are_refused_with_the_lengths_that_work():
    q, k, v, _ = _inputs(1, 18, 2, 2, 8)
    with pytest.raises(LayoutError, match=r"sequence length 18 .* multiple of 8 \(e\.g\. 16 or 24\)"):
        ring_attention_sharded(q, k, v, _mesh((4, "sp")), backend="reference")
    # Inside shard_map: 12 tokens split contiguously leave 3 per device, which zigzag cannot halve.
    q, k, v, _ = _inputs(1, 12, 2, 2, 8)
    spec = PartitionSpec(None, "sp", None, None)
    sharded = jax.shard_map(functools.partial(ring_attention, backend="reference"), mesh=_mesh((4, "sp")),
                            in_specs=(spec,) * 3, out_specs=spec)
    with pytest.raises(LayoutError, match=r"3 tokens on each of 4 devices.*multiple of 8 \(e\.g\. 8 or 16\)"):
        sharded(q, k, v)


def test_bad_arguments_are_refused_by_name():
    q, k, v, _ = _inputs(1, 8, 4, 2, 8)
    mesh = _mesh((4, "sp"))
    with pytest.raises(ValueError, match="layout"):
        ring_attention_sharded(q, k, v, mesh, layout="striped")
    with pytest.raises(ValueError, match="variant"):
        ring_attention_sharded(q, k, v, mesh, variant="tree")
    with pytest.raises(ValueError, match="axis_name 'seq'"):
        ring_attention_sharded(q, k, v, mesh, axis_name="seq")
    with pytest.raises(ValueError, match="axis_name 'sp' is not a mesh axis in scope"):
        ring_attention(q, k, v)
    with pytest.raises(ValueError, match="heads must be a multiple"):
        ring_attention_sharded(q[:, :, :3], k, v, mesh, backend="reference")


def test_wrong_layout_gives_wrong_answers():
    """Negative controls: gathering in the wrong order, or running the ring with the masks of another layout than
    its data's, must move the output far outside the tolerance (so the passing tests above are not vacuous)."""
    q, k, v, _ = _inputs(1, 16, 2, 2, 8, seed=4)
    mesh, world = _mesh((4, "sp")), 4
    spec = PartitionSpec(None, "sp", None, None)

    def ring_with_masks_of(layout, zigzag_data):
        return jax.shard_map(functools.partial(ring_attention, layout=layout, backend="reference"), mesh=mesh,
                             in_specs=(spec,) * 3, out_specs=spec)(*zigzag_data)

    @_jit
    def outputs(q, k, v):
        zigzag_data = [shard_for_ring(x, world, "zigzag") for x in (q, k, v)]
        right, wrong_masks = (ring_with_masks_of(layout, zigzag_data) for layout in ("zigzag", "contiguous"))
        return (gather_from_ring(right, world, "zigzag"), gather_from_ring(right, world, "contiguous"),
                gather_from_ring(wrong_masks, world, "zigzag"))

    right, wrong_order, wrong_masks = outputs(q, k, v)
    expected = np.asarray(reference_attention(q, k, v))
    np.testing.assert_allclose(right, expected, atol=FP32_ATOL, rtol=FP32_RTOL)
    assert np.max(np.abs(wrong_order - expected)) > 0.1
    assert np.max(np.abs(wrong_masks - expected)) > 0.1


def test_merge_of_two_empty_partials_stays_finite():
    """A row no block has reached yet (lse -inf on both sides) merges to output 0, lse -inf, never NaN."""
    out = jnp.ones((1, 2, 1, 4))
    lse = jnp.array([[[-jnp.inf, 0.5]]])
    merged_out, merged_lse = _merge(out * 0, jnp.full_like(lse, -jnp.inf), out, lse)
    assert not np.any(np.isnan(merged_out))
    np.testing.assert_array_equal(merged_out[:, 0], 0.0)
    np.testing.assert_array_equal(merged_out[:, 1], 1.0)
    np.testing.assert_array_equal(merged_lse, lse)


# ---------------------------------------------------------------------------------------------------------------
# The Pallas per-pair kernels (interpreted on CPU: tiny shapes)
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout,variant,causal", [("zigzag", "ring", True), ("contiguous", "allgather", True),
                                                   ("zigzag", "allgather", False)])
def test_pallas_pairs_bf16_meet_the_flash_rule(layout, variant, causal):
    q, k, v, dout = _inputs(1, 32, 4, 2, 16, dtype=jnp.bfloat16, seed=5)
    got = _ring_results(q, k, v, dout, _mesh((4, "sp")), layout=layout, variant=variant, causal=causal,
                        backend="pallas")
    naive = _single_device_results(q, k, v, dout, causal)
    _assert_flash_rule(got, naive, _float64_attention(q, k, v, dout, causal))


def test_pallas_pairs_fp32_match_single_device():
    """fp32 through the Pallas kernels (default backend): checks the ring's use of the kernels' contract (global
    out/lse into the backward, float32 partial outputs) rather than kernel precision."""
    q, k, v, dout = _inputs(1, 32, 4, 2, 16, seed=6)
    got = _ring_results(q, k, v, dout, _mesh((2, "sp")), backend="pallas")
    _assert_fp32_close(got, _single_device_results(q, k, v, dout, True))


# ---------------------------------------------------------------------------------------------------------------
# Real sizes on 4 GPUs
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["ring", "allgather"])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_four_gpu_ring_bf16_meets_the_flash_rule(layout, variant):
    """Llama-8B-like heads (32 query, 8 KV, dim 128) over 4096 tokens on 4 GPUs. The exact answer is the fp32
    reference at full matmul precision (float64 does not fit a GPU at this size; its error is ~1e-6, far below
    bf16's ~1e-2)."""
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if len(gpus) < 4:
        pytest.skip("needs 4 GPUs visible to JAX")
    q, k, v, dout = _inputs(1, 4096, 32, 8, 128, dtype=jnp.bfloat16, seed=7)
    got = _ring_results(q, k, v, dout, _mesh((4, "sp"), devices=gpus), layout=layout, variant=variant,
                        backend="pallas")
    naive = _single_device_results(q, k, v, dout, True)
    with jax.default_matmul_precision("highest"):
        exact = _single_device_results(*(x.astype(jnp.float32) for x in (q, k, v, dout)), True)
    _assert_flash_rule(got, naive, [np.asarray(x, np.float64) for x in exact])
