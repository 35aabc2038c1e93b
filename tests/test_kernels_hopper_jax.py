"""The Hopper family's Mosaic GPU kernels (`jax_impl/kernels/hopper/forward.py`, `backward.py`) through the
public API (`backend="pallas_hopper"`): out, lse, dq, dk, dv against float64 under the flash-attention rule,
the ring's pair contract (partials merged by lse, backward from the global out/lse), dispatch and config.

On CPU the kernels EXECUTE under Pallas's Mosaic GPU interpreter (TMA copies, barriers, warpgroup roles and
masks are the kernel's own code; only the matmul and layout-hint helpers marked INTERPRET differ), at tiny
shapes: the interpreter steps every warpgroup of every CTA in Python, so each case costs tens of seconds even
at one or two CTAs. `gpu`-marked tests run the compiled kernels on an sm90 GPU against the Triton-lowering
kernels and cuDNN.

Tolerances: the flash-attention rule of tests/kernel_twins.py (max error vs float64 <= 2x the
naive same-dtype implementation's + KERNEL_ATOL); its reasons are stated there.
"""

from __future__ import annotations

import functools
import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_flash_attention_jax import (_float64_attention, _flash_and_naive, _flash_rule_violations, _inputs, _jit,
                                      _ring_step_by_pairs, _with_grads)

from jax_impl.attention import reference_attention
from jax_impl.kernels.flash_attention import BACKENDS, flash_attention, flash_attention_forward
from jax_impl.kernels.hopper.config import (BACKWARD_FORMS, BACKWARD_PRODUCER_REGISTERS, GQA_HEAD_SPLITS, HopperConfig,
                                            autotune_space, default_config, hopper_unsupported, register_caps)

on_hopper = pytest.mark.skipif(
    jax.default_backend() != "gpu" or getattr(jax.devices()[0], "compute_capability", None) != "9.0",
    reason="needs an sm90 (Hopper) GPU")

# (Sq, Sk, H, Hkv, D, causal, backward form, query rows): odd tails on both sides; GQA 3:1 and 2:1; Sq > Sk causal
# has rows that see no key; D 64 (the interpreter's cost grows with D, and D 128 runs the same code at the GPU tests'
# sizes). The default (two-kernel, S^T) backward takes every case; the one-kernel forms, whose dQ takes an
# interpreter-only path (per-CTA or per-warpgroup slices, masked and summed), and the query-rows orientation
# (`HopperConfig.bwd_query_rows`: P and dS through shared memory) the case with rows that see no key and CTAs that
# skip query blocks, and query rows also the full-attention case (padded keys). The full-attention cases have 4 query
# blocks and 2 K/V tiles; in the one-kernel form's (with and without GQA) the second tile's walk starts 2 steps in
# and wraps (`HopperConfig.bwd_stagger`).
INTERPRET_CASES = [(77, 141, 3, 1, 64, True, "two_kernel", False), (141, 77, 2, 1, 64, True, "two_kernel", False),
                   (200, 150, 2, 2, 64, False, "two_kernel", False), (141, 77, 2, 1, 64, True, "one_kernel", False),
                   (141, 77, 2, 1, 64, True, "one_kernel_private", False),
                   (141, 77, 2, 1, 64, True, "two_kernel", True), (200, 150, 2, 2, 64, False, "two_kernel", True),
                   (200, 150, 2, 2, 64, False, "one_kernel", True), (200, 150, 2, 1, 64, False, "one_kernel", True),
                   (141, 77, 2, 1, 64, True, "one_kernel", True), (141, 77, 2, 1, 64, True, "one_kernel_private", True)]


def _assert_meets_the_rule(case, config: HopperConfig, seed: int = 0):
    """The Mosaic kernels at `config` on the bf16 inputs of `case` (Sq, Sk, H, Hkv, D, causal): out, lse and the
    gradients within the flash rule against float64."""
    seq_q, seq_k, heads, kv_heads, head_dim, causal = case
    q, k, v, dout = _inputs(1, seq_q, seq_k, heads, kv_heads, head_dim, jnp.bfloat16, seed=seed)
    exact = _float64_attention(q, k, v, dout, causal=causal, scale=1 / math.sqrt(head_dim))
    flash, naive = _flash_and_naive(q, k, v, dout, causal=causal, backend="pallas_hopper", config=config)
    assert not _flash_rule_violations(flash, naive, exact)


