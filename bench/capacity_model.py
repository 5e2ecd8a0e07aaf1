"""User code for bench/bench_capacity.py, imported by the rank and server processes (bench/ is put on their
PYTHONPATH): the digits MLP with an accelerator's time emulated by a sleep, so that what a GPU buys (a rank's
examples a second, a replica's requests a second) is set by how many GPUs each side holds, not by the 2 shared CPU
cores all the processes run on.

- training (`paced_logged_mlp`): each training forward sleeps `seconds_per_example` x its micro-batch's examples (a
  GPU's time is its examples' time: with `elastic.batch: global` a group of fewer ranks gives each rank more of the
  step's examples, so a step takes longer and the job's examples a second follow its ranks), and appends a line to
  the forward log as bench/regroup_model.py's model does (time, pid, RANK, examples, ranks).
- serving (`paced_mlp`): each inference forward sleeps `seconds` + `seconds_per_row` x its batch's rows (a GPU's
  forward: a fixed launch cost and a part that grows with the batch), one forward at a time per model replica.
"""

from __future__ import annotations

import time

from regroup_model import ForwardLoggedMLP
from torch import nn

from tandem.examples.digits import mlp


class PacedLoggedMLP(ForwardLoggedMLP):
    def __init__(self, log: str, hidden: int, seconds_per_example: float):
        super().__init__(log, hidden)
        self.seconds_per_example = seconds_per_example

    def forward(self, x):
        if self.training:
            time.sleep(self.seconds_per_example * len(x))
        return super().forward(x)


def paced_logged_mlp(log: str, seconds_per_example: float, hidden: int = 64) -> nn.Module:
    return PacedLoggedMLP(log, hidden, seconds_per_example)


class PacedMLP(nn.Module):
    def __init__(self, hidden: int, seconds: float, seconds_per_row: float):
        super().__init__()
        self.net = mlp(hidden=hidden)
        self.seconds, self.seconds_per_row = seconds, seconds_per_row

    def forward(self, x):
        if not self.training:
            time.sleep(self.seconds + self.seconds_per_row * len(x))
        return self.net(x)


def paced_mlp(seconds: float, seconds_per_row: float, hidden: int = 64) -> nn.Module:
    """The digits MLP (random weights: what it answers does not matter here) whose inference forward sleeps."""
    return PacedMLP(hidden, seconds, seconds_per_row)
