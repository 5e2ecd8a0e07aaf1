"""Decisions the ranks take together while training (worker/train/rank_agreement.py), on 2 real gloo ranks."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from distributed import run_on_ranks

from tandem.api import ParallelTrainingJobSpec
from tandem.worker.train.rank_agreement import Agreement

STEP_SECONDS = 0.002


def _steps_with_agreement(rank: int, stop_on_rank_1_at: int | None, checkpoint_every_seconds: float | None):
    """Steps of STEP_SECONDS (rank 1 twice as slow, as a straggler); returns (exchange steps, stop step,
    checkpoint steps) as this rank saw them."""
    agreement = Agreement(is_master=rank == 0, first_step=1, checkpoint_every_seconds=checkpoint_every_seconds,
                          target_seconds=0.02)
    exchanges, checkpoints, stop_step = [], [], None
    for step in range(1, 400):
        time.sleep(STEP_SECONDS * (1 + rank))
        asked = stop_on_rank_1_at is not None and rank == 1 and step >= stop_on_rank_1_at
        if step == agreement.next_step:
            exchanges.append(step)
            outcome = agreement.exchange(step, stop_requested=asked)
            if outcome.checkpoint:
                checkpoints.append(step)
            if outcome.stop:
                stop_step = step
                break
    agreement.close()
    return exchanges, stop_step, checkpoints


def test_a_stop_asked_on_one_rank_is_acted_on_by_every_rank_after_the_same_step():
    rank0, rank1 = run_on_ranks(_steps_with_agreement, 50, None, world_size=2)
    assert rank0 == rank1, "the ranks disagree on when to exchange or when to stop"
    exchanges, stop_step, checkpoints = rank0
    assert stop_step is not None and stop_step > 50
    # Rank 0 proposes about 20 ms of steps; with rank 1's 4 ms steps holding both back, that is a handful.
    assert stop_step - 50 <= 2 * max(b - a for a, b in zip(exchanges, exchanges[1:], strict=False)) + 1
    assert 1 < len(exchanges) < stop_step, "exchanges should be spaced by rank 0's proposal, not every step"
    assert checkpoints == []


def test_the_time_rule_for_checkpoints_is_decided_once_for_every_rank():
    rank0, rank1 = run_on_ranks(_steps_with_agreement, None, 0.1, world_size=2)
    assert rank0 == rank1
    _, stop_step, checkpoints = rank0
    assert stop_step is None
    # About 1.6 s of steps with a checkpoint due every 0.1 s: one at most every other exchange, never one
    # straight after another (the clock restarts when the rule fires).
    assert 5 <= len(checkpoints) <= 17, checkpoints


def _train_with_checkpoints_by_time(rank: int) -> list[int]:
    import tandem.worker.train.rank_agreement
    from tandem.examples.digits import mlp, train_data
    from tandem.worker import checkpoint
    from tandem.worker.train.trainer import RankContext, train

    tandem.worker.train.rank_agreement.TARGET_SECONDS = 0.01
    directory = Path(os.environ["CHECKPOINTS"])
    spec = ParallelTrainingJobSpec.model_validate({
        "workers": 2,
        "trainer": {"model": "tandem.examples.digits:mlp", "data": "tandem.examples.digits:train_data",
                    "modelArgs": {"hidden": 16}, "batchSizePerWorker": 8, "maxSteps": 150, "epochs": 10},
        "checkpoint": {"directory": str(directory), "everyMinutes": 0.001, "keepLast": 1000},
    })
    context = RankContext(rank=rank, world_size=2, device=torch.device("cpu"), job="by-time",
                          checkpoint_dir=directory)
    train(spec, context, mlp(hidden=16), train_data())
    return [checkpoint.load(path)["manifest"]["step"] for path in checkpoint.list_checkpoints(directory)]


def test_checkpoint_every_minutes_writes_checkpoints_during_training(tmp_path, monkeypatch):
    monkeypatch.setenv("CHECKPOINTS", str(tmp_path))
    steps, _ = run_on_ranks(_train_with_checkpoints_by_time, world_size=2)
    assert steps[-1] == 150, "the final checkpoint"
    assert len(steps) >= 3, f"everyMinutes 0.001 wrote only {steps} in 150 steps"


def test_cuda_ranks_get_a_cpu_backend_for_the_agreement_and_the_totals():
    """The exchanges above use CPU tensors; under NCCL alone a GPU job would fail at its first one. (NCCL is not
    built into this machine's torch, so a GPU group cannot be started here: this checks the backend string.)"""
    from tandem.worker.train.process_group import backend_for

    assert backend_for(torch.device("cpu")) == "gloo"
    assert set(backend_for(torch.device("cuda", 0)).split(",")) == {"cpu:gloo", "cuda:nccl"}