@pytest.mark.parametrize("seq_q,seq_k,heads,kv_heads,head_dim,causal,bwd_form,query_rows", INTERPRET_CASES,
                         ids=[f"q{a}-k{b}-h{c}:{d}-d{e}-{'causal' if f else 'full'}-{g}{'-query-rows' if h else ''}"
                              for a, b, c, d, e, f, g, h in INTERPRET_CASES])
def test_mosaic_flash_rule_against_float64(seq_q, seq_k, heads, kv_heads, head_dim, causal, bwd_form, query_rows):
    q, k, v, dout = _inputs(1, seq_q, seq_k, heads, kv_heads, head_dim, jnp.bfloat16)
    flash, naive = _flash_and_naive(q, k, v, dout, causal=causal, backend="pallas_hopper",
                                    config=HopperConfig(bwd_form=bwd_form, bwd_query_rows=query_rows))
    exact = _float64_attention(q, k, v, dout, causal=causal, scale=1 / math.sqrt(head_dim))
    assert flash[0].dtype == jnp.bfloat16 and flash[1].dtype == jnp.float32
    assert not _flash_rule_violations(flash, naive, exact)
    unseen = np.isneginf(exact[1]).transpose(0, 2, 1)  # [B, Sq, H]: rows that see no key get out 0 and dq 0
    assert not np.any(np.asarray(flash[0], np.float32)[unseen]) and not np.any(np.asarray(flash[2])[unseen])


# The GQA group's heads split among CTAs (`HopperConfig.bwd_head_splits`; Sq, Sk, H, Hkv, causal, form, query rows):
# causal with Sq > Sk in the two-kernel form, full with wrapped (staggered) walks in the one-kernel form; one CTA per
# query head in both (the group's 2 heads, GQA_HEAD_SPLITS asked).
HEAD_SPLIT_CASES = [(141, 77, 2, 1, True, "two_kernel", False), (200, 150, 2, 1, False, "one_kernel", True)]


@pytest.mark.parametrize("seq_q,seq_k,heads,kv_heads,causal,bwd_form,query_rows", HEAD_SPLIT_CASES,
                         ids=["causal-two-kernel", "full-one-kernel-query-rows"])
def test_mosaic_head_splits_meet_the_rule(seq_q, seq_k, heads, kv_heads, causal, bwd_form, query_rows):
    _assert_meets_the_rule((seq_q, seq_k, heads, kv_heads, 64, causal), HopperConfig(
        bwd_form=bwd_form, bwd_query_rows=query_rows, bwd_head_splits=GQA_HEAD_SPLITS))


# Forward-only forms (Sq, Sk, H, Hkv, causal, config changes, out dtype): three compute warpgroups (192-row tiles)
# with a tile longer than the sequence, and rows that see no key (warpgroups draining steps only later ones need);
# the persistent full-attention grid, also with three warpgroups set for full attention only (the interpreter runs
# 2 CTAs, so each walks several (batch, head, tile) items and the K/V ring and barrier phases run on across
# items), with keys padded past Sk and the ring's fp32 out.
FORWARD_FORMS = [(77, 141, 3, 1, True, dict(compute_warpgroups=3), jnp.bfloat16),
                 (141, 77, 2, 1, True, dict(compute_warpgroups=3), jnp.bfloat16),
                 (100, 150, 3, 1, False, dict(persistent=True), jnp.bfloat16),
                 (200, 150, 3, 1, False, dict(full_compute_warpgroups=3, persistent=True), jnp.float32)]


@pytest.mark.parametrize("seq_q,seq_k,heads,kv_heads,causal,change,out_dtype", FORWARD_FORMS,
                         ids=[f"q{a}-k{b}-h{c}:{d}-{'causal' if e else 'full'}-{'-'.join(map(str, f.items()))}"
                              for a, b, c, d, e, f, _ in FORWARD_FORMS])
