"""The live progress bar on a terminal (`tandem run`, ParallelWrapper): the job and its epoch, the bar, step/total,
loss, samples/s and ETA, on one line that fits the terminal's width, 80 columns included.

The step count is never cut. When the line is too long, the job's name gives way first (down to a few characters,
with an ellipsis), then the bar shrinks to its least, then samples/s and then the ETA are left out; the loss goes
last. The layout is worked out again at each update, so a resized terminal is followed.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn
from rich.table import Column

from tandem.api import ParallelTrainingJobStatus

BAR_WIDTH = (8, 40)
"""The bar's least and greatest width, in columns."""
NAME_KEPT = 8
"""The characters of the job's name kept, at least, before the bar shrinks."""
GAP = "  "


@dataclass(frozen=True)
class Line:
    left: str
    """The job's name and its epoch."""
    bar_width: int
    right: str
    """step/total, then the loss, samples/s and ETA that fit."""


def layout(width: int, name: str, epoch: int, step: int, total: int | None, loss: str, speed: str,
           eta: str | None) -> Line:
    """The line for a terminal `width` columns wide."""
    epoch_text = f" epoch {epoch}"
    counts = f"{step}/{total}" if total else str(step)
    details = {"loss": f"loss {loss}", "speed": f"{speed} samples/s", "eta": f"eta {eta}" if eta else ""}
    least, most = BAR_WIDTH
    for left_out in ((), ("speed",), ("speed", "eta"), ("speed", "eta", "loss")):
        right = GAP.join([counts, *(text for key, text in details.items() if text and key not in left_out)])
        room = width - len(right) - 2 - len(epoch_text)  # for the name and the bar (a space between columns)
        if room >= min(len(name), NAME_KEPT) + least:
            shown = shorten(name, room - least)
            return Line(shown + epoch_text, max(least, min(most, room - len(shown))), right)
    return Line(shorten(name + epoch_text, max(1, width - len(counts) - 4)), 1, counts)  # narrower than any terminal


def shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[:max(0, width - 1)] + "…"


class ProgressBar:
    """One live line on `console`, replaced at each `show`; `close` leaves the last one on the screen."""

    def __init__(self, name: str, console: Console):
        self.name = name
        self.console = console
        self._bar = BarColumn()
        self._progress = Progress(
            TextColumn("{task.fields[left]}", style="bold", markup=False, table_column=Column(no_wrap=True)),
            self._bar,
            TextColumn("{task.fields[right]}", markup=False, table_column=Column(no_wrap=True)),
            console=console,
        )
        self._task = self._progress.add_task(name, total=None, left=name, right="")
        self._progress.start()

    def show(self, status: ParallelTrainingJobStatus) -> None:
        progress = status.progress
        line = layout(self.console.width, self.name, progress.epoch, progress.step, progress.total_steps,
                      progress.loss_text or "-", progress.samples_per_second_text or "-", progress.eta_text)
        self._bar.bar_width = line.bar_width
        self._progress.update(self._task, completed=progress.step, total=progress.total_steps or None,
                              left=line.left, right=line.right)

    def close(self) -> None:
        self._progress.stop()
