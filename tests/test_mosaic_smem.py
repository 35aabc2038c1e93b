"""Shared memory of the Hopper family's Mosaic GPU kernels (`jax_impl/kernels/hopper/config.py`), on CPU, compiling
nothing:
the accounting against the numbers GPUs reported and against Pallas's own resource estimate of the traced kernels;
the heuristic's configs fit every kernel of every call the JAX ring makes (P = 1..8, local lengths 256..256k,
both layouts and variants, causal or not, every head dim, dtype and out dtype, forward and every backward form);
the negative controls (configs that do not fit are flagged, and forced, raise one clear error before compiling);
the sweep's candidates all fit; the limit comes from the device.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, PartitionSpec

from jax_impl.kernels import flash_attention as flash_attention_module
from jax_impl.kernels.flash_attention import flash_attention_backward, flash_attention_forward
from jax_impl.kernels.hopper import backward as hopper_backward_module
from jax_impl.kernels.hopper import forward as hopper_forward_module
from jax_impl.kernels.hopper.backward import hopper_backward
from jax_impl.kernels.hopper.config import (BACKWARD_FORMS, SM90_SMEM_BYTES, HopperConfig, autotune_space,
                                            default_config, fits, smem_limit, smem_needs)
from jax_impl.kernels.hopper.forward import hopper_forward
from jax_impl.ring_attention import ring_attention

BF16, FP16, FP32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)
HEAD_DIMS_AND_DTYPES = [(64, BF16), (64, FP16), (128, BF16), (128, FP16)]
WORLDS = range(1, 9)
LOCAL_LENGTHS = [2 ** n for n in range(8, 19)]  # 256 .. 256k


# ---------------------------------------------------------------------------------------------------------------
# The accounting
# ---------------------------------------------------------------------------------------------------------------

def test_accounting_reproduces_what_the_gpus_reported():
    """Mosaic GPU's own smem_bytes in launch errors on an H200: issue 32's ring call (the default config's
    three full-attention warpgroups with the ring's fp32 out tile at D=128) and the 2026-11-23 sweep's dQ kernel
    rows (compare/results/kernels-mosaic-2026-11-23-h200-matrix/sweep-16k.json)."""
    full_fp32 = dict(head_dim=128, dtype=BF16, out_dtype=FP32, causal=False)
    assert smem_needs(HopperConfig(full_compute_warpgroups=3, persistent=True), **full_fp32)["forward"] == 280688
    causal = dict(head_dim=128, dtype=BF16, causal=True)
    assert smem_needs(HopperConfig(dq_block_q=128, dq_block_kv=64), **causal)["backward dQ"] == 264320
    assert smem_needs(HopperConfig(bwd_num_stages=3), **causal)["backward dQ"] == 297120


def _launched_kernels(jaxpr):
    """The Mosaic GPU kernel calls in a traced jaxpr: (their kernel jaxpr, their reduction_scratch_bytes)."""
    for eqn in jaxpr.eqns:
        params = eqn.params
        if "compiler_params" in params and ("jaxprs" in params or "jaxpr" in params):
            compiler_params = params["compiler_params"]
            compiler_params = compiler_params.get("mosaic_gpu", compiler_params) if isinstance(
                compiler_params, dict) else compiler_params
            kernel = params["jaxprs"][0] if "jaxprs" in params else params["jaxpr"]
            yield getattr(kernel, "jaxpr", kernel), compiler_params.reduction_scratch_bytes
            continue
        for param in params.values():
            for inner in param if isinstance(param, (tuple, list)) else (param,):
                if hasattr(inner, "eqns") or hasattr(getattr(inner, "jaxpr", None), "eqns"):
                    yield from _launched_kernels(getattr(inner, "jaxpr", inner))


def _pallas_estimates(fn, *args) -> list[int]:
    """Bytes Mosaic GPU would launch each kernel of `fn(*args)` with, from Pallas's own resource estimate of the
    traced kernels (private: jax/_src/pallas/mosaic_gpu/lowering.py) plus 8 bytes a barrier, as Mosaic GPU's
    launch adds them."""
    lowering = pytest.importorskip("jax._src.pallas.mosaic_gpu.lowering")
    mosaic = pytest.importorskip("jax.experimental.mosaic.gpu")
    if not hasattr(lowering, "_estimate_resources"):
        pytest.skip("this jax's Pallas Mosaic GPU lowering has no resource estimate to compare with")
    estimates = []
    for kernel, reduction_bytes in _launched_kernels(jax.make_jaxpr(fn)(*args).jaxpr):
        context = lowering.ResourceEstimatorContext(reduction_scratch_bytes=reduction_bytes,
                                                    axis_names=lowering._AxisNames(grid=()),
                                                    lowering_semantics=mosaic.LoweringSemantics.Lane)
        resources = lowering._estimate_resources(context, kernel)
        estimates.append(resources.smem_scratch_bytes + 8 * sum(b.num_barriers for b in resources.barriers))
    assert estimates, "no Mosaic GPU kernel found in the traced call"
    return estimates


# (config changes, head dim, causal, out dtype, Sq, Sk): every kernel and form (both orientations of the dK/dV step,
# the descriptors rebuilt by default and hoisted), the fp32 out tile and the reused one, both forward schedules, extra
# stages, larger dQ tiles, and lengths short enough to clamp the stages.
ESTIMATE_CASES = [
    (dict(full_compute_warpgroups=3, persistent=True), 128, False, FP32, 1024, 1024),
    (dict(full_compute_warpgroups=3, persistent=True), 128, False, BF16, 1024, 1024),
    (dict(full_compute_warpgroups=3), 64, True, FP32, 1024, 2048),
    (dict(num_stages=3, bwd_num_stages=3), 128, True, BF16, 1024, 1024),
    (dict(dq_block_q=128, dq_block_kv=64), 128, False, BF16, 777, 1000),
    (dict(bwd_form="one_kernel"), 128, True, BF16, 1024, 1024),
    (dict(bwd_form="one_kernel_private"), 64, False, FP32, 1024, 1024),
    (dict(bwd_form="one_kernel", bwd_query_rows=True), 128, True, BF16, 1024, 1024),
    (dict(bwd_query_rows=True, bwd_rebuild_descriptors=False), 64, False, FP32, 1024, 1024),
    (dict(bwd_form="one_kernel_private", bwd_query_rows=True), 128, False, BF16, 1024, 1024),
    (dict(num_stages=3, bwd_num_stages=3), 64, True, BF16, 64, 100),
]


@pytest.mark.parametrize("change,head_dim,causal,out_dtype,seq_q,seq_k", ESTIMATE_CASES)
def test_accounting_equals_pallas_own_estimate(monkeypatch, change, head_dim, causal, out_dtype, seq_q, seq_k):
    """The kernels traced for a GPU (interpret=False; tracing compiles nothing) and Pallas's estimate of their
    scratch agree with `smem_needs` kernel by kernel, over the limit or not (the check is turned off to trace)."""
    monkeypatch.setattr(hopper_forward_module, "check_smem", lambda *args, **kwargs: None)
    monkeypatch.setattr(hopper_backward_module, "check_smem", lambda *args, **kwargs: None)
    config = HopperConfig(**change)
    q = jax.ShapeDtypeStruct((1, seq_q, 4, head_dim), BF16)
    kv = jax.ShapeDtypeStruct((1, seq_k, 2, head_dim), BF16)
    lse = jax.ShapeDtypeStruct((1, 4, seq_q), FP32)
    forward = functools.partial(hopper_forward, causal=causal, softmax_scale=0.1, out_dtype=out_dtype, config=config,
                                interpret=False)
    backward = functools.partial(hopper_backward, causal=causal, softmax_scale=0.1, config=config, interpret=False)
    estimated = _pallas_estimates(forward, q, kv, kv) + _pallas_estimates(backward, q, q, kv, kv, q, lse)
    needs = smem_needs(config, head_dim=head_dim, dtype=BF16, out_dtype=out_dtype, causal=causal, seq_q=seq_q,
                       seq_k=seq_k, group=2)
    assert estimated == list(needs.values())


# ---------------------------------------------------------------------------------------------------------------
# The heuristic against every call of the JAX ring
# ---------------------------------------------------------------------------------------------------------------

def _recorded_ring_calls(monkeypatch, world: int, local_len: int, *, causal: bool, layout: str, variant: str):
    """The Mosaic kernel calls (kind, Sq, Sk, causal, out dtype, config) one forward and backward of the ring
    makes on rank-local shapes (D=128, bf16, GQA 2:1), recorded by tracing it (every `lax.cond` / `lax.switch`
    branch is traced, so every rank's pieces are there) over an abstract mesh of `world` devices."""
    calls = []

    def forward(q, k, v, *, causal, softmax_scale, out_dtype, config, interpret, spans=None):
        # documents (none here) run the causal schedule, whose scratch the causal calls measure
        calls.append(("forward", q.shape[1], k.shape[1], causal, jnp.dtype(out_dtype), config))
        return jnp.zeros_like(q, out_dtype), jnp.zeros_like(q[..., 0], jnp.float32).transpose(0, 2, 1)

    def backward(dout, q, k, v, out, lse, *, causal, softmax_scale, config, interpret, spans=None):
        calls.append(("backward", q.shape[1], k.shape[1], causal, None, config))
        return tuple(jnp.zeros_like(x, jnp.float32) for x in (q, k, v))

    monkeypatch.setattr(flash_attention_module, "hopper_forward", forward)
    monkeypatch.setattr(flash_attention_module, "hopper_backward", backward)
    mesh = AbstractMesh((world,), ("sp",))
    tokens = PartitionSpec(None, "sp", None, None)
    attend = jax.shard_map(functools.partial(ring_attention, causal=causal, layout=layout, variant=variant,
                                             backend="pallas_hopper"),
                           mesh=mesh, in_specs=(tokens,) * 3, out_specs=tokens)
    q = jax.ShapeDtypeStruct((1, world * local_len, 2, 128), BF16)
    kv = jax.ShapeDtypeStruct((1, world * local_len, 1, 128), BF16)
    with jax.sharding.use_abstract_mesh(mesh):
        jax.make_jaxpr(jax.grad(lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))(
            q, kv, kv)
    return calls


@pytest.fixture(scope="module")
def ring_calls():
    """Every distinct Mosaic kernel call of the ring over P, local length, layout, variant and causal."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        found = set()
        for world in WORLDS:
            for local_len in LOCAL_LENGTHS:
                for layout in ("contiguous", "zigzag"):
                    for variant in ("ring", "allgather"):
                        for causal in (True, False):
                            found.update(_recorded_ring_calls(monkeypatch, world, local_len, causal=causal,
                                                              layout=layout, variant=variant))
        return found


def test_the_ring_asks_for_its_pieces_with_the_configs_that_fit(ring_calls):
    """What the walk below checks is what the ring asks: its diagonal blocks, the zigzag's half-by-half squares
    and the allgather's query runs against key prefixes all appear, and the config each call got is the heuristic
    for its out dtype: the ring's fp32 partials of full attention at D=128 on two compute warpgroups."""
    shapes = {(kind, seq_q, seq_k, causal) for kind, seq_q, seq_k, causal, _, _ in ring_calls}
    assert ("forward", 4096, 4096, True) in shapes and ("backward", 4096, 4096, True) in shapes  # diagonal
    assert ("forward", 2048, 2048, False) in shapes  # a zigzag off-diagonal square
    assert ("forward", 2048, 8 * 4096, True) in shapes  # an allgather run against the whole prefix, P=8
    for _, _, _, _, out_dtype, config in ring_calls:  # out dtype None: a backward call
        assert config == default_config(128, dtype=BF16, out_dtype=out_dtype)
    fp32_full = {config for kind, _, _, causal, out_dtype, config in ring_calls
                 if kind == "forward" and out_dtype == FP32 and not causal}
    assert fp32_full and all(config.forward_schedule(False)[1] == 2 for config in fp32_full)


@pytest.mark.parametrize("head_dim,dtype", HEAD_DIMS_AND_DTYPES, ids=[f"d{d}-{t.name}" for d, t in
                                                                       HEAD_DIMS_AND_DTYPES])
def test_default_configs_fit_every_ring_call(ring_calls, head_dim, dtype):
    """Each piece shape the ring produces, forward in the input's dtype and in float32, backward in every form
    of the heuristic's config, with and without documents: every kernel within sm90's 227 KiB."""
    over = []
    for kind, seq_q, seq_k, causal, _, _ in ring_calls:
        for out_dtype, documents in itertools.product((dtype, FP32), (False, True)):
            config = default_config(head_dim, dtype=dtype, out_dtype=out_dtype, documents=documents)
            forms = [config] if kind == "forward" else [dataclasses.replace(config, bwd_form=form)
                                                        for form in BACKWARD_FORMS]
            for form in forms:
                needs = smem_needs(form, head_dim=head_dim, dtype=dtype, out_dtype=out_dtype, causal=causal,
                                   seq_q=seq_q, seq_k=seq_k, group=2)
                over += [(kind, seq_q, seq_k, causal, out_dtype.name, form.bwd_form, kernel, needed)
                         for kernel, needed in needs.items() if needed > SM90_SMEM_BYTES]
    assert not over, over[:5]


# ---------------------------------------------------------------------------------------------------------------
# Negative controls, the sweep's candidates, the device's limit
# ---------------------------------------------------------------------------------------------------------------

def test_the_default_takes_two_full_warpgroups_only_where_three_do_not_fit():
    """Half-precision out keeps the measured-fastest full-attention schedule (three warpgroups, persistent at
    D=128: the out tile reuses Q's buffer); the ring's fp32 partials at D=128 take two, still persistent."""
    for head_dim in (64, 128):
        for dtype in (BF16, FP16):
            assert default_config(head_dim, dtype=dtype).forward_schedule(False)[1:] == (3, head_dim > 64)
            assert default_config(head_dim, dtype=dtype, out_dtype=FP32).forward_schedule(False)[1:] == (
                (2, True) if head_dim == 128 else (3, False))


def test_configs_that_do_not_fit_are_flagged():
    full_fp32 = dict(head_dim=128, dtype=BF16, out_dtype=FP32, causal=False)
    assert not fits(HopperConfig(full_compute_warpgroups=3), limit=SM90_SMEM_BYTES, **full_fp32)
    assert fits(HopperConfig(full_compute_warpgroups=3), limit=SM90_SMEM_BYTES, **full_fp32 | dict(out_dtype=BF16))
    assert not fits(HopperConfig(num_stages=4), limit=SM90_SMEM_BYTES, head_dim=128, dtype=BF16, causal=True)
    # stages follow the call: four K/V slots for a call of one 128-key block take one
    assert fits(HopperConfig(num_stages=4), limit=SM90_SMEM_BYTES, head_dim=128, dtype=BF16, causal=True,
                seq_q=128, seq_k=128)


def test_a_forced_config_that_does_not_fit_raises_before_compiling():
    """One clear ValueError naming the config, the kernel and the bytes, under the interpreter as on a GPU; no
    kernel is traced or run (the call returns at once)."""
    q = jnp.zeros((1, 384, 2, 128), BF16)
    kv = jnp.zeros((1, 384, 1, 128), BF16)
    three = HopperConfig(full_compute_warpgroups=3, persistent=True)
    with pytest.raises(ValueError, match=r"HopperConfig\(.*full_compute_warpgroups=3.* needs 280688 bytes of "
                                         r"shared memory in the Mosaic forward kernel .*float32 out.* over the "
                                         r"device's 232448"):
        flash_attention_forward(q, kv, kv, causal=False, out_dtype=jnp.float32, backend="pallas_hopper", config=three)
    lse = jnp.zeros((1, 2, 384), jnp.float32)
    with pytest.raises(ValueError, match=r"bwd_num_stages=3.* needs 297120 bytes .* backward dQ kernel"):
        flash_attention_backward(q, q, kv, kv, q, lse, causal=True, backend="pallas_hopper",
                                 config=HopperConfig(bwd_num_stages=3))


def test_autotune_space_holds_only_candidates_that_fit():
    for head_dim in (64, 128):
        for out_dtype in (BF16, FP32):
            space = autotune_space(head_dim, out_dtype=out_dtype)
            assert space[0] == default_config(head_dim, out_dtype=out_dtype)
            assert all(fits(config, limit=SM90_SMEM_BYTES, head_dim=head_dim, dtype=BF16, out_dtype=out_dtype,
                            causal=causal) for config in space for causal in (True, False))
    left_out = [dict(num_stages=3), dict(bwd_num_stages=3),
                dict(dq_block_q=128, dq_block_kv=64, bwd_form="two_kernel", bwd_query_rows=False)]
    base = default_config(128)
    for change in left_out:  # in the D=64 space, out of the D=128 one: the same function decides
        assert dataclasses.replace(default_config(64), **change) in autotune_space(64)
        assert dataclasses.replace(base, **change) not in autotune_space(128)
        assert not fits(dataclasses.replace(base, **change), limit=SM90_SMEM_BYTES, head_dim=128, dtype=BF16,
                        causal=True)


def test_the_limit_is_the_devices(monkeypatch):
    """Read where Mosaic GPU reads it; sm90's 227 KiB under the interpreter or where the device does not say; a
    limit no default fits is an error."""
    assert smem_limit(interpret=True) == SM90_SMEM_BYTES == 232448

    @dataclasses.dataclass
    class Device:
        shared_memory_per_block_optin: int

    monkeypatch.setattr(jax, "local_devices", lambda: [Device(200 * 1024)])
    assert smem_limit(interpret=False) == 200 * 1024
    assert smem_limit(interpret=True) == SM90_SMEM_BYTES
    with pytest.raises(ValueError, match="no Mosaic default fits"):  # the D=128 dQ kernel takes 231552
        default_config(128, limit=smem_limit(interpret=False))
    monkeypatch.setattr(jax, "local_devices", lambda: [object()])
    assert smem_limit(interpret=False) == SM90_SMEM_BYTES
