"""The model of bench/bench_preemption.py, imported by the rank pods (bench/ is on their PYTHONPATH): the digits MLP
with dropout (so a resume that is not exact shows), a pause in every training forward (so a run lasts long enough to
be preempted midway), and on rank 0 one line appended to `log` per training forward, once it has computed:
`<time.time()> <pid>`. With no eval data the trainer makes no other forward, so the lines of a finished job, less
its maxSteps, are the steps computed again after a stop: the steps lost."""

from __future__ import annotations

import os
import time

from torch import nn

from tandem.examples.digits import mlp


class CountedMLP(nn.Module):
    def __init__(self, hidden: int, dropout: float, step_seconds: float, log: str | None) -> None:
        super().__init__()
        self.net = mlp(hidden=hidden, dropout=dropout)
        self.step_seconds = step_seconds
        self.log = log if log and os.environ.get("RANK") == "0" else None

    def forward(self, x):
        out = self.net(x)
        if self.training:
            if self.step_seconds:
                time.sleep(self.step_seconds)
            if self.log:
                descriptor = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(descriptor, f"{time.time():.6f} {os.getpid()}\n".encode())
                finally:
                    os.close(descriptor)
        return out


def counted_mlp(hidden: int = 32, dropout: float = 0.3, step_seconds: float = 0.05, log: str | None = None,
                ) -> nn.Module:
    return CountedMLP(hidden, dropout, step_seconds, log)
