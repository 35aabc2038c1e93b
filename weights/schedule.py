"""Optimizer hyperparameters and the learning-rate schedule, one definition for both backends' training loops.

Linear warmup from 0 to `lr` over `warmup_steps`, then cosine decay to `min_lr_ratio * lr` at `total_steps`.
Both backends evaluate `learning_rate(step)` on the host in float64 and feed the value to AdamW, so the two runs
use the same learning rate at every step.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 3e-3
    warmup_steps: int = 5
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
