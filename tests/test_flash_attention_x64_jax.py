"""JAX FlashAttention with `jax_enable_x64` on (issue 32, item 4): the Pallas kernels' index arithmetic is int32
whatever the default integer width (`jax_impl.kernels.tiles.index_div` / `index_rem`, int32 iotas), so both kernel
families run and meet the same flash rule as with it off (tests/kernel_twins.py; tolerances and their reasons
there). One forward and backward case per family, on CPU: "pallas" (there the Triton-lowering kernels, interpreted)
and "pallas_hopper" (the Mosaic GPU kernels under Pallas's GPU interpreter, default config, two-kernel backward).
The one-kernel backward forms are not run here: with x64 on, Pallas's GPU interpreter (jax 0.10.2) hangs in them
although their traced kernel is the same as with x64 off but for the width of some literals.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest
from test_flash_attention_jax import _flash_and_naive, _flash_rule_violations, _float64_attention, _inputs

from jax_impl.kernels.flash_attention import flash_attention


@pytest.fixture
def x64():
    """jax_enable_x64 on for one test, then back to what it was."""
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", previous)


@pytest.mark.parametrize("backend", ["pallas", "pallas_hopper"], ids=["triton-lowering", "mosaic"])
def test_kernels_meet_the_rule_with_x64_on(x64, backend):
    # causal with Sq < Sk and GQA 2:1: the causal step ranges (the divisions that failed) and the head grouping
    q, k, v, dout = _inputs(1, 70, 90, 2, 1, 64, jnp.bfloat16)
    assert jnp.zeros(()).dtype == jnp.float64  # x64 is on: Python numbers default to 64 bits
    flash, naive = _flash_and_naive(q, k, v, dout, causal=True, backend=backend)
    assert [x.dtype for x in flash] == [jnp.bfloat16, jnp.float32, jnp.bfloat16, jnp.bfloat16, jnp.bfloat16]
    exact = _float64_attention(q, k, v, dout, causal=True, scale=1 / math.sqrt(64))
    assert not _flash_rule_violations(flash, naive, exact)

