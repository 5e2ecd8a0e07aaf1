"""One optimizer step over a group of accumulated micro-batches: forward and backward under the mode's exchange
and the mixed-precision settings, then the NaN/Inf guard, clipping, the learning rate, and the optimizer step.

A step whose loss or gradients are not all finite is skipped on the device (nonfinite.py): after the gradient
exchange every rank holds the same gradients, so all ranks skip together.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F

from tandem.api.training import TrainerSpec
from tandem.worker.train.data import to_device
from tandem.worker.train.modes import TrainingMode
from tandem.worker.train.nonfinite import NonFiniteGuard
from tandem.worker.train.optim import LearningRateSchedule


def loss_for(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy for integer class labels, mean squared error for float targets."""
    if targets.is_floating_point():
        return F.mse_loss(outputs.float(), targets.reshape(outputs.shape).float())
    return F.cross_entropy(outputs.float(), targets)


def autocast_for(precision: str, device: torch.device):
    if precision == "none":
        return nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


class TrainStep:
    def __init__(self, trainer: TrainerSpec, mode: TrainingMode, optimizer: torch.optim.Optimizer,
                 scaler: torch.amp.GradScaler, schedule: LearningRateSchedule, device: torch.device,
                 world_size: int):
        self.mode = mode
        self.optimizer = optimizer
        self.scaler = scaler
        self.schedule = schedule
        self.device = device
        self.world_size = world_size
        self.clip_norm = trainer.gradient_clip_norm
        self.fp16 = trainer.mixed_precision == "fp16"
        self.autocast = autocast_for(trainer.mixed_precision, device)
        self.parameters = list(mode.model.parameters())
        self.guard = NonFiniteGuard(self.parameters, device)
        self.input_shape: list[int] | None = None
        """One example's shape, recorded for checkpoint manifests (what a server validates requests against)."""

    def __call__(self, steps_done: int, micro_batches: Sequence[Any], *, step_examples: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Train on `micro_batches` as the step after `steps_done`; returns the step's loss and NaN/Inf flag (device
        tensors, never read here) and the examples it took over all ranks.

        `step_examples`: an elastic step's examples over all ranks, shared unevenly (this rank may have fewer than
        the others, or none): each micro-batch's mean loss is weighted by its size x world_size / step_examples, so
        that the exchanged mean is the mean over the step's examples whatever the shares."""
        losses, examples = [], 0
        for index, micro_batch in enumerate(micro_batches):
            inputs, targets = micro_batch if self.device.type == "cpu" else to_device(micro_batch, self.device)
            self.input_shape = self.input_shape or list(inputs.shape[1:])
            with self.mode.no_sync(last_micro_batch=index == len(micro_batches) - 1), self.autocast:
                loss = loss_for(self.mode.module(inputs), targets)
                if step_examples is not None:
                    loss = loss * (inputs.shape[0] * self.world_size / step_examples)
                elif len(micro_batches) > 1:  # the mean over the step's examples; skipped when there is one
                    loss = loss / len(micro_batches)
            self.scaler.scale(loss).backward()
            losses.append(loss.detach())
            examples += inputs.shape[0] * self.world_size
        self.mode.exchange()
        if step_examples is not None:
            examples = step_examples
        step_loss = torch.zeros((), device=self.device) if not losses else \
            losses[0] if len(losses) == 1 else torch.stack(losses).sum()

        self.scaler.unscale_(self.optimizer)
        self.schedule.apply(steps_done)
        norm = torch.nn.utils.clip_grad_norm_(self.parameters, self.clip_norm) if self.clip_norm is not None else None
        found = self.guard.check(step_loss, norm)
        if not self.fp16:  # fp16: the gradient scaler hands the optimizer its own flag, for overflows
            self.optimizer.found_inf = found  # the fused optimizer skips its update, on the device, when set
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return step_loss, found, examples
