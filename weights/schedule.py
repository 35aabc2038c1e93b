"""Optimizer hyperparameters and the learning-rate schedule, one definition for both backends' training loops, and
the default settings by model size (`default_optimizer`), which `twinflash train` uses when --lr / --warmup-steps
are not given.

Linear warmup from 0 to `lr` over `warmup_steps`, then cosine decay to `min_lr_ratio * lr` at `total_steps`.
Both backends evaluate `learning_rate(step)` on the host in float64 and feed the value to AdamW, so the two runs
use the same learning rate at every step.

Defaults by size, as the published Llama recipes set them (peak lr falling with width; warmup before it): AdamW's
first steps move every weight by about lr whatever its gradient's size (m / sqrt(v) is +-1 at step 1), so a layer's
output moves by about lr x its input width; at 2048 wide, lr 3e-3 reached within 5 steps (the old default for every
model) rewrote the network in the first steps: the Llama-3.2-1B shape's loss jumped from 9.9 to 21.2 at step 3
(2 x H200, S=8k, issue 22). Warmup: `WARMUP_FRACTION` of the run as Llama's 2000 of ~500k steps would be far too
short for runs of tens of steps, so never fewer than `WARMUP_MIN_STEPS`.
"""

from __future__ import annotations

import dataclasses
import math

# (parameters up to, peak lr, whose recipe), smallest first
PEAK_LR_BY_SIZE = (
    (1e8, 3e-3, "the tiny presets: narrow models take large steps"),
    (5e9, 4e-4, "TinyLlama 1.1B and OLMo 1B, Llama-architecture; Llama 3.2 1B / 3B publish none"),
    (2e10, 3e-4, "Llama 1 and 2 7B / 13B, Llama 3 8B"),
    (math.inf, 1.5e-4, "Llama 1 and 2 33B / 70B, Llama 3 70B"),
)
WARMUP_FRACTION = 0.02
WARMUP_MIN_STEPS = 10


def default_peak_lr(num_params: int) -> float:
    return next(lr for limit, lr, _ in PEAK_LR_BY_SIZE if num_params <= limit)


def default_warmup_steps(steps: int) -> int:
    """max(`WARMUP_MIN_STEPS`, `WARMUP_FRACTION` of the run), and never longer than the run."""
    return min(steps, max(WARMUP_MIN_STEPS, math.ceil(WARMUP_FRACTION * steps)))


def _short(x: float) -> str:
    mantissa, exponent = f"{x:e}".split("e")
    return f"{float(mantissa):g}e{int(exponent)}"


def defaults_help() -> str:
    """The defaults in words, for `--help`."""
    def size(limit: float) -> str:
        return f"up to {limit / 1e6:g}M" if limit < 1e9 else f"up to {limit / 1e9:g}B" if limit < math.inf else "above"

    tiers = ", ".join(f"{size(limit)} {_short(lr)} ({why})" for limit, lr, why in PEAK_LR_BY_SIZE)
    return (f"peak lr by parameter count: {tiers}; warmup {WARMUP_FRACTION:.0%} of --steps, at least "
            f"{WARMUP_MIN_STEPS} steps; then cosine decay to {OptimizerConfig.min_lr_ratio:g} x the peak")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    lr: float = PEAK_LR_BY_SIZE[0][1]
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


def default_optimizer(num_params: int, steps: int, **overrides) -> OptimizerConfig:
    """The optimizer of a `steps`-step run of a model with `num_params` parameters: `default_peak_lr`,
    `default_warmup_steps`, the rest OptimizerConfig's; `overrides` (e.g. lr=) replace fields."""
    fields = {"lr": default_peak_lr(num_params), "warmup_steps": default_warmup_steps(steps), "total_steps": steps}
    return OptimizerConfig(**(fields | overrides))
