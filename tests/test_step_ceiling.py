"""`weights.flops.step_ceiling`, the ideal step behind the MFU targets of issue #20: its FLOP bookkeeping checked by
hand on the tiny preset, and the ceilings weights/README.md quotes for the 2-GPU targets."""

from __future__ import annotations

import pytest

from weights.config import preset
from weights.flops import (PEAK_FLOPS_PER_DEVICE, attention_flops, layer_matmul_parameters, matmul_parameters,
                           model_flops_per_token, step_ceiling)


def test_layer_parameters_add_up_to_the_model():
    config = preset("llama3.1-8b")  # untied head: matmul parameters = layers + head, plus the norms
    head = config.vocab_size * config.hidden_size
    norms = (2 * config.num_layers + 1) * config.hidden_size
    assert config.num_layers * layer_matmul_parameters(config) + head + norms == matmul_parameters(config)


def test_at_peak_rates_only_the_uncredited_work_costs():
    config = preset("tiny")
    seq_len = 512
    ceiling = step_ceiling(config, seq_len, batch=2, devices=4, loss_recompute=False,
                           attention_flops_per_s=PEAK_FLOPS_PER_DEVICE, gemm_flops_per_s=PEAK_FLOPS_PER_DEVICE)
    tokens = 2 * seq_len / 4
    attention_forward = config.num_layers * attention_flops(2, config.num_heads, seq_len, seq_len, config.head_dim,
                                                            causal=True, backward=False) / 4
    gemm = 6 * matmul_parameters(config) * tokens
    assert ceiling.credited_flops == pytest.approx(model_flops_per_token(config, seq_len) * tokens)
    assert ceiling.credited_flops == pytest.approx(gemm + 3 * attention_forward)
    # the attention kernels do 3.5 forwards against the 3 that MFU credits, so even peak rates stay below 100 %
    assert ceiling.mfu == pytest.approx((gemm + 3 * attention_forward) / (gemm + 3.5 * attention_forward))
    assert ceiling.recompute_s == 0.0


def test_recomputation_costs_time_without_credit():
    config = preset("tiny")
    rates = dict(attention_flops_per_s=400e12, gemm_flops_per_s=700e12)
    off = step_ceiling(config, 1024, loss_recompute=False, **rates)
    loss = step_ceiling(config, 1024, loss_recompute=True, **rates)
    saved = step_ceiling(config, 1024, remat="save-attention", loss_recompute=False, **rates)
    full = step_ceiling(config, 1024, remat="full", loss_recompute=False, **rates)
    half = step_ceiling(config, 1024, remat="full", checkpointed_layers=config.num_layers // 2,
                        loss_recompute=False, **rates)
    assert half.recompute_s == pytest.approx(full.recompute_s / 2)
    assert off.credited_flops == loss.credited_flops == saved.credited_flops == full.credited_flops
    head = 2 * 1024 * config.vocab_size * config.hidden_size
    assert loss.recompute_s == pytest.approx(head / 700e12)
    layers = 2 * 1024 * config.num_layers * layer_matmul_parameters(config)
    assert saved.recompute_s == pytest.approx(layers / 700e12)
    assert full.recompute_s == pytest.approx(saved.recompute_s + off.attention_s / 3.5)
    assert off.mfu > loss.mfu > saved.mfu > full.mfu


def test_the_issue_20_targets_at_cudnn_rates():
    # cuDNN on H200 (fwd + bwd, causal): ~430 TF/s at head_dim 64, ~545 at 128; cuBLAS GEMMs ~700 TF/s.
    one_b = step_ceiling(preset("llama3.2-1b"), 32768, devices=2, attention_flops_per_s=430e12,
                         gemm_flops_per_s=700e12)
    eight_b = step_ceiling(preset("llama3.1-8b"), 32768, devices=2, remat="save-attention",
                           attention_flops_per_s=545e12, gemm_flops_per_s=700e12)
    assert one_b.mfu == pytest.approx(0.486, abs=0.001)  # 50 % is out of reach at D=64, even with no overhead
    assert eight_b.mfu == pytest.approx(0.508, abs=0.001)  # 50 % leaves ~35 ms of 2.31 s for everything else
    assert eight_b.step_s == pytest.approx(2.309, abs=0.001)


def test_unknown_remat_mode_is_refused():
    with pytest.raises(ValueError, match="remat"):
        step_ceiling(preset("tiny"), 64, remat="some", attention_flops_per_s=1.0, gemm_flops_per_s=1.0)
