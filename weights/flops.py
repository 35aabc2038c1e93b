"""FLOP counts shared by both backends' benchmarks (framework-neutral: stdlib only).

Attention is counted the way FlashAttention's papers and the measured peers count it, so TFLOP/s figures
compare directly: two matmuls (S = Q K^T and O = P V) of 2 * Sq * Sk * D flops each per head, halved when
causal (half of the score matrix is masked), and the backward as 2.5 forwards (five matmuls against two),
so forward + backward = 3.5 forwards. Softmax and masking flops are not counted.

`model_flops_per_token` is the numerator of training MFU (6N plus causal attention, the backward counted as two
forwards), used by `twinflash train` and `twinflash compare`; `PEAK_FLOPS_PER_DEVICE` is its denominator (an FP8 run's
second MFU divides by `PEAK_FP8_FLOPS_PER_DEVICE`).
`step_ceiling` is the MFU a training step would reach if it did nothing but its matmuls and attention kernels at
given rates, the recomputation it does (uncredited) included: how far a target MFU is reachable at all.
"""

from __future__ import annotations

import dataclasses

from weights.config import LlamaConfig
from weights.documents import causal_pairs

PEAK_FLOPS_PER_DEVICE = 989e12  # dense bf16 peak of an H100/H200 SXM: the denominator of every MFU
# dense FP8 (e4m3) peak of an H100/H200 SXM: 1,979 TFLOP/s (NVIDIA's H100 and H200 datasheets list 3,958 with
# 2:4 sparsity, dense half that): the second MFU of an FP8 run (`twinflash compare --precisions bf16,fp8`)
PEAK_FP8_FLOPS_PER_DEVICE = 1979e12


def attention_flops(batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int, causal: bool,
                    backward: bool) -> float:
    """FLOPs of one attention call over `heads` query heads; with `backward=True`, forward plus backward."""
    flops = 4.0 * batch * heads * seq_q * seq_k * head_dim
    if causal:
        flops /= 2
    if backward:
        flops *= 3.5
    return flops


def matmul_parameters(config: LlamaConfig) -> int:
    """Parameters that every token multiplies in a matmul: all of them, except the input embedding table when the
    LM head is a separate matrix (a lookup does no FLOPs); a tied table counts once, as the head."""
    embedding = config.vocab_size * config.hidden_size
    return config.num_params - (0 if config.tie_word_embeddings else embedding)


def model_flops_per_token(config: LlamaConfig, seq_len: int, causal_pairs: float | None = None) -> float:
    """Training (forward + backward) model FLOPs per token of causal sequences of `seq_len` tokens, the numerator
    of MFU (no credit for recomputation):

        6 * N + 6 * layers * heads * head_dim * seq_len

    N = `matmul_parameters` (2 FLOPs per multiply-add forward, twice that backward); the attention term is the
    causal forward of `attention_flops` (2 * 2 * S^2 * head_dim per head, halved by the mask) times 3 for
    forward + backward, per token: 12 * layers * heads * head_dim * S^2 / 2 per sequence. This is the model-FLOPs
    convention (the backward as two forwards), not the 2.5 forwards that `attention_flops(backward=True)` counts
    for kernel throughput. Packed documents attend within each one: `causal_pairs` (per sequence, the mean over a
    batch of `weights.documents.causal_pairs`) replaces S^2 / 2, so only the attention really done is credited."""
    pairs = seq_len * seq_len / 2 if causal_pairs is None else causal_pairs
    attention_forward = 4.0 * config.num_heads * config.head_dim * pairs  # `attention_flops` at S^2 / 2 pairs
    return 6.0 * matmul_parameters(config) + 3 * config.num_layers * attention_forward / seq_len


def batch_model_flops(config: LlamaConfig, batch: int, seq_len: int, segment_ids=None) -> float:
    """Training model FLOPs of `batch` causal sequences of `seq_len` tokens (`model_flops_per_token` times their
    tokens); packed documents (`segment_ids` [batch, seq_len]), each sequence's own attention
    (`weights.documents.causal_pairs`)."""
    if segment_ids is None:
        return batch * seq_len * model_flops_per_token(config, seq_len)
    return seq_len * sum(model_flops_per_token(config, seq_len, pairs) for pairs in causal_pairs(segment_ids))


