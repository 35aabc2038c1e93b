"""FlashAttention for PyTorch: the public, differentiable `flash_attention`, the pair-level forward/backward the
ring attention calls, the dispatch to the interchangeable kernel backends and the check of `config=`. Twin of
`jax_impl/kernels/flash_attention.py` (same names, same contract).

Backends (`backend=`, `weights.training.ATTENTION_BACKENDS["torch"]`):
  "triton"           ours, the default: the Hopper family where it runs the call (`_uses_hopper`), else the portable
                     one; GQA native, any lengths, head dims 32/64/96/128/256, bf16/fp16/fp32.
  "triton_hopper"    forces the Hopper family both ways (`kernels/hopper/`: Gluon sm_90 kernels, Triton 3.6, head
                     dims 64/128, bf16/fp16): the forward (warp-specialised TMA producer, two ping-pong consumer
                     warpgroups at D=128, three at D=64) and the one-kernel backward (K/V resident, five async wgmma
                     per query block, dQ by TMA reduce-add; warp-specialised like FlashAttention-3's).
  "triton_portable"  forces the portable family (`kernels/portable/`: `tl` kernels), which the CPU interpreter and
                     non-Hopper GPUs run.
  "reference"        the plain-math functions of `torch_impl.attention` (float32 math).
  "sdpa_cudnn"       torch's cuDNN attention ops, "sdpa_flash" torch's FlashAttention-2 ops (CUDA only, bf16/fp16;
                     K/V repeated for GQA and dk/dv summed back; causal only with Sq == Sk, since those ops align
                     the causal mask top-left).
  "flash_attn"       the optional flash-attn 2.x package (`pip install 'twinflash[flash-attn]'`).

Without CUDA, Triton's interpreter runs the portable kernels on CPU when TRITON_INTERPRET=1 was set before anything
imported triton: the `twinflash` CLI and tests/conftest.py set it when there is no CUDA GPU; otherwise a call with
CPU tensors raises one line naming that fix (`tiles.interpreter_problem`).

Packed documents (`weights/documents.py`): `flash_attention(..., segment_ids=)` turns them into key spans
(`torch_impl/documents.py`), which the pair functions take as `spans=` (the ring's per-step spans); both of our
kernel families take them (the portable kernels and the Gluon ones, each under its SPANS switch), so "triton" picks
the family as without documents, and "reference" takes them too; every other backend refuses them with one
ValueError naming those that take them.

Launch shapes (`config=`, every entry point): those of the kernel family serving the call, a `PortableConfig`
(`kernels/portable/config.py`: one `KernelConfig` per kernel) or a `HopperConfig` (`kernels/hopper/config.py`: the
forward's shape and, in its `backward` field, the backward's); the other family's is a ValueError naming both, and
so is any config for the vendor and reference backends. None lets the family pick: the portable kernels' autotuner
from its space, the Hopper kernels' shapes measured fastest per call class.
"""

from __future__ import annotations

import dataclasses
import inspect
import math

import torch

from torch_impl.attention import reference_attention_backward, reference_attention_forward
from torch_impl.documents import Spans, causally_limited, checked_segment_ids, document_spans
from torch_impl.kernels.hopper.backward import hopper_backward
from torch_impl.kernels.hopper.config import HopperBackwardConfig, HopperConfig, hopper_unsupported
from torch_impl.kernels.hopper.forward import hopper_forward
from torch_impl.kernels.portable.backward import portable_backward
from torch_impl.kernels.portable.config import KernelConfig, PortableConfig
from torch_impl.kernels.portable.forward import portable_forward
from torch_impl.kernels.tiles import interpreter_problem
from torch_impl.remat import keep_for_backward
from weights.attention import check_attention_shapes, check_config_family
from weights.documents import documents_refusal
from weights.training import ATTENTION_BACKENDS

aten = torch.ops.aten  # the CUDA-only SDPA ops behind the sdpa_* backends

BACKENDS = ATTENTION_BACKENDS["torch"]
_TRITON_BACKENDS = ("triton", "triton_portable", "triton_hopper")
DOCUMENT_BACKENDS = _TRITON_BACKENDS + ("reference", )  # those that take documents (`_check_spans`)
SUPPORTED_HEAD_DIMS = (32, 64, 96, 128, 256)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_HALF_DTYPES = (torch.bfloat16, torch.float16)
_FLASH_ATTN_MISSING = "backend 'flash_attn' needs the optional flash-attn package: pip install 'twinflash[flash-attn]'"


# ----------------------------------------------------------------------------------------------- validation

