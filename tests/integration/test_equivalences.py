"""Exact equivalences the mathematics promises, checked in place of accuracy floors: a wrong scale, a missed
division or a clip applied when it should not be changes the weights, where an accuracy floor would still pass."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from distributed import run_on_ranks
from jobs import final_weights, manifest, tandem_run

from tandem.api import ParallelTrainingJobSpec

PLAIN = {"optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9}, "evalData": None}


@pytest.fixture(scope="module")
def one_rank_of_batch_32(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The final weights of 20 steps on one rank of batch 32 through `tandem run`: what both equivalences below
    compare with (2 micro-batches of 16 on one rank, and 2 ranks of 16), run once for the module."""
    directory = tmp_path_factory.mktemp("one-rank-of-batch-32")
    one = manifest(directory, "one", workers=1, trainer={**PLAIN, "maxSteps": 20, "batchSizePerWorker": 32})
    result = tandem_run(one)
    assert result.returncode == 0, result.stderr
    return final_weights(directory, "one")


def test_two_micro_batches_of_16_match_one_batch_of_32(tmp_path, one_rank_of_batch_32):
    """Gradient accumulation 2 x batch 16 on one rank takes the same steps as batch 32: the same 32 examples per
    step (one shuffle), each micro-batch's mean loss divided by 2. Within the first epoch (45 steps), whose
    steps are all full."""
    accumulated = manifest(tmp_path, "accumulated", workers=1,
                           trainer={**PLAIN, "maxSteps": 20, "batchSizePerWorker": 16, "gradientAccumulationSteps": 2})
    result = tandem_run(accumulated)
    assert result.returncode == 0, result.stderr
    a, b = final_weights(tmp_path, "accumulated"), one_rank_of_batch_32
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5)


def _first_step_under_clipping(rank: int, factors: list[float | None]) -> tuple[float, list[torch.Tensor]]:
    """The first batch's gradient norm, measured by hand, then one trainer step from the same initial weights for
    each clip limit (that norm times a factor; None: no clipping). Returns the norm, the initial weights and the
    weights after each step."""
    from tandem.examples.digits import mlp, train_data
    from tandem.worker.train.data import epoch_batches, training_loader
    from tandem.worker.train.trainer import RankContext, train

    def initial_model() -> torch.nn.Module:
        torch.manual_seed(0)
        return mlp(hidden=16)

    def flat(model: torch.nn.Module) -> torch.Tensor:
        return torch.cat([p.detach().flatten() for p in model.parameters()]).clone()

    model = initial_model()
    inputs, targets = next(epoch_batches(training_loader(train_data(), rank=0, world_size=1, batch_size=16, seed=0), 0))
    F.cross_entropy(model(inputs), targets).backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()
    weights = [flat(model)]
    for index, factor in enumerate(factors):
        spec = ParallelTrainingJobSpec.model_validate({
            "workers": 1,
            "trainer": {"model": "tandem.examples.digits:mlp", "data": "tandem.examples.digits:train_data",
                        "maxSteps": 1, "batchSizePerWorker": 16, "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0},
                        "gradientClipNorm": None if factor is None else norm * factor},
            "checkpoint": {"directory": os.environ["CHECKPOINTS"]},
        })
        context = RankContext(rank=rank, world_size=1, device=torch.device("cpu"), job="clip",
                              checkpoint_dir=Path(os.environ["CHECKPOINTS"]) / str(index))
        model = initial_model()
        train(spec, context, model, train_data())
        weights.append(flat(model))
    return norm, weights


def test_clipping_changes_an_update_exactly_when_the_norm_exceeds_the_limit(tmp_path, monkeypatch):
    monkeypatch.setenv("CHECKPOINTS", str(tmp_path))
    [(norm, (initial, unclipped, above, below))] = run_on_ranks(
        _first_step_under_clipping, [None, 1.01, 0.5], world_size=1)
    assert norm > 0
    assert torch.equal(above, unclipped), "a clip limit above the gradient's norm changed the update"
    # Below the norm, the update is the unclipped one scaled to the limit: half of it here.
    torch.testing.assert_close(below - initial, (unclipped - initial) * 0.5, rtol=1e-4, atol=1e-7)
    assert not torch.equal(below, unclipped)


def test_two_ranks_of_batch_b_match_one_rank_of_batch_2b(tmp_path, one_rank_of_batch_32):
    """allReduce: 2 ranks x batch 16 see the examples 1 rank x batch 32 sees (one shuffle, interleaved shards),
    and DDP averages their gradients: the same steps."""
    two = manifest(tmp_path, "two", trainer={**PLAIN, "maxSteps": 20, "batchSizePerWorker": 16}, workers=2)
    result = tandem_run(two)
    assert result.returncode == 0, result.stderr
    a, b = final_weights(tmp_path, "two"), one_rank_of_batch_32
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5)
