"""FlashAttention for JAX: public API, validation, backend dispatch, the check of `config=` and autodiff. Twin of
`torch_impl/kernels/flash_attention.py`; the kernels, and the block-size configs with their heuristics, live in
`kernels/portable/` (`PortableConfig`) and `kernels/hopper/` (`HopperConfig`).

Two levels:
  - `flash_attention(q, k, v, ...)`: drop-in attention (an `AttentionFn` with the defaults), differentiable
    through `jax.custom_vjp`; works under jit and inside `jax.shard_map`.
  - `flash_attention_forward` / `flash_attention_backward`: the pair-level contract the ring attention
    calls per (query shard, key shard) pair: the forward returns (out, lse) with out in fp32 on request so
    partials merge without rounding, the backward takes the globally merged out/lse and returns fp32
    gradients that sum over pairs to the full ones.

Backends (`backend=`, `weights.training.ATTENTION_BACKENDS["jax"]`):
  - "pallas" (default): our Pallas kernels: the portable family (`kernels/portable/`: Pallas's Triton lowering; on
    CPU in Pallas interpret mode). On a Hopper GPU (sm90), bf16/fp16 at the head dims of HOPPER_DEFAULT_HEAD_DIMS
    get the Hopper family (`kernels/hopper/`: Mosaic GPU kernels) instead, and a Hopper call they cannot serve warns
    once and falls back.
  - "pallas_hopper" / "pallas_portable": force one of the two families. "pallas_hopper" needs an sm90 GPU, or runs
    under Pallas's Mosaic GPU interpreter on CPU (tests), and raises where its dtype/head dim is not served.
  - "reference": the plain-math fp32 functions of `jax_impl.attention`.
  - "cudnn" (GPU only, bf16/fp16, head dim a multiple of 8 up to 256, causal only with Sq == Sk since cuDNN's
    causal mask is top-left aligned): cuDNN's fused attention through jax's cuDNN module. Its forward with
    `return_residual=True` returns the softmax statistics, which are our natural-log lse [B, H, Sq]. Its
    custom_vjp backward ignores any lse cotangent and only uses its own residuals, so the pair backward calls
    jax's private backward rule (`fused_attention_stablehlo._dot_product_attention_bwd_rule`, identical in
    jax 0.10.2 and 0.11.2; checked by signature at call time) with the supplied global out and lse as the
    residuals -- cuDNN recomputes delta = rowsum(dO * O) from that out itself. Caveats: cuDNN takes O in
    the input dtype and returns bf16/fp16 outputs and gradients, so fp32 out/gradients requested by the
    pair contract are exact casts of half-precision results (the ring accumulates them with that rounding).

Packed documents (`weights/documents.py`): `flash_attention(..., segment_ids=)` turns them into key spans
(`jax_impl/documents.py`, traceable), which the pair functions take as `spans=` (the ring's per-step spans); both
Pallas families and "reference" take them ("pallas" picks the family as without documents: the Hopper one on sm90
where it serves the inputs; the Mosaic backward in its two-kernel form, the heuristic's with documents), cuDNN
refuses them with one ValueError naming those that take them (`DOCUMENT_BACKENDS`).

Block sizes (`config=`, every entry point): those of the Pallas kernel family serving the call, a `PortableConfig`
or a `HopperConfig` (the other family's is a ValueError naming both, and so is any config for "reference" and
"cudnn"); None picks the family's heuristic (`portable.config.default_config`, `hopper.config.default_config`: for
the Mosaic kernels by head dim, dtype and the forward's out dtype, among the configs that fit the device's shared
memory). A `HopperConfig` some kernel of which does not fit is a ValueError naming it and the bytes, before anything
compiles. They travel only as this argument: the module holds no state that a call could change.

Semantics shared by every backend: q [B, Sq, H, D], k/v [B, Sk, Hkv, D], H a multiple of Hkv (GQA: K/V are
never repeated). `causal=True` with Sq != Sk aligns the last query with the last key (the flash-attention
convention): query i sees key j iff j <= i + Sk - Sq. A query that sees no key (causal, Sq > Sk) gets
out 0, lse -inf and zero gradients. lse is [B, H, Sq] float32, natural log, of the scaled scores.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import warnings

import jax
import jax.numpy as jnp
from jax import lax

from jax_impl.attention import reference_attention_backward, reference_attention_forward
from jax_impl.documents import Spans, causally_limited, checked_segment_ids, document_spans
from jax_impl.kernels.hopper.backward import hopper_backward
from jax_impl.kernels.hopper import config as hopper_config
from jax_impl.kernels.hopper.config import HopperConfig, hopper_unsupported, smem_limit
from jax_impl.kernels.hopper.forward import hopper_forward
from jax_impl.kernels.portable.backward import portable_backward
from jax_impl.kernels.portable import config as portable_config
from jax_impl.kernels.portable.config import PortableConfig
from jax_impl.kernels.portable.forward import portable_forward
from jax_impl.remat import keep_for_backward
from weights.attention import check_attention_shapes, check_config_family
from weights.documents import documents_refusal
from weights.training import ATTENTION_BACKENDS

BACKENDS = ATTENTION_BACKENDS["jax"]
# Head dims at which "pallas" takes the Hopper kernels on sm90, as measured on an H200 (compare/results/README.md;
# the GPU tests of tests/test_kernels_hopper_jax.py passed there): at D=128 forward+backward 14-25 % above the
# Triton lowering (2026-11-22); at D=64, 16k, 392-410 TF/s (2026-11-23) against the Triton lowering's 345 with
# its retuned blocks (2026-11-21, non-causal, Hkv=8, where Mosaic runs 410).
HOPPER_DEFAULT_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
DOCUMENT_BACKENDS = ("pallas", "pallas_portable", "pallas_hopper", "reference")  # take documents (`_check_spans`)
MAX_HEAD_DIM = 256


def _interpret() -> bool:
    """Pallas kernels compile through Triton on GPUs and run interpreted everywhere else."""
    return jax.default_backend() != "gpu"


def _on_hopper() -> bool:
    device = jax.devices()[0]
    return jax.default_backend() == "gpu" and getattr(device, "compute_capability", None) == "9.0"


def _uses_hopper(backend: str, q) -> bool:
    """Which Pallas kernel family serves this call: True for the Hopper family (Mosaic GPU), False for the portable
    one (Triton lowering). Both take documents, so they do not decide it."""
    if backend == "pallas_portable":
        return False
    unsupported = hopper_unsupported(q, q.shape[3])
    if backend == "pallas_hopper":
        if jax.default_backend() == "gpu" and not _on_hopper():
            raise ValueError(f"backend='pallas_hopper' needs a Hopper (sm90) GPU; this one is "
                             f"{getattr(jax.devices()[0], 'compute_capability', '?')}")
        if unsupported:
            raise ValueError(f"backend='pallas_hopper' does not serve {unsupported}; use 'pallas' or "
                             f"'pallas_portable'")
        return True
    if not _on_hopper():
        return False
    if unsupported:
        if jnp.dtype(q.dtype) != jnp.float32:  # fp32 is a correctness path: portable, no warning
            warnings.warn(f"flash_attention: the Hopper kernels do not serve {unsupported}; using the portable "
                          f"kernels", stacklevel=3)
        return False
    return q.shape[3] in HOPPER_DEFAULT_HEAD_DIMS


def runs_hopper_kernels(backend: str, q) -> bool:
    """Whether the Hopper family (Mosaic GPU kernels) serves `backend`'s calls on inputs like q (the ring then runs
    its blocks in as few kernel shapes as it can: `ring_attention._kernel_pieces`)."""
    return backend in ("pallas", "pallas_hopper") and _uses_hopper(backend, q)


def _pallas_config(backend: str, q, config, *, interpret: bool, documents: bool,
                   out_dtype=None) -> PortableConfig | HopperConfig:
    """The config of the Pallas kernel family serving this call (a `HopperConfig` for the Hopper family, else a
    `PortableConfig`): `config` if given, else the family's heuristic for q's head dim and dtype, and for the Hopper
    family the forward's out dtype (None: q's; the ring's fp32 partials take more shared memory), whether the call
    has `documents` (the backward's form) and the device's shared memory."""
    uses_hopper = _uses_hopper(backend, q)
    if config is None:
        return (hopper_config.default_config(q.shape[3], dtype=q.dtype, out_dtype=out_dtype,
                                             limit=smem_limit(interpret), documents=documents) if uses_hopper
                else portable_config.default_config(q.shape[3], q.dtype, interpret=interpret))
    check_config_family(config, uses_hopper=uses_hopper, hopper_config=HopperConfig, portable_config=PortableConfig,
                        backend=backend)
    return config


# --- validation -----------------------------------------------------------------------------------------------

def _check_backend(backend: str, config=None) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if config is not None and not isinstance(config, (PortableConfig, HopperConfig)):
        raise ValueError(f"config must be a PortableConfig, a HopperConfig or None, got {type(config).__name__}")
    if config is not None and not backend.startswith("pallas"):
        raise ValueError(f"config sets Pallas kernel block sizes; backend={backend!r} takes none")


def _validate_qkv(q, k, v) -> None:
    check_attention_shapes(q.shape, k.shape, v.shape)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if jnp.dtype(x.dtype) not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} dtype must be bfloat16, float16 or float32, got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    head_dim = q.shape[3]
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {MAX_HEAD_DIM}], got {head_dim}")


def _resolve_scale(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real) or not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be a positive Python number or None, got {softmax_scale!r}")
    return float(softmax_scale)


def _check_spans(spans, q, backend: str) -> None:
    """Documents' key spans (`jax_impl.documents.Spans`, int32 [B, Sq] each) and a backend that takes them: either
    Pallas family (also through "pallas") and the reference."""
    if spans is None:
        return
    if backend not in DOCUMENT_BACKENDS:
        raise ValueError(documents_refusal(backend, DOCUMENT_BACKENDS))
    if not isinstance(spans, Spans):
        raise ValueError(f"spans must be a jax_impl.documents.Spans, got {type(spans).__name__}")
    for name, x in zip(spans._fields, spans):
        if getattr(x, "dtype", None) != jnp.int32 or tuple(x.shape) != tuple(q.shape[:2]):
            got = f"{x.dtype} {tuple(x.shape)}" if hasattr(x, "shape") else type(x).__name__
            raise ValueError(f"spans.{name} must be an int32 array [B, Sq] = {tuple(q.shape[:2])}, got {got}")


def _document_mask(causal: bool, spans, seq_k: int):
    """(causal, spans) as the kernels take them: with documents, the causal rule folded into the spans."""
    if spans is None or not causal:
        return causal, spans
    return False, causally_limited(spans, seq_k)


def _check_causal(causal) -> bool:
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be a bool, got {causal!r}")
    return causal


def _resolve_out_dtype(out_dtype, q_dtype):
    dtype = jnp.dtype(q_dtype if out_dtype is None else out_dtype)
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"out_dtype must be bfloat16, float16, float32 or None, got {out_dtype}")
    return dtype


def _validate_backward_inputs(dout, q, out, lse) -> None:
    if dout.shape != q.shape:
        raise ValueError(f"dout shape {dout.shape} must equal q shape {q.shape}")
    if out.shape != q.shape:
        raise ValueError(f"out shape {out.shape} must equal q shape {q.shape}")
    batch, seq_q, heads, _ = q.shape
    if lse.shape != (batch, heads, seq_q):
        raise ValueError(f"lse shape {lse.shape} must be [batch, heads, seq_q] = {(batch, heads, seq_q)}")
    for name, x in (("dout", dout), ("out", out), ("lse", lse)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be a floating-point array, got {x.dtype}")


# --- cuDNN ------------------------------------------------------------------------------------------------------

_CUDNN_BWD_RULE_PARAMS = ("scale", "seed", "dropout_rate", "variadic_args", "mask_type", "layout",
                          "sliding_window_length", "is_training", "return_residual", "res", "grad_output")


def _cudnn_module(q, k, causal: bool):
    """jax's cuDNN attention module, after checking this call is one cuDNN can serve."""
    if jax.default_backend() != "gpu":
        raise ValueError(f"backend='cudnn' needs a CUDA GPU; jax's default backend is {jax.default_backend()!r}")
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"backend='cudnn' supports bfloat16 and float16 inputs, got {q.dtype}")
    if q.shape[3] % 8:
        raise ValueError(f"backend='cudnn' needs head_dim a multiple of 8, got {q.shape[3]}")
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError("backend='cudnn' aligns the causal mask top-left, so causal needs Sq == Sk; "
                         f"got Sq={q.shape[1]}, Sk={k.shape[1]}")
    from jax._src.cudnn import fused_attention_stablehlo  # private: no public API returns lse or takes it back
    return fused_attention_stablehlo


