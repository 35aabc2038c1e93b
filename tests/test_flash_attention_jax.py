"""JAX FlashAttention (`jax_impl/kernels/flash_attention.py` and its Pallas kernels) against a float64 reference: out,
lse, dq, dk, dv over dtypes, causal/full, MHA/GQA, head dims and odd or unequal lengths; the pair-level contract
the ring uses (partials merged by lse, backward from the global out/lse); autodiff under jit and shard_map;
random shapes (hypothesis); configs and validation. On CPU the kernels run in Pallas interpret mode with small
blocks; `gpu`-marked tests run the Triton-compiled kernels at real sizes. Twin of
`tests/test_flash_attention_torch.py`: the cases both run, their inputs, the float64 answer and the tolerances
(with their reasons) are tests/kernel_twins.py's: the flash rule (max error vs float64 <= 2x the naive same-dtype
attention's + KERNEL_ATOL) for bf16/fp16, FP32_TOL for fp32 (float32 math in another summation order).
"""

from __future__ import annotations

import functools
import math

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import kernel_twins as twins
import numpy as np
import pytest
from hypothesis import given, settings
from jax.sharding import NamedSharding, PartitionSpec

from jax_impl.attention import reference_attention, reference_attention_backward, reference_attention_forward
from jax_impl.kernels import flash_attention as flash_attention_module
from jax_impl.kernels.flash_attention import (BACKENDS, flash_attention, flash_attention_backward,
                                              flash_attention_forward)
from jax_impl.kernels.hopper.config import HopperConfig
from jax_impl.kernels.portable.config import INTERPRET_CONFIG, KernelConfig, PortableConfig, default_config