def test_mosaic_forward_forms_meet_the_rule(seq_q, seq_k, heads, kv_heads, causal, change, out_dtype):
    q, k, v, dout = _inputs(1, seq_q, seq_k, heads, kv_heads, 64, jnp.bfloat16)
    exact = _float64_attention(q, k, v, dout, causal=causal, scale=1 / 8)
    out, lse = flash_attention_forward(q, k, v, causal=causal, out_dtype=out_dtype, backend="pallas_hopper",
                                       config=HopperConfig(**change))
    naive = reference_attention(q, k, v, causal=causal, return_lse=True)
    assert out.dtype == out_dtype
    # the forward alone: the gradients are the exact answer's own, so only out and lse can break the rule
    assert not _flash_rule_violations((out, lse, *exact[2:]), (*naive, *exact[2:]), exact)
    unseen = np.isneginf(exact[1]).transpose(0, 2, 1)
    assert not np.any(np.asarray(out)[unseen])


def test_mosaic_keys_padded_past_the_dq_step_meet_the_rule():
    """Sk a multiple of the dQ kernel's 64-key step but not of the dK/dV kernel's 128-key tile: the padding holds a
    whole dQ step no row sees, which the non-causal step range must leave out (before it did, the step was
    streamed but never consumed and the interpreted kernel waited forever)."""
    q, k, v, dout = _inputs(1, 100, 192, 2, 2, 64, jnp.bfloat16)
    flash, naive = _flash_and_naive(q, k, v, dout, causal=False, backend="pallas_hopper",
                                    config=HopperConfig(dq_block_kv=64))
    assert not _flash_rule_violations(flash, naive, _float64_attention(q, k, v, dout, causal=False, scale=1 / 8))


def test_mosaic_negative_control_fails_the_rule():
    """The rule has teeth for this kernel too: k and v swapped violates it."""
    q, k, v, dout = _inputs(1, 70, 90, 2, 2, 64, jnp.float16)
    flash = _with_grads(lambda q, k, v: flash_attention(q, v, k, return_lse=True, backend="pallas_hopper"),
                        q, k, v, dout)
    naive = _with_grads(functools.partial(reference_attention, return_lse=True), q, k, v, dout)
    assert _flash_rule_violations(flash, naive, _float64_attention(q, k, v, dout, causal=True, scale=1 / 8))


def test_backend_names_and_forced_hopper_errors():
    assert {"pallas", "pallas_hopper", "pallas_portable"} <= set(BACKENDS)
    q, k, v, _ = _inputs(1, 8, 8, 2, 2, 96, jnp.bfloat16)
    with pytest.raises(ValueError, match="head_dim 96"):
        flash_attention_forward(q, k, v, causal=True, backend="pallas_hopper")
    q32, k32, v32, _ = _inputs(1, 8, 8, 2, 2, 64, jnp.float32)
    with pytest.raises(ValueError, match="dtype float32"):
        flash_attention_forward(q32, k32, v32, causal=True, backend="pallas_hopper")
    assert hopper_unsupported(q32[..., :64].astype(jnp.bfloat16), 64) is None


def test_config_rejects_blocks_wgmma_cannot_tile():
    with pytest.raises(ValueError, match="multiple of 64"):
        HopperConfig(block_kv=96)
    with pytest.raises(ValueError, match="compute_warpgroups"):
        HopperConfig(compute_warpgroups=4)
    with pytest.raises(ValueError, match="full_block_kv"):
        HopperConfig(full_block_kv=100)
    with pytest.raises(ValueError, match="bwd_form"):
        HopperConfig(bwd_form="three_kernel")
    with pytest.raises(ValueError, match="bwd_block_q == bwd_block_kv"):
        HopperConfig(bwd_block_kv=128, bwd_form="one_kernel")
    with pytest.raises(ValueError, match="bwd_block_q == bwd_block_kv"):
        HopperConfig(bwd_block_kv=128, bwd_form="one_kernel_private")
    HopperConfig(bwd_block_kv=128)  # the two-kernel form takes unequal backward blocks
    for producer in (20, 44, 176):  # below setmaxnreg's 24, not a multiple of 8, above the 168 a thread starts with
        with pytest.raises(ValueError, match="bwd_producer_registers"):
            HopperConfig(bwd_producer_registers=producer)


