"""FLOP counts shared by both backends' benchmarks (framework-neutral: stdlib only).

Attention is counted the way FlashAttention's papers and the measured peers count it, so TFLOP/s figures
compare directly: two matmuls (S = Q K^T and O = P V) of 2 * Sq * Sk * D flops each per head, halved when
causal (half of the score matrix is masked), and the backward as 2.5 forwards (five matmuls against two),
so forward + backward = 3.5 forwards. Softmax and masking flops are not counted.

`model_flops_per_token` is the numerator of training MFU (6N plus causal attention, the backward counted as two
forwards), used by `twinflash train` and `twinflash compare`; `PEAK_FLOPS_PER_DEVICE` is its denominator.
"""

from __future__ import annotations

from weights.config import LlamaConfig

PEAK_FLOPS_PER_DEVICE = 989e12  # dense bf16 peak of an H100/H200 SXM: the denominator of every MFU


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


def model_flops_per_token(config: LlamaConfig, seq_len: int) -> float:
    """Training (forward + backward) model FLOPs per token of causal sequences of `seq_len` tokens, the numerator
    of MFU (no credit for recomputation):

        6 * N + 6 * layers * heads * head_dim * seq_len

    N = `matmul_parameters` (2 FLOPs per multiply-add forward, twice that backward); the attention term is the
    causal forward of `attention_flops` (2 * 2 * S^2 * head_dim per head, halved by the mask) times 3 for
    forward + backward, per token: 12 * layers * heads * head_dim * S^2 / 2 per sequence. This is the model-FLOPs
    convention (the backward as two forwards), not the 2.5 forwards that `attention_flops(backward=True)` counts
    for kernel throughput."""
    attention_forward = attention_flops(1, config.num_heads, seq_len, seq_len, config.head_dim, causal=True,
                                        backward=False)
    return 6.0 * matmul_parameters(config) + 3 * config.num_layers * attention_forward / seq_len


def forward_flops_per_token(config: LlamaConfig, seq_len: int) -> float:
    """Forward-only model FLOPs per token (a third of `model_flops_per_token`: 2N plus the causal attention
    forward), the numerator of MFU for inference-style forward passes."""
    return model_flops_per_token(config, seq_len) / 3
