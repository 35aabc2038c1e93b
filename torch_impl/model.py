"""Llama in PyTorch: embedding, RMSNorm, RoPE (llama3 scaling), GQA attention, SwiGLU MLP, final norm, LM head.
Twin of `jax_impl/model.py`: same modules, same names, same parameter paths (the converted checkpoint's names).

Attention is pluggable: `Llama(config, attention_fn=...)` takes any `AttentionFn` (`fn(q, k, v) -> out`, causal,
q [B, S, H, D], k/v [B, S, Hkv, D]); the default is plain math (`reference_attention`); the flash kernel and the
ring drop in unchanged. `positions` gives the global position of each local token, so a sequence-parallel rank
holding a zigzag shard rotates its tokens by their true positions. Packed documents (`segment_ids` [B, S],
`weights/documents.py`) reach the attention function as its `segment_ids` keyword, and their RoPE positions restart
at each document: positions [B, S] then, each token's offset in its document (`weights.documents.document_offsets`),
since a document's tokens must rotate as they would alone. `remat` checkpoints each decoder layer
("full": only layer inputs are kept for the backward, which recomputes the rest; "save-attention": the attention's
output and log-sum-exp are kept too, so the backward does not rerun the attention; see `torch_impl/remat.py`), or
the layers `checkpointed` names.

For `twinflash train --profile` the attention function's work and a checkpointed layer's rerun in the backward
are marked as regions (`torch_impl/profiling.py`); `compile_elementwise` compiles the modules around the attention
(the training step does on GPUs).

`convert_to_fp8` turns the decoder layers' linears into torchao `Float8Linear`s running the FP8 recipe of
weights/fp8.py (`twinflash train --fp8`). torchao is optional (the `fp8` extra) and needs no GPU: off GPUs its matmul
takes torchao's emulation (`emulate`: the float8 values over their scales, multiplied in float32), the same recipe
within float32 rounding; `torch._scaled_mm`'s CPU kernel computes it too, 10-30x slower than a float32 matmul.

Numerics follow HF transformers' LlamaForCausalLM: RMSNorm in float32 then cast back before the weight multiply,
RoPE angles in float32 cast to the compute dtype, logits returned as float32.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from torch_impl.attention import AttentionFn, reference_attention
from torch_impl.profiling import region
from torch_impl.remat import checkpointed_layer
from weights import LlamaConfig, open_weights, rope_inverse_frequencies
from weights.fp8 import FP8_DTYPE, GRADIENT_DTYPE, is_fp8_linear
from weights.parallel import CheckpointedLayers

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rotary_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [S, head_dim] (or [B, S, head_dim] for positions [B, S]) for rotate-half RoPE at the positions."""
    angles = positions.float()[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, S, heads, D]; pairs feature i with i + D/2 (HF's layout, kept by the converted format)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[..., None, :] + rotated * sin[..., None, :]


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        c = config
        self.wq = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.wk = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.wv = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.wo = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention_fn: AttentionFn
                ) -> torch.Tensor:
        b, s, _ = x.shape
        c = self.config
        q = self.wq(x).view(b, s, c.num_heads, c.head_dim)
        k = self.wk(x).view(b, s, c.num_kv_heads, c.head_dim)
        v = self.wv(x).view(b, s, c.num_kv_heads, c.head_dim)
        out = _attend(attention_fn, apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v)
        return self.wo(out.reshape(b, s, c.num_heads * c.head_dim))