def test_register_caps_never_ask_more_than_the_block_has():
    """setmaxnreg: an increase past what the other warpgroups released waits forever, so every split must sum
    within the registers a thread starts with times the warpgroups (168 x 3, 128 x 4)."""
    assert register_caps(2) == (40, 232) and register_caps(3) == (32, 160) and register_caps(2, 24) == (24, 240)
    assert HopperConfig(bwd_producer_registers=24).backward_registers == (24, 240)
    for compute, start in ((2, 168), (3, 128)):
        for producer in range(24, start + 1, 8):
            _, cap = register_caps(compute, producer)
            assert cap % 8 == 0 and producer + compute * cap <= start * (compute + 1), (compute, producer)


@pytest.mark.parametrize("bwd_form", BACKWARD_FORMS)
def test_every_backward_form_traces_for_gpus_inside_shard_map(bwd_form, monkeypatch):
    """The compiled (not interpreted) kernels' gradient inside `jax.shard_map`, as the ring takes it, traced on CPU
    with the interpreter switched off (tracing compiles nothing): the one-kernel forms' dQ, read back from the
    reduce-add Ref, was typed invariant over the mesh axis while its input varied, and the custom_vjp refused it
    (the two-kernel form, whose outputs the launch declares varying, is the control). No psum in the gradient
    either: an output typed invariant while its input varies makes JAX's transpose sum its cotangent over the
    devices (issue 32's wrong ring gradients)."""
    monkeypatch.setattr(importlib.import_module("jax_impl.kernels.flash_attention"), "_interpret", lambda: False)
    mesh = jax.make_mesh((4,), ("sp",))
    config = HopperConfig(bwd_form=bwd_form, bwd_query_rows=True)
    spec = jax.sharding.PartitionSpec(None, "sp")

    def loss(q):
        out = jax.shard_map(functools.partial(flash_attention, causal=True, backend="pallas_hopper", config=config),
                            mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)(q, q, q)
        return jnp.sum(out.astype(jnp.float32))
    q = jax.device_put(jnp.zeros((1, 512, 2, 64), jnp.bfloat16), jax.sharding.NamedSharding(mesh, spec))
    gradient = str(jax.make_jaxpr(jax.grad(loss))(q))
    assert "twinflash_backward_dkdv" in gradient and "psum" not in gradient


@pytest.mark.parametrize("auto_barriers", [False, True])
def test_the_dkdv_kernel_compiles_with_its_configs_barriers(auto_barriers, monkeypatch):
    """`HopperConfig.bwd_auto_barriers` reaches the dK/dV kernel's launch as Pallas's `unsafe_no_auto_barriers`
    (its negation); traced for GPUs, nothing compiles."""
    backward = importlib.import_module("jax_impl.kernels.hopper.backward")
    launched = []

    def launch(*args, compiler_params, **kwargs):
        launched.append(compiler_params)
        raise StopIteration  # the launch's arguments are all this test reads

    monkeypatch.setattr(backward, "launch", launch)
    config = HopperConfig(bwd_form="one_kernel", bwd_query_rows=True, bwd_auto_barriers=auto_barriers)
    q, lse = jnp.zeros((1, 128, 2, 64), jnp.bfloat16), jnp.zeros((1, 2, 128), jnp.float32)
    with pytest.raises(StopIteration):
        backward.hopper_backward(q, q, q, q, q, lse, causal=True, softmax_scale=0.125, config=config, interpret=False)
    assert launched == [dict(unsafe_no_auto_barriers=not auto_barriers)]


