"""Rank 0's scalar log (worker/train/scalars.py), read back with TensorBoard's own reader (tandem/curves.py): the tags
and steps it writes, the windows' mean loss without NaN/Inf steps, the evaluation at checkpoints, and a resume that
hides what the run wrote past its checkpoint."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tandem import curves
from tandem.worker.train.scalars import EVERY_STEPS, ScalarLog, run_directory
from tandem.worker.train.state import Position


def mode(compresses: bool):
    bytes_ = SimpleNamespace(sent=0, dense=0)
    return SimpleNamespace(compression_report=(lambda: {"threshold": 1e-3}) if compresses else (lambda: None),
                           communication=lambda: (bytes_.sent, bytes_.dense), bytes=bytes_)


def log(tmp_path, position: Position, compresses: bool = False) -> tuple[ScalarLog, SimpleNamespace]:
    exchange = mode(compresses)
    schedule = SimpleNamespace(rate=lambda step: 0.1 / (1 + step))
    return ScalarLog(run_directory(tmp_path, "run-a"), position=position, schedule=schedule, mode=exchange), exchange


def train(scalars: ScalarLog, position: Position, steps: range, loss, bad=frozenset(), exchange=None) -> None:
    """Steps `steps` as the trainer records them: the position moves on, then the step record hands the losses over
    (here, one read per step)."""
    for step in steps:
        position.step, position.samples = step, position.samples + 32
        if exchange is not None:
            exchange.bytes.sent, exchange.bytes.dense = exchange.bytes.sent + 10, exchange.bytes.dense + 100
        scalars.losses(step, [loss(step)], [step in bad])


def test_the_loss_lr_and_speed_every_window_and_the_evaluation_at_checkpoints(tmp_path):
    position = Position()
    scalars, _ = log(tmp_path, position)
    train(scalars, position, range(1, 21), loss=lambda step: float(step), bad={3, 4})
    scalars.checkpoint(20, {"evalLoss": 0.5, "accuracy": 0.9})
    scalars.close()

    [folder] = curves.run_folders(tmp_path)
    assert folder == tmp_path / curves.DIRECTORY / "run-a"
    read = curves.read_scalars(folder)
    assert set(read) == {curves.LOSS, curves.LEARNING_RATE, curves.SAMPLES_PER_SECOND, curves.EVAL_LOSS,
                         curves.ACCURACY}
    good_first_window = [step for step in range(1, 11) if step not in (3, 4)]
    assert [step for step, _ in read[curves.LOSS]] == [EVERY_STEPS, 2 * EVERY_STEPS]
    assert read[curves.LOSS][0][1] == pytest.approx(sum(good_first_window) / len(good_first_window))
    assert read[curves.LOSS][1][1] == pytest.approx(sum(range(11, 21)) / 10)
    assert read[curves.LEARNING_RATE] == [(10, pytest.approx(0.1 / 10)), (20, pytest.approx(0.1 / 20))]
    speeds = read[curves.SAMPLES_PER_SECOND]  # at each read, the clock permitting
    assert speeds and all(step in range(1, 21) and value > 0 for step, value in speeds)
    assert read[curves.EVAL_LOSS] == [(20, 0.5)]
    assert read[curves.ACCURACY] == [(20, pytest.approx(0.9))]


def test_the_bytes_ratio_only_where_the_mode_compresses(tmp_path):
    position = Position()
    scalars, exchange = log(tmp_path, position, compresses=True)
    train(scalars, position, range(1, 11), loss=lambda step: 1.0, exchange=exchange)
    scalars.close()
    read = curves.read_scalars(curves.run_folders(tmp_path)[0])
    assert read[curves.BYTES_RATIO] == [(step, pytest.approx(0.1)) for step in range(1, 11)]


def test_a_resumed_run_hides_what_it_wrote_past_its_checkpoint(tmp_path):
    position = Position()
    first, _ = log(tmp_path, position)
    train(first, position, range(1, 31), loss=lambda step: 1.0)  # steps 21-30 are lost: no checkpoint after 20
    first.close()
    resumed_at = Position(step=20)
    second, _ = log(tmp_path, resumed_at)
    train(second, resumed_at, range(21, 41), loss=lambda step: 2.0)
    second.close()

    losses = curves.read_scalars(curves.run_folders(tmp_path)[0])[curves.LOSS]
    assert losses == [(10, 1.0), (20, 1.0), (30, 2.0), (40, 2.0)]
