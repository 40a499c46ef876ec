"""Learning-rate schedules: linear warmup, then cosine decay to zero or constant."""

from __future__ import annotations

import math

import torch

__all__ = ["make_scheduler"]


def make_scheduler(optimizer: torch.optim.Optimizer, kind: str, warmup_steps: int,
                   total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """``LambdaLR`` with a linear warmup over ``warmup_steps`` from 0, then ``cosine`` (to 0 at
    ``total_steps``) or ``constant``."""

    def factor(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        if kind == "constant":
            return 1.0
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
