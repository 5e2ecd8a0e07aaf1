"""An elastic step on real gloo ranks (tests/distributed.py): its examples shared unevenly over the ranks alive
(data.step_share), each micro-batch's loss weighted by its share (step.TrainStep), the gradients all-reduced after
the backward passes (modes.ExchangedAllReduceMode). The step must be the step one process takes on all its examples
at once, whatever the shares, a rank with none included."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import run_on_ranks
from torch.utils.data import default_collate

from tandem.api.training import TrainerSpec
from tandem.worker.train.data import step_share
from tandem.worker.train.modes import ExchangedAllReduceMode
from tandem.worker.train.optim import LearningRateSchedule, build_optimizer
from tandem.worker.train.step import TrainStep

EXAMPLES = 64
TRAINER = TrainerSpec.model_validate({"model": "m:f", "data": "m:d", "batchSizePerWorker": 2,
                                      "optimizer": {"name": "sgd", "lr": 0.5, "momentum": 0.0}})


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(EXAMPLES, 4, generator=generator), torch.randint(0, 3, (EXAMPLES,), generator=generator)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _one_elastic_step(rank: int, start: int, step_examples: int) -> dict[str, torch.Tensor]:
    world_size = dist.get_world_size()
    inputs, targets = _data()
    model = _model()
    optimizer = build_optimizer(model.parameters(), TRAINER.optimizer)
    mode = ExchangedAllReduceMode(model, world_size, dist.Work.wait)
    train_step = TrainStep(TRAINER, mode, optimizer, torch.amp.GradScaler("cpu", enabled=False),
                           LearningRateSchedule(optimizer, TRAINER, total_steps=1), torch.device("cpu"), world_size)
    share = step_share(list(range(EXAMPLES)), start=start, examples=step_examples, rank=rank, world_size=world_size)
    batch = TRAINER.batch_size_per_worker
    micro_batches = [default_collate([(inputs[i], targets[i]) for i in share[k:k + batch]])
                     for k in range(0, len(share), batch)]
    train_step(0, micro_batches, step_examples=step_examples)
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def _one_step_at_once(start: int, step_examples: int) -> dict[str, torch.Tensor]:
    inputs, targets = _data()
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=TRAINER.optimizer.lr)
    chosen = slice(start, start + step_examples)
    torch.nn.functional.cross_entropy(model(inputs[chosen]), targets[chosen]).backward()
    optimizer.step()
    return model.state_dict()


@pytest.mark.parametrize(("start", "step_examples"), [
    (0, 8),   # 4 each, in two micro-batches
    (3, 5),   # 3 and 2: uneven shares, a short micro-batch
    (60, 1),  # rank 1 has no example: it sends zeros
])
def test_an_elastic_step_over_uneven_shares_is_the_step_over_all_its_examples(start, step_examples):
    ranks = run_on_ranks(_one_elastic_step, start, step_examples, world_size=2)
    expected = _one_step_at_once(start, step_examples)
    for weights in ranks:
        for name, tensor in expected.items():
            torch.testing.assert_close(weights[name], tensor, rtol=1e-5, atol=1e-6)
