"""What a preemption would cost now (status.preemptionCost, worker/train/preemption.py): the steps since the last
complete checkpoint, counted by rank 0's Reporter in every status it publishes, and the seconds the latest
checkpoint took to write, measured by Checkpointer.save."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from jobs import Recorder

from tandem.api import ParallelTrainingJobSpec
from tandem.examples.digits import mlp
from tandem.worker import checkpoint
from tandem.worker.train.modes import optimizer_settings, training_mode
from tandem.worker.train.optim import LearningRateSchedule, build_optimizer
from tandem.worker.train.reporting import Reporter
from tandem.worker.train.state import Checkpointer, Position, TrainState


def cost(recorder: Recorder) -> tuple[int, float | None]:
    latest = recorder.published[-1].preemption_cost
    return latest.steps_since_checkpoint, latest.checkpoint_seconds


def test_before_any_checkpoint_every_step_done_is_at_stake_and_no_checkpoint_time_is_known():
    recorder = Recorder()
    reporter = Reporter([recorder], workers=2, total_steps=100, interval=0.0)
    for step in range(1, 8):
        reporter.progress(epoch=1, step=step, loss=1.0, samples=32 * step)
    assert cost(recorder) == (7, None)
    assert recorder.published[-1].to_dict()["preemptionCost"] == {"stepsSinceCheckpoint": 7}


def test_after_a_checkpoint_the_steps_count_from_it_and_its_write_time_is_reported():
    recorder = Recorder()
    reporter = Reporter([recorder], workers=2, total_steps=100, interval=0.0)
    for step in range(1, 11):
        reporter.progress(epoch=1, step=step, loss=1.0, samples=32 * step)
    reporter.checkpoint(Path("/ckpt/step-00000010.pt"), 10, seconds=0.25)
    assert cost(recorder) == (0, 0.25)
    for step in range(11, 14):
        reporter.progress(epoch=1, step=step, loss=1.0, samples=32 * step)
    assert cost(recorder) == (3, 0.25)
    reporter.checkpoint(Path("/ckpt/step-00000013.pt"), 13, seconds=0.5)
    reporter.progress(epoch=1, step=14, loss=1.0, samples=32 * 14)
    final = reporter.final("Succeeded", "done", epoch=1, metrics={}, bytes_sent=0, dense_bytes=0)
    assert (final.preemption_cost.steps_since_checkpoint, final.preemption_cost.checkpoint_seconds) == (1, 0.5)
    assert final.to_dict()["preemptionCost"] == {"stepsSinceCheckpoint": 1, "checkpointSeconds": 0.5}


def test_a_resumed_run_counts_from_the_checkpoint_it_resumed_not_from_zero():
    recorder = Recorder()
    reporter = Reporter([recorder], workers=2, total_steps=100, interval=0.0)
    reporter.resumed(Path("/ckpt/step-00000080.pt"), step=80, epoch=4)
    assert cost(recorder) == (0, None), "this process did not write it: how long it took is unknown"
    reporter.progress(epoch=4, step=83, loss=1.0, samples=64)
    assert cost(recorder) == (3, None)


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_checkpointer_save_measures_its_wall_time_until_the_file_is_complete(tmp_path, monkeypatch, one_rank_group):
    spec = ParallelTrainingJobSpec.model_validate({
        "workers": 1, "trainer": {"model": "tandem.examples.digits:mlp", "modelArgs": {"hidden": 8},
                                  "data": "tandem.examples.digits:train_data"},
        "checkpoint": {"directory": str(tmp_path)}})
    model = mlp(hidden=8)
    mode = training_mode(spec, model, torch.device("cpu"), 1)
    optimizer = build_optimizer(model.parameters(), optimizer_settings(spec))
    state = TrainState(model, optimizer, torch.amp.GradScaler("cpu", enabled=False),
                       LearningRateSchedule(optimizer, spec.trainer, total_steps=10), mode, Position(step=5))
    checkpointer = Checkpointer(spec, rank=0, world_size=1, job="timed", directory=tmp_path)
    assert checkpointer.seconds is None

    write, slow = checkpoint.save, 0.3
    written: list[float] = []

    def slow_write(*args, **kwargs):
        time.sleep(slow)  # a slow disk: the save is complete only once this returns
        path = write(*args, **kwargs)
        written.append(time.perf_counter())
        return path

    monkeypatch.setattr(checkpoint, "save", slow_write)
    started = time.perf_counter()
    path = checkpointer.save(state, input_shape=[64])
    elapsed = time.perf_counter() - started
    assert path is not None and path.is_file() and checkpoint.load(path)["manifest"]["step"] == 5
    assert slow <= checkpointer.seconds <= elapsed, (checkpointer.seconds, elapsed)
    assert checkpointer.seconds >= written[0] - started - 0.05, "measured until the file was complete on disk"