def test_autotune_space_starts_at_the_default_and_varies_the_backward():
    for head_dim in (64, 128):
        space = autotune_space(head_dim)
        assert space[0] == default_config(head_dim) and len(set(space)) == len(space) > 5
        assert {c.bwd_overlap for c in space} == {True, False}
        assert {c.bwd_form for c in space} == {"one_kernel", "one_kernel_private", "two_kernel"}
        assert {c.bwd_form for c in space if c.bwd_query_rows} == set(BACKWARD_FORMS)
        assert {c.bwd_form for c in space if not c.bwd_stagger} == {"one_kernel", "one_kernel_private"}
        assert {c.dq_block_kv for c in space} == {64, 128}
        assert {c.bwd_head_splits for c in space} == {1, GQA_HEAD_SPLITS}
        assert not space[0].bwd_auto_barriers and {c.bwd_auto_barriers for c in space} == {True, False}
        # the one-kernel form's (measured there), not the two-kernel one that documents take
        assert (default_config(head_dim).bwd_head_splits, default_config(head_dim, documents=True).bwd_head_splits) == (
            GQA_HEAD_SPLITS, 1)
        assert {(c.bwd_form, c.bwd_producer_registers) for c in space} >= {
            (form, producer) for form in BACKWARD_FORMS for producer in BACKWARD_PRODUCER_REGISTERS}
    assert any(c.block_kv == 256 for c in autotune_space(64)) and not any(c.block_kv == 256
                                                                          for c in autotune_space(128))


# ---------------------------------------------------------------------------------------------------------------
# GPU: compiled Mosaic kernels vs the Triton-lowering kernels vs cuDNN
# ---------------------------------------------------------------------------------------------------------------

