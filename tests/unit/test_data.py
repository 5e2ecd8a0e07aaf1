"""Data loading pieces of the trainer: shards (DistributedSampler's, bit for bit), resume position (exact at another
world size), the steps left, prefetching, accumulation groups."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

from tandem.worker.train.data import (
    EpochShard,
    accumulation_groups,
    epoch_batches,
    evaluation_shard,
    examples_consumed,
    steps_left,
    training_loader,
    training_steps,
)
from tandem.worker.train.state import Position


def _dataset(n: int = 100) -> TensorDataset:
    return TensorDataset(torch.arange(n).float().unsqueeze(1), torch.arange(n))


def _labels(batches) -> list[int]:
    return [int(label) for _, labels in batches for label in labels]


def test_two_ranks_cover_what_one_rank_covers_step_by_step():
    one = list(epoch_batches(training_loader(_dataset(), rank=0, world_size=1, batch_size=8, seed=3), epoch=1))
    shards = [
        list(epoch_batches(training_loader(_dataset(), rank=r, world_size=2, batch_size=4, seed=3), epoch=1))
        for r in (0, 1)
    ]
    for step, batch in enumerate(one):
        assert sorted(_labels([batch])) == sorted(_labels([shards[0][step], shards[1][step]]))


def test_skip_resumes_at_the_same_batch_with_or_without_prefetch():
    loader = training_loader(_dataset(), rank=0, world_size=1, batch_size=10, seed=0)
    full = _labels(epoch_batches(loader, epoch=2))
    assert _labels(epoch_batches(loader, epoch=2, skip=4)) == full[40:]
    assert _labels(epoch_batches(loader, epoch=2, skip=4, prefetch=3)) == full[40:]
    assert _labels(epoch_batches(loader, epoch=3)) != full


@pytest.mark.parametrize("size", [3, 100], ids=["producer-finished", "producer-mid-epoch"])
def test_leaving_an_epoch_early_ends_the_prefetch_thread(size):
    """The consumer may leave (maxSteps, a stop) while the producer waits on a full buffer, also with only the
    end-of-epoch marker left to hand over."""
    loader = training_loader(_dataset(size), rank=0, world_size=1, batch_size=1, seed=0)
    batches = epoch_batches(loader, epoch=0, prefetch=2)
    next(batches)
    time.sleep(0.5)  # let the producer fill the buffer and block
    closer = threading.Thread(target=batches.close)
    closer.start()
    closer.join(timeout=30)
    assert not closer.is_alive(), "closing the epoch hung on the prefetch thread"
    assert not any(t.name == "tandem-prefetch" and t.is_alive() for t in threading.enumerate())


def test_errors_in_the_loader_reach_the_training_thread():
    class Broken(TensorDataset):
        def __getitem__(self, index):
            if index == 7:
                raise ValueError("example 7 is broken")
            return super().__getitem__(index)

    dataset = _dataset()
    loader = training_loader(Broken(*dataset.tensors), rank=0, world_size=1, batch_size=1, seed=0)
    try:
        list(epoch_batches(loader, epoch=0, prefetch=2))
    except ValueError as error:
        assert "example 7 is broken" in str(error)
    else:
        raise AssertionError("the loader's error was swallowed")


def test_accumulation_groups_keep_the_short_last_group():
    assert [len(g) for g in accumulation_groups(iter(range(7)), 3)] == [3, 3, 1]


def test_evaluation_shards_cover_every_example_once():
    shards = [evaluation_shard(_dataset(11), rank=r, world_size=3).indices for r in range(3)]
    assert sorted(i for shard in shards for i in shard) == list(range(11))


@pytest.mark.parametrize("size", [1, 7, 100, 101])
@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_an_epochs_shards_are_distributed_samplers_bit_for_bit(size, world_size):
    """From an epoch's start EpochShard deals exactly DistributedSampler's indices (shuffle, padding, order), so
    runs that never change size train on what they did before it."""
    for rank in range(world_size):
        reference = DistributedSampler(_dataset(size), num_replicas=world_size, rank=rank, shuffle=True, seed=11)
        ours = EpochShard(size, rank=rank, world_size=world_size, seed=11)
        for epoch in (0, 3):
            reference.set_epoch(epoch)
            ours.set_epoch(epoch)
            assert list(ours) == list(reference) and len(ours) == len(reference)


# (micro-batches done, saved ranks, saved batch, ranks, batch): the epoch goes on from examples done x ranks x batch.
RESIZED = [
    (15, 2, 16, 1, 16),  # 2 -> 1 rank
    (21, 1, 16, 2, 16),  # 1 -> 2: 336 examples, not a multiple of the new 32
    (5, 3, 4, 2, 4),     # 3 -> 2
    (5, 2, 4, 4, 4),     # 2 -> 4
    (3, 4, 4, 3, 4),     # 4 -> 3
    (9, 2, 8, 2, 4),     # the batch halved at the same world size
    (1, 1, 4, 3, 7),     # fewer examples than one new micro-batch
]


@pytest.mark.parametrize("saved", RESIZED, ids=[str(case) for case in RESIZED])
def test_an_epoch_resumed_at_another_world_size_sees_every_example_exactly_once(saved):
    """The examples the old ranks consumed and those the new ranks go on with are the epoch, each once, but for the
    padding the sampler adds at every epoch's end (to a multiple of the ranks): every world size walks one shuffled
    order of the epoch, and the new run deals it from the first example the old one had not taken."""
    batches_done, saved_world_size, saved_batch_size, world_size, batch_size = saved
    dataset = _dataset(1000)

    def labels(ranks: int, batch: int, start: int, take: int | None) -> list[int]:
        seen = []
        for rank in range(ranks):
            loader = training_loader(dataset, rank=rank, world_size=ranks, batch_size=batch, seed=5)
            seen += _labels(list(epoch_batches(loader, epoch=3, start=start))[:take])
        return seen

    before = labels(saved_world_size, saved_batch_size, 0, batches_done)
    start = examples_consumed(batches_done, world_size=saved_world_size, batch_size=saved_batch_size)
    after = labels(world_size, batch_size, start, None)
    assert len(before) == start
    padding = (-(1000 - start)) % world_size
    assert len(before) + len(after) == 1000 + padding
    assert set(before) | set(after) == set(range(1000))
    assert len(set(before)) == len(before) and set(before).isdisjoint(after), "an example seen twice"


@pytest.mark.parametrize(("epoch", "batches_done", "epochs", "per_epoch", "accumulation", "expected"), [
    (0, 0, 3, 45, 1, 135),  # a fresh run: every epoch
    (0, 0, 3, 45, 2, 69),   # groups of 2: 23 steps an epoch, the last one short
    (1, 10, 3, 45, 1, 80),  # the rest of epoch 2, then epoch 3
    (1, 11, 3, 45, 2, 17 + 23),  # resumed at another world size, off a group boundary: 34 micro-batches left
    (2, 45, 3, 45, 1, 0),   # resumed at an epoch's very end
    (3, 0, 3, 45, 1, 0),    # done
])
def test_steps_left_counts_what_training_steps_hands_out(epoch, batches_done, epochs, per_epoch, accumulation,
                                                         expected):
    loader = training_loader(_dataset(per_epoch * 4), rank=0, world_size=2, batch_size=2, seed=0)
    assert len(loader) == per_epoch
    position = Position(epoch=epoch, batches_done=batches_done)
    assert steps_left(position, epochs=epochs, loader=loader, accumulation=accumulation) == expected
    assert len(list(training_steps(loader, position, epochs=epochs, accumulation=accumulation))) == expected


def test_an_epoch_resumed_part_way_at_another_size_is_counted_from_where_it_goes_on():
    """180 examples at 2 ranks x 2: 45 micro-batches an epoch. Resumed after 21 examples consumed elsewhere, epoch 2
    has 159 left: 80 per rank (one of padding), 40 micro-batches; then epoch 3 whole. The position turns to the
    next epoch at the usual start."""
    loader = training_loader(_dataset(180), rank=0, world_size=2, batch_size=2, seed=0)
    position = Position(epoch=1, epoch_start=21)
    assert steps_left(position, epochs=3, loader=loader, accumulation=1) == 40 + 45
    steps = list(training_steps(loader, position, epochs=3, accumulation=1))
    assert len(steps) == 40 + 45
    assert (position.epoch, position.batches_done, position.epoch_start) == (3, 0, 0)
