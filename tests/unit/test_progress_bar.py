"""The live bar `tandem run` shows fits the terminal, 80 columns included, and never cuts the step count
(worker/train/progress_bar.py), rendered by rich as on a terminal."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from tandem.api import ParallelTrainingJobStatus
from tandem.worker.train.reporting import ConsoleSink


def status(step: int, total: int, loss: float | None, speed: float | None, eta: float | None):
    status = ParallelTrainingJobStatus(phase="Running")
    progress = status.progress
    progress.epoch, progress.step, progress.total_steps = 3, step, total
    progress.loss, progress.samples_per_second, progress.eta_seconds = loss, speed, eta
    return ParallelTrainingJobStatus.model_validate(status.model_dump())


def rendered(name: str, shown: ParallelTrainingJobStatus, width: int) -> str:
    """The bar's line as rich draws it `width` columns wide (the live display's last frame)."""
    stream = io.StringIO()
    sink = ConsoleSink(name, stream=stream)
    sink.console = Console(file=stream, width=width, record=True)
    sink.live = True  # the bar, not log lines: a recording console is not a terminal
    sink.publish(shown)
    sink.close()
    return sink.console.export_text().splitlines()[-1]


@pytest.mark.parametrize("name", ["digits-train", "a-training-job-with-a-name-longer-than-the-bar", "odd[bold]name"])
@pytest.mark.parametrize(("step", "total"), [(690, 2860), (123456, 1000000), (5, 10)])
@pytest.mark.parametrize("width", [80, 60])
def test_the_bar_fits_and_keeps_the_step_count(name, step, total, width):
    line = rendered(name, status(step, total, 0.06094, 1523.4, 125), width)
    assert len(line) <= width, line
    assert f" {step}/{total}" in line, line


def test_at_80_columns_the_digits_job_shows_everything(tmp_path):
    line = rendered("digits-train", status(690, 2860, 0.06094, 1523.4, 125), 80)
    assert line.startswith("digits-train epoch 3 ")
    assert line.endswith(" 690/2860  loss 0.06094  1523 samples/s  eta 2m5s"), line


def test_a_long_name_gives_way_before_the_numbers():
    line = rendered("a-training-job-with-a-name-longer-than-the-bar", status(690, 2860, 0.06094, 1523.4, 125), 80)
    assert line.startswith("a-training") and "… epoch 3 " in line
    assert line.endswith("690/2860  loss 0.06094  1523 samples/s  eta 2m5s"), line
