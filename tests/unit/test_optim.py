"""The learning-rate schedule (worker/train/optim.py): a function of the step, applied to the optimizer."""

from __future__ import annotations

import pytest
import torch

from tandem.api.training import TrainerSpec
from tandem.worker.train.optim import LearningRateSchedule, build_optimizer


def schedule_for(total_steps: int, **trainer) -> LearningRateSchedule:
    spec = TrainerSpec.model_validate({"model": "m:f", "data": "m:g", "optimizer": {"name": "sgd", "lr": 0.5},
                                       **trainer})
    optimizer = build_optimizer(torch.nn.Linear(2, 2).parameters(), spec.optimizer)
    return LearningRateSchedule(optimizer, spec, total_steps)


def rates(schedule: LearningRateSchedule, steps: int) -> list[float]:
    seen = []
    for step in range(steps):
        schedule.apply(step)
        seen.append(schedule.optimizer.param_groups[0]["lr"])
    return seen


def test_warmup_rises_linearly_then_holds():
    assert rates(schedule_for(10, lrWarmupSteps=4), 6) == pytest.approx([0.125, 0.25, 0.375, 0.5, 0.5, 0.5])


def test_cosine_decays_from_the_end_of_warmup_to_zero_at_the_last_step():
    schedule = schedule_for(12, lrWarmupSteps=2, lrSchedule="cosine")
    seen = rates(schedule, 13)
    assert seen[:3] == pytest.approx([0.25, 0.5, 0.5])
    assert seen[7] == pytest.approx(0.25)
    assert seen[12] == pytest.approx(0.0, abs=1e-12)
    assert all(a >= b for a, b in zip(seen[2:], seen[3:], strict=False))


def test_a_constant_rate_is_left_to_the_optimizer():
    schedule = schedule_for(10)
    assert schedule.constant
    schedule.optimizer.param_groups[0]["lr"] = 0.123
    schedule.apply(5)
    assert schedule.optimizer.param_groups[0]["lr"] == 0.123
    assert schedule.describe(5) == {"kind": "constant", "warmup_steps": 0, "total_steps": 10, "base_lr": 0.5,
                                    "lr": 0.5}


def test_an_elastic_scale_applies_and_a_return_to_full_size_restores_the_rate():
    """batch perRank: the rate follows elastic.lrScaling's multiplier at a smaller size, and returns to optimizer.lr
    when the group is back at spec.workers (a constant schedule, which otherwise leaves the optimizer alone)."""
    schedule = schedule_for(10)
    schedule.scale = 0.5
    assert rates(schedule, 2) == pytest.approx([0.25, 0.25])
    schedule.scale = 1.0
    assert rates(schedule, 2) == pytest.approx([0.5, 0.5])