NAMES = twins.NAMES
# Interpret-mode kernels are tiny loops; XLA's CPU optimisation passes dominate their compile time. (On a GPU
# the kernels are Triton-compiled and XLA keeps its defaults.)
FAST_COMPILE = ({"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
                if jax.default_backend() == "cpu" else {})
on_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs jax with a GPU backend")


def _inputs(batch, seq_q, seq_k, heads, kv_heads, head_dim, dtype, seed=0):
    """The twins' inputs (kernel_twins.inputs) as `dtype` arrays: q, k, v and an output cotangent."""
    case = twins.KernelCase(seq_q, seq_k, heads, kv_heads, head_dim, batch=batch)
    return [jnp.asarray(x).astype(dtype) for x in twins.inputs(case, jnp.dtype(dtype).name, seed)]


def _case_inputs(case: twins.KernelCase, dtype, seed=0):
    return _inputs(case.batch, case.seq_q, case.seq_k, case.heads, case.kv_heads, case.dim, dtype, seed)


def _named(results) -> dict:
    """(out, lse, dq, dk, dv) as kernel_twins' {name: array}."""
    return dict(zip(NAMES, results))


def _float64_attention(q, k, v, dout, *, causal, scale):
    """(out, lse, dq, dk, dv) in float64 numpy from the (already rounded) inputs: kernel_twins' exact answer."""
    exact = twins.float64_attention(*(np.asarray(x, np.float64) for x in (q, k, v, dout)), causal, scale)
    return tuple(exact[name] for name in NAMES)


def _jit(fn):
    return jax.jit(fn, compiler_options=FAST_COMPILE)


def _with_grads(attention, q, k, v, dout):
    """(out, lse, dq, dk, dv) of `attention(q, k, v) -> (out, lse)` under jit, gradients of sum(out * dout)."""
    def run(q, k, v, dout):
        (out, lse), pullback = jax.vjp(attention, q, k, v)
        return (out, lse, *pullback((dout, jnp.zeros_like(lse))))
    return _jit(run)(q, k, v, dout)


def _flash_rule_violations(got, naive, exact) -> dict[str, tuple[float, float]]:
    """{name: (our error, naive error)} breaking the flash rule (kernel_twins.flash_rule_violations)."""
    return twins.flash_rule_violations(_named(got), _named(naive), _named(exact))


def _assert_fp32_close(got, expected):
    twins.assert_fp32_close(_named(got), _named(expected))


def _flash_and_naive(q, k, v, dout, *, causal, scale=None, **flash_kwargs):
    flash = _with_grads(functools.partial(flash_attention, causal=causal, softmax_scale=scale, return_lse=True,
                                          **flash_kwargs), q, k, v, dout)
    naive = _with_grads(functools.partial(reference_attention, causal=causal, softmax_scale=scale, return_lse=True),
                        q, k, v, dout)
    return flash, naive


# ---------------------------------------------------------------------------------------------------------------
# Accuracy: the flash-attention rule against float64 (kernel_twins' cases)
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", twins.HALF_CASES, ids=twins.ids(twins.HALF_CASES))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
def test_flash_rule_against_float64(dtype, causal, case):
    q, k, v, dout = _case_inputs(case, dtype)
    flash, naive = _flash_and_naive(q, k, v, dout, causal=causal)
    exact = _float64_attention(q, k, v, dout, causal=causal, scale=1 / math.sqrt(case.dim))
    assert flash[0].dtype == dtype and flash[1].dtype == jnp.float32
    violations = _flash_rule_violations(flash, naive, exact)
    assert not violations, f"(ours, naive) errors beyond the rule: {violations}"
    twins.assert_unseen_rows_zero(_named(flash), _named(exact))


@pytest.mark.parametrize("case", twins.FP32_CASES, ids=twins.ids(twins.FP32_CASES))
def test_float32_matches_float64_like_float32_math(case):
    """fp32 inputs (the CPU model tests' path), causal with Sq != Sk; head dim 96 (padded to 128 inside) with
    GQA 3, and the widest head dim, 256."""
    q, k, v, dout = _case_inputs(case, jnp.float32, seed=3)
    flash = _with_grads(functools.partial(flash_attention, causal=True, return_lse=True), q, k, v, dout)
    _assert_fp32_close(flash, _float64_attention(q, k, v, dout, causal=True, scale=1 / math.sqrt(case.dim)))


@pytest.mark.parametrize("mistake", ["wrong_scale", "swapped_kv"])
def test_negative_control_fails_the_rule(mistake):
    """The rule has teeth: the kernel run with a wrong scale, or with k and v swapped, violates it."""
    q, k, v, dout = _case_inputs(twins.NEGATIVE_CONTROL, jnp.bfloat16)
    scale = 1 / math.sqrt(q.shape[-1])
    wrong_scale, (k_in, v_in) = ((twins.WRONG_SCALE_FACTOR * scale, (k, v)) if mistake == "wrong_scale"
                                 else (scale, (v, k)))
    flash = _with_grads(lambda q, k, v: flash_attention(q, k_in, v_in, softmax_scale=wrong_scale, return_lse=True),
                        q, k, v, dout)
    naive = _with_grads(functools.partial(reference_attention, return_lse=True), q, k, v, dout)
    assert "out" in _flash_rule_violations(flash, naive, _float64_attention(q, k, v, dout, causal=True, scale=scale))


def test_fully_masked_rows_are_zero_with_lse_minus_inf():
    q, k, v, dout = _case_inputs(twins.UNSEEN_ROWS, jnp.bfloat16)
    flash = _with_grads(functools.partial(flash_attention, causal=True, softmax_scale=0.2, return_lse=True),
                        q, k, v, dout)
    exact = _named(_float64_attention(q, k, v, dout, causal=True, scale=0.2))
    twins.assert_unseen_rows_zero(_named(flash), exact)
    assert (exact["lse"][:, :, :30] == -np.inf).all()  # query i sees key j iff j <= i - 30
    twins.max_errors(_named(flash), exact)  # lse -inf exactly on those rows, everything else finite


# ---------------------------------------------------------------------------------------------------------------
# Pair-level contract (what the ring calls)
# ---------------------------------------------------------------------------------------------------------------

def _ring_step_by_pairs(q, k, v, dout, *, backend):
    """The second half of a causal sequence (queries q) against its two key halves: the first half without a
    mask, itself causally. Returns (merged out, merged lse, dq, dk, dv) computed pair by pair as the ring does."""
    chunk = q.shape[1]
    halves = [(k[:, :chunk], v[:, :chunk], False), (k[:, chunk:], v[:, chunk:], True)]
    partials = [flash_attention_forward(q, kh, vh, causal=causal, out_dtype=jnp.float32, backend=backend)
                for kh, vh, causal in halves]
    lse = jnp.logaddexp(partials[0][1], partials[1][1])
    out = sum(jnp.exp(part_lse - lse).transpose(0, 2, 1)[..., None] * part_out for part_out, part_lse in partials)
    grads = [flash_attention_backward(dout, q, kh, vh, out, lse, causal=causal, backend=backend)
             for kh, vh, causal in halves]
    assert all(g.dtype == jnp.float32 for pair_grads in grads for g in pair_grads)
    (dq_first, dk_first, dv_first), (dq_self, dk_self, dv_self) = grads
    return (out, lse, dq_first + dq_self, jnp.concatenate([dk_first, dk_self], axis=1),
            jnp.concatenate([dv_first, dv_self], axis=1))


def _full_by_pair_functions(q, k, v, dout, *, backend):
    out, lse = flash_attention_forward(q, k, v, causal=True, out_dtype=jnp.float32, backend=backend)
    return (out, lse, *flash_attention_backward(dout, q, k, v, out, lse, causal=True, backend=backend))


@pytest.mark.parametrize("backend", ["pallas", "reference"])
def test_pairs_merged_by_lse_and_backward_from_global_stats_equal_full_attention(backend):
    """Causal ring step in fp32 (only the algebra is under test): partials merged by lse equal the full
    attention (causal, Sq = Sk / 2: bottom-right aligned), and per-pair backward from the merged out/lse sums
    to the full gradients."""
    q, k, v, dout = _inputs(1, 40, 80, 4, 2, 32, jnp.float32, seed=4)
    by_pairs = _jit(functools.partial(_ring_step_by_pairs, backend=backend))(q, k, v, dout)
    full = _jit(functools.partial(_full_by_pair_functions, backend=backend))(q, k, v, dout)
    for name, a, b in zip(NAMES, by_pairs, full):
        np.testing.assert_allclose(a, b, **twins.FP32_TOL, err_msg=name)


def test_pallas_pairs_match_reference_pairs_with_half_inputs_and_fp32_out():
    """bf16 pair forward with out_dtype float32 and backward from a bf16 global out: same contract as the
    reference pair functions (fp32 math on the same rounded inputs); a few bf16 ulps apart since the kernel
    rounds P to bf16 before the PV matmul and the reference does not (kernel_twins.HALF_P_TOL)."""
    q, k, v, dout = _inputs(1, 50, 50, 4, 1, 64, jnp.bfloat16, seed=5)

    def pairs(q, k, v, dout, backend):
        out, lse = flash_attention_forward(q, k, v, causal=True, out_dtype=jnp.float32, backend=backend)
        grads = flash_attention_backward(dout, q, k, v, out.astype(jnp.bfloat16), lse, causal=True, backend=backend)
        return out, lse, *grads

    results = {backend: _jit(functools.partial(pairs, backend=backend))(q, k, v, dout)
               for backend in ("pallas", "reference")}
    assert all(x.dtype == jnp.float32 for x in results["pallas"])
    for name, a, b in zip(NAMES, results["pallas"], results["reference"]):
        np.testing.assert_allclose(a, b, **twins.HALF_P_TOL, err_msg=name)


# ---------------------------------------------------------------------------------------------------------------
# Autodiff, jit, shard_map
# ---------------------------------------------------------------------------------------------------------------

def _loss(attention):
    return lambda q, k, v: jnp.sum(jnp.sin(attention(q, k, v)))


def test_grad_under_jit_equals_reference_grad():
    q, k, v, _ = _inputs(2, 33, 50, 4, 2, 32, jnp.float32, seed=6)
    ours = _jit(jax.grad(_loss(flash_attention), argnums=(0, 1, 2)))(q, k, v)
    reference = jax.grad(_loss(reference_attention), argnums=(0, 1, 2))(q, k, v)
    for name, a, b in zip(("dq", "dk", "dv"), ours, reference):
        np.testing.assert_allclose(a, b, **twins.FP32_TOL, err_msg=name)


def test_lse_is_non_differentiable():
    """flash_attention hands lse out under stop_gradient: a loss on lse alone has zero gradient."""
    q, k, v, _ = _inputs(1, 20, 20, 2, 2, 16, jnp.float32, seed=7)
    grads = jax.grad(lambda q, k, v: jnp.sum(flash_attention(q, k, v, return_lse=True)[1]), argnums=(0, 1, 2))(q, k, v)
    assert all(not np.any(g) for g in grads)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_inside_shard_map_over_batch(causal):
    """Each device runs the kernel on its batch shard (as the ring calls it per device), forward and grad, with
    shard_map's varying-axes check on (causal and full loops lower differently in the interpreter)."""
    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    q, k, v, _ = _inputs(2, 24, 24, 2, 1, 16, jnp.float32, seed=8)
    q, k, v = (jax.device_put(x, NamedSharding(mesh, PartitionSpec("data"))) for x in (q, k, v))
    attention = functools.partial(flash_attention, causal=causal)
    sharded = jax.shard_map(attention, mesh=mesh, in_specs=PartitionSpec("data"), out_specs=PartitionSpec("data"))
    out = _jit(sharded)(q, k, v)
    grads = _jit(jax.grad(_loss(sharded), argnums=(0, 1, 2)))(q, k, v)
    reference = functools.partial(reference_attention, causal=causal)
    np.testing.assert_allclose(out, reference(q, k, v), **twins.FP32_TOL)
    for a, b in zip(grads, jax.grad(_loss(reference), argnums=(0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(a, b, **twins.FP32_TOL)


# ---------------------------------------------------------------------------------------------------------------
# Random shapes
# ---------------------------------------------------------------------------------------------------------------

def _pallas_and_reference_pairs(q, k, v, dout, *, causal, scale):
    results = []
    for forward, backward in ((flash_attention_forward, flash_attention_backward),
                              (reference_attention_forward, reference_attention_backward)):
        out, lse = forward(q, k, v, causal=causal, softmax_scale=scale)
        results.append((out, lse, *backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale)))
    return results


@settings(max_examples=5, deadline=None, derandomize=True)
@given(batch=st.integers(1, 2), seq_q=st.integers(1, 70), seq_k=st.integers(1, 70), kv_heads=st.integers(1, 2),
       group=st.sampled_from([1, 2, 3]), head_dim=st.sampled_from([8, 16, 48, 64]), causal=st.booleans())
def test_random_shapes_match_reference_pairs(batch, seq_q, seq_k, kv_heads, group, head_dim, causal):
    """Any shape: the Pallas pair functions equal the fp32 reference pair functions (fp32 inputs)."""
    q, k, v, dout = _inputs(batch, seq_q, seq_k, group * kv_heads, kv_heads, head_dim, jnp.float32, seed=seq_q)
    ours, reference = _jit(functools.partial(_pallas_and_reference_pairs, causal=causal,
                                             scale=1 / math.sqrt(head_dim)))(q, k, v, dout)
    np.testing.assert_array_equal(np.isneginf(ours[1]), np.isneginf(reference[1]))
    finite = np.isfinite(reference[1])
    ours, reference = list(ours), list(reference)
    ours[1], reference[1] = np.where(finite, ours[1], 0), np.where(finite, reference[1], 0)
    _assert_fp32_close(ours, reference)


# ---------------------------------------------------------------------------------------------------------------
# Configuration and validation
# ---------------------------------------------------------------------------------------------------------------

def _forward_grids(config, q, k, v) -> list[tuple]:
    """The grids of the pallas_calls one traced forward launches with `config` (inside its jitted kernels)."""
    def grids(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                yield tuple(eqn.params["grid_mapping"].grid)
            for param in eqn.params.values():
                if hasattr(param, "eqns") or hasattr(param, "jaxpr"):
                    yield from grids(getattr(param, "jaxpr", param))

    return list(grids(jax.make_jaxpr(functools.partial(flash_attention_forward, causal=True, config=config))(
        q, k, v).jaxpr))


def test_config_is_an_argument_and_none_means_the_heuristic():
    """A PortableConfig reaches the kernels (its block_q sets the forward grid) and computes the same attention; no
    config means `default_config`; nothing outside the call changes."""
    q, k, v, dout = _inputs(1, 40, 40, 2, 2, 32, jnp.float32, seed=9)
    custom = PortableConfig(KernelConfig(16, 16, 4, 1), KernelConfig(16, 16, 4, 1), KernelConfig(16, 16, 4, 1))
    assert default_config(32, jnp.float32, interpret=True) == INTERPRET_CONFIG != custom
    assert _forward_grids(custom, q, k, v) == [(3, 1, 2)]  # 40 query rows in blocks of 16
    assert _forward_grids(None, q, k, v) == _forward_grids(INTERPRET_CONFIG, q, k, v) == [(2, 1, 2)]  # of 32
    flash = _with_grads(functools.partial(flash_attention, causal=True, return_lse=True, config=custom),
                        q, k, v, dout)
    reference = _with_grads(functools.partial(reference_attention, causal=True, return_lse=True), q, k, v, dout)
    _assert_fp32_close(flash, reference)


HOPPER_SHAPED = dict(q=(1, 8, 4, 64), k=(1, 8, 2, 64), dtype=jnp.bfloat16)  # a call the Hopper family serves


@pytest.mark.parametrize("backend, config, shape, message", [
    ("pallas", HopperConfig(), {}, "config is a HopperConfig, the hopper family's, but the portable family serves"),
    ("pallas_portable", HopperConfig(), HOPPER_SHAPED,
     "config is a HopperConfig, the hopper family's, but the portable family serves this call"),
    ("pallas_hopper", INTERPRET_CONFIG, HOPPER_SHAPED,
     "config is a PortableConfig, the portable family's, but the hopper family serves this call"),
    ("pallas_portable", KernelConfig(16, 16, 4, 1), {}, "config must be a PortableConfig, a HopperConfig or None"),
    ("reference", INTERPRET_CONFIG, {}, "takes none"),
])
def test_config_of_the_wrong_kind_is_refused(backend, config, shape, message):
    with pytest.raises(ValueError, match=message):
        flash_attention(*_arrays(**shape), backend=backend, config=config)


def test_config_of_the_portable_family_is_refused_where_pallas_picks_the_hopper_family(monkeypatch):
    """Under the automatic "pallas" the family is the inputs' and the device's (here as on an sm90 GPU): a
    PortableConfig is then a ValueError naming both families, before anything compiles."""
    monkeypatch.setattr(flash_attention_module, "_on_hopper", lambda: True)
    message = "config is a PortableConfig, the portable family's, but the hopper family serves this call"
    with pytest.raises(ValueError, match=message):
        flash_attention(*_arrays(**HOPPER_SHAPED), backend="pallas", config=INTERPRET_CONFIG)
    with pytest.raises(ValueError, match=message):
        flash_attention_forward(*_arrays(**HOPPER_SHAPED), causal=True, config=INTERPRET_CONFIG)


def _arrays(q=(1, 8, 4, 16), k=(1, 8, 2, 16), v=None, dtype=jnp.float32):
    return (jnp.zeros(q, dtype), jnp.zeros(k, dtype), jnp.zeros(v or k, dtype))


BAD_CALLS = {
    "q_ndim": (lambda: flash_attention(jnp.zeros((8, 4, 16)), *_arrays()[1:]), "q must be 4-D"),
    "k_dtype": (lambda: flash_attention(*_arrays(dtype=jnp.int32)), "q dtype"),
    "mixed_dtype": (lambda: flash_attention(_arrays()[0].astype(jnp.bfloat16), *_arrays()[1:]), "share a dtype"),
    "heads": (lambda: flash_attention(*_arrays(q=(1, 8, 3, 16))), r"multiple of k/v heads"),
    "batch": (lambda: flash_attention(*_arrays(k=(2, 8, 2, 16))), "batch"),
    "head_dim_mismatch": (lambda: flash_attention(*_arrays(k=(1, 8, 2, 32))), "head_dim"),
    "head_dim_too_big": (lambda: flash_attention(*_arrays(q=(1, 8, 4, 512), k=(1, 8, 2, 512))), "head_dim"),
    "kv_shape": (lambda: flash_attention(*_arrays(v=(1, 9, 2, 16))), "k and v"),
    "empty_seq": (lambda: flash_attention(*_arrays(q=(1, 0, 4, 16))), "sequence lengths"),
    "scale": (lambda: flash_attention(*_arrays(), softmax_scale=-1.0), "softmax_scale"),
    "causal": (lambda: flash_attention(*_arrays(), causal="yes"), "causal"),
    "backend": (lambda: flash_attention(*_arrays(), backend="triton"), "backend must be one of"),
    "out_dtype": (lambda: flash_attention_forward(*_arrays(), causal=True, out_dtype=jnp.int8), "out_dtype"),
    "dout_shape": (lambda: flash_attention_backward(jnp.zeros((1, 7, 4, 16)), *_arrays(), jnp.zeros((1, 8, 4, 16)),
                                                    jnp.zeros((1, 4, 8)), causal=True), "dout shape"),
    "out_shape": (lambda: flash_attention_backward(jnp.zeros((1, 8, 4, 16)), *_arrays(), jnp.zeros((1, 8, 4, 8)),
                                                   jnp.zeros((1, 4, 8)), causal=True), "out shape"),
    "lse_shape": (lambda: flash_attention_backward(jnp.zeros((1, 8, 4, 16)), *_arrays(), jnp.zeros((1, 8, 4, 16)),
                                                   jnp.zeros((1, 8, 4)), causal=True), "lse shape"),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_validation_errors_name_the_argument(case):
    call, message = BAD_CALLS[case]
    with pytest.raises(ValueError, match=message):
        call()


def test_backends_listed_and_cudnn_refused_off_gpu():
    assert BACKENDS == ("pallas", "pallas_portable", "pallas_hopper", "reference", "cudnn")
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="needs a CUDA GPU"):
            flash_attention(*_arrays(dtype=jnp.bfloat16), backend="cudnn")


# ---------------------------------------------------------------------------------------------------------------
# GPU: Triton-compiled kernels at real sizes (reference in float32 on the device: its error is ~1e-6, far below
# the bf16 errors the rule compares)
# ---------------------------------------------------------------------------------------------------------------

GPU_SHAPES = [(2, 1031, 1031, 8, 2, 128), (1, 4096, 4096, 8, 8, 64), (1, 2048, 2048, 4, 1, 32),
              (1, 1000, 3000, 4, 2, 128), (1, 2048, 2048, 4, 4, 256)]


def _device_exact(q, k, v, dout, causal):
    """(out, lse, dq, dk, dv) from the reference pair functions on float32 copies of the rounded inputs."""
    f32 = [x.astype(jnp.float32) for x in (q, k, v, dout)]
    scale = 1 / math.sqrt(q.shape[-1])
    out, lse = reference_attention_forward(*f32[:3], causal=causal, softmax_scale=scale)
    grads = reference_attention_backward(f32[3], *f32[:3], out, lse, causal=causal, softmax_scale=scale)
    return [np.asarray(x, np.float64) for x in (out, lse, *grads)]


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("batch,seq_q,seq_k,heads,kv_heads,head_dim", GPU_SHAPES)
def test_gpu_flash_rule(batch, seq_q, seq_k, heads, kv_heads, head_dim, causal):
    q, k, v, dout = _inputs(batch, seq_q, seq_k, heads, kv_heads, head_dim, jnp.bfloat16, seed=seq_q)
    flash, naive = _flash_and_naive(q, k, v, dout, causal=causal)
    assert not _flash_rule_violations(flash, naive, _device_exact(q, k, v, dout, causal))


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gpu_cudnn_pairs_follow_the_contract(causal):
    """cuDNN's lse is our natural-log lse, and its backward from a supplied out/lse meets the rule."""
    q, k, v, dout = _inputs(1, 2048, 2048, 8, 2, 128, jnp.bfloat16, seed=11)
    out, lse = flash_attention_forward(q, k, v, causal=causal, out_dtype=jnp.float32, backend="cudnn")
    grads = flash_attention_backward(dout, q, k, v, out, lse, causal=causal, backend="cudnn")
    naive = _with_grads(functools.partial(reference_attention, causal=causal, return_lse=True), q, k, v, dout)
    assert not _flash_rule_violations((out, lse, *grads), naive, _device_exact(q, k, v, dout, causal))
