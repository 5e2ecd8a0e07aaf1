"""Elastic training's pure pieces: the plan of each generation, the step shares (each example of an epoch once at
any sequence of world sizes), the batch and learning rate at each size, and which errors are the group's."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils.data import TensorDataset

from tandem.api import ParallelTrainingJobSpec
from tandem.worker.train.data import (
    EpochShard,
    advance,
    elastic_steps,
    elastic_steps_left,
    epoch_order,
    step_share,
)
from tandem.worker.train.elastic import lr_scale, step_examples
from tandem.worker.train.membership import GroupLost, Plan, is_group_failure, plan_generation
from tandem.worker.train.modes import ExchangedSharedGradientsMode
from tandem.worker.train.state import Position, seed_rank

# (name, previous members, registered slot -> step, joiners slot -> incarnation, min, max,
#  expected members, source, lost, added, fallback substring or "")
PLANS = [
    ("one of two lost", [0, 1], {0: 10}, {}, 1, 2, [0], 0, [1], {}, ""),
    ("a replacement joins", [0], {0: 40}, {1: 2}, 1, 2, [0, 1], 0, [], {1: 2}, ""),
    ("lost and replaced at once", [0, 1, 2], {0: 7, 2: 7}, {1: 3}, 1, 3, [0, 1, 2], 0, [1], {1: 3}, ""),
    ("the survivor furthest on is the source", [0, 1, 2], {0: 7, 1: 8, 2: 8}, {}, 1, 3, [0, 1, 2], 1, [], {}, ""),
    ("joiners past maxWorkers wait", [0, 1], {0: 5, 1: 5}, {2: 1, 3: 1}, 1, 3, [0, 1, 2], 0, [], {2: 1}, ""),
    ("below minWorkers: a fallback", [0, 1, 2], {0: 4}, {}, 2, 3, [0], -1, [1, 2], {},
     "1 rank(s) left, fewer than elastic.minWorkers (2)"),
    ("a joiner makes up minWorkers", [0, 1], {0: 4}, {1: 2}, 2, 2, [0, 1], 0, [1], {1: 2}, ""),
]


def test_a_member_asking_to_leave_is_left_out_and_not_counted_lost():
    plan = plan_generation(4, [0, 1, 2], {0: 9, 1: 9, 2: 9}, {}, min_workers=1, max_workers=3, leaving=frozenset({2}))
    assert (plan.members, plan.left, plan.lost, plan.fallback) == ([0, 1], [2], [], "")
    assert not any(plan.receives_state(slot) for slot in plan.members)


@pytest.mark.parametrize(("name", "previous", "registered", "joiners", "low", "high", "members", "source", "lost",
                          "added", "fallback"), PLANS, ids=[case[0] for case in PLANS])
def test_plan_generation(name, previous, registered, joiners, low, high, members, source, lost, added, fallback):
    plan = plan_generation(5, previous, registered, joiners, min_workers=low, max_workers=high)
    assert (plan.members, plan.source, plan.lost, plan.added) == (members, source, lost, added)
    assert (fallback in plan.fallback) if fallback else plan.fallback == ""
    assert Plan.from_json(plan.to_json()) == plan


def test_the_members_behind_the_source_take_its_state():
    plan = plan_generation(3, [0, 1, 2], {0: 8, 1: 7}, {2: 2}, min_workers=1, max_workers=3)
    assert plan.step == 8
    assert [slot for slot in plan.members if plan.receives_state(slot)] == [1, 2]


def _epochs_taken(size: int, step: int, world_sizes: list[int], epochs: int) -> list[Counter]:
    """Every example index each rank takes, epoch by epoch, when the world size changes to the next of
    `world_sizes` every few steps (as regroups change it)."""
    dataset = TensorDataset(torch.arange(size).float().unsqueeze(1), torch.arange(size))
    position, taken = Position(), [Counter() for _ in range(epochs)]
    sizes = iter(world_sizes * 100)
    while position.epoch < epochs:
        world_size = next(sizes)
        generators = [elastic_steps(dataset, position, epochs=epochs, step_examples=step, batch_size=3, rank=rank,
                                    world_size=world_size, seed=5) for rank in range(world_size)]
        for _ in range(3):
            if position.epoch >= epochs:
                break
            epoch, examples = position.epoch, None
            for generator in generators:
                micro_batches, share, examples = next(generator)
                labels = [int(label) for _, batch_labels in micro_batches for label in batch_labels]
                assert labels == share and all(len(labels) <= 3 for _, labels in micro_batches)
                taken[epoch].update(share)
            advance(position, examples, epoch_size=size)
    return taken


@pytest.mark.parametrize(("size", "step", "world_sizes"), [
    (100, 12, [2, 1, 3, 2]), (97, 12, [3, 2, 5]), (50, 8, [4, 4, 1]), (31, 31, [2, 3]), (10, 4, [7, 1]),
])
def test_each_example_of_an_epoch_once_across_size_changes(size, step, world_sizes):
    for epoch in _epochs_taken(size, step, world_sizes, epochs=2):
        assert sorted(epoch.elements()) == list(range(size))


def test_where_the_size_divides_the_step_a_rank_takes_what_epoch_shard_deals_it():
    size, world_size, batch = 96, 4, 3
    order = epoch_order(size, seed=2, epoch=1)
    for rank in range(world_size):
        shard = EpochShard(size, rank=rank, world_size=world_size, seed=2)
        shard.set_epoch(1)
        dealt = list(shard)
        elastic = [index for start in range(0, size, world_size * batch * 2)
                   for index in step_share(order, start=start, examples=world_size * batch * 2, rank=rank,
                                           world_size=world_size)]
        assert elastic == dealt


def test_a_rank_with_no_share_in_a_short_last_step_gets_no_micro_batch():
    dataset = TensorDataset(torch.zeros(10, 1), torch.arange(10))
    position = Position(epoch_start=8)
    micro_batches, share, examples = next(elastic_steps(dataset, position, epochs=1, step_examples=4, batch_size=2,
                                                        rank=2, world_size=3, seed=0))
    assert (micro_batches, share, examples) == ([], [], 2)


def test_elastic_steps_left():
    assert elastic_steps_left(Position(), epochs=2, epoch_size=100, step_examples=32) == 8
    assert elastic_steps_left(Position(epoch=1, epoch_start=96), epochs=2, epoch_size=100, step_examples=32) == 1
    assert elastic_steps_left(Position(epoch=2), epochs=2, epoch_size=100, step_examples=32) == 0


def _spec(**elastic) -> ParallelTrainingJobSpec:
    return ParallelTrainingJobSpec.model_validate({
        "workers": 4, "elastic": elastic,
        "trainer": {"model": "m:f", "data": "m:d", "batchSizePerWorker": 8, "gradientAccumulationSteps": 2}})


@pytest.mark.parametrize(("name", "elastic", "world_size", "examples", "scale"), [
    ("global keeps the batch", {}, 2, 64, 1.0),
    ("global at full size", {"batch": "global"}, 4, 64, 1.0),
    ("perRank linear", {"batch": "perRank"}, 2, 32, 0.5),
    ("perRank sqrt", {"batch": "perRank", "lrScaling": "sqrt"}, 1, 16, 0.5),
    ("perRank none", {"batch": "perRank", "lrScaling": "none"}, 2, 32, 1.0),
    ("perRank above workers", {"batch": "perRank", "maxWorkers": 8}, 8, 128, 2.0),
])
def test_batch_and_learning_rate_at_each_size(name, elastic, world_size, examples, scale):
    spec = _spec(**elastic)
    assert step_examples(spec, world_size) == examples
    assert lr_scale(spec, world_size) == pytest.approx(scale)


@pytest.mark.parametrize(("error", "groups"), [
    (GroupLost("rank 1's heartbeat stalled"), True),
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"), True),
    (RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:61825"), True),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x2)"), False),
    (ValueError("Connection closed"), False),
])
def test_only_a_peer_lost_is_the_groups_failure(error, groups):
    assert is_group_failure(error) is groups


def test_sharedgradients_members_take_the_sources_threshold_and_keep_their_own_residuals():
    """What a regroup does to sharedGradients' state: every member behind the source takes its shared part (the
    threshold, its calibration, the step and counters: all ranks must encode against the same threshold); a
    survivor keeps its residuals (its gradient mass not yet sent), a joiner starts with none; a lost or leaving
    rank's residuals go with it."""
    spec = ParallelTrainingJobSpec.model_validate({
        "workers": 2, "trainingMode": "sharedGradients", "elastic": {},
        "trainer": {"model": "m:f", "data": "m:d"}})
    model = torch.nn.Linear(3, 2)

    def mode():
        return ExchangedSharedGradientsMode(model, 2, lambda work: work.wait(), spec)

    source, survivor, joiner = mode(), mode(), mode()
    source.compression.threshold, source.compression.step, source.compression.calibrated = 0.25, 40, True
    survivor.compression.load_state_dict({**survivor.compression.state_dict(), "step": 39, "bytes_sent": 7,
                                          "residuals": {0: torch.ones(6)}})
    shared = source.shared_state()
    assert "residuals" not in shared and "bytes_sent" not in shared
    for member in (survivor, joiner):
        member.take_shared_state(shared)
        assert (member.compression.threshold, member.compression.step, member.compression.calibrated) == \
            (0.25, 40, True)
    assert survivor.compression.state_dict()["residuals"][0].equal(torch.ones(6))
    assert survivor.compression.bytes_sent == 7
    assert joiner.compression.state_dict()["residuals"] == {}