def _cudnn_forward(q, k, v, *, causal, softmax_scale, out_dtype):
    cudnn = _cudnn_module(q, k, causal)
    mask = cudnn.MaskType.CAUSAL if causal else cudnn.MaskType.NO_MASK
    out, lse = cudnn.dot_product_attention(q, k, v, scale=softmax_scale, mask_type=mask, qkv_layout="BTNH",
                                           return_residual=True)
    return out.astype(out_dtype), lse


def _cudnn_backward(dout, q, k, v, out, lse, *, causal, softmax_scale):
    cudnn = _cudnn_module(q, k, causal)
    rule = cudnn._dot_product_attention_bwd_rule
    if tuple(inspect.signature(rule).parameters) != _CUDNN_BWD_RULE_PARAMS:
        raise NotImplementedError(f"backend='cudnn' backward was written against jax 0.10/0.11's private cuDNN "
                                  f"backward rule; jax {jax.__version__} changed it")
    unused = jnp.zeros(0, q.dtype)  # bias, seqlens, offsets and page tables: none, as jax itself passes them
    residuals = (q, k, v, unused, unused, unused, unused, unused, unused, unused, lse.astype(jnp.float32),
                 out.astype(q.dtype))
    mask = cudnn.MaskType.CAUSAL if causal else cudnn.MaskType.NO_MASK
    dq, dk, dv, *_ = rule(softmax_scale, 42, 0.0, (False, False), mask, cudnn.AttentionLayout.BTNH.value, None,
                          cudnn.check_cudnn_version(), False, residuals, dout.astype(q.dtype))
    return dq.astype(jnp.float32), dk.astype(jnp.float32), dv.astype(jnp.float32)