GPU_CASES = [(1024, 1024, 8, 2, 128, True), (1000, 1000, 4, 4, 128, False), (777, 2048, 6, 2, 64, True),
             (2048, 777, 4, 1, 64, True), (1536, 1536, 4, 4, 64, False)]


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("seq_q,seq_k,heads,kv_heads,head_dim,causal", GPU_CASES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
def test_gpu_mosaic_triton_and_cudnn_meet_the_rule(dtype, seq_q, seq_k, heads, kv_heads, head_dim, causal):
    q, k, v, dout = _inputs(1, seq_q, seq_k, heads, kv_heads, head_dim, dtype, seed=7)
    exact = _float64_attention(q, k, v, dout, causal=causal, scale=1 / math.sqrt(head_dim))
    backends = ["pallas", "pallas_hopper", "pallas_portable"] + (["cudnn"] if not causal or seq_q == seq_k else [])
    for backend in backends:
        flash, naive = _flash_and_naive(q, k, v, dout, causal=causal, backend=backend)
        assert not _flash_rule_violations(flash, naive, exact), backend


# Every backward form at every register split `autotune_space` offers (the heuristic's picks among them: one kernel
# with query rows in bfloat16, two kernels in float16 or with documents, at producer 24 for D=128, 40 for D=64), and
# in the query-rows orientation, at both head dims.
BACKWARD_VARIANTS = [(form, producer, query_rows) for form in BACKWARD_FORMS for producer in BACKWARD_PRODUCER_REGISTERS
                     for query_rows in (False, True)]


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("bwd_form,producer,query_rows", BACKWARD_VARIANTS,
                         ids=[f"{f}-{p}{'-query-rows' if r else ''}" for f, p, r in BACKWARD_VARIANTS])
@pytest.mark.parametrize("seq_q,seq_k,heads,kv_heads,head_dim,causal", GPU_CASES)
def test_gpu_mosaic_backward_forms_meet_the_rule(seq_q, seq_k, heads, kv_heads, head_dim, causal, bwd_form,
                                                 producer, query_rows):
    _assert_meets_the_rule((seq_q, seq_k, heads, kv_heads, head_dim, causal), HopperConfig(
        bwd_form=bwd_form, bwd_producer_registers=producer, bwd_query_rows=query_rows), seed=7)


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("bwd_form,query_rows", [("one_kernel", True), ("two_kernel", False)],
                         ids=["one-kernel-query-rows", "two-kernel"])
@pytest.mark.parametrize("seq_q,seq_k,heads,kv_heads,head_dim,causal", [c for c in GPU_CASES if c[2] > c[3]])
def test_gpu_head_splits_meet_the_rule(seq_q, seq_k, heads, kv_heads, head_dim, causal, bwd_form, query_rows):
    """The GQA cases with the group's heads split among CTAs (`HopperConfig.bwd_head_splits`, the one-kernel
    heuristic's), in the heuristic's form and the two-kernel one."""
    _assert_meets_the_rule((seq_q, seq_k, heads, kv_heads, head_dim, causal), HopperConfig(
        bwd_form=bwd_form, bwd_query_rows=query_rows, bwd_head_splits=GQA_HEAD_SPLITS), seed=7)


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_one_kernel_staggered_with_gqa_meets_the_rule(head_dim):
    """The one-kernel form's full-attention walk rotated by steps under GQA (`HopperConfig.bwd_stagger`): every
    key tile starts at another (query block, head) step and wraps."""
    q, k, v, dout = _inputs(1, 1000, 1000, 8, 2, head_dim, jnp.bfloat16, seed=7)
    exact = _float64_attention(q, k, v, dout, causal=False, scale=1 / math.sqrt(head_dim))
    flash, naive = _flash_and_naive(q, k, v, dout, causal=False, backend="pallas_hopper",
                                    config=HopperConfig(bwd_form="one_kernel", bwd_query_rows=True))
    assert not _flash_rule_violations(flash, naive, exact)


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_ring_pairs_with_external_lse_meet_the_rule(head_dim):
    """The ring's use: fp32 partial outs merged by lse, then each pair's backward from the merged (global) out
    and lse; the summed results meet the rule against the full attention's float64 answer."""
    q_all, k, v, dout_all = _inputs(1, 2048, 2048, 8, 2, head_dim, jnp.bfloat16, seed=9)
    q, dout = q_all[:, 1024:], dout_all[:, 1024:]  # the second half of a causal sequence against all its keys
    exact = _float64_attention(q, k, v, dout, causal=True, scale=1 / math.sqrt(head_dim))
    naive = _with_grads(functools.partial(reference_attention, causal=True, return_lse=True), q, k, v, dout)
    for backend in ("pallas_hopper", "pallas_portable", "cudnn"):
        by_pairs = _jit(functools.partial(_ring_step_by_pairs, backend=backend))(q, k, v, dout)
        assert not _flash_rule_violations(by_pairs, naive, exact), backend


# Compiled forward forms (Sq, Sk, H, Hkv, D, causal, config changes, out dtype), as FORWARD_FORMS on CPU; None: no
# config, the heuristic's, here the call issue 32 saw fail to compile (the ring's fp32 partials of full attention at
# D=128, which three compute warpgroups cannot fit: jax_impl/kernels/hopper/config.default_config).
GPU_FORWARD_FORMS = [(777, 2048, 6, 2, 64, True, dict(compute_warpgroups=3), jnp.bfloat16),
                     (2048, 777, 4, 1, 64, True, dict(compute_warpgroups=3), jnp.bfloat16),
                     (1536, 1536, 4, 4, 64, False, dict(full_compute_warpgroups=3, persistent=True), jnp.float32),
                     (1000, 1000, 4, 2, 64, False, dict(full_block_kv=256, persistent=True), jnp.bfloat16),
                     (1000, 1000, 4, 4, 128, False, dict(persistent=True), jnp.float32),
                     (1000, 1000, 8, 2, 128, False, None, jnp.float32),
                     (1000, 1000, 8, 2, 128, False, None, jnp.bfloat16)]


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("seq_q,seq_k,heads,kv_heads,head_dim,causal,change,out_dtype", GPU_FORWARD_FORMS)
def test_gpu_mosaic_forward_forms_meet_the_rule(seq_q, seq_k, heads, kv_heads, head_dim, causal, change, out_dtype):
    q, k, v, dout = _inputs(1, seq_q, seq_k, heads, kv_heads, head_dim, jnp.bfloat16, seed=7)
    exact = _float64_attention(q, k, v, dout, causal=causal, scale=1 / math.sqrt(head_dim))
    config = None if change is None else HopperConfig(**change)
    out, lse = _jit(functools.partial(flash_attention_forward, causal=causal, out_dtype=out_dtype,
                                      backend="pallas_hopper", config=config))(q, k, v)
    naive = _jit(functools.partial(reference_attention, causal=causal, return_lse=True))(q, k, v)
    # the forward alone: the gradients are the exact answer's own, so only out and lse can break the rule
    assert not _flash_rule_violations((out, lse, *exact[2:]), (*naive, *exact[2:]), exact)