def test_a_checkpoint_of_the_other_exchange_keeps_the_threshold_and_this_ranks_bytes_not_its_residuals():
    """A job made elastic (or no longer) resumes a checkpoint whose residuals follow the other exchange's bucket
    order: they are reset, as at another world size; the threshold and this rank's own byte counts carry on (a
    reset as if it were not rank 0 would drop the job's byte totals)."""
    spec = ParallelTrainingJobSpec.model_validate({
        "workers": 2, "trainingMode": "sharedGradients", "elastic": {},
        "trainer": {"model": "m:f", "data": "m:d"}})
    saved = ExchangedSharedGradientsMode(torch.nn.Linear(3, 2), 2, lambda work: work.wait(), spec)
    saved.compression.load_state_dict({**saved.compression.state_dict(), "threshold": 0.125, "bytes_sent": 700,
                                       "dense_bytes": 9000, "residuals": {0: torch.ones(8)}})
    resumed = ExchangedSharedGradientsMode(torch.nn.Linear(3, 2), 2, lambda work: work.wait(), spec)
    resumed.load_state_dict({**saved.state_dict(), "exchange": "ddp"})
    assert (resumed.compression.threshold, resumed.compression.bytes_sent, resumed.compression.dense_bytes) == \
        (0.125, 700, 9000)
    assert resumed.compression.state_dict()["residuals"] == {}
    same = ExchangedSharedGradientsMode(torch.nn.Linear(3, 2), 2, lambda work: work.wait(), spec)
    same.load_state_dict(saved.state_dict())
    assert same.compression.state_dict()["residuals"][0].equal(torch.ones(8))


def test_a_joiner_draws_its_own_random_numbers_not_a_peers_nor_step_0s_again():
    """A rank joining at step 46 takes its peers' model and position, not their generators: its dropout noise is
    its own, and not the stream its rank drew from step 0 (which it would replay)."""
    def draws(rank: int, step: int = 0) -> torch.Tensor:
        seed_rank(7, rank, step=step)
        return torch.rand(4)

    fresh, joiner, peer = draws(1), draws(1, step=46), draws(0, step=46)
    assert not joiner.equal(fresh) and not joiner.equal(peer)
    assert joiner.equal(draws(1, step=46)), "seeded, so a run is repeatable"