# --- pair-level API ---------------------------------------------------------------------------------------------

def flash_attention_forward(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool, softmax_scale=None,
                            out_dtype=None, backend: str = "pallas",
                            config: PortableConfig | HopperConfig | None = None, spans: Spans | None = None
                            ) -> tuple[jax.Array, jax.Array]:
    """One attention pair's forward: (out [B, Sq, H, D] in `out_dtype` or q's dtype, lse [B, H, Sq] float32).
    `softmax_scale=None` means 1/sqrt(D). Not differentiable itself: pair it with `flash_attention_backward`.
    `config`: the Pallas kernels' block sizes, None for the heuristic (module doc). `spans`: the documents' key
    spans of the pair (`jax_impl.documents`), intersected with the causal rule when `causal`."""
    _check_backend(backend, config)
    _validate_qkv(q, k, v)
    _check_spans(spans, q, backend)
    causal, spans = _document_mask(_check_causal(causal), spans, k.shape[1])
    scale = _resolve_scale(softmax_scale, q.shape[3])
    out_dtype = _resolve_out_dtype(out_dtype, q.dtype)
    if backend == "reference":
        return reference_attention_forward(q, k, v, causal=causal, softmax_scale=scale, out_dtype=out_dtype,
                                           spans=spans)
    if backend == "cudnn":
        return _cudnn_forward(q, k, v, causal=causal, softmax_scale=scale, out_dtype=out_dtype)
    interpret = _interpret()
    config = _pallas_config(backend, q, config, interpret=interpret, documents=spans is not None,
                            out_dtype=out_dtype)
    if isinstance(config, HopperConfig):
        return hopper_forward(q, k, v, causal=causal, softmax_scale=scale, out_dtype=out_dtype, config=config,
                              interpret=interpret, spans=spans)
    return portable_forward(q, k, v, causal=causal, softmax_scale=scale, out_dtype=out_dtype, config=config.forward,
                            interpret=interpret, spans=spans)


