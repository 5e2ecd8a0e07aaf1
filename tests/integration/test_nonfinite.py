"""The NaN/Inf guard (worker/train/nonfinite.py): the verdict on the device, the fused optimizer skipping on it, and the
step record read in order."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from distributed import run_on_ranks

from tandem.api import ParallelTrainingJobSpec
from tandem.api.training import Optimizer
from tandem.worker.train.nonfinite import CAPACITY, NonFiniteGuard, StepRecord, TrainingError
from tandem.worker.train.optim import build_optimizer
from tandem.worker.train.state import Position


def model_with_gradients(*gradients: float) -> torch.nn.Linear:
    model = torch.nn.Linear(len(gradients), 1, bias=False)
    model.weight.grad = torch.tensor([gradients])
    return model


@pytest.mark.parametrize(("gradients", "loss", "bad"), [
    ((1.0, 2.0), 0.5, False),
    ((1.0, float("nan")), 0.5, True),
    ((float("inf"), 2.0), 0.5, True),
    ((1.0, 2.0), float("nan"), True),
])
def test_the_verdict_covers_gradients_and_loss(gradients, loss, bad):
    model = model_with_gradients(*gradients)
    guard = NonFiniteGuard(list(model.parameters()), torch.device("cpu"))
    assert bool(guard.check(torch.tensor(loss))) is bad
    torch.testing.assert_close(model.weight.grad, torch.tensor([gradients]), rtol=0, atol=0, equal_nan=True)


def test_with_clipping_the_norm_gives_the_verdict():
    guard = NonFiniteGuard([], torch.device("cpu"))
    assert not guard.check(torch.tensor(1.0), gradient_norm=torch.tensor(3.0))
    assert guard.check(torch.tensor(1.0), gradient_norm=torch.tensor(float("inf")))


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_a_flagged_step_changes_nothing_and_the_next_step_is_a_normal_first_step(name):
    """The fused optimizer skips on the flag, with no host sync; even a skipped first step leaves SGD's momentum
    buffers valid, so the first good step matches a fresh optimizer's first step."""
    spec = Optimizer.model_validate({"name": name, "lr": 0.1, "momentum": 0.9})
    torch.manual_seed(0)
    skipped, fresh = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    fresh.load_state_dict(skipped.state_dict())
    before = [p.detach().clone() for p in skipped.parameters()]
    optimizer = build_optimizer(skipped.parameters(), spec)
    guard = NonFiniteGuard(list(skipped.parameters()), torch.device("cpu"))

    for p in skipped.parameters():
        p.grad = torch.full_like(p, float("nan"))
    optimizer.found_inf = guard.check(torch.tensor(1.0))
    optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, skipped.parameters(), strict=True))

    reference = build_optimizer(fresh.parameters(), spec)
    for model in (skipped, fresh):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
    optimizer.found_inf = guard.check(torch.tensor(1.0))
    optimizer.step()
    reference.step()
    for a, b in zip(skipped.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)


def test_the_record_reads_steps_in_order():
    position = Position()
    record = StepRecord(position, max_consecutive_bad_steps=3, counts_bad_steps=True)
    for step, (loss, bad) in enumerate([(2.0, 0), (float("nan"), 1), (1.0, 0), (5.0, 1)], start=1):
        record.add(step, torch.tensor(loss), torch.tensor(float(bad)))
    assert record.running_loss is None, "nothing is read before a flush"
    record.flush()
    assert record.running_loss == pytest.approx(0.9 * 2.0 + 0.1 * 1.0), "bad steps stay out of the running loss"
    assert (position.bad_steps, position.consecutive_bad_steps) == (2, 1)


def test_the_limit_names_the_step_that_reached_it():
    record = StepRecord(Position(), max_consecutive_bad_steps=3, counts_bad_steps=True)
    flags = [0, 1, 1, 0, 1, 1, 1, 1]
    for step, bad in enumerate(flags, start=11):
        record.add(step, torch.tensor(1.0), torch.tensor(float(bad)))
    with pytest.raises(TrainingError, match=r"3 consecutive steps with a NaN/Inf loss or gradient \(step 17\)"):
        record.flush()


def test_a_full_record_is_read_at_once_and_fp16_skips_are_not_counted():
    position = Position()
    record = StepRecord(position, max_consecutive_bad_steps=2, counts_bad_steps=False)
    for step in range(1, CAPACITY + 1):
        record.add(step, torch.tensor(1.0), torch.tensor(1.0 if step % 2 else 0.0))
    assert record.running_loss == pytest.approx(1.0), "the full buffer was read"
    assert position.bad_steps == 0


class _Published:
    """A sink that keeps (step, loss, latest checkpoint step) of each status rank 0 publishes."""

    def __init__(self):
        self.seen: list[tuple[int, float | None, int | None]] = []

    def publish(self, status) -> None:
        self.seen.append((status.progress.step, status.progress.loss, status.checkpoint.step))

    def close(self) -> None:
        pass


def _train_publishing(rank: int) -> list[tuple[int, float | None, int | None]]:
    from tandem.examples.digits import mlp, train_data
    from tandem.worker.train.trainer import RankContext, train

    directory = Path(os.environ["CHECKPOINTS"])
    spec = ParallelTrainingJobSpec.model_validate({
        "workers": 2,
        "trainer": {"model": "tandem.examples.digits:mlp", "data": "tandem.examples.digits:train_data",
                    "batchSizePerWorker": 16, "maxSteps": 120, "epochs": 10,
                    "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9}},
        "checkpoint": {"directory": str(directory), "everySteps": 100},
    })
    sink = _Published()
    context = RankContext(rank=rank, world_size=2, device=torch.device("cpu"), job="published",
                          checkpoint_dir=directory, sinks=[sink])
    train(spec, context, mlp(), train_data())
    return sink.seen


def test_the_status_published_with_a_checkpoint_carries_the_loss_of_its_step(tmp_path, monkeypatch):
    """Losses are read from the device about once a second; a checkpoint reads them first, so its status does
    not show the loss of the last read (here: the first steps', about ln 10 = 2.3)."""
    monkeypatch.setenv("CHECKPOINTS", str(tmp_path))
    seen, _ = run_on_ranks(_train_publishing, world_size=2)
    at_checkpoint = [loss for step, loss, checkpoint_step in seen if step == checkpoint_step == 100]
    assert at_checkpoint and at_checkpoint[0] < 1.0, seen
