"""Plain-math attention in JAX: the reference every kernel and the ring are checked against, and the model's
default attention function. Twin of `torch_impl/attention.py`.

Shapes follow flash-attention: q [B, Sq, H, D], k and v [B, Sk, Hkv, D] with H a multiple of Hkv; GQA by
grouping query heads over their KV head (K/V are never repeated). `causal=True` with Sq != Sk aligns the last
query with the last key: query i sees key j iff j <= i + Sk - Sq. A query that sees no key (possible only when
Sq > Sk) gets output 0 and log-sum-exp -inf; that row is found from the mask, never from the values, so a NaN
in q, k or v always reaches the output. lse is [B, H, Sq], float32, natural log of the softmax
denominator of the scaled scores.

The model calls an `AttentionFn`: `fn(q, k, v) -> out`, causal, default scale 1/sqrt(D), output in q's
dtype. The kernel and ring modules provide drop-in replacements with that signature.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

AttentionFn = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def _grouped_scores(q: jax.Array, k: jax.Array, softmax_scale: float, causal: bool) -> jax.Array:
    """Scaled scores [B, Hkv, G, Sq, Sk] with masked entries at -inf."""
    b, sq, h, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, sq, hkv, h // hkv, d)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k) * jnp.asarray(softmax_scale, q.dtype)
    if causal:
        sk = k.shape[1]
        visible = jnp.arange(sk)[None, :] <= jnp.arange(sq)[:, None] + (sk - sq)
        scores = jnp.where(visible, scores, -jnp.inf)
    return scores


def _rows_with_a_key(sq: int, sk: int, causal: bool) -> jax.Array:
    """bool [Sq, 1]: the queries that see at least one key. Their softmax rows are computed as they are, so a NaN
    in the inputs reaches the output; only the other rows are set to 0 and -inf."""
    rows = jnp.arange(sq)[:, None]
    return rows + (sk - sq) >= 0 if causal else jnp.full(rows.shape, sk > 0)


def _softmax_with_lse(scores: jax.Array, causal: bool) -> tuple[jax.Array, jax.Array]:
    """float32 (probs, lse); rows with no visible key get probs 0 and lse -inf."""
    scores = scores.astype(jnp.float32)
    sees = _rows_with_a_key(scores.shape[-2], scores.shape[-1], causal)
    # the inner wheres keep a row without keys finite, so that its (unused) gradient is 0, not NaN
    row_max = jnp.where(sees, jnp.max(scores, axis=-1, keepdims=True), 0.0)
    exp = jnp.exp(scores - row_max)
    total = jnp.where(sees, jnp.sum(exp, axis=-1, keepdims=True), 1.0)
    lse = jnp.where(sees, jnp.log(total) + row_max, -jnp.inf)
    probs = jnp.where(sees, exp / total, 0.0)
    return probs, lse[..., 0]


def reference_attention_forward(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool, softmax_scale: float,
                                out_dtype=None) -> tuple[jax.Array, jax.Array]:
    """Pair-level forward computed in float32: (out [B, Sq, H, D] in `out_dtype` or q's dtype, lse [B, H, Sq])."""
    b, sq, h, d = q.shape
    scores = _grouped_scores(q.astype(jnp.float32), k.astype(jnp.float32), softmax_scale, causal)
    probs, lse = _softmax_with_lse(scores, causal)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs, v.astype(jnp.float32)).reshape(b, sq, h, d)
    return out.astype(out_dtype or q.dtype), lse.reshape(b, h, sq)


def reference_attention_backward(dout: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, out: jax.Array,
                                 lse: jax.Array, *, causal: bool, softmax_scale: float
                                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Pair-level backward in float32 from (possibly globally merged) out and lse: (dq, dk, dv), float32.

    With the global out/lse of a row, P = exp(S - lse) is this pair's share of the global softmax and
    delta = rowsum(dout * out) is the global one, so per-pair gradients sum to the full gradient.
    """
    b, sq, h, d = q.shape
    hkv = k.shape[2]
    g = h // hkv
    f32 = jnp.float32
    scores = _grouped_scores(q.astype(f32), k.astype(f32), softmax_scale, causal)
    lse_g = lse.astype(f32).reshape(b, hkv, g, sq)[..., None]
    sees = _rows_with_a_key(sq, k.shape[1], causal)
    probs = jnp.where(sees, jnp.exp(scores - jnp.where(sees, lse_g, 0.0)), 0.0)
    dout_g = dout.astype(f32).reshape(b, sq, hkv, g, d)
    delta = jnp.sum(dout.astype(f32) * out.astype(f32), axis=-1).transpose(0, 2, 1).reshape(b, hkv, g, sq)
    dv = jnp.einsum("bhgqk,bqhgd->bkhd", probs, dout_g)
    dprobs = jnp.einsum("bqhgd,bkhd->bhgqk", dout_g, v.astype(f32))
    dscores = probs * (dprobs - delta[..., None]) * softmax_scale
    dq = jnp.einsum("bhgqk,bkhd->bqhgd", dscores, k.astype(f32)).reshape(b, sq, h, d)
    dk = jnp.einsum("bhgqk,bqhgd->bkhd", dscores, q.astype(f32).reshape(b, sq, hkv, g, d))
    return dq, dk, dv


def reference_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
                        softmax_scale: float | None = None, return_lse: bool = False):
    """Naive attention in q's dtype (matmuls in that dtype, softmax in float32, as HF's eager attention);
    differentiable through ordinary autodiff. This is the "naive same-dtype implementation" of the kernel
    tests' error rule and the model's default attention."""
    b, sq, h, d = q.shape
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    probs, lse = _softmax_with_lse(_grouped_scores(q, k, scale, causal), causal)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs.astype(q.dtype), v).reshape(b, sq, h, d)
    if return_lse:
        return out, lse.reshape(b, h, sq)
    return out
