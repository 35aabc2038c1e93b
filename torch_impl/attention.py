"""Plain-math attention in PyTorch: the reference every kernel and the ring are checked against, and the
model's default attention function. Twin of `jax_impl/attention.py`.

Shapes follow flash-attention: q [B, Sq, H, D], k and v [B, Sk, Hkv, D] with H a multiple of Hkv; GQA by
grouping query heads over their KV head (K/V are never repeated). `causal=True` with Sq != Sk aligns the last
query with the last key: query i sees key j iff j <= i + Sk - Sq. A query that sees no key (possible only when
Sq > Sk) gets output 0 and log-sum-exp -inf; that row is found from the mask, never by replacing NaN, so a NaN
in q, k or v always reaches the output. lse is [B, H, Sq], float32, natural log of the softmax
denominator of the scaled scores.

Packed documents (`weights/documents.py`): `reference_attention` takes segment ids, the pair functions the key
spans they become (`torch_impl/documents.py`); a pair masks by them, intersected with the causal rule.

The model calls an `AttentionFn`: `fn(q, k, v) -> out`, causal, default scale 1/sqrt(D), output in q's
dtype. The kernel and ring modules provide drop-in replacements with that signature.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from torch_impl.documents import Spans, checked_segment_ids, document_spans, visible_keys

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _visible(sq: int, sk: int, causal: bool, spans: Spans | None, device: torch.device) -> torch.Tensor | None:
    """bool mask broadcastable to the scores [B, Hkv, G, Sq, Sk] (None: every pair attends): the causal rule
    and/or the documents' key spans."""
    visible = None
    if causal:
        visible = torch.arange(sk, device=device)[None, :] <= torch.arange(sq, device=device)[:, None] + (sk - sq)
    if spans is not None:
        in_span = visible_keys(spans, sk)[:, None, None]
        visible = in_span if visible is None else in_span & visible
    return visible


def _grouped_scores(q: torch.Tensor, k: torch.Tensor, softmax_scale: float, visible: torch.Tensor | None
                    ) -> torch.Tensor:
    """Scaled scores [B, Hkv, G, Sq, Sk] with masked entries at -inf."""
    b, sq, h, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, sq, hkv, h // hkv, d)
    scores = torch.einsum("bqhgd,bkhd->bhgqk", qg, k) * softmax_scale
    return scores if visible is None else scores.masked_fill(~visible, float("-inf"))


def _softmax_from_lse(scores: torch.Tensor, lse: torch.Tensor, visible: torch.Tensor | None) -> torch.Tensor:
    """exp(scores - lse) over [..., Sq, Sk], 0 in the rows whose query sees no key. Those rows are found from the
    mask, so a NaN in the inputs reaches the output; only they are set to 0 (exp(-inf - -inf) would be NaN)."""
    if visible is None:
        return torch.exp(scores - lse[..., None])
    return torch.where(visible.any(-1, keepdim=True), torch.exp(scores - lse[..., None]), 0.0)


def reference_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                                softmax_scale: float, out_dtype: torch.dtype | None = None,
                                spans: Spans | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pair-level forward computed in float32: (out [B, Sq, H, D] in `out_dtype` or q's dtype, lse [B, H, Sq]).
    `spans`: the documents' key spans (`torch_impl.documents`), intersected with the causal rule when causal."""
    b, sq, h, d = q.shape
    visible = _visible(sq, k.shape[1], causal, spans, q.device)
    scores = _grouped_scores(q.float(), k.float(), softmax_scale, visible)
    lse = torch.logsumexp(scores, dim=-1)
    probs = _softmax_from_lse(scores, lse, visible)
    out = torch.einsum("bhgqk,bkhd->bqhgd", probs, v.float()).reshape(b, sq, h, d)
    return out.to(out_dtype or q.dtype), lse.reshape(b, h, sq)


def reference_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 out: torch.Tensor, lse: torch.Tensor, *, causal: bool, softmax_scale: float,
                                 spans: Spans | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pair-level backward in float32 from (possibly globally merged) out and lse: (dq, dk, dv), float32.

    With the global out/lse of a row, P = exp(S - lse) is this pair's share of the global softmax and
    delta = rowsum(dout * out) is the global one, so per-pair gradients sum to the full gradient.
    """
    b, sq, h, d = q.shape
    hkv = k.shape[2]
    g = h // hkv
    visible = _visible(sq, k.shape[1], causal, spans, q.device)
    scores = _grouped_scores(q.float(), k.float(), softmax_scale, visible)
    lse_g = lse.float().reshape(b, hkv, g, sq)
    probs = _softmax_from_lse(scores, lse_g, visible)
    dout_g = dout.float().reshape(b, sq, hkv, g, d)
    delta = (dout.float() * out.float()).sum(-1).permute(0, 2, 1).reshape(b, hkv, g, sq)
    dv = torch.einsum("bhgqk,bqhgd->bkhd", probs, dout_g)
    dprobs = torch.einsum("bqhgd,bkhd->bhgqk", dout_g, v.float())
    dscores = probs * (dprobs - delta[..., None]) * softmax_scale
    dq = torch.einsum("bhgqk,bkhd->bqhgd", dscores, k.float()).reshape(b, sq, h, d)
    dk = torch.einsum("bhgqk,bqhgd->bkhd", dscores, q.float().reshape(b, sq, hkv, g, d))
    return dq, dk, dv


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                        softmax_scale: float | None = None, return_lse: bool = False,
                        segment_ids: torch.Tensor | None = None):
    """Naive attention in q's dtype (matmuls in that dtype, softmax in float32, as HF's eager attention);
    differentiable through ordinary autograd. This is the "naive same-dtype implementation" of the
    kernel tests' error rule and the model's default attention. `segment_ids` [B, S] (self-attention, Sq == Sk):
    packed documents (`weights/documents.py`), each attending only to itself."""
    b, sq, h, d = q.shape
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    spans = None
    if segment_ids is not None:
        if k.shape[1] != sq:
            raise ValueError(f"segment_ids need self-attention (Sq == Sk), got Sq={sq}, Sk={k.shape[1]}")
        spans = document_spans(checked_segment_ids(segment_ids, b, sq, q.device), causal=causal)
    visible = _visible(sq, k.shape[1], causal, spans, q.device)
    scores = _grouped_scores(q, k, scale, visible).float()
    lse = torch.logsumexp(scores, dim=-1)
    probs = _softmax_from_lse(scores, lse, visible).to(q.dtype)
    out = torch.einsum("bhgqk,bkhd->bqhgd", probs, v).reshape(b, sq, h, d)
    if return_lse:
        return out, lse.reshape(b, h, sq)
    return out
