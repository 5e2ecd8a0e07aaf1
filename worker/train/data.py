"""Data loading: each rank's shard (`EpochShard`, DistributedSampler's order), resumable mid-epoch at any world size
and batch, prefetched on a thread."""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Generator, Iterator
from contextlib import closing
from itertools import islice
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, Subset, default_collate


class EpochShard(Sampler[int]):
    """This rank's examples of an epoch, as DistributedSampler deals them (shuffle, no drop_last): the dataset
    shuffled with seed + epoch, position p of the order to rank p % world_size, the order padded with its own first
    examples to a multiple of world_size. `set_epoch(epoch, start)` deals only the order's positions from `start`
    on: the rest of an epoch whose first `start` examples were consumed at another world size or batch. At start 0
    the indices are DistributedSampler's, bit for bit."""

    def __init__(self, size: int, *, rank: int, world_size: int, seed: int) -> None:
        self.size, self.rank, self.world_size, self.seed = size, rank, world_size, seed
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def examples(self, start: int) -> int:
        """This rank's examples of an epoch dealt from `start` on."""
        return math.ceil(max(0, self.size - start) / self.world_size)

    def __len__(self) -> int:
        return self.examples(self.start)

    def __iter__(self) -> Iterator[int]:
        rest = epoch_order(self.size, seed=self.seed, epoch=self.epoch)[self.start:]
        total = len(self) * self.world_size
        if rest and total > len(rest):
            rest += (rest * math.ceil((total - len(rest)) / len(rest)))[:total - len(rest)]
        return iter(rest[self.rank:total:self.world_size])


def epoch_order(size: int, *, seed: int, epoch: int) -> list[int]:
    """The order an epoch takes the dataset's examples in, the same at every world size (DistributedSampler's)."""
    return torch.randperm(size, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def step_share(order: list[int], *, start: int, examples: int, rank: int, world_size: int) -> list[int]:
    """An elastic job's step takes the `examples` of the epoch's order from position `start` on, every rank every
    world_size-th of them: at any world size each example of the epoch once, none repeated (no padding). Where
    world_size divides the step's examples, rank r's micro-batch k is the one EpochShard deals it."""
    return order[start + rank:start + examples:world_size]


def elastic_steps(dataset: Dataset, position: Any, *, epochs: int, step_examples: int, batch_size: int,
                  rank: int, world_size: int, seed: int) -> Generator[tuple[list[Any], list[int], int]]:
    """An elastic job's steps from where `position` stands, read afresh for each step (a regroup rebuilds this with
    another world size; the position moves only when a step completes, `advance`): each step's micro-batches of at
    most `batch_size` examples (none where this rank's share is empty), their example indices, and the step's
    examples over all ranks."""
    size, order, epoch_of_order = len(dataset), None, None
    while position.epoch < epochs:
        if epoch_of_order != position.epoch:
            order, epoch_of_order = epoch_order(size, seed=seed, epoch=position.epoch), position.epoch
        examples = min(step_examples, size - position.epoch_start)
        share = step_share(order, start=position.epoch_start, examples=examples, rank=rank, world_size=world_size)
        chunks = [share[i:i + batch_size] for i in range(0, len(share), batch_size)]
        yield [default_collate([dataset[i] for i in chunk]) for chunk in chunks], share, examples


def advance(position: Any, examples: int, *, epoch_size: int) -> None:
    """An elastic job's position after a step of `examples` (its epoch turns with the epoch's last)."""
    position.epoch_start += examples
    if position.epoch_start >= epoch_size:
        position.next_epoch()


def elastic_steps_left(position: Any, *, epochs: int, epoch_size: int, step_examples: int) -> int:
    """The steps of `step_examples` each from `position` to the end of the last epoch."""
    if position.epoch >= epochs:
        return 0
    rest = math.ceil(max(0, epoch_size - position.epoch_start) / step_examples)
    return rest + (epochs - position.epoch - 1) * math.ceil(epoch_size / step_examples)


def training_loader(dataset: Dataset, *, rank: int, world_size: int, batch_size: int, seed: int) -> DataLoader:
    """This rank's batches: a shuffle shared by all ranks (seed + epoch), every world_size-th example.

    With 2 ranks x batch b, step k covers exactly the examples 1 rank x batch 2b would, so both give the
    same gradient mean.
    """
    sampler = EpochShard(len(dataset), rank=rank, world_size=world_size, seed=seed)
    # Every iter() of a DataLoader draws a number from its generator. From torch's global one, that draw would
    # shift every random number the model takes after it (dropout), and a resumed run starts its epoch's
    # iterator again: the run would no longer continue the random sequence the checkpoint saved.
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=False,
                      generator=torch.Generator().manual_seed(seed))