def _validate(q, k, v, *, causal, softmax_scale, backend, config, spans=None) -> float:
    """Check shapes, dtypes, devices, the documents' spans, the config and the backend's own limits; return the
    softmax scale to use."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(map(repr, BACKENDS))}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}; supported: bfloat16, float16, float32")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    check_attention_shapes(q.shape, k.shape, v.shape)
    head_dim = q.shape[3]
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} is not supported; supported: {SUPPORTED_HEAD_DIMS}")
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")
    _check_spans(spans, q, backend)
    _check_config(config, backend, q, k, v)
    _check_backend_limits(backend, q, (k, v), causal)
    return scale


def _check_spans(spans, q, backend) -> None:
    """Documents' key spans (`torch_impl.documents.Spans`, int32 [B, Sq] each on q's device) and a backend that
    takes them: our kernel families (either, or "triton" picking one) and the reference."""
    if spans is None:
        return
    if backend not in DOCUMENT_BACKENDS:
        raise ValueError(documents_refusal(backend, DOCUMENT_BACKENDS))
    if not isinstance(spans, Spans):
        raise ValueError(f"spans must be a torch_impl.documents.Spans, got {type(spans).__name__}")
    for name, t in zip(spans._fields, spans):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or tuple(t.shape) != tuple(q.shape[:2]):
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"spans.{name} must be an int32 tensor [B, Sq] = {tuple(q.shape[:2])}, got {got}")
        if t.device != q.device:
            raise ValueError(f"spans.{name} is on {t.device} but q is on {q.device}")


def _check_config(config, backend, q, k, v) -> None:
    """A config must be the one of the kernel family that serves the call (`_uses_hopper`)."""
    if config is None:
        return
    if backend not in _TRITON_BACKENDS:
        raise ValueError(f"config sets our Triton kernels' launch shapes; backend={backend!r} takes none")
    if not isinstance(config, (PortableConfig, HopperConfig)):
        raise ValueError(f"config must be a PortableConfig, a HopperConfig or None, got {type(config).__name__}")
    check_config_family(config, uses_hopper=_uses_hopper(backend, q, k, v), hopper_config=HopperConfig,
                        portable_config=PortableConfig, backend=backend)
    if isinstance(config, HopperConfig):
        if config.backward is not None and not isinstance(config.backward, HopperBackwardConfig):
            raise ValueError(f"config.backward must be a HopperBackwardConfig or None, got "
                             f"{type(config.backward).__name__}")
        return
    for field in dataclasses.fields(config):
        name, entry = field.name, getattr(config, field.name)
        if not isinstance(entry, KernelConfig):
            raise ValueError(f"config.{name} must be a KernelConfig, got {type(entry).__name__}")
        block_m, block_n, num_warps, num_stages = entry
        if not all(b >= 16 and b & (b - 1) == 0 for b in (block_m, block_n, num_warps * 16)) or num_stages < 1:
            raise ValueError(f"config.{name} = {entry}: blocks must be powers of two >= 16, num_warps a power of "
                             f"two, num_stages >= 1")


def _check_backend_limits(backend, q, k_v, causal) -> None:
    seq_k = k_v[0].shape[1]
    on_cuda = q.device.type == "cuda"
    if backend in _TRITON_BACKENDS and not on_cuda:
        if q.device.type != "cpu":
            raise ValueError(f"backend {backend!r} runs CUDA tensors (or CPU ones, interpreted), got {q.device.type}")
        if problem := interpreter_problem():
            raise ValueError(f"backend {backend!r} got CPU tensors but {problem}")
    if backend == "triton_hopper" and (reason := hopper_unsupported(q, *k_v)):
        raise ValueError(f"backend 'triton_hopper' {reason}; backend 'triton' falls back to the portable kernels")
    if backend in ("sdpa_cudnn", "sdpa_flash", "flash_attn"):
        if backend == "flash_attn":
            _flash_attn_interface()
        if not on_cuda:
            raise ValueError(f"backend {backend!r} needs CUDA tensors, got {q.device.type} tensors")
        if q.dtype not in _HALF_DTYPES:
            raise ValueError(f"backend {backend!r} supports bfloat16 and float16 only, got {q.dtype}")
        if backend != "flash_attn" and causal and q.shape[1] != seq_k:
            raise ValueError(f"backend {backend!r} aligns the causal mask top-left, so it supports causal only "
                             f"with equal lengths; got Sq={q.shape[1]}, Sk={seq_k}")


def _validate_backward(dout, q, out, lse) -> None:
    batch, seq_q, heads, _ = q.shape
    for name, t in (("dout", dout), ("out", out)):
        if not isinstance(t, torch.Tensor) or t.shape != q.shape:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got {got}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}; supported: bfloat16, float16, float32")
    if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != (batch, heads, seq_q):
        got = tuple(lse.shape) if isinstance(lse, torch.Tensor) else type(lse).__name__
        raise ValueError(f"lse must have shape [B, H, Sq] = {(batch, heads, seq_q)}, got {got}")
    if lse.dtype != torch.float32:
        raise ValueError(f"lse must be float32, got {lse.dtype}")
    for name, t in (("dout", dout), ("out", out), ("lse", lse)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")


# ------------------------------------------------------------------------------------------ torch SDPA ops

def _heads_major(x: torch.Tensor, group: int = 1) -> torch.Tensor:
    """[B, S, Hx, D] -> [B, Hx * group, S, D] (SDPA's dim order), each head repeated `group` times. A view of x's
    tokens-major memory when group is 1: the cuDNN and FlashAttention-2 ops read the strides (the last dim must
    be dense), so a copy into heads-major memory would only add a pass over the tensor."""
    if group > 1:
        x = x.repeat_interleave(group, dim=2)
    return x.transpose(1, 2)


def _tokens_major(grad: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """SDPA gradient [B, H, S, D] -> [B, S, H / group, D] in `dtype`, summed over each group of repeated heads
    (accumulated in float32 by the reduction itself: one pass, whatever `dtype` is)."""
    grad = grad.transpose(1, 2)
    if group > 1:
        grad = grad.unflatten(2, (-1, group)).sum(3, dtype=dtype)
    return grad.to(dtype).contiguous()


def _sdpa_forward(q, k, v, causal, scale, out_dtype, backend):
    group = q.shape[2] // k.shape[2]
    qt, kt, vt = _heads_major(q), _heads_major(k, group), _heads_major(v, group)
    if backend == "sdpa_cudnn":
        result = aten._scaled_dot_product_cudnn_attention(qt, kt, vt, None, True, 0.0, causal, False,
                                                                    scale=scale)
    else:
        result = aten._scaled_dot_product_flash_attention(qt, kt, vt, 0.0, causal, False, scale=scale)
    out, lse = result[0], result[1]
    batch, seq_q, heads, _ = q.shape
    # The ops write out in q's memory order, so the tokens-major view is dense and only out_dtype may cost a pass.
    # cuDNN returns lse as [B, H, Sq, 1], FlashAttention as [B, H, Sq]: float32 both.
    return out.transpose(1, 2).to(out_dtype).contiguous(), lse.float().reshape(batch, heads, seq_q)


def _sdpa_backward(dout, q, k, v, out, lse, causal, scale, backend, grad_dtype):
    group = q.shape[2] // k.shape[2]
    batch, seq_q, heads, _ = q.shape
    seq_k = k.shape[1]
    qt, kt, vt = _heads_major(q), _heads_major(k, group), _heads_major(v, group)
    # dout and out join q as operands in q's dtype (a no-op for the training step's bf16 ones)
    dot, ot = _heads_major(dout.to(q.dtype)), _heads_major(out.to(q.dtype))
    unused_rng = torch.empty((), dtype=torch.int64, device=q.device)  # philox seed/offset: read only with dropout
    if backend == "sdpa_cudnn":
        dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
            dot, qt, kt, vt, ot, lse.reshape(batch, heads, seq_q, 1).contiguous(), unused_rng, unused_rng,
            None, None, None, seq_q, seq_k, 0.0, causal, scale=scale)
    else:
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            dot, qt, kt, vt, ot, lse.contiguous(), None, None, seq_q, seq_k, 0.0, causal, unused_rng, unused_rng,
            scale=scale)
    return _tokens_major(dq, 1, grad_dtype), _tokens_major(dk, group, grad_dtype), _tokens_major(dv, group, grad_dtype)


# -------------------------------------------------------------------------------------- flash-attn package

def _flash_attn_interface():
    try:
        from flash_attn import flash_attn_interface
    except ImportError:
        raise ValueError(_FLASH_ATTN_MISSING) from None
    return flash_attn_interface


def _flash_attn_forward(q, k, v, causal, scale, out_dtype):
    fa = _flash_attn_interface()
    out, lse, _ = fa.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, return_attn_probs=True)
    # flash-attn marks a row that sees no key with lse +inf (so its backward gets P = 0); ours says -inf.
    return out.to(out_dtype), lse.float().masked_fill(lse == math.inf, -math.inf)


def _flash_attn_backward(dout, q, k, v, out, lse, causal, scale):
    fa = _flash_attn_interface()
    backward = fa._flash_attn_backward
    # 2.7+ registers it as a torch custom op (the Python function is `_init_fn`) with separate window sizes.
    params = inspect.signature(getattr(backward, "_init_fn", backward)).parameters
    window = ({"window_size_left": -1, "window_size_right": -1} if "window_size_left" in params
              else {"window_size": (-1, -1)})
    softcap = {"softcap": 0.0} if "softcap" in params else {}
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    backward(dout.to(q.dtype).contiguous(), q, k, v, out.to(q.dtype).contiguous(),
             lse.masked_fill(lse == -math.inf, math.inf).contiguous(), dq, dk, dv, dropout_p=0.0,
             softmax_scale=scale, causal=causal, alibi_slopes=None, deterministic=False, rng_state=None,
             **window, **softcap)
    return dq.float(), dk.float(), dv.float()


# -------------------------------------------------------------------------------------------------- dispatch

def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _uses_hopper(backend, q, k, v) -> bool:
    """Which kernel family serves a Triton backend's call, both directions: the forced one, or for "triton" the
    Hopper kernels where they run the inputs (sm_90, Triton 3.6, D 64/128, 16-bit; documents or not: both families
    take key spans), else the portable ones. On H200
    the Hopper forward ran 587-609 TF/s at D=128, 16k (compare/results/kernels-gluon-2026-11-22-h200), its
    warp-specialised backward 520-540 TF/s against the portable one's 377-395 at D=128, 426-429 against 332-337 at
    D=64 (compare/results/kernels-gluon-backward-2026-11-23-h200-h13d)."""
    if backend == "triton":
        return hopper_unsupported(q, k, v) is None
    return backend == "triton_hopper"


def _document_mask(causal, spans, seq_k):
    """(causal, spans) as the kernels take them: with documents, the causal rule folded into the spans."""
    if spans is None or not causal:
        return causal, spans
    return False, causally_limited(spans, seq_k)


def _forward(q, k, v, causal, scale, out_dtype, backend, config, spans=None):
    causal, spans = _document_mask(causal, spans, k.shape[1])
    if backend in _TRITON_BACKENDS:
        q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
        if _uses_hopper(backend, q, k, v):
            return hopper_forward(q, k, v, causal=causal, softmax_scale=scale, out_dtype=out_dtype, config=config,
                                  spans=spans)
        return portable_forward(q, k, v, causal=causal, softmax_scale=scale, out_dtype=out_dtype,
                                config=None if config is None else config.forward, spans=spans)
    if backend == "reference":
        return reference_attention_forward(q, k, v, causal=causal, softmax_scale=scale, out_dtype=out_dtype,
                                           spans=spans)
    if backend == "flash_attn":
        return _flash_attn_forward(q, k, v, causal, scale, out_dtype)
    return _sdpa_forward(q, k, v, causal, scale, out_dtype, backend)


def _backward(dout, q, k, v, out, lse, causal, scale, backend, config, grad_dtype, spans=None):
    causal, spans = _document_mask(causal, spans, k.shape[1])
    if backend in _TRITON_BACKENDS:
        # dout joins q, k, v as a tensor-core operand, so it takes their dtype.
        dout, q, k, v, out = (_last_dim_contiguous(x) for x in (dout.to(q.dtype), q, k, v, out))
        if _uses_hopper(backend, q, k, v):
            return hopper_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale, grad_dtype=grad_dtype,
                                   config=None if config is None else config.backward, spans=spans)
        return portable_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale, grad_dtype=grad_dtype,
                                 config=config, spans=spans)
    if backend == "reference":
        grads = reference_attention_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale,
                                             spans=spans)
    elif backend == "flash_attn":
        grads = _flash_attn_backward(dout, q, k, v, out, lse, causal, scale)
    else:
        return _sdpa_backward(dout, q, k, v, out, lse, causal, scale, backend, grad_dtype)
    return tuple(g.to(grad_dtype) for g in grads)


class _FlashAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, backend, config, spans):
        out, lse = keep_for_backward(lambda: _forward(q, k, v, causal, scale, q.dtype, backend, config, spans))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale, ctx.backend, ctx.config, ctx.spans = causal, scale, backend, config, spans
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(dout, q, k, v, out, lse, ctx.causal, ctx.scale, ctx.backend, ctx.config,
                               grad_dtype=q.dtype, spans=ctx.spans)
        return dq, dk, dv, None, None, None, None, None


# ------------------------------------------------------------------------------------------------ public API

def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                    softmax_scale: float | None = None, return_lse: bool = False, backend: str = "triton",
                    config: PortableConfig | HopperConfig | None = None, segment_ids: torch.Tensor | None = None):
    """Differentiable attention softmax(q k^T * scale) v, memory linear in the sequence length.

    q [B, Sq, H, D]; k, v [B, Sk, Hkv, D] with H a multiple of Hkv (grouped-query attention: query head h
    reads KV head h // (H // Hkv)). Returns out [B, Sq, H, D] in q's dtype, and with `return_lse=True` also
    lse [B, H, Sq], float32 natural-log log-sum-exp of the scaled scores (no gradient flows through lse).
    `softmax_scale` defaults to 1/sqrt(D). `causal=True` with Sq != Sk aligns the LAST query with the LAST
    key (bottom-right, like flash-attn 2.1+): query i sees key j iff j <= i + Sk - Sq; a query that sees no
    key (only possible when Sq > Sk) gets output 0, lse -inf and zero gradients. `config`: the launch shapes of
    the kernel family serving the call, None for the family's own choice (module doc). `segment_ids` [B, S]
    (self-attention, Sq == Sk): packed documents (`weights/documents.py`), each token attending only within its
    own; both of our kernel families and "reference" take them.
    """
    spans = None
    if segment_ids is not None:
        if k.shape[1] != q.shape[1]:
            raise ValueError(f"segment_ids need self-attention (Sq == Sk), got Sq={q.shape[1]}, Sk={k.shape[1]}")
        spans = document_spans(checked_segment_ids(segment_ids, q.shape[0], q.shape[1], q.device), causal=False)
    scale = _validate(q, k, v, causal=causal, softmax_scale=softmax_scale, backend=backend, config=config,
                      spans=spans)
    out, lse = _FlashAttentionFunction.apply(q, k, v, bool(causal), scale, backend, config, spans)
    return (out, lse) if return_lse else out


def exact_output_dtype(backend: str, dtype: torch.dtype) -> torch.dtype:
    """The narrowest `out_dtype` of `flash_attention_forward` that keeps all that `backend` computes for `dtype`
    inputs: the SDPA and flash-attn ops write out in the inputs' dtype (a float32 copy adds a pass and nothing
    else); ours and the reference hold it in float32 until they write it."""
    return dtype if backend in ("sdpa_cudnn", "sdpa_flash", "flash_attn") else torch.float32


def flash_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                            softmax_scale: float | None, out_dtype: torch.dtype | None = None,
                            backend: str = "triton", config: PortableConfig | HopperConfig | None = None,
                            spans: Spans | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pair-level forward, not differentiable: (out [B, Sq, H, D] in `out_dtype` or q's dtype, lse [B, H, Sq]
    float32). A ring asks for float32 `out` so partial outputs merge by lse without rounding. `config` as for
    `flash_attention`. `spans`: the documents' key spans of the pair (`torch_impl.documents`), intersected with
    the causal rule when `causal`."""
    scale = _validate(q, k, v, causal=causal, softmax_scale=softmax_scale, backend=backend, config=config,
                      spans=spans)
    if out_dtype is not None and out_dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"out_dtype must be one of bfloat16, float16, float32 or None, got {out_dtype}")
    with torch.no_grad():
        return _forward(q, k, v, bool(causal), scale, out_dtype or q.dtype, backend, config, spans)


def flash_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, *, causal: bool, softmax_scale: float | None,
                             backend: str = "triton", config: PortableConfig | HopperConfig | None = None,
                             spans: Spans | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pair-level backward: (dq, dk, dv), float32, so a ring can accumulate them across steps.

    `out` and `lse` may be the GLOBAL ones (merged over all key blocks): delta = rowsum(dout * out) is then
    the global one and P = exp(S - lse) this pair's share of the global softmax, so the per-pair gradients
    sum to the full gradient. The kernels take dout in q's dtype (a matmul operand next to q, k, v). `config` and
    `spans` as for `flash_attention_forward`.
    """
    scale = _validate(q, k, v, causal=causal, softmax_scale=softmax_scale, backend=backend, config=config,
                      spans=spans)
    _validate_backward(dout, q, out, lse)
    with torch.no_grad():
        return _backward(dout, q, k, v, out, lse, bool(causal), scale, backend, config, grad_dtype=torch.float32,
                         spans=spans)
