"""Progress reporting: rank 0 keeps one status object (the CR's `.status` shape) and publishes it to sinks. Each
published status carries what a preemption would cost then (`preemptionCost`, preemption.py).

Sinks: a status file (what `tandem run` reads and renders), the console (a rich progress bar on a
terminal, plain log lines otherwise), and, on a cluster, the job's status subresource (status_sink.py:
KubernetesStatusSink, which sends from a thread of its own and keeps its promises while the API server fails).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from rich.console import Console

from tandem.api import ParallelTrainingJobStatus
from tandem.api.training import CheckpointRecord, Recovery
from tandem.worker.train.preemption import preemption_cost
from tandem.worker.train.progress_bar import ProgressBar
from tandem.worker.train.status_sink import HISTORY_LIMIT

if TYPE_CHECKING:
    from tandem.worker.train.membership import Plan


def now() -> datetime:
    return datetime.now(UTC).replace(microsecond=0)


class Sink(Protocol):
    def publish(self, status: ParallelTrainingJobStatus) -> None: ...

    def close(self) -> None: ...


class StatusFileSink:
    """Writes the status as JSON, atomically replaced, so a reader never sees half a file."""

    def __init__(self, path: Path):
        self.path = path

    def publish(self, status: ParallelTrainingJobStatus) -> None:
        temporary = self.path.with_name(f".{self.path.name}.tmp")
        temporary.write_text(json.dumps(status.to_dict()))
        os.replace(temporary, self.path)

    def close(self) -> None:
        pass


def read_status_file(path: Path) -> ParallelTrainingJobStatus | None:
    try:
        return ParallelTrainingJobStatus.model_validate_json(path.read_text())
    except (OSError, ValueError):
        return None


class ConsoleSink:
    """Epoch, step/total, loss, samples/s and ETA (as kubectl's columns print them): a live bar on a terminal, one log
    line per update otherwise (progress_bar.py: the bar fits the terminal's width)."""

    def __init__(self, title: str, stream=None):
        self.title = title
        self.console = Console(file=stream or sys.stderr)
        self.live = self.console.is_terminal
        self._bar: ProgressBar | None = None

    def publish(self, status: ParallelTrainingJobStatus) -> None:
        progress = status.progress
        loss, speed = progress.loss_text or "-", progress.samples_per_second_text or "-"
        if not self.live:
            self.console.print(
                f"{self.title}: {status.phase} epoch {progress.epoch} step {progress.step}/{progress.total_steps} "
                f"loss {loss} samples/s {speed} eta {progress.eta_text or '-'}",
                highlight=False, soft_wrap=True,
            )
            return
        if self._bar is None:
            self._bar = ProgressBar(self.title, self.console)
        self._bar.show(status)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class Reporter:
    """Rank 0's status: updated every step, published at most every `interval` seconds, and at once for
    checkpoints and phase changes."""

    def __init__(self, sinks: list[Sink], *, workers: int, total_steps: int, interval: float = 2.0,
                 compression: Callable[[], dict[str, float | int] | None] | None = None):
        self.sinks = sinks
        self.compression = compression
        """What the mode's compression reports for status.communication (read only when the status is published)."""
        self.interval = interval
        self.status = ParallelTrainingJobStatus(phase="Running", start_time=now())
        self.status.workers.ready = self.status.workers.total = workers
        self.status.progress.total_steps = total_steps
        self._last_publish = 0.0
        self._first: tuple[float, int, int] | None = None
        self._latest: tuple[float, int, int, float | None, int] | None = None
        self._checkpoint_seconds: float | None = None

    def publish(self) -> None:
        self.refresh()
        self.status.preemption_cost = preemption_cost(self.status, self._checkpoint_seconds)
        self.status = ParallelTrainingJobStatus.model_validate(self.status.model_dump())  # refresh summaries
        for sink in self.sinks:
            sink.publish(self.status)
        self._last_publish = time.monotonic()

    def progress(self, *, epoch: int, step: int, loss: float | None, samples: int) -> None:
        """Record a finished optimizer step; `samples` counts examples processed by this run over all ranks.
        Cheap on the steps that do not publish: the status is brought up to date only when it is published."""
        clock = time.monotonic()
        self._latest = (clock, epoch, step, loss, samples)
        if self._first is None:
            self._first = (clock, samples, step)
        if clock - self._last_publish >= self.interval:
            self.publish()

    def refresh(self) -> None:
        """Apply the latest recorded step to the status (once: later edits of the status stick)."""
        report = self.compression() if self.compression is not None else None
        if report:
            communication = self.status.communication
            self.status.communication = communication.model_copy(update=report)
        if self._latest is None:
            return
        clock, epoch, step, loss, samples = self._latest
        self._latest = None
        progress = self.status.progress
        progress.epoch, progress.step, progress.last_heartbeat = epoch, step, now()
        if loss is not None:
            progress.loss = loss
        started, samples_then, step_then = self._first
        elapsed = clock - started
        if elapsed > 0 and step > step_then:
            progress.samples_per_second = (samples - samples_then) / elapsed
            steps_per_second = (step - step_then) / elapsed
            progress.eta_seconds = max(0.0, (progress.total_steps - step) / steps_per_second)

    def checkpoint(self, path: Path, step: int, seconds: float | None = None,
                   metrics: dict[str, float] | None = None) -> None:
        """The checkpoint of `step` is complete at `path`; `seconds`: how long writing it took (None: not written by
        this process, as a resumed one); `metrics`: its evaluation's."""
        self._checkpoint_seconds = seconds
        record = CheckpointRecord(path=str(path), step=step, time=now(), metrics=metrics or {})
        checkpoint = self.status.checkpoint
        checkpoint.latest, checkpoint.step, checkpoint.time = record.path, record.step, record.time
        checkpoint.history = [*checkpoint.history, record][-HISTORY_LIMIT:]
        self.publish()

    def resumed(self, path: Path, *, step: int, epoch: int, metrics: dict[str, float] | None = None) -> None:
        """Training resumes from the checkpoint at `path` (`metrics`: those its manifest records): the first status
        shows its step, not 0."""
        self.status.progress.step, self.status.progress.epoch = step, epoch
        self.checkpoint(path, step, metrics=metrics)

    def regrouped(self, plan: Plan, *, workers: int, stopped_at: int, seconds: float, total_steps: int) -> None:
        """An elastic job's group changed in process (membership.Plan): the ranks training now, the recovery."""
        status = self.status
        status.workers.ready = workers
        status.progress.total_steps = total_steps
        status.recoveries.regroups += 1
        left = (f"rank(s) {', '.join(map(str, plan.left))} left as asked (their pods deleted: the job scaled down, "
                "or lent them)") if plan.left else ""
        status.last_recovery = Recovery(kind="regroup", lost=plan.lost, added=sorted(plan.added), workers=workers,
                                        stopped_at_step=stopped_at, resumed_at_step=plan.step, seconds=seconds,
                                        time=now(), message=left)
        self.publish()

    def final(self, phase: str, message: str, *, epoch: int, metrics: dict[str, float], bytes_sent: int,
              dense_bytes: int) -> ParallelTrainingJobStatus:
        """The status at the end of training, with the evaluation's metrics and the bytes the ranks exchanged."""
        self.refresh()
        self.status.progress.epoch = epoch
        self.status.metrics.update(metrics)
        self.status.communication.bytes_sent, self.status.communication.dense_bytes = bytes_sent, dense_bytes
        self.status.phase = phase
        self.status.message = message
        self.status.completion_time = now()
        self.publish()
        for sink in self.sinks:
            sink.close()
        return self.status
