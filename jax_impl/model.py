"""Llama in JAX with Flax NNX: embedding, RMSNorm, RoPE (llama3 scaling), GQA attention, SwiGLU MLP, final norm, LM
head. Twin of `torch_impl/model.py`: same modules, same names, same parameter paths (the converted checkpoint's names).

NNX rather than Linen because its modules are plain Python objects with attribute paths, so the module tree reads
like the torch one, parameters are set from the converted checkpoint directly (no `init` that re-initialises them),
and `nnx.split`/`nnx.merge` still give jit and sharding a pure pytree. Weights keep the torch/HF `[out, in]` layout
(`Linear.weight`), so one checkpoint name means one array in both backends.

Attention is pluggable: `Llama(config, params, attention_fn=...)` takes any `AttentionFn` (`fn(q, k, v) -> out`,
causal); the default is plain math; the flash kernel and the ring (inside `jax.shard_map`) drop in unchanged.
`positions` gives the global position of each local token, for sequence-parallel shards. Packed documents
(`segment_ids` [B, S], `weights/documents.py`) reach the attention function as its `segment_ids` keyword, and
their RoPE positions restart at each document: positions [B, S] then, each token's offset in its document
(`weights.documents.document_offsets`), since a document's tokens must rotate as they would alone. `remat`
checkpoints each decoder layer (a scan of `jax.checkpoint`-ed layers; "full": only layer inputs are kept for the
backward, which recomputes the rest; "save-attention": the attention's output and log-sum-exp are kept too, so the
backward does not rerun the attention; see `jax_impl/remat.py`), or the layers `checkpointed` names. With
`layer_weight_dtype` and `gather_layer_weight`, the layers may be given sharded fp32 weights: each checkpointed layer
casts and gathers its own (jax_impl/train.py says why).

`convert_to_fp8` switches the decoder layers' linears to `fp8_matmul`, the FP8 recipe of weights/fp8.py
(`twinflash train --fp8`; the torch twin uses torchao's Float8Linear): a `jax.custom_vjp` whose forward and both
backward matmuls quantise their operands per tensor (an activation per device's tokens) to float8 and run
`lax.dot_general` on the float8 arrays into bf16, times the inverse scales (`_scaled_dot`: the form XLA turns into
one cuBLASLt FP8 GEMM on GPUs; XLA runs it on CPU as well).

The decoder layers' weights come one per canonical name ("layers.<i>.<suffix>") or stacked over the layers
("layers.*.<suffix>", [num_layers, ...]: `stack_layers`, the JAX training state's layout), which the scan of
checkpointed layers takes as it is instead of stacking a copy.

Numerics follow HF transformers' LlamaForCausalLM: RMSNorm in float32 then cast back before the weight multiply,
RoPE angles in float32 cast to the compute dtype, logits returned as float32. In bf16 the RMSNorm weight multiply
and the embedding lookup are computed from float32 views (the same values), so that their weights' gradients, sums
over every token, accumulate in float32 as torch's reductions and CUDA embedding backward do.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_impl.attention import AttentionFn, reference_attention
from jax_impl.profiling import region
from jax_impl.remat import checkpointed_scan
from weights import LlamaConfig, open_weights, rope_inverse_frequencies
from weights.fp8 import AMAX_EPS, FP8_DTYPE, FP8_MAX, GRADIENT_DTYPE, is_fp8_linear
from weights.parallel import CheckpointedLayers

DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}
STACKED_LAYERS = "layers.*."  # "layers.*.<suffix>": every decoder layer's <suffix> weight, stacked [num_layers, ...]


def is_stacked(name: str) -> bool:
    return name.startswith(STACKED_LAYERS)


def _layer_index(name: str) -> int | None:
    parts = name.split(".", 2)
    return int(parts[1]) if parts[0] == "layers" and len(parts) == 3 and parts[1].isdigit() else None


def _stack_arrays(values: list) -> Any:
    return jnp.stack(values) if isinstance(values[0], jax.Array) else np.stack(values)


def _unstack_array(value: Any) -> list:
    return list(jnp.unstack(value)) if isinstance(value, jax.Array) else list(value)


def stack_layers(params: Mapping[str, Any], stack: Callable[[list], Any] = _stack_arrays) -> dict[str, Any]:
    """`params` by canonical name with each decoder-layer weight stacked over the layers: "layers.<i>.<suffix>"
    becomes "layers.*.<suffix>" = `stack`([layer 0's, layer 1's, ...]) (default: jnp.stack of jax arrays,
    np.stack of numpy ones), placed where its first layer's was; other names stay."""
    layers: dict[str, dict[int, Any]] = {}
    order: dict[str, Any] = {}
    for name, value in params.items():
        index = _layer_index(name)
        key = name if index is None else STACKED_LAYERS + name.split(".", 2)[2]
        order.setdefault(key, value)
        if index is not None:
            layers.setdefault(key, {})[index] = value
    return {key: stack([layers[key][i] for i in sorted(layers[key])]) if key in layers else value
            for key, value in order.items()}


