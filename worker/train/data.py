"""Data loading: each rank's shard (DistributedSampler), resumable mid-epoch, prefetched on a thread."""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Generator, Iterator
from contextlib import closing
from itertools import islice
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset


def training_loader(dataset: Dataset, *, rank: int, world_size: int, batch_size: int, seed: int) -> DataLoader:
    """This rank's batches: a shuffle shared by all ranks (seed + epoch), every world_size-th example.

    With 2 ranks x batch b, step k covers exactly the examples 1 rank x batch 2b would, so both give the
    same gradient mean.
    """
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
    # Every iter() of a DataLoader draws a number from its generator. From torch's global one, that draw would
    # shift every random number the model takes after it (dropout), and a resumed run starts its epoch's
    # iterator again: the run would no longer continue the random sequence the checkpoint saved.
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=False,
                      generator=torch.Generator().manual_seed(seed))


def evaluation_shard(dataset: Dataset, *, rank: int, world_size: int) -> Subset:
    """Every world_size-th example, no padding: the shards add up to the dataset exactly once."""
    return Subset(dataset, range(rank, len(dataset), world_size))


def epoch_batches(loader: DataLoader, epoch: int, *, skip: int = 0, prefetch: int = 0) -> Generator[Any]:
    """The epoch's batches after the first `skip` (a resumed run's data position), loaded `prefetch` ahead.
    Close it (contextlib.closing) when leaving an epoch early, so its loader thread ends."""
    loader.sampler.set_epoch(epoch)
    batches = islice(iter(loader), skip, None)
    yield from _prefetched(batches, prefetch) if prefetch > 0 else batches


def training_steps(loader: DataLoader, position: Any, *, epochs: int, accumulation: int,
                   prefetch: int = 0) -> Generator[list[Any]]:
    """The groups of micro-batches (one optimizer step each) from where `position` stands (its epoch and the
    micro-batches of it done) to the end of the last epoch. `position` moves as each group is handed out; its
    epoch turns with an epoch's last group. Close it (contextlib.closing) when leaving early."""
    batches_per_epoch = len(loader)
    while position.epoch < epochs:
        batches = epoch_batches(loader, position.epoch, skip=position.batches_done, prefetch=prefetch)
        with closing(batches):
            for group in accumulation_groups(batches, accumulation):
                position.batches_done += len(group)
                if position.batches_done >= batches_per_epoch:
                    position.epoch, position.batches_done = position.epoch + 1, 0
                yield group
        if position.batches_done >= batches_per_epoch:  # resumed at an epoch's very end
            position.epoch, position.batches_done = position.epoch + 1, 0


def resumed_batches_done(batches_done: int, *, saved_world_size: int, saved_batch_size: int, world_size: int,
                         batch_size: int) -> int:
    """The micro-batches of the current epoch a run of `world_size` ranks x `batch_size` skips to resume a data
    position saved as `batches_done` micro-batches of `saved_world_size` x `saved_batch_size`.

    Every world size walks the epoch in the same order: the sampler shuffles the whole dataset with seed + epoch
    and deals position p to rank p % W, so micro-batch k of W ranks x B covers positions k*W*B to (k+1)*W*B - 1
    (`training_loader`). The saved position is therefore a count of examples, `batches_done` x saved W x saved
    B (mid-epoch it is below the dataset's size: the sampler's padding comes only at the epoch's end), and the
    new run skips the whole micro-batches of W x B that fit in it. It rounds down: no example of the epoch is
    skipped unseen, and fewer than W x B examples (one new micro-batch across the ranks) are trained on twice.
    With the same world size and batch size the position is kept as it is.
    """
    consumed = batches_done * saved_world_size * saved_batch_size
    return consumed // (world_size * batch_size)


def steps_left(position: Any, *, epochs: int, batches_per_epoch: int, accumulation: int) -> int:
    """The optimizer steps `training_steps` hands out from `position` to the end of the last epoch: the rest of the
    position's epoch in groups of `accumulation` micro-batches (the last may be shorter), then whole epochs."""
    if position.epoch >= epochs:
        return 0
    rest = math.ceil(max(0, batches_per_epoch - position.batches_done) / accumulation)
    return rest + (epochs - position.epoch - 1) * math.ceil(batches_per_epoch / accumulation)


def accumulation_groups(batches: Iterator[Any], size: int) -> Iterator[list[Any]]:
    """Consecutive groups of `size` micro-batches (one optimizer step each); the last may be shorter."""
    group: list[Any] = []
    for batch in batches:
        group.append(batch)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group


_DONE = object()


def _prefetched(batches: Iterator[Any], depth: int) -> Iterator[Any]:
    """Load up to `depth` batches ahead on a daemon thread (DL4J's AsyncDataSetIterator)."""
    buffer: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def offer(item: Any) -> bool:
        """Put `item` unless the consumer has gone; False once it has."""
        while not stop.is_set():
            try:
                buffer.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for batch in batches:
                if not offer(batch):
                    return
            offer(_DONE)
        except BaseException as error:  # handed to the training thread, which raises it
            offer(error)

    thread = threading.Thread(target=produce, name="tandem-prefetch", daemon=True)
    thread.start()
    try:
        while (item := buffer.get()) is not _DONE:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join()


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, list | tuple):
        return type(batch)(to_device(item, device) for item in batch)
    return batch
