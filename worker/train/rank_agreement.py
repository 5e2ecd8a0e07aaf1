"""What the ranks decide together while training, exchanged in one asynchronous all-reduce every so often.

A stop request arrives as a signal on one rank; the time rule for checkpoints (checkpoint.everyMinutes) is read
from one clock. Acting on either alone would make ranks leave the loop, or enter a checkpoint's collectives,
after different steps. So each exchange carries, reduced with MAX:

- stop: whether any rank has been asked to stop;
- checkpoint: rank 0's verdict on the time rule;
- interval: rank 0's proposal for the steps until the next exchange, about TARGET_SECONDS of training;
- regroup: in an elastic job, rank 0's word that a rank asks to join or leave (every rank enters the next generation).

An exchange starts at an agreed step and overlaps the following steps' compute; its outcome is read at the
next exchange, where every rank acts on it after the same step. A stop therefore lands within two intervals
(about two seconds) whatever the step time, and a fast model pays for one small all-reduce a second.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

TARGET_SECONDS = 1.0
"""About how long the steps between two exchanges take."""
MAX_INTERVAL = 10_000


@dataclass(frozen=True)
class Outcome:
    """What every rank does after the step of an exchange."""

    stop: bool = False
    checkpoint: bool = False
    regroup: bool = False


class Agreement:
    """One rank's side of the exchanges; every rank calls `exchange` after the same steps (`next_step`)."""

    def __init__(
        self, *, is_master: bool, first_step: int, checkpoint_every_seconds: float | None,
        target_seconds: float | None = None, wait: Callable[[dist.Work], None] = dist.Work.wait,
    ):
        self.is_master = is_master
        self.next_step = first_step
        """The step after which the next exchange happens (the same on every rank)."""
        self.checkpoint_every_seconds = checkpoint_every_seconds
        self.target_seconds = TARGET_SECONDS if target_seconds is None else target_seconds
        self.wait = wait
        """How the exchange in flight is waited for (an elastic job's: with an eye on the members' heartbeats)."""
        self._values = torch.zeros(4, dtype=torch.float64)
        self._pending: dist.Work | None = None
        self._interval = 1
        self._last_exchange = (time.monotonic(), first_step - 1)
        self._last_checkpoint = time.monotonic()

    def exchange(self, step: int, *, stop_requested: bool, regroup_wanted: bool = False) -> Outcome:
        """At the agreed step: the previous exchange's outcome (the same on every rank), then the next exchange."""
        clock = time.monotonic()  # before waiting: the steps' own pace, without a straggler's
        outcome = Outcome()
        if self._pending is not None:
            self.wait(self._pending)
            self._pending = None
            stop, checkpoint, interval, regroup = self._values.tolist()
            outcome = Outcome(stop=stop > 0, checkpoint=checkpoint > 0, regroup=regroup > 0)
            self._interval = int(interval)
            if outcome.checkpoint:
                self.checkpoint_written()
        self._values.copy_(torch.tensor([float(stop_requested), *self._master_proposal(step, clock),
                                         float(regroup_wanted)]))
        self._pending = dist.all_reduce(self._values, op=dist.ReduceOp.MAX, async_op=True)
        self._last_exchange = (time.monotonic(), step)
        self.next_step = step + self._interval
        return outcome

    def checkpoint_written(self) -> None:
        """Restart the time rule's clock (any checkpoint counts, whichever rule wrote it)."""
        self._last_checkpoint = time.monotonic()

    def close(self) -> None:
        """Finish the exchange in flight (every rank must, before the group's next collective)."""
        if self._pending is not None:
            self.wait(self._pending)
            self._pending = None

    def _master_proposal(self, step: int, clock: float) -> tuple[float, float]:
        if not self.is_master:
            return 0.0, 0.0
        checkpoint_due = (self.checkpoint_every_seconds is not None
                          and clock - self._last_checkpoint >= self.checkpoint_every_seconds)
        then, step_then = self._last_exchange
        seconds_per_step = max(clock - then, 1e-9) / max(1, step - step_then)
        return float(checkpoint_due), float(min(MAX_INTERVAL, max(1, int(self.target_seconds / seconds_per_step))))