def flash_attention_backward(dout: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, out: jax.Array,
                             lse: jax.Array, *, causal: bool, softmax_scale=None, backend: str = "pallas",
                             config: PortableConfig | HopperConfig | None = None, spans: Spans | None = None
                             ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One attention pair's backward: (dq, dk, dv) in float32, shaped like q, k, v (dk/dv per KV head).

    `out` and `lse` may be the globally merged ones of a ring step (any float dtype): delta = rowsum(dout*out)
    is computed from the given out, and P = exp(S - lse) is then this pair's share of the global softmax.
    `config` and `spans` as for `flash_attention_forward`.
    """
    _check_backend(backend, config)
    _validate_qkv(q, k, v)
    _validate_backward_inputs(dout, q, out, lse)
    _check_spans(spans, q, backend)
    causal, spans = _document_mask(_check_causal(causal), spans, k.shape[1])
    scale = _resolve_scale(softmax_scale, q.shape[3])
    if backend == "reference":
        return reference_attention_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale,
                                            spans=spans)
    if backend == "cudnn":
        return _cudnn_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale)
    interpret = _interpret()
    config = _pallas_config(backend, q, config, interpret=interpret, documents=spans is not None)
    if isinstance(config, HopperConfig):
        return hopper_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale, config=config,
                               interpret=interpret, spans=spans)
    return portable_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale,
                             dkdv_config=config.backward_dkdv, dq_config=config.backward_dq, interpret=interpret,
                             spans=spans)


# --- differentiable API -----------------------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _attention_with_lse(q, k, v, spans, causal, softmax_scale, backend, config):
    return flash_attention_forward(q, k, v, causal=causal, softmax_scale=softmax_scale, backend=backend,
                                   config=config, spans=spans)


def _attention_fwd(q, k, v, spans, causal, softmax_scale, backend, config):
    out, lse = keep_for_backward(*flash_attention_forward(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                                          backend=backend, config=config, spans=spans))
    return (out, lse), (q, k, v, spans, out, lse)


def _attention_bwd(causal, softmax_scale, backend, config, residuals, cotangents):
    q, k, v, spans, out, lse = residuals
    dout, _ = cotangents  # lse is non-differentiable: flash_attention hands it out under stop_gradient
    dq, dk, dv = flash_attention_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
                                          backend=backend, config=config, spans=spans)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None  # the spans are integers


_attention_with_lse.defvjp(_attention_fwd, _attention_bwd)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True, softmax_scale=None,
                    return_lse: bool = False, backend: str = "pallas",
                    config: PortableConfig | HopperConfig | None = None, segment_ids=None):
    """FlashAttention: out [B, Sq, H, D] in q's dtype (and lse [B, H, Sq] float32 with return_lse=True).

    q [B, Sq, H, D], k/v [B, Sk, Hkv, D] with H a multiple of Hkv (GQA, K/V not repeated); bf16, fp16 or
    fp32 (fp32 accumulation throughout); any Sq, Sk >= 1; head_dim up to 256. `softmax_scale=None` means
    1/sqrt(D). `causal=True` with Sq != Sk aligns the last query with the last key (flash-attention
    convention): query i sees key j iff j <= i + Sk - Sq; a query seeing no key gets out 0 and lse -inf.

    Differentiable in q, k, v (custom VJP running the backward kernels). The returned lse is wrapped in
    `stop_gradient`: it is for inspection and merging, and gradients flow only through out. Works under jit
    and inside `jax.shard_map`. `backend`: one of BACKENDS, "pallas" by default; `config`: the Pallas kernels'
    block sizes, None for the heuristic (see module doc). `segment_ids` [B, S] (self-attention, Sq == Sk):
    packed documents (`weights/documents.py`), each token attending only within its own; both Pallas families
    and "reference" take them (`DOCUMENT_BACKENDS`).
    """
    _check_backend(backend, config)
    _validate_qkv(q, k, v)
    causal = _check_causal(causal)
    scale = _resolve_scale(softmax_scale, q.shape[3])
    spans = None
    if segment_ids is not None:
        if k.shape[1] != q.shape[1]:
            raise ValueError(f"segment_ids need self-attention (Sq == Sk), got Sq={q.shape[1]}, Sk={k.shape[1]}")
        spans = document_spans(checked_segment_ids(segment_ids, q.shape[0], q.shape[1]), causal=False)
        _check_spans(spans, q, backend)
    out, lse = _attention_with_lse(q, k, v, spans, causal, scale, backend, config)
    if return_lse:
        return out, lax.stop_gradient(lse)
    return out