@torch.compiler.disable
def _attend(attention_fn: AttentionFn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The attention function, run eagerly even inside a compiled `Attention` (our kernels and the ring's
    communication are their own autograd Functions): torch.compile splits the layer around it."""
    with region("attention"):
        return attention_fn(q, k, v)


class FeedForward(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w3 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention_fn: AttentionFn
                ) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, attention_fn)
        return x + self.feed_forward(self.ffn_norm(x))


def _marked_recompute(layer: nn.Module):
    """`layer`, whose reruns by the backward (checkpointing's recomputation) are marked for the profile."""
    def run(*args):
        if torch._C._current_graph_task_id() == -1:  # -1: not inside a backward
            return layer(*args)
        with region("recompute"):
            return layer(*args)

    return run


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig, attention_fn: AttentionFn | None = None, remat: str = "off"):
        super().__init__()
        self.config = config
        self.attention_fn = attention_fn or reference_attention
        self.remat = remat  # a `weights.parallel.REMAT_MODES` key: which activations the backward recomputes
        self.checkpointed: CheckpointedLayers | None = None  # which layers `remat` applies to (None: all)
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.output = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size,
                                                                        bias=False)
        self.register_buffer("inv_freq", torch.from_numpy(rope_inverse_frequencies(config)), persistent=False)

    def hidden_states(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                      segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normed hidden states [B, S, hidden] in the compute dtype (module docstring: positions, segment
        ids)."""
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        attention_fn = (self.attention_fn if segment_ids is None
                        else functools.partial(self.attention_fn, segment_ids=segment_ids))
        x = self.tok_embeddings(tokens)
        cos, sin = rotary_cos_sin(self.inv_freq, positions, x.dtype)
        for index, layer in enumerate(self.layers):
            if self.remat != "off" and (self.checkpointed is None or self.checkpointed.checkpointed(index)):
                x = checkpointed_layer(_marked_recompute(layer), x, cos, sin, attention_fn, mode=self.remat)
            else:
                x = layer(x, cos, sin, attention_fn)
        return self.norm(x)

    def compile_elementwise(self) -> None:
        """torch.compile (in place) the modules around the attention: the norms, the attention's projections and
        RoPE (split around the attention function, `_attend`) and the SwiGLU MLP, so that their elementwise work
        runs as a few fused kernels instead of one kernel per op. The matmuls stay cuBLAS's."""
        for layer in self.layers:
            for module in (layer.attention_norm, layer.attention, layer.ffn_norm, layer.feed_forward):
                module.compile()
        self.norm.compile()

    def head_weight(self) -> torch.Tensor:
        """The LM head [vocab, hidden]: the embedding table when tied."""
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.head_weight()).float()

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, S, vocab] float32 for token ids [B, S]."""
        return self.logits(self.hidden_states(tokens, positions, segment_ids))


def convert_to_fp8(llama: Llama, linears: frozenset[str], *, emulate: bool) -> None:
    """In place, before FSDP wraps the model: the decoder layers' `linears` (names inside a layer, from
    `weights.fp8.fp8_linears`) become torchao `Float8Linear`s with dynamic per-tensor scaling of inputs, weights and
    output gradients (weights/fp8.py's recipe). Their weights stay plain parameters under the same names, so
    sharding, checkpoints and exports see the model unchanged. `emulate`: their matmuls in float32 (torchao's
    emulation, for devices without FP8 GEMMs) instead of `torch._scaled_mm`."""
    torchao_log = logging.getLogger("torchao")
    level = torchao_log.level
    # importing torchao warns once per CUDA extension library it cannot load (all of them on CPU), on every rank;
    # the float8 training path uses none of them
    torchao_log.setLevel(logging.ERROR)
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.float8.config import CastConfig, ScalingGranularity, ScalingType
    finally:
        torchao_log.setLevel(level)

    def cast(dtype: str) -> CastConfig:
        return CastConfig(scaling_type=ScalingType.DYNAMIC, scaling_granularity=ScalingGranularity.TENSORWISE,
                          target_dtype=getattr(torch, dtype))

    config = Float8LinearConfig(
        cast_config_input=cast(FP8_DTYPE), cast_config_input_for_grad_weight=cast(FP8_DTYPE),
        cast_config_weight=cast(FP8_DTYPE), cast_config_weight_for_grad_input=cast(FP8_DTYPE),
        cast_config_grad_output=cast(GRADIENT_DTYPE), cast_config_grad_output_for_grad_weight=cast(GRADIENT_DTYPE),
        round_scales_to_power_of_2=False, emulate=emulate)
    convert_to_float8_training(llama, config=config,
                               module_filter_fn=lambda module, name: is_fp8_linear(name, linears))


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting token t+1 from position t."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


def load_model(model: str | Path, *, dtype: str | torch.dtype = "fp32", device: str | torch.device = "cpu",
               seed: int = 0, attention_fn: AttentionFn | None = None) -> Llama:
    """A Llama from a converted checkpoint directory or a preset name (random weights from `seed`), its
    parameters read tensor by tensor and cast to `dtype` on `device`."""
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    source = open_weights(model, seed)
    with torch.device("meta"):
        llama = Llama(source.config, attention_fn)
    state = {}
    for name in source.names():
        array = source.tensor(name)
        state[name] = torch.from_numpy(array.astype("float32", copy=False)).to(device=device, dtype=dtype)
    llama.load_state_dict(state, strict=True, assign=True)
    llama.inv_freq = torch.from_numpy(rope_inverse_frequencies(source.config)).to(device)
    return llama.eval()