def unstack_layers(params: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of `stack_layers` (jnp.unstack of jax arrays, rows of numpy ones), in canonical order: layer 0's
    weights, then layer 1's, ..., where the first stacked weight was; other names stay."""
    layers = {name[len(STACKED_LAYERS):]: _unstack_array(value) for name, value in params.items() if is_stacked(name)}
    unstacked = {}
    for name, value in params.items():
        if not is_stacked(name):
            unstacked[name] = value
        elif name[len(STACKED_LAYERS):] == next(iter(layers)):
            for i in range(len(layers[name[len(STACKED_LAYERS):]])):
                unstacked.update({f"layers.{i}.{suffix}": weights[i] for suffix, weights in layers.items()})
    return unstacked


TokenBlocks = tuple[int, int]  # (fsdp, sp): how a [B, S, ...] activation's tokens are split over the devices


def _device_blocks(x: jax.Array, blocks: TokenBlocks) -> jax.Array:
    """x [B, S, ...] as [fsdp, sp, B / fsdp * S / sp, ...]: block (f, s) holds device (f, s)'s tokens (batch over
    fsdp, sequence over sp in the ring layout's order, which the global arrays keep)."""
    fsdp, sp = blocks
    x = x.reshape(fsdp, x.shape[0] // fsdp, sp, x.shape[1] // sp, *x.shape[2:]).swapaxes(1, 2)
    return x.reshape(fsdp, sp, -1, *x.shape[4:])


def _from_device_blocks(x: jax.Array, batch: int) -> jax.Array:
    """The inverse of `_device_blocks`, for `batch` sequences."""
    fsdp, sp = x.shape[:2]
    x = x.reshape(fsdp, sp, batch // fsdp, -1, *x.shape[3:]).swapaxes(1, 2)
    return x.reshape(batch, -1, *x.shape[4:])


def quantise(x: jax.Array, dtype: str, axes: tuple[int, ...] | None = None) -> tuple[jax.Array, jax.Array]:
    """(x scaled into float8 `dtype`, saturated, and its float32 scale), one scale per slice over `axes` (default:
    per tensor): weights/fp8.py's recipe, scale = 448 / max(amax, eps), torchao's formula (torchao divides in
    float64 then rounds to float32; one correctly rounded float32 division gives the same number, as 53 >= 2 * 24
    + 2 bits make double rounding harmless)."""
    amax = jnp.max(jnp.abs(x), axis=axes, keepdims=True).astype(jnp.float32)
    scale = FP8_MAX / jnp.maximum(amax, AMAX_EPS)
    return _scaled_cast(x, scale, dtype), scale


def _scaled_cast(x: jax.Array, scale: jax.Array, dtype: str) -> jax.Array:
    return jnp.clip(x.astype(jnp.float32) * scale, -FP8_MAX, FP8_MAX).astype(jnp.dtype(dtype))


def _transposed_cast(x: jax.Array, scale: jax.Array, dtype: str) -> jax.Array:
    """x [..., rows, cols] cast as `_scaled_cast` casts it, as [..., cols, rows] in memory: the operand a GEMM that
    contracts over the rows takes (cuBLASLt's FP8 GEMMs take both operands contraction-minor). Behind an
    optimization barrier, since otherwise XLA folds the transpose into the dot and its GEMM rewriter puts it back
    after fusion as a lone float8 transpose, a loop-emitted kernel at a tenth of the bandwidth: one H200 ran one
    linear's fwd+bwd of the 1B MLP shape (32k tokens, 2048 -> 8192) in 4.95 ms that way, 3.1 ms this way, bf16
    4.1 (compare/results/train-fp8-jax-2026-11-29-h200)."""
    return jax.lax.optimization_barrier(_scaled_cast(jnp.swapaxes(x, -1, -2), scale, dtype))


def _quantised_blocks(x: jax.Array, dtype: str) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(x [fsdp, sp, tokens, features] quantised per device block, the same transposed ([fsdp, sp, features,
    tokens], `_transposed_cast`), the blocks' inverse scales [fsdp, sp])."""
    x_q, scale = quantise(x, dtype, (2, 3))
    return x_q, _transposed_cast(x, scale, dtype), 1 / scale[..., 0, 0]


def _scaled_dot(a_q: jax.Array, b_q: jax.Array, inverse_scale: jax.Array, dtype,
                precision: jax.lax.Precision) -> jax.Array:
    """One FP8 GEMM a_q [m, k] . b_q [n, k]^T of 2-D float8 operands, both contraction-minor, into `dtype`, times
    the scalar `inverse_scale` (1 / scale_a * 1 / scale_b) rounded to `dtype`: flax's fp8_scaled_dot_general form,
    which XLA's GEMM rewriter turns into a cuBLASLt FP8 GEMM with that scale in its epilogue, writing `dtype`
    directly (a float32 product rescaled in a second pass cost more than the FP8 GEMMs saved; XLA 0.11 rewrites no
    dequantised float32 form and folds no float32 scale into a bf16 result: compare/results/
    train-fp8-jax-2026-11-23-h200-h17k). `precision` HIGHEST turns off cuBLASLt's fast FP8 accumulation, as
    torchao's backward GEMMs run."""
    product = jax.lax.dot_general(a_q, b_q, (((1,), (1,)), ((), ())), precision=precision,
                                  preferred_element_type=dtype)
    return product * inverse_scale.astype(dtype)


def _per_block(fn: Callable, blocks: TokenBlocks) -> Callable:
    """`fn` over the device blocks ([fsdp, sp, ...] arguments and results): called once on a single block (scalar
    scales, which XLA folds into the GEMM), else vmapped (batched GEMMs, sharded as the blocks are; their
    per-block scales stay a separate multiply of the bf16 products)."""
    if blocks == (1, 1):
        return lambda *args: jax.tree.map(lambda a: a[None, None], fn(*(a[0, 0] for a in args)))
    return jax.vmap(jax.vmap(fn))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def fp8_matmul(x: jax.Array, weight: jax.Array, blocks: TokenBlocks) -> jax.Array:
    """x [B, S, in] @ weight [out, in].T in FP8 (weights/fp8.py), in x's dtype. Activations and output gradients
    get one scale per device's tokens (`blocks`), as each torch rank's Float8Linear scales its own; the (gathered)
    weight one scale. Each operand is cast in the layout its GEMM reads (`_transposed_cast`)."""
    return _fp8_matmul_forward(x, weight, blocks)[0]


def _fp8_matmul_forward(x: jax.Array, weight: jax.Array, blocks: TokenBlocks):
    x_q, x_transposed, x_inverse = _quantised_blocks(_device_blocks(x, blocks), FP8_DTYPE)
    w_q, w_scale = quantise(weight, FP8_DTYPE)
    w_inverse = 1 / w_scale.reshape(())
    forward = _per_block(lambda a, a_inverse: _scaled_dot(a, w_q, a_inverse * w_inverse, x.dtype,
                                                          jax.lax.Precision.DEFAULT), blocks)
    y = _from_device_blocks(forward(x_q, x_inverse), x.shape[0])
    # the float8 activation, transposed, is kept for the weight gradient: the very values torchao's Float8Linear
    # gets by quantising the kept bf16 input again, at half its bytes and without that pass; the weight's scale too
    return y, (x_transposed, x_inverse, weight, w_scale)


def _fp8_matmul_backward(blocks: TokenBlocks, residuals, grad: jax.Array):
    """dX per device block; dW per device block in bf16 (a torch rank's), then summed over the blocks in float32."""
    x_transposed, x_inverse, weight, w_scale = residuals
    g_q, g_transposed, g_inverse = _quantised_blocks(_device_blocks(grad, blocks), GRADIENT_DTYPE)
    w_transposed = _transposed_cast(weight, w_scale, FP8_DTYPE)
    w_inverse = 1 / w_scale.reshape(())
    highest = jax.lax.Precision.HIGHEST

    def block(g, g_t, x_t, g_inv, x_inv):
        return (_scaled_dot(g, w_transposed, g_inv * w_inverse, grad.dtype, highest),
                _scaled_dot(g_t, x_t, g_inv * x_inv, weight.dtype, highest))

    grad_x, grad_w = _per_block(block, blocks)(g_q, g_transposed, x_transposed, g_inverse, x_inverse)
    return _from_device_blocks(grad_x, grad.shape[0]), grad_w.astype(jnp.float32).sum((0, 1)).astype(weight.dtype)


fp8_matmul.defvjp(_fp8_matmul_forward, _fp8_matmul_backward)


class Linear(nnx.Module):
    """y = x @ weight.T with weight [out, in], as torch.nn.Linear; in FP8 (`fp8_matmul`) once `fp8_blocks`, the
    activations' split over the devices, is set."""

    def __init__(self, weight: jax.Array):
        self.weight = nnx.Param(weight)
        self.fp8_blocks: TokenBlocks | None = None

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.fp8_blocks is not None:
            return fp8_matmul(x, self.weight[...], self.fp8_blocks)
        return jnp.einsum("...i,oi->...o", x, self.weight[...])


class Embedding(nnx.Module):
    def __init__(self, weight: jax.Array):
        self.weight = nnx.Param(weight)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        # the rows are picked from a float32 view (the same values): the gradient's scatter-add over the tokens then
        # accumulates in float32, as torch's CUDA embedding backward does, instead of in bf16
        weight = self.weight[...]
        return jnp.take(weight.astype(jnp.float32), tokens, axis=0).astype(weight.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, weight: jax.Array, eps: float):
        self.eps = eps
        self.weight = nnx.Param(weight)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        # weight * normed in x's dtype, each product rounded once as a same-dtype multiply does, but multiplied in
        # float32: the weight's gradient, a sum over every token, then accumulates in float32 as torch's does (a
        # bf16 sum over the tokens lost ~5x more: tests/test_train_precision.py)
        weight = self.weight[...]
        product = weight.astype(jnp.float32) * normed.astype(x.dtype).astype(jnp.float32)
        return product.astype(jnp.promote_types(weight.dtype, x.dtype))


def rotary_cos_sin(inv_freq: jax.Array, positions: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """cos, sin [S, head_dim] (or [B, S, head_dim] for positions [B, S]) for rotate-half RoPE at the positions."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, S, heads, D]; pairs feature i with i + D/2 (HF's layout, kept by the converted format)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[..., None, :] + rotated * sin[..., None, :]


class Attention(nnx.Module):
    def __init__(self, config: LlamaConfig, params: dict[str, jax.Array], prefix: str):
        self.config = config
        self.wq = Linear(params[prefix + "wq.weight"])
        self.wk = Linear(params[prefix + "wk.weight"])
        self.wv = Linear(params[prefix + "wv.weight"])
        self.wo = Linear(params[prefix + "wo.weight"])

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, attention_fn: AttentionFn) -> jax.Array:
        b, s, _ = x.shape
        c = self.config
        q = self.wq(x).reshape(b, s, c.num_heads, c.head_dim)
        k = self.wk(x).reshape(b, s, c.num_kv_heads, c.head_dim)
        v = self.wv(x).reshape(b, s, c.num_kv_heads, c.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        with region("attention"):
            out = attention_fn(q, k, v)
        return self.wo(out.reshape(b, s, c.num_heads * c.head_dim))


class FeedForward(nnx.Module):
    def __init__(self, params: dict[str, jax.Array], prefix: str):
        self.w1 = Linear(params[prefix + "w1.weight"])
        self.w3 = Linear(params[prefix + "w3.weight"])
        self.w2 = Linear(params[prefix + "w2.weight"])

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.w2(jax.nn.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nnx.Module):
    def __init__(self, config: LlamaConfig, params: dict[str, jax.Array], prefix: str):
        self.attention_norm = RMSNorm(params[prefix + "attention_norm.weight"], config.rms_norm_eps)
        self.attention = Attention(config, params, prefix + "attention.")
        self.ffn_norm = RMSNorm(params[prefix + "ffn_norm.weight"], config.rms_norm_eps)
        self.feed_forward = FeedForward(params, prefix + "feed_forward.")

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, attention_fn: AttentionFn) -> jax.Array:
        x = x + self.attention(self.attention_norm(x), cos, sin, attention_fn)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nnx.Module):
    """Built from a dict of canonical name -> array (see weights/checkpoint.py), the decoder layers' weights one per
    name or stacked (`stack_layers`); nothing is initialised randomly."""

    def __init__(self, config: LlamaConfig, params: Mapping[str, jax.Array], attention_fn: AttentionFn | None = None,
                 remat: str = "off", layer_weight_dtype: Any = None,
                 gather_layer_weight: Callable[[jax.Array], jax.Array] | None = None,
                 checkpointed: CheckpointedLayers | None = None):
        self.config = config
        self.attention_fn = attention_fn or reference_attention
        self.remat = remat  # a `weights.parallel.REMAT_MODES` key: which activations the backward recomputes
        self.checkpointed = checkpointed  # which layers `remat` applies to (None: all)
        # applied to each decoder-layer weight inside the checkpointed layer (remat only), the cast then the
        # gather: where the weights come as fp32 shards, the layer casts and gathers its own, in the forward and
        # again in the backward
        self.layer_weight_dtype = layer_weight_dtype
        self.gather_layer_weight = gather_layer_weight
        self.tok_embeddings = Embedding(params["tok_embeddings.weight"])
        stacked = STACKED_LAYERS + "attention_norm.weight" in params
        if stacked and remat != "off":  # one block whose weights are the stack the scan of layers runs over
            self.layers = TransformerBlock(config, params, STACKED_LAYERS)
        else:
            layer_params = unstack_layers(params) if stacked else params
            self.layers = nnx.List([TransformerBlock(config, layer_params, f"layers.{i}.")
                                    for i in range(config.num_layers)])
        self.norm = RMSNorm(params["norm.weight"], config.rms_norm_eps)
        self.output = None if config.tie_word_embeddings else Linear(params["output.weight"])
        self.inv_freq = jnp.asarray(rope_inverse_frequencies(config))

    def hidden_states(self, tokens: jax.Array, positions: jax.Array | None = None,
                      segment_ids: jax.Array | None = None) -> jax.Array:
        """Final-normed hidden states [B, S, hidden] in the compute dtype (module docstring: positions, segment
        ids)."""
        if positions is None:
            positions = jnp.arange(tokens.shape[1])
        attention_fn = (self.attention_fn if segment_ids is None
                        else functools.partial(self.attention_fn, segment_ids=segment_ids))
        x = self.tok_embeddings(tokens)
        cos, sin = rotary_cos_sin(self.inv_freq, positions, x.dtype)

        if self.remat != "off":
            x = self._checkpointed_layers(x, cos, sin, attention_fn)
        else:
            for layer in self.layers:
                x = layer(x, cos, sin, attention_fn)
        return self.norm(x)

    def _checkpointed_layers(self, x: jax.Array, cos: jax.Array, sin: jax.Array, attention_fn: AttentionFn
                             ) -> jax.Array:
        """The decoder layers as a `lax.scan` of a `jax.checkpoint`-ed layer over their stacked weights: the
        forward keeps each layer's input, the backward loop recomputes one layer per iteration. A Python loop of
        checkpointed layers (`nnx.remat`) leaves the order of the recomputations to XLA, which on GPUs ran them
        all early and kept them live: on 4 H200s the Llama-3.1-8B step at 128k tokens asked for 172 GiB per device
        (the torch twin: 43 GiB). Weights given one per layer are stacked here (a copy); stacked ones are used as
        they are."""
        if isinstance(self.layers, TransformerBlock):
            graph, stacked = nnx.split(self.layers)
        else:
            graph = nnx.graphdef(self.layers[0])
            stacked = jax.tree.map(lambda *weights: jnp.stack(weights), *(nnx.state(layer) for layer in self.layers))

        def run_layer(x: jax.Array, weights) -> jax.Array:
            return nnx.merge(graph, weights)(x, cos, sin, attention_fn)

        return checkpointed_scan(run_layer, x, stacked, mode=self.remat, dtype=self.layer_weight_dtype,
                                 gather=self.gather_layer_weight, layers=self.checkpointed)

    def logits(self, hidden: jax.Array) -> jax.Array:
        head = self.tok_embeddings.weight[...] if self.output is None else self.output.weight[...]
        return jnp.einsum("bsh,vh->bsv", hidden, head).astype(jnp.float32)

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        """Logits [B, S, vocab] float32 for token ids [B, S]."""
        return self.logits(self.hidden_states(tokens, positions, segment_ids))


def convert_to_fp8(llama: Llama, linears: frozenset[str], token_blocks: TokenBlocks = (1, 1)) -> None:
    """In place: the decoder layers' `linears` (names inside a layer, from `weights.fp8.fp8_linears`) compute in
    FP8 (`fp8_matmul`), their activations scaled per device block `token_blocks` (the mesh's (fsdp, sp)). Their
    weights are unchanged, so sharding, checkpoints and exports see the same model."""
    for path, module in nnx.iter_modules(llama):
        if isinstance(module, Linear) and is_fp8_linear(".".join(map(str, path)), linears):
            module.fp8_blocks = token_blocks


def next_token_loss(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """Mean cross-entropy of predicting token t+1 from position t."""
    log_probs = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    targets = tokens[:, 1:]
    return -jnp.mean(jnp.take_along_axis(log_probs, targets[..., None], axis=-1))


def parameter_dict(model: Llama) -> dict[str, jax.Array]:
    """Canonical name -> array, the inverse of the constructor's `params`."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {".".join(str(p) for p in path): variable[...] for path, variable in flat}


def load_model(model: str | Path, *, dtype: str = "fp32", seed: int = 0,
               attention_fn: AttentionFn | None = None) -> Llama:
    """A Llama from a converted checkpoint directory or a preset name (random weights from `seed`), its
    parameters read tensor by tensor and cast to `dtype` on the default device."""
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    source = open_weights(model, seed)
    params = {name: jnp.asarray(source.tensor(name).astype(np.float32, copy=False), dtype=dtype)
              for name in source.names()}
    return Llama(source.config, params, attention_fn)

