"""bf16 gradient precision of the JAX model's sums over the tokens (issue 22's follow-up): the RMSNorm weight's and
the embedding's gradients are sums over every token of a device; summed in bf16 they lost ~5x more than the one
rounding of a float32 sum that torch's bf16 training makes (its reductions and its CUDA embedding backward
accumulate in float32), which moved torch and JAX apart 10x more than the bf16 noise floor. Each check bounds the
error against a float64 reference by twice that one rounding, and runs the old bf16-summing formula as the negative
control that must fail the same bound."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_impl.model import Embedding, RMSNorm

TOKENS, HIDDEN, VOCAB = 4096, 64, 256  # a device's tokens of the 1B run at 8k on sp=2: the length of the sums
EPS = 1e-5


def _bf16(rng: np.random.Generator, *shape: int) -> jax.Array:
    return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)


def _relative_error(value: jax.Array, exact: np.ndarray) -> float:
    return float(np.abs(np.asarray(value, np.float64) - exact).mean() / np.abs(exact).mean())


def _one_rounding(exact: np.ndarray) -> float:
    """The error of the exact result rounded once to bf16: what a float32 sum stored in bf16 makes."""
    return _relative_error(jnp.asarray(exact, jnp.float32).astype(jnp.bfloat16), exact)


def _weight_gradient(module_call, weight: jax.Array, cotangent: jax.Array) -> jax.Array:
    return jax.jit(jax.vjp(module_call, weight)[1])(cotangent)[0]


def test_rmsnorm_weight_gradient_sums_the_tokens_in_float32():
    rng = np.random.default_rng(0)
    x, cotangent = _bf16(rng, TOKENS, HIDDEN), _bf16(rng, TOKENS, HIDDEN)
    weight = jnp.asarray(1 + 0.1 * rng.standard_normal(HIDDEN), jnp.bfloat16)
    x32 = x.astype(jnp.float32)
    normed = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + EPS)).astype(jnp.bfloat16)
    exact = (np.asarray(normed, np.float64) * np.asarray(cotangent, np.float64)).sum(0)
    bound = 2 * _one_rounding(exact)  # 2x: the products' roundings in float32 and the final one to bf16

    ours = _weight_gradient(lambda w: RMSNorm(w, EPS)(x), weight, cotangent)
    assert ours.dtype == jnp.bfloat16
    assert _relative_error(ours, exact) <= bound
    summed_in_bf16 = _weight_gradient(lambda w: w * normed, weight, cotangent)  # the formula before the fix
    assert _relative_error(summed_in_bf16, exact) > bound  # negative control: the bound catches a bf16 sum


def test_rmsnorm_forward_is_the_bf16_multiply():
    rng = np.random.default_rng(1)
    x, weight = _bf16(rng, 64, HIDDEN), _bf16(rng, HIDDEN)

    def before(w):
        x32 = x.astype(jnp.float32)
        return w * (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + EPS)).astype(x.dtype)

    ours = jax.jit(lambda w: RMSNorm(w, EPS)(x))(weight)
    assert ours.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(ours, np.float32), np.asarray(jax.jit(before)(weight), np.float32))


def test_embedding_gradient_sums_the_tokens_in_float32():
    rng = np.random.default_rng(2)
    tokens = jnp.asarray(rng.integers(0, 64, TOKENS))  # byte-like text: each used row is picked ~64 times
    cotangent = _bf16(rng, TOKENS, HIDDEN)
    table = _bf16(rng, VOCAB, HIDDEN)
    exact = np.zeros((VOCAB, HIDDEN))
    np.add.at(exact, np.asarray(tokens), np.asarray(cotangent, np.float64))
    bound = 2 * _one_rounding(exact)  # 2x: slack for the float32 sum's own roundings

    np.testing.assert_array_equal(np.asarray(Embedding(table)(tokens), np.float32),
                                  np.asarray(jnp.take(table, tokens, axis=0), np.float32))
    ours = _weight_gradient(lambda t: Embedding(t)(tokens), table, cotangent)
    assert ours.dtype == jnp.bfloat16
    assert _relative_error(ours, exact) <= bound
    summed_in_bf16 = _weight_gradient(lambda t: jnp.take(t, tokens, axis=0), table, cotangent)  # before the fix
    assert _relative_error(summed_in_bf16, exact) > bound  # negative control
