"""User code for bench/bench_regroup.py, imported by the rank processes (bench/ is put on their PYTHONPATH): the
digits MLP whose every training forward appends one line to a log, so that the benchmark can see when each
process ran each micro-batch:

    <time.time()> <pid> <RANK> <examples in the micro-batch> <ranks in the process group>
"""

from __future__ import annotations

import os
import time

import torch.distributed as dist
from torch import nn

from tandem.examples.digits import mlp


class ForwardLoggedMLP(nn.Module):
    def __init__(self, log: str, hidden: int):
        super().__init__()
        self.net = mlp(hidden=hidden)
        self.log_path = log
        self.log: int | None = None  # opened by the first training forward, in the process that trains

    def forward(self, x):
        if self.training:
            if self.log is None:
                self.log = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            ranks = dist.get_world_size() if dist.is_initialized() else 1
            line = f"{time.time():.6f} {os.getpid()} {os.environ.get('RANK', '?')} {len(x)} {ranks}\n"
            os.write(self.log, line.encode())  # one appending write a line: whole lines, whichever process writes
        return self.net(x)


def forward_logged_mlp(log: str, hidden: int = 128) -> nn.Module:
    """tandem.examples.digits:mlp(hidden), each training forward logged to the file `log`."""
    return ForwardLoggedMLP(log, hidden)
