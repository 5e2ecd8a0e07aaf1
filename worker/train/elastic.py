"""What the trainer does differently in an elastic job (spec.elastic, recovery regroup): the mode over each
generation's group, the batch and learning rate at each size, and the state a generation's source hands the members
behind it. Who the members are is membership.py's.

Batch: `global` keeps spec.workers x batchSizePerWorker x gradientAccumulationSteps examples a step at every size,
the ranks alive sharing them (data.step_share: unevenly where the size does not divide it, each micro-batch's loss
weighted by its share, step.TrainStep); `perRank` keeps each rank's batchSizePerWorker x gradientAccumulationSteps,
and the learning rate follows lrScaling.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import asdict

import torch
import torch.distributed as dist

from tandem.api import ParallelTrainingJobSpec
from tandem.worker.train.membership import Plan
from tandem.worker.train.modes import (
    AveragingMode,
    ExchangedAllReduceMode,
    ExchangedSharedGradientsMode,
    ThresholdCompressed,
    TrainingMode,
)
from tandem.worker.train.state import TrainState, from_bytes, to_bytes


def elastic_mode(spec: ParallelTrainingJobSpec, model: torch.nn.Module, world_size: int,
                 wait: Callable[[dist.Work], None], *, first: bool, previous: TrainingMode | None) -> TrainingMode:
    """The mode over a generation's group. `first`: generation 1, where every replica starts from rank 0's;
    `previous`: this rank's mode in the generation before (sharedGradients carries its compression state on)."""
    if spec.training_mode == "averaging":
        return AveragingMode(model, spec, world_size, wait=wait, same_start=first)
    if spec.training_mode == "sharedGradients":
        return ExchangedSharedGradientsMode(model, world_size, wait, spec,
                                            compression=previous.compression if previous is not None else None)
    return ExchangedAllReduceMode(model, world_size, wait)


def step_examples(spec: ParallelTrainingJobSpec, world_size: int) -> int:
    """The examples of one optimizer step at `world_size` ranks."""
    trainer = spec.trainer
    ranks = spec.workers if spec.elastic.batch == "global" else world_size
    return ranks * trainer.batch_size_per_worker * trainer.gradient_accumulation_steps


def lr_scale(spec: ParallelTrainingJobSpec, world_size: int) -> float:
    """The learning rate's multiplier at `world_size` ranks: 1 with batch global (the batch does not change)."""
    elastic = spec.elastic
    if elastic.batch == "global" or elastic.lr_scaling == "none":
        return 1.0
    ratio = world_size / spec.workers
    return ratio if elastic.lr_scaling == "linear" else math.sqrt(ratio)


def batch_line(spec: ParallelTrainingJobSpec, world_size: int) -> str:
    """How a generation of `world_size` ranks trains, for the log."""
    examples = step_examples(spec, world_size)
    if spec.elastic.batch == "global":
        return f"global batch {examples} kept ({math.ceil(examples / world_size)} examples a rank at most)"
    scale = lr_scale(spec, world_size)
    return (f"batch perRank: global batch {examples}, learning rate x{scale:.3g} "
            f"(lrScaling {spec.elastic.lr_scaling}, {world_size} of {spec.workers} workers)")


def share_state(state: TrainState, plan: Plan, slot: int, wait: Callable[[dist.Work], None]) -> bool:
    """The plan's source sends the state every rank shares (model, optimizer, gradient scaler, position: what a
    checkpoint holds for all ranks; sharedGradients' threshold and counters) to the members behind it: joiners,
    and survivors whose step it passed. Sent as a checkpoint's bytes are written and read back with weights_only
    (no pickled objects). Every member takes part; returns whether this rank took the state. The position object is
    kept (the loop holds it) and updated."""
    receivers = [member for member in plan.members if plan.receives_state(member)]
    if not receivers:
        return False
    source = plan.members.index(plan.source)
    payload = torch.empty(0, dtype=torch.uint8)
    if slot == plan.source:
        compressed = isinstance(state.mode, ThresholdCompressed)
        payload = to_bytes({**state.state_dict(),
                            **({"compression": state.mode.shared_state()} if compressed else {})})
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    wait(dist.broadcast(size, src=source, async_op=True))
    if slot != plan.source:
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
    wait(dist.broadcast(payload, src=source, async_op=True))
    if slot not in receivers:
        return False
    contents = from_bytes(payload)
    position = state.position
    state.load_state_dict(contents, f"rank {source}'s state")
    vars(position).update(asdict(state.position))
    state.position = position
    if "compression" in contents:
        state.mode.take_shared_state(contents["compression"])
    return True


def regroup_line(plan: Plan, *, stopped_at: int, seconds: float, took_state: bool) -> str:
    lost = f"lost rank(s) {', '.join(map(str, plan.lost))}" if plan.lost else ""
    left = f"rank(s) {', '.join(map(str, plan.left))} left" if plan.left else ""
    added = f"added rank(s) {', '.join(map(str, plan.added))}" if plan.added else ""
    change = "; ".join(part for part in (lost, left, added) if part) or "no change"
    state = "; this rank took the state from rank " + str(plan.members.index(plan.source)) if took_state else ""
    return (f"tandem worker: regrouped: generation {plan.generation}, {len(plan.members)} rank(s) "
            f"({change}), stopped at step {stopped_at}, resumed at step {plan.step} in {seconds:.2f}s{state}")


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
