"""The NaN/Inf guard and the per-step record, kept on the device so that the loop never waits for it.

Reading a step's loss or its verdict on the host (`.item()`) makes the CPU wait until the device has finished
the step, and then the device waits for the CPU to queue the next one: on a GPU, two stalls a step. So:

- the verdict (is every gradient entry and the loss finite?) is computed on the device and handed to the fused
  optimizer as `found_inf`, the flag torch's GradScaler uses: a bad step changes no parameter and no optimizer
  state, decided on the device;
- each step's loss and verdict are kept, as device tensors, until the host reads them all at once (`flush`):
  at the ranks' agreements (about once a second), before checkpoints, at the end, or after CAPACITY steps.
  Reading them in step order gives the running loss over good steps, the skipped-step counts and the
  consecutive-bad-steps limit exactly as if each had been read at once; only the error for that limit comes up
  to a second late.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

CAPACITY = 256
"""Steps recorded between reads at most."""


class TrainingError(RuntimeError):
    """Training cannot go on: too many consecutive steps with a NaN/Inf loss or gradient."""


class NonFiniteGuard:
    """Whether a step's gradients and loss are all finite, as a device flag (0: finite) in one fused pass: the
    kernel torch's GradScaler uses, with a scale of 1. A gradient norm answers the same at twice the cost."""

    def __init__(self, parameters: list[torch.nn.Parameter], device: torch.device):
        self.parameters = parameters
        self.device = device
        self._scale = torch.ones((), device=device)

    def check(self, loss: torch.Tensor, gradient_norm: torch.Tensor | None = None) -> torch.Tensor:
        """A new flag for this step (0-d, as GradScaler makes it: Adam subtracts it from its step counts). With
        clipping, the norm clip_grad_norm_ computed gives the gradients' verdict with no further pass."""
        found = torch.zeros((), device=self.device)
        tensors = [loss]
        if gradient_norm is not None:
            tensors.append(gradient_norm)
        else:
            tensors += [p.grad for p in self.parameters if p.grad is not None]
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, self._scale)
        return found


class StepRecord:
    """Each step's loss and verdict, on the device until `flush` reads them in step order."""

    def __init__(self, counts: Any, *, max_consecutive_bad_steps: int, counts_bad_steps: bool,
                 on_read: Callable[[int, list[float], list[bool]], None] | None = None):
        self.counts = counts
        """Where the bad-step counts live (`bad_steps`, `consecutive_bad_steps`): the trainer's Position, which
        checkpoints save and resumes restore; updated at each flush."""
        self.max_consecutive_bad_steps = max_consecutive_bad_steps
        self.counts_bad_steps = counts_bad_steps
        """False under fp16, where the gradient scaler skips overflowing steps as a matter of course."""
        self.on_read = on_read
        """Given what each flush read, in step order: (the first step's number, the steps' losses, whether each was
        bad): rank 0's scalar log (scalars.py) takes its losses from here, never waiting for the device itself."""
        self._losses: list[torch.Tensor] = []
        self._bad: list[torch.Tensor] = []
        self._first_step = 0
        self.running_loss: float | None = None

    def add(self, step: int, loss: torch.Tensor, found: torch.Tensor) -> None:
        """Record the step numbered `step` (1-based) without waiting for the device: `loss` and `found` are this
        step's own tensors (not reused)."""
        if not self._losses:
            self._first_step = step
        self._losses.append(loss)
        self._bad.append(found)
        if len(self._losses) == CAPACITY:
            self.flush()

    def flush(self) -> None:
        """Read the recorded steps: running loss (exponential average over good steps), bad-step counts.
        Raises TrainingError at the step where the consecutive bad steps reached the limit."""
        if not self._losses:
            return
        recorded = torch.stack([torch.stack(self._losses).float(), torch.stack(self._bad)]).tolist()
        first, self._losses, self._bad = self._first_step, [], []
        if self.on_read is not None:
            self.on_read(first, recorded[0], [bool(found) for found in recorded[1]])
        counts = self.counts
        for offset, (loss, found) in enumerate(zip(*recorded, strict=True)):
            if not found:
                counts.consecutive_bad_steps = 0
                self.running_loss = loss if self.running_loss is None else 0.9 * self.running_loss + 0.1 * loss
            elif self.counts_bad_steps:
                counts.bad_steps += 1
                counts.consecutive_bad_steps += 1
                if counts.consecutive_bad_steps >= self.max_consecutive_bad_steps:
                    raise TrainingError(
                        f"{counts.consecutive_bad_steps} consecutive steps with a NaN/Inf loss or gradient "
                        f"(step {first + offset}); lower optimizer.lr, set gradientClipNorm, or check the data"
                    )
