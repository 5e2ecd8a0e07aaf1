"""Data loading pieces of the trainer: shards, resume position, prefetching, accumulation groups."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch.utils.data import TensorDataset

from tandem.worker.train.data import accumulation_groups, epoch_batches, evaluation_shard, training_loader


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
