"""Plain-math attention in JAX: the reference every kernel and the ring are checked against, and the model's
default attention function. Twin of `torch_impl/attention.py`.

Shapes follow flash-attention: q [B, Sq, H, D], k and v [B, Sk, Hkv, D] with H a multiple of Hkv; GQA by
grouping query heads over their KV head (K/V are never repeated). `causal=True` with Sq != Sk aligns the last
query with the last key: query i sees key j iff j <= i + Sk - Sq. A query that sees no key (possible only when
Sq > Sk) gets output 0 and log-sum-exp -inf; that row is found from the mask, never from the values, so a NaN
in q, k or v always reaches the output. lse is [B, H, Sq], float32, natural log of the softmax
denominator of the scaled scores.

Packed documents (`weights/documents.py`): `reference_attention` takes segment ids, the pair functions the key
spans they become (`jax_impl/documents.py`); a pair masks by them, intersected with the causal rule.

The model calls an `AttentionFn`: `fn(q, k, v) -> out`, causal, default scale 1/sqrt(D), output in q's
dtype. The kernel and ring modules provide drop-in replacements with that signature.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jax_impl.documents import Spans, checked_segment_ids, document_spans, visible_keys

AttentionFn = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def _visible(sq: int, sk: int, causal: bool, spans: Spans | None) -> jax.Array | None:
    """bool mask broadcastable to the scores [B, Hkv, G, Sq, Sk] (None: every pair attends): the causal rule
    and/or the documents' key spans."""
    visible = None
    if causal:
        visible = jnp.arange(sk)[None, :] <= jnp.arange(sq)[:, None] + (sk - sq)
    if spans is not None:
        in_span = visible_keys(spans, sk)[:, None, None]
        visible = in_span if visible is None else in_span & visible
    return visible


def _grouped_scores(q: jax.Array, k: jax.Array, softmax_scale: float, visible: jax.Array | None) -> jax.Array:
    """Scaled scores [B, Hkv, G, Sq, Sk] with masked entries at -inf."""
    b, sq, h, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, sq, hkv, h // hkv, d)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k) * jnp.asarray(softmax_scale, q.dtype)
    return scores if visible is None else jnp.where(visible, scores, -jnp.inf)


def _rows_with_a_key(visible: jax.Array | None) -> jax.Array:
    """bool [..., Sq, 1]: the queries that see at least one key, found from the mask. Their softmax rows are
    computed as they are, so a NaN in the inputs reaches the output; only the other rows are set to 0 and -inf."""
    return jnp.array(True) if visible is None else jnp.any(visible, axis=-1, keepdims=True)


def _softmax_with_lse(scores: jax.Array, visible: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """float32 (probs, lse); rows with no visible key get probs 0 and lse -inf."""
    scores = scores.astype(jnp.float32)
    sees = _rows_with_a_key(visible)
    # the inner wheres keep a row without keys finite, so that its (unused) gradient is 0, not NaN
    row_max = jnp.where(sees, jnp.max(scores, axis=-1, keepdims=True), 0.0)
    exp = jnp.exp(scores - row_max)
    total = jnp.where(sees, jnp.sum(exp, axis=-1, keepdims=True), 1.0)
    lse = jnp.where(sees, jnp.log(total) + row_max, -jnp.inf)
    probs = jnp.where(sees, exp / total, 0.0)
    return probs, lse[..., 0]


def reference_attention_forward(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool, softmax_scale: float,
                                out_dtype=None, spans: Spans | None = None) -> tuple[jax.Array, jax.Array]:
    """Pair-level forward computed in float32: (out [B, Sq, H, D] in `out_dtype` or q's dtype, lse [B, H, Sq]).
    `spans`: the documents' key spans (`jax_impl.documents`), intersected with the causal rule when causal."""
    b, sq, h, d = q.shape
    visible = _visible(sq, k.shape[1], causal, spans)
    scores = _grouped_scores(q.astype(jnp.float32), k.astype(jnp.float32), softmax_scale, visible)
    probs, lse = _softmax_with_lse(scores, visible)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs, v.astype(jnp.float32)).reshape(b, sq, h, d)
    return out.astype(out_dtype or q.dtype), lse.reshape(b, h, sq)


def reference_attention_backward(dout: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, out: jax.Array,
                                 lse: jax.Array, *, causal: bool, softmax_scale: float, spans: Spans | None = None
                                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Pair-level backward in float32 from (possibly globally merged) out and lse: (dq, dk, dv), float32.

    With the global out/lse of a row, P = exp(S - lse) is this pair's share of the global softmax and
    delta = rowsum(dout * out) is the global one, so per-pair gradients sum to the full gradient.
    """
    b, sq, h, d = q.shape
    hkv = k.shape[2]
    g = h // hkv
    f32 = jnp.float32
    visible = _visible(sq, k.shape[1], causal, spans)
    scores = _grouped_scores(q.astype(f32), k.astype(f32), softmax_scale, visible)
    lse_g = lse.astype(f32).reshape(b, hkv, g, sq)[..., None]
    sees = _rows_with_a_key(visible)
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
                        softmax_scale: float | None = None, return_lse: bool = False, segment_ids=None):
    """Naive attention in q's dtype (matmuls in that dtype, softmax in float32, as HF's eager attention);
    differentiable through ordinary autodiff. This is the "naive same-dtype implementation" of the kernel
    tests' error rule and the model's default attention. `segment_ids` [B, S] (self-attention, Sq == Sk): packed
    documents (`weights/documents.py`), each attending only to itself."""
    b, sq, h, d = q.shape
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    spans = None
    if segment_ids is not None:
        if k.shape[1] != sq:
            raise ValueError(f"segment_ids need self-attention (Sq == Sk), got Sq={sq}, Sk={k.shape[1]}")
        spans = document_spans(checked_segment_ids(segment_ids, b, sq), causal=causal)
    visible = _visible(sq, k.shape[1], causal, spans)
    probs, lse = _softmax_with_lse(_grouped_scores(q, k, scale, visible), visible)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs.astype(q.dtype), v).reshape(b, sq, h, d)
    if return_lse:
        return out, lse.reshape(b, h, sq)
    return out
