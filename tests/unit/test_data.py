"""Data loading pieces of the trainer: shards, resume position (also at another world size), the steps left,
prefetching, accumulation groups."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch.utils.data import TensorDataset

from tandem.worker.train.data import (
    accumulation_groups,
    epoch_batches,
    evaluation_shard,
    resumed_batches_done,
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


# (batches done, saved ranks, saved batch, ranks, batch) -> micro-batches the resumed run skips.
RESUMED = [
    ((7, 2, 4, 2, 4), 7),      # same layout: the position as saved
    ((15, 2, 16, 1, 16), 30),  # 2 -> 1 rank: 480 examples, exactly 30 of 16
    ((21, 1, 16, 2, 16), 10),  # 1 -> 2: 336 examples; 10 x 32 = 320 fit, 16 are seen again
    ((5, 3, 4, 2, 4), 7),      # 3 -> 2: 60 examples; 7 x 8 = 56
    ((5, 2, 4, 4, 4), 2),      # 2 -> 4: 40 examples; 2 x 16 = 32
    ((3, 4, 4, 3, 4), 4),      # 4 -> 3: 48 examples; exactly 4 x 12
    ((9, 2, 8, 2, 4), 18),     # the batch halved at the same world size: 144 examples, 18 of 8
    ((0, 2, 16, 5, 16), 0),    # an epoch's start stays one
    ((1, 1, 4, 2, 4), 0),      # fewer examples than one new micro-batch: the epoch starts again
]


@pytest.mark.parametrize(("saved", "expected"), RESUMED, ids=[str(case) for case, _ in RESUMED])
def test_a_data_position_maps_to_another_world_size_by_examples_seen_rounding_down(saved, expected):
    batches_done, saved_world_size, saved_batch_size, world_size, batch_size = saved
    assert resumed_batches_done(batches_done, saved_world_size=saved_world_size, saved_batch_size=saved_batch_size,
                                world_size=world_size, batch_size=batch_size) == expected


@pytest.mark.parametrize(("saved", "expected"), RESUMED[1:7], ids=[str(case) for case, _ in RESUMED[1:7]])
def test_the_resumed_run_sees_every_example_of_the_epoch_and_repeats_fewer_than_one_micro_batch(saved, expected):
    """The examples the old ranks consumed and those the new ranks go on with cover the epoch, with fewer than one new
    micro-batch (W x B examples) seen twice: every world size walks one shuffled order of the epoch."""
    batches_done, saved_world_size, saved_batch_size, world_size, batch_size = saved
    dataset = _dataset(1000)

    def labels(ranks: int, batch: int, skip: int, take: int | None) -> list[int]:
        seen = []
        for rank in range(ranks):
            loader = training_loader(dataset, rank=rank, world_size=ranks, batch_size=batch, seed=5)
            seen += _labels(list(epoch_batches(loader, epoch=3, skip=skip))[:take])
        return seen

    before = labels(saved_world_size, saved_batch_size, 0, batches_done)
    after = labels(world_size, batch_size, expected, None)
    assert set(before) | set(after) == set(range(1000))
    repeated = len(before) + len(after) - len(set(before + after))
    assert len(before) == batches_done * saved_world_size * saved_batch_size
    padding = (-1000) % world_size  # the sampler pads the epoch's end to a multiple of the ranks
    assert repeated - padding < world_size * batch_size


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
    assert steps_left(position, epochs=epochs, batches_per_epoch=per_epoch, accumulation=accumulation) == expected
    assert len(list(training_steps(loader, position, epochs=epochs, accumulation=accumulation))) == expected
