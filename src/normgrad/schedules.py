"""Learning-rate schedules: plain Python functions of the 1-based optimizer step that
return the learning rate for that step (``Trainer(lr=...)`` takes one, or a number)."""

from __future__ import annotations

import math
from typing import Callable

from normgrad._session import TrainerError

__all__ = ["Schedule", "constant", "linear_warmup", "cosine"]

Schedule = Callable[[int], float]


def constant(lr: float) -> Schedule:
    """lr at every step."""
    return lambda step: float(lr)


def linear_warmup(lr: float, warmup_steps: int) -> Schedule:
    """lr * step / warmup_steps for the first ``warmup_steps`` steps, then lr."""
    if warmup_steps < 1:
        raise TrainerError(f"warmup_steps must be >= 1, got {warmup_steps}")
    return lambda step: float(lr) * min(1.0, step / warmup_steps)


def cosine(lr: float, total_steps: int, warmup_steps: int = 0, min_lr: float = 0.0) -> Schedule:
    """Linear warmup over ``warmup_steps`` (if any), then cosine decay from lr to ``min_lr``
    at ``total_steps`` (min_lr after it): min_lr + (lr - min_lr) (1 + cos(pi t)) / 2, with t
    the fraction of the decay steps done."""
    if total_steps <= warmup_steps:
        raise TrainerError(f"total_steps ({total_steps}) must exceed warmup_steps ({warmup_steps})")

    def schedule(step: int) -> float:
        if step <= warmup_steps:
            return float(lr) * step / warmup_steps
        done = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
        return float(min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * done)))

    return schedule
