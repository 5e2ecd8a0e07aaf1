"""Rank 0's scalars as TensorBoard event files, the convention of torchtitan and Lightning: `tensorboard --logdir` on
the checkpoint directory (on a cluster, its claim) shows the curves, and `tandem plot` draws them (tandem/curves.py
names the tags and the folder).

They go under the checkpoint directory, one folder per run (`tensorboard/<run>`: a resume and a restart write on in
the run's own folder, a run started afresh gets its own beside the others). What is written, at the optimizer step
it belongs to:

- `train/loss`: the mean loss of the good steps (NaN/Inf skipped) of every EVERY_STEPS steps, and `train/lr`, the
  learning rate of that window's last step;
- `train/samples_per_second`: over all ranks, between the step record's reads (about once a second, when the ranks
  compare notes), time spent writing checkpoints left out;
- `communication/bytes_ratio`, where the mode compresses gradients (sharedGradients): the bytes rank 0 sent over
  those a dense fp32 all-reduce sends, between the same reads;
- `eval/loss`, `eval/accuracy` (whatever evaluation.py measures): at each checkpoint.

The losses come from the step record's reads (nonfinite.StepRecord), never from the device directly: logging costs
the loop no wait for the device.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from tandem import curves
from tandem.worker.train.modes import TrainingMode
from tandem.worker.train.optim import LearningRateSchedule
from tandem.worker.train.state import Position

EVERY_STEPS = 10
"""The loss and learning rate are written every this many optimizer steps (the window's mean loss)."""

FLUSH_SECONDS = 10
"""How often the event file is flushed to disk while training (besides each checkpoint, and the end)."""


def run_directory(checkpoint_dir: Path, run: str) -> Path:
    return checkpoint_dir / curves.DIRECTORY / run


class ScalarLog:
    """Rank 0's TensorBoard writer. `losses` is the step record's `on_read`; `checkpoint` is called once a checkpoint is
    complete; `close` at the end."""

    def __init__(self, directory: Path, *, position: Position, schedule: LearningRateSchedule, mode: TrainingMode):
        from torch.utils.tensorboard import SummaryWriter  # rank 0 only: tensorboard takes most of a second to import

        # A resumed run writes on from its checkpoint's step: what the run wrote past it before (then lost) is hidden.
        self.writer = SummaryWriter(str(directory), purge_step=position.step + 1 if position.step else None,
                                    flush_secs=FLUSH_SECONDS)
        self.position = position
        self.schedule = schedule
        self.mode = mode
        self.compresses = mode.compression_report() is not None
        self._window: list[float] = []
        self._since = self._now()

    def losses(self, first_step: int, losses: list[float], bad: list[bool]) -> None:
        """Steps `first_step`, `first_step + 1`, ... were read: their losses and NaN/Inf verdicts."""
        for step, (loss, skipped) in enumerate(zip(losses, bad, strict=True), start=first_step):
            if not skipped and math.isfinite(loss):
                self._window.append(loss)
            if step % EVERY_STEPS == 0:
                if self._window:
                    self.writer.add_scalar(curves.LOSS, sum(self._window) / len(self._window), step)
                self.writer.add_scalar(curves.LEARNING_RATE, self.schedule.rate(step - 1), step)
                self._window = []
        self._rates(first_step + len(losses) - 1)

    def checkpoint(self, step: int, metrics: dict[str, float]) -> None:
        """The checkpoint of `step` is complete, its evaluation's `metrics` measured: written, and the file flushed."""
        for name, value in metrics.items():
            self.writer.add_scalar(curves.EVAL_TAGS.get(name, f"eval/{name}"), value, step)
        self.writer.flush()
        self._since = self._now()  # the checkpoint's time is not training's

    def close(self) -> None:
        self.writer.close()

    def _now(self) -> tuple[float, int, int, int]:
        return (time.monotonic(), self.position.samples, *self.mode.communication())

    def _rates(self, step: int) -> None:
        """What went on since the last read (or checkpoint): samples per second and the bytes' ratio."""
        clock, samples, sent, dense = now = self._now()
        before_clock, before_samples, before_sent, before_dense = self._since
        self._since = now
        if clock > before_clock and samples > before_samples:
            self.writer.add_scalar(curves.SAMPLES_PER_SECOND, (samples - before_samples) / (clock - before_clock),
                                   step)
        if self.compresses and dense > before_dense:
            self.writer.add_scalar(curves.BYTES_RATIO, (sent - before_sent) / (dense - before_dense), step)