def evaluation_shard(dataset: Dataset, *, rank: int, world_size: int) -> Subset:
    """Every world_size-th example, no padding: the shards add up to the dataset exactly once."""
    return Subset(dataset, range(rank, len(dataset), world_size))


def epoch_length(loader: DataLoader, start: int = 0) -> int:
    """The micro-batches of an epoch dealt from example `start` of its order on."""
    return math.ceil(loader.sampler.examples(start) / loader.batch_size)


def epoch_batches(loader: DataLoader, epoch: int, *, start: int = 0, skip: int = 0,
                  prefetch: int = 0) -> Generator[Any]:
    """The epoch's batches from example `start` of its order, after the first `skip` (a resumed run's data
    position), loaded `prefetch` ahead. Close it (contextlib.closing) when leaving an epoch early, so its loader
    thread ends."""
    loader.sampler.set_epoch(epoch, start)
    batches = islice(iter(loader), skip, None)
    yield from _prefetched(batches, prefetch) if prefetch > 0 else batches


def training_steps(loader: DataLoader, position: Any, *, epochs: int, accumulation: int,
                   prefetch: int = 0) -> Generator[list[Any]]:
    """The groups of micro-batches (one optimizer step each) from where `position` stands (its epoch, the example
    of the epoch's order its run began at, and the micro-batches of it done) to the end of the last epoch.
    `position` moves as each group is handed out; its epoch turns with an epoch's last group. Close it
    (contextlib.closing) when leaving early."""
    while position.epoch < epochs:
        batches_in_epoch = epoch_length(loader, position.epoch_start)
        batches = epoch_batches(loader, position.epoch, start=position.epoch_start, skip=position.batches_done,
                                prefetch=prefetch)
        with closing(batches):
            for group in accumulation_groups(batches, accumulation):
                position.batches_done += len(group)
                if position.batches_done >= batches_in_epoch:
                    position.next_epoch()
                yield group
        if position.batches_done >= batches_in_epoch:  # resumed at an epoch's very end
            position.next_epoch()


def examples_consumed(batches_done: int, *, world_size: int, batch_size: int) -> int:
    """The examples of an epoch's order that `batches_done` micro-batches of `world_size` ranks x `batch_size` took.

    Every world size walks the epoch in the same order: micro-batch k of W ranks x B covers positions k*W*B to
    (k+1)*W*B - 1 of it (`EpochShard`), and mid-epoch no padding has come yet (only at the epoch's end), so a run
    at another world size or batch goes on from exactly this position: no example of the epoch is skipped, none
    seen twice."""
    return batches_done * world_size * batch_size


def steps_left(position: Any, *, epochs: int, loader: DataLoader, accumulation: int) -> int:
    """The optimizer steps `training_steps` hands out from `position` to the end of the last epoch: the rest of the
    position's epoch in groups of `accumulation` micro-batches (the last may be shorter), then whole epochs."""
    if position.epoch >= epochs:
        return 0
    rest = math.ceil(max(0, epoch_length(loader, position.epoch_start) - position.batches_done) / accumulation)
    return rest + (epochs - position.epoch - 1) * math.ceil(epoch_length(loader) / accumulation)


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
