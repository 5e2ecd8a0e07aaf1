"""Optimizer and learning-rate schedule from the job spec."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR

from tandem.api.training import Optimizer, TrainerSpec


def build_optimizer(parameters: Iterable[torch.nn.Parameter], spec: Optimizer) -> torch.optim.Optimizer:
    if spec.name == "sgd":
        return torch.optim.SGD(parameters, lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay)
    if spec.name == "adam":
        return torch.optim.Adam(parameters, lr=spec.lr, weight_decay=spec.weight_decay)
    return torch.optim.AdamW(parameters, lr=spec.lr, weight_decay=spec.weight_decay)


def build_schedule(optimizer: torch.optim.Optimizer, trainer: TrainerSpec, total_steps: int) -> LambdaLR:
    """Linear warm-up over lrWarmupSteps, then constant or cosine decay to 0 at total_steps."""
    warmup = trainer.lr_warmup_steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if trainer.lr_schedule == "cosine":
            progress = (step - warmup) / max(1, total_steps - warmup)
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return LambdaLR(optimizer, factor)
