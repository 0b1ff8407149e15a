"""Learning rates: scaled to the effective batch, and schedules built from the optimizer and
the run's total optimizer steps."""

from __future__ import annotations

import math
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from navit_lightning.errors import ConfigError, is_number

# The exponent of the effective batch's growth that a learning rate follows: sqrt is the usual
# start for Adam-type optimizers, linear (Goyal et al., 2017) for SGD.
LR_SCALING_EXPONENTS = {"sqrt": 0.5, "linear": 1.0}


def check_lr_scaling(rule: str | None, reference_tokens: int) -> None:
    if rule is not None and rule not in LR_SCALING_EXPONENTS:
        raise ConfigError(
            f"model.lr_scaling={rule!r} is unknown: use one of {sorted(LR_SCALING_EXPONENTS)}, "
            "or null for optimizer.lr as given"
        )
    if rule is not None and not (is_number(reference_tokens) and reference_tokens >= 1):
        raise ConfigError(
            f"model.lr_reference_tokens={reference_tokens} must be 1 or more: the tokens a step "
            "that optimizer.lr was tuned at"
        )


def step_factors(trainer: Any) -> tuple[int, int]:
    """(ranks, batches accumulated) of one optimizer step of `trainer`; (1, 1) without one."""
    return (1, 1) if trainer is None else (trainer.world_size, trainer.accumulate_grad_batches)


def limited(batches: int, limit: int | float) -> int:
    """An epoch's `batches` under trainer.limit_train_batches, as Lightning counts them."""
    return min(batches, limit) if isinstance(limit, int) else int(batches * limit)


def lr_scale(rule: str, step_tokens: int, reference_tokens: int) -> float:
    """The factor that carries a learning rate tuned at `reference_tokens` a step to
    `step_tokens` a step under `rule` (one of LR_SCALING_EXPONENTS)."""
    return (step_tokens / reference_tokens) ** LR_SCALING_EXPONENTS[rule]


class ResumableLambdaLR(LambdaLR):
    """A LambdaLR that, given a checkpoint's state, sets the optimizer's rates from its own
    lambdas at the saved step. The checkpoint's rates came from the schedule it was saved
    with: a run resumed with more epochs would take one step at the old schedule's rate."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._last_lr = [
            base * rate(self.last_epoch) for base, rate in zip(self.base_lrs, self.lr_lambdas, strict=True)
        ]
        for group, lr in zip(self.optimizer.param_groups, self._last_lr, strict=True):
            group["lr"] = lr


def warmup_cosine(
    optimizer: Optimizer, total_steps: int, warmup_steps: int = 100, min_lr_ratio: float = 0.01
) -> LambdaLR:
    """Linear warm-up from 0 to the base rate over warmup_steps (at most half the run), then
    cosine decay to min_lr_ratio x base.
    A run resumed with another total (a larger max_epochs) goes on along the new cosine from
    the step it was saved at."""
    if warmup_steps < 0:
        raise ConfigError(f"scheduler.warmup_steps={warmup_steps} must be 0 (no warm-up) or more")
    if not 0 <= min_lr_ratio <= 1:
        raise ConfigError(f"scheduler.min_lr_ratio={min_lr_ratio} is a share of the base rate: 0 <= it <= 1")
    # At most half the run warms up, so that a short one (a smoke test, a tiny max_steps)
    # still decays; a shorter warm-up is taken as given. A run of unknown length
    # (trainer.max_epochs=-1, ended by max_time or early stopping) warms up, then keeps the
    # base rate: there is no end for the cosine to reach (half of infinity made no warm-up).
    if math.isfinite(total_steps):
        warmup_steps = min(warmup_steps, max(1, int(total_steps) // 2))

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return ResumableLambdaLR(optimizer, factor)
