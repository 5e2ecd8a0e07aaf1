"""User code for the trainer tests, imported by worker processes (tests/ is put on their PYTHONPATH)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

from tandem.examples.digits import mlp
from tandem.worker import checkpoint


class FaultOnRank(nn.Module):
    """The digits MLP, except that on rank `rank` its `at`-th training forward goes wrong: it raises ("raise"), its
    output is NaN ("nan"), or it never returns ("hang": a hung rank crashes nothing and reports nothing)."""

    def __init__(self, rank: int, at: int, fault: str):
        super().__init__()
        self.net = mlp(hidden=16)
        self.rank, self.at, self.fault = str(rank), at, fault
        self.calls = 0

    def forward(self, x):
        out = self.net(x)
        if not self.training:
            return out
        self.calls += 1
        if os.environ.get("RANK") != self.rank or self.calls != self.at:
            return out
        if self.fault == "raise":
            raise RuntimeError(f"injected failure in rank {self.rank}'s forward pass")
        if self.fault == "hang":
            time.sleep(3600)
        return out * float("nan")


def crash_on_rank_one(at: int = 3) -> nn.Module:
    return FaultOnRank(1, at, "raise")


def nan_on_rank_one(at: int) -> nn.Module:
    return FaultOnRank(1, at, "nan")


def hang_on_rank_zero(at: int) -> nn.Module:
    return FaultOnRank(0, at, "hang")


def nan_data(bad_every: int = 0, size: int = 256) -> TensorDataset:
    """Random 64-feature, 10-class data; every example NaN when bad_every == 1, every bad_every-th otherwise."""
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(size, 64, generator=generator)
    y = torch.randint(0, 10, (size,), generator=generator)
    if bad_every:
        x[::bad_every] = float("nan")
    return TensorDataset(x, y)


def not_a_module() -> str:
    return "a string"


class DropoutMLP(nn.Module):
    """The digits MLP with dropout after each hidden layer (so training draws random numbers every step), and an
    optional pause in each training forward, which makes a run long enough to be stopped midway by a signal."""

    def __init__(self, hidden: int, p: float, step_seconds: float):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(64, hidden), nn.ReLU(), nn.Dropout(p),
            nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(p),
            nn.Linear(hidden, 10),
        )
        self.step_seconds = step_seconds

    def forward(self, x):
        if self.training and self.step_seconds:
            time.sleep(self.step_seconds)
        return self.net(x)


def dropout_mlp(hidden: int = 32, p: float = 0.3, step_seconds: float = 0.0) -> nn.Module:
    return DropoutMLP(hidden, p, step_seconds)


def dropout_mlp_paused_until_resumed(hidden: int = 32, p: float = 0.3, step_seconds: float = 0.0) -> nn.Module:
    """dropout_mlp whose pause applies only in a job's first group of ranks (TANDEM_RESUME_FROM empty): long enough
    to be stopped midway, and a resumed run that does not wait."""
    return DropoutMLP(hidden, p, 0.0 if os.environ.get("TANDEM_RESUME_FROM") else step_seconds)


class PacedUntil(DropoutMLP):
    """DropoutMLP pausing in each training forward until a file exists: a run slow enough for a test to act on
    (kill a rank, wait for its replacement) that then finishes at full speed."""

    def __init__(self, hidden: int, p: float, step_seconds: float, until: str):
        super().__init__(hidden, p, step_seconds)
        self.until = Path(until)

    def forward(self, x):
        if self.step_seconds and self.until.exists():
            self.step_seconds = 0.0
        return super().forward(x)


def paced_until(until: str, hidden: int = 32, p: float = 0.0, step_seconds: float = 0.05) -> nn.Module:
    return PacedUntil(hidden, p, step_seconds, until)


class FreezesInEvaluation(PacedUntil):
    """paced_until, except that rank 1 stops itself (SIGSTOP: frozen, its connections open, as on a node that went
    silent) in its first evaluation forward, once `stopped` does not exist yet (it creates it): a test wakes it."""

    def __init__(self, hidden: int, step_seconds: float, until: str, stopped: str):
        super().__init__(hidden, 0.0, step_seconds, until)
        self.stopped = Path(stopped)

    def forward(self, x):
        if not self.training and os.environ.get("RANK") == "1" and not self.stopped.exists():
            self.stopped.touch()
            os.kill(os.getpid(), signal.SIGSTOP)
        return super().forward(x)


def freezes_in_evaluation(until: str, stopped: str, hidden: int = 32, step_seconds: float = 0.05) -> nn.Module:
    return FreezesInEvaluation(hidden, step_seconds, until, stopped)


def regression_data(size: int = 512) -> TensorDataset:
    """64 features in [0, 1); a float target, their mean: a regression that a linear layer fits exactly."""
    x = torch.rand(size, 64, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, x.mean(dim=1, keepdim=True))


def regressor() -> nn.Module:
    return nn.Linear(64, 1)


class CrashOnceAfterCheckpoint(DropoutMLP):
    """dropout_mlp, except that in a job's first group of ranks (TANDEM_RESUME_FROM empty) rank 1's `at`-th training
    forward raises, once the checkpoint of step `at - 1` is complete on disk: the crash comes right after it. A
    restarted group resumes from a checkpoint and never crashes. `at` 0: never."""

    def __init__(self, at: int, hidden: int, p: float):
        super().__init__(hidden, p, 0.0)
        self.at = at
        self.calls = 0

    def forward(self, x):
        if self.training and self.at:
            self.calls += 1
            if self.calls == self.at and os.environ.get("RANK") == "1" and not os.environ.get("TANDEM_RESUME_FROM"):
                written = checkpoint.checkpoint_path(Path(os.environ["TANDEM_CHECKPOINT_DIR"]), self.at - 1)
                deadline = time.monotonic() + 60
                while not written.exists() and time.monotonic() < deadline:
                    time.sleep(0.01)
                raise RuntimeError(f"injected failure in rank 1 after {written.name}")
        return super().forward(x)


def crash_once_after_checkpoint(at: int = 0, hidden: int = 32, p: float = 0.3) -> nn.Module:
    return CrashOnceAfterCheckpoint(at, hidden, p)


class LearningRateSpike(nn.Module):
    """The digits MLP whose gradients are multiplied by `factor` in training steps `at` + 1 .. `at` + `steps` (one
    training forward a step): with SGD, the learning rate spiking `factor`-fold for those steps, so that the
    checkpoints after them are worse than those before."""

    def __init__(self, hidden: int, at: int, steps: int, factor: float):
        super().__init__()
        self.net = mlp(hidden=hidden)
        self.at, self.steps, self.factor = at, steps, factor
        self.forwards = 0
        for parameter in self.parameters():
            parameter.register_hook(self._scaled)

    def _scaled(self, grad: torch.Tensor) -> torch.Tensor:
        return grad * self.factor if self.at < self.forwards <= self.at + self.steps else grad

    def forward(self, x):
        if self.training:
            self.forwards += 1
        return self.net(x)


def learning_rate_spike(hidden: int = 32, at: int = 50, steps: int = 5, factor: float = 30.0) -> nn.Module:
    return LearningRateSpike(hidden, at, steps, factor)
