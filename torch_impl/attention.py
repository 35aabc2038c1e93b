"""Plain-math attention in PyTorch: the reference every kernel and the ring are checked against, and the
model's default attention function. Twin of `jax_impl/attention.py`.

Shapes follow flash-attention: q [B, Sq, H, D], k and v [B, Sk, Hkv, D] with H a multiple of Hkv; GQA by
grouping query heads over their KV head (K/V are never repeated). `causal=True` with Sq != Sk aligns the last
query with the last key: query i sees key j iff j <= i + Sk - Sq. A query that sees no key (possible only when
Sq > Sk) gets output 0 and log-sum-exp -inf; that row is found from the mask, never by replacing NaN, so a NaN
in q, k or v always reaches the output. lse is [B, H, Sq], float32, natural log of the softmax
denominator of the scaled scores.

The model calls an `AttentionFn`: `fn(q, k, v) -> out`, causal, default scale 1/sqrt(D), output in q's
dtype. The kernel and ring modules provide drop-in replacements with that signature.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _grouped_scores(q: torch.Tensor, k: torch.Tensor, softmax_scale: float, causal: bool) -> torch.Tensor:
    """Scaled scores [B, Hkv, G, Sq, Sk] with masked entries at -inf."""
    b, sq, h, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, sq, hkv, h // hkv, d)
    scores = torch.einsum("bqhgd,bkhd->bhgqk", qg, k) * softmax_scale
    if causal:
        sk = k.shape[1]
        visible = (torch.arange(sk, device=q.device)[None, :]
                   <= torch.arange(sq, device=q.device)[:, None] + (sk - sq))
        scores = scores.masked_fill(~visible, float("-inf"))
    return scores


def _rows_with_a_key(sq: int, sk: int, causal: bool, device: torch.device) -> torch.Tensor:
    """bool [Sq, 1]: the queries that see at least one key. Their softmax rows are computed as they are, so a NaN
    in the inputs reaches the output; only the other rows are set to 0 (exp(-inf - -inf) would be NaN there)."""
    rows = torch.arange(sq, device=device)[:, None]
    return rows + (sk - sq) >= 0 if causal else torch.full_like(rows, sk > 0, dtype=torch.bool)


def _softmax_from_lse(scores: torch.Tensor, lse: torch.Tensor, causal: bool) -> torch.Tensor:
    """exp(scores - lse) over [..., Sq, Sk], 0 in the rows whose query sees no key."""
    sees = _rows_with_a_key(scores.shape[-2], scores.shape[-1], causal, scores.device)
    return torch.where(sees, torch.exp(scores - lse[..., None]), 0.0)


def reference_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                                softmax_scale: float, out_dtype: torch.dtype | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pair-level forward computed in float32: (out [B, Sq, H, D] in `out_dtype` or q's dtype, lse [B, H, Sq])."""
    b, sq, h, d = q.shape
    scores = _grouped_scores(q.float(), k.float(), softmax_scale, causal)
    lse = torch.logsumexp(scores, dim=-1)
    probs = _softmax_from_lse(scores, lse, causal)
    out = torch.einsum("bhgqk,bkhd->bqhgd", probs, v.float()).reshape(b, sq, h, d)
    return out.to(out_dtype or q.dtype), lse.reshape(b, h, sq)


def reference_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 out: torch.Tensor, lse: torch.Tensor, *, causal: bool, softmax_scale: float
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pair-level backward in float32 from (possibly globally merged) out and lse: (dq, dk, dv), float32.

    With the global out/lse of a row, P = exp(S - lse) is this pair's share of the global softmax and
    delta = rowsum(dout * out) is the global one, so per-pair gradients sum to the full gradient.
    """
    b, sq, h, d = q.shape
    hkv = k.shape[2]
    g = h // hkv
    scores = _grouped_scores(q.float(), k.float(), softmax_scale, causal)
    lse_g = lse.float().reshape(b, hkv, g, sq)
    probs = _softmax_from_lse(scores, lse_g, causal)
    dout_g = dout.float().reshape(b, sq, hkv, g, d)
    delta = (dout.float() * out.float()).sum(-1).permute(0, 2, 1).reshape(b, hkv, g, sq)
    dv = torch.einsum("bhgqk,bqhgd->bkhd", probs, dout_g)
    dprobs = torch.einsum("bqhgd,bkhd->bhgqk", dout_g, v.float())
    dscores = probs * (dprobs - delta[..., None]) * softmax_scale
    dq = torch.einsum("bhgqk,bkhd->bqhgd", dscores, k.float()).reshape(b, sq, h, d)
    dk = torch.einsum("bhgqk,bqhgd->bkhd", dscores, q.float().reshape(b, sq, hkv, g, d))
    return dq, dk, dv


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                        softmax_scale: float | None = None, return_lse: bool = False):
    """Naive attention in q's dtype (matmuls in that dtype, softmax in float32, as HF's eager attention);
    differentiable through ordinary autograd. This is the "naive same-dtype implementation" of the
    kernel tests' error rule and the model's default attention."""
    b, sq, h, d = q.shape
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    scores = _grouped_scores(q, k, scale, causal).float()
    lse = torch.logsumexp(scores, dim=-1)
    probs = _softmax_from_lse(scores, lse, causal).to(q.dtype)
    out = torch.einsum("bhgqk,bkhd->bqhgd", probs, v).reshape(b, sq, h, d)
    if return_lse:
        return out, lse.reshape(b, h, sq)
    return out
