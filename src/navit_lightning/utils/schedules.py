"""Learning-rate schedules, built from the optimizer and the run's total optimizer steps."""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


def warmup_cosine(
    optimizer: Optimizer, total_steps: int, warmup_steps: int = 100, min_lr_ratio: float = 0.01
) -> LambdaLR:
    """Linear warm-up from 0 to the base rate, then cosine decay to min_lr_ratio x base."""
    # A short run (a smoke test, a tiny max_steps) still gets most of its steps decaying.
    warmup_steps = min(warmup_steps, max(1, total_steps // 10))

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)
