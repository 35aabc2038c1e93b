"""Optimizer hyperparameters and the learning-rate schedule, one definition for both backends' training loops, and
the default settings by model size (`default_optimizer`), which `twinflash train` uses when --lr / --warmup-steps
are not given.

Linear warmup from 0 to `lr` over `warmup_steps`, then cosine decay to `min_lr_ratio * lr` at `total_steps`.
Both backends evaluate `learning_rate(step)` on the host in float64 and feed the value to AdamW, so the two runs
use the same learning rate at every step.

Defaults by model width, from published recipes (Llama's for 7B and wider; for the 1B / 3B widths, for which Llama
3.2 publishes none, GPT-3 XL's), with warmup before the peak. Why: AdamW's first steps move every weight by about lr whatever its gradient's size (m / sqrt(v) is
+-1 at step 1), so a layer's output moves by about lr x its input width per step. The old default for every model,
lr 3e-3 reached within 5 steps, rewrote a 2048-wide network in its first steps: the Llama-3.2-1B shape's loss
jumped from 9.9 to 21.2 at step 3 (2 x H200, S=8k, issue 22). Short runs with small batches (tens of steps of one
sequence) are less forgiving than the recipes' (millions of tokens per step, thousands of warmup steps): on CPU a
2-layer model of the 1B width at S=512 oscillated (loss 5.9 -> 9.6 at step 5) with 4e-4 and did not with
2e-4 (compare/results/lr-spike-check-2026-11-22-cpu.json). Warmup: Llama's ~2000 steps are a fraction of a
percent of its runs, far too few steps in a run of tens, so `WARMUP_FRACTION` of the run but never fewer than
`WARMUP_MIN_STEPS` (compare/bench/lr_spike_check.py, last at 8b5685a, measured a few-layer model of the 1B width).
"""

from __future__ import annotations

import dataclasses
import math

# (hidden size up to, peak lr, whose recipe), narrowest first. By width, not parameter count: the first steps move
# a layer's output by ~lr x its width, and a model cut to a few layers (the compare's check model) keeps its width.
PEAK_LR_BY_WIDTH = (
    (512, 3e-3, "the tiny presets: narrow models take large steps"),
    (3072, 2e-4, "Llama 3.2 1B / 3B, 2048 / 3072 wide, which publish none: as GPT-3 XL 1.3B, 2048 wide; "
                 "TinyLlama's and OLMo 1B's 4e-4 oscillated in short runs of this width on CPU"),
    (5120, 3e-4, "Llama 1 and 2 7B / 13B, Llama 3 8B, 4096 / 5120 wide"),
    (math.inf, 1.5e-4, "Llama 1 and 2 33B / 70B, Llama 3 70B, 6656 / 8192 wide"),
)
WARMUP_FRACTION = 0.02
WARMUP_MIN_STEPS = 10


def default_peak_lr(hidden_size: int) -> float:
    return next(lr for limit, lr, _ in PEAK_LR_BY_WIDTH if hidden_size <= limit)


def default_warmup_steps(steps: int) -> int:
    """max(`WARMUP_MIN_STEPS`, `WARMUP_FRACTION` of the run), and never longer than the run."""
    return min(steps, max(WARMUP_MIN_STEPS, math.ceil(WARMUP_FRACTION * steps)))


def _short(x: float) -> str:
    mantissa, exponent = f"{x:e}".split("e")
    return f"{float(mantissa):g}e{int(exponent)}"


def defaults_help() -> str:
    """The defaults in words, for `--help`."""
    tiers = ", ".join(f"{f'up to {limit}' if limit < math.inf else 'wider'}: {_short(lr)} ({why})"
                      for limit, lr, why in PEAK_LR_BY_WIDTH)
    return (f"peak lr by hidden size, {tiers}; warmup {WARMUP_FRACTION:.0%} of --steps, at least "
            f"{WARMUP_MIN_STEPS} steps; then cosine decay to {OptimizerConfig.min_lr_ratio:g} x the peak")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    lr: float = PEAK_LR_BY_WIDTH[0][1]
    warmup_steps: int = WARMUP_MIN_STEPS
    total_steps: int = 20
    min_lr_ratio: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip_norm: float = 1.0

    def learning_rate(self, step: int) -> float:
        """Learning rate for optimizer step `step` (0-based)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * progress))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * cosine)


def default_optimizer(hidden_size: int, steps: int, **overrides) -> OptimizerConfig:
    """The optimizer of a `steps`-step run of a model `hidden_size` wide: `default_peak_lr`, `default_warmup_steps`,
    the rest OptimizerConfig's; `overrides` (e.g. lr=) replace fields."""
    fields = {"lr": default_peak_lr(hidden_size), "warmup_steps": default_warmup_steps(steps), "total_steps": steps}
    return OptimizerConfig(**(fields | overrides))