def forward_flops_per_token(config: LlamaConfig, seq_len: int) -> float:
    """Forward-only model FLOPs per token (a third of `model_flops_per_token`: 2N plus the causal attention
    forward), the numerator of MFU for inference-style forward passes."""
    return model_flops_per_token(config, seq_len) / 3


def layer_matmul_parameters(config: LlamaConfig) -> int:
    """Parameters of one decoder layer's matmuls (the q/k/v/o projections and the SwiGLU MLP; norms excluded)."""
    c = config
    projections = (2 * c.num_heads + 2 * c.num_kv_heads) * c.head_dim * c.hidden_size  # q and o, k and v
    return projections + 3 * c.hidden_size * c.intermediate_size


@dataclasses.dataclass(frozen=True)
class StepCeiling:
    """The ideal training step of one device (seconds), from its FLOPs at the given kernel rates; `mfu` is what
    `twinflash train` would report for that step."""

    credited_flops: float  # MFU numerator of one device's step: `model_flops_per_token` x its tokens
    gemm_s: float          # the credited matmuls (6N per token)
    attention_s: float     # the attention kernels, forward + backward
    recompute_s: float     # uncredited reruns: checkpointed layers, the loss chunks' logits
    step_s: float
    mfu: float


def step_ceiling(config: LlamaConfig, seq_len: int, *, batch: int = 1, devices: int = 1, remat: str = "off",
                 checkpointed_layers: int | None = None, loss_recompute: bool = True, attention_flops_per_s: float,
                 gemm_flops_per_s: float) -> StepCeiling:
    """The step of `batch` causal sequences of `seq_len` tokens split evenly over `devices` (data or sequence
    parallel alike: each device does 1/devices of the work) if it ran only its matmuls at `gemm_flops_per_s` and
    its attention at `attention_flops_per_s` (a kernel benchmark's forward + backward rate, `attention_flops`'
    3.5-forwards convention), with no elementwise work, communication, optimizer or idle time.
    `checkpointed_layers` of the layers (None: all) are checkpointed as `remat` says.

    Recomputation costs time without credit: `remat` "full" reruns every layer's forward (its matmuls and its
    attention forward), "save-attention" its matmuls only (`weights.parallel.REMAT_MODES`); `loss_recompute`
    reruns the LM head's logits in the backward (the chunked loss, `torch_impl/train.py`). A rerun attention
    forward is counted at the forward + backward rate (cuDNN's forward alone runs ~10 % faster)."""
    if remat not in ("off", "full", "save-attention"):
        raise ValueError(f"remat must be off, full or save-attention, got {remat!r}")
    tokens = batch * seq_len / devices
    c = config
    attention_call = attention_flops(batch, c.num_heads, seq_len, seq_len, c.head_dim, causal=True, backward=False)
    attention_forward = c.num_layers * attention_call / devices
    gemm_s = 6.0 * matmul_parameters(c) * tokens / gemm_flops_per_s
    attention_s = 3.5 * attention_forward / attention_flops_per_s
    rerun_layers = 0 if remat == "off" else c.num_layers if checkpointed_layers is None else checkpointed_layers
    rerun_gemm = 2.0 * tokens * (rerun_layers * layer_matmul_parameters(c)
                                 + (c.vocab_size * c.hidden_size if loss_recompute else 0))
    rerun_attention = attention_forward * rerun_layers / c.num_layers if remat == "full" else 0.0
    recompute_s = rerun_gemm / gemm_flops_per_s + rerun_attention / attention_flops_per_s
    credited = model_flops_per_token(c, seq_len) * tokens
    step_s = gemm_s + attention_s + recompute_s
    return StepCeiling(credited, gemm_s, attention_s, recompute_s, step_s, credited / (step_s * PEAK_FLOPS_PER_DEVICE))
