"""The training loop every rank runs, in every mode but `custom` (which runs the user's own command).

Read top to bottom: set up (seed, the mode around the model, optimizer, data, schedule), resume, then steps until
the planned total, each followed by what the mode does after a step (averaging), progress, a stop check all ranks
agree on, and checkpoints when due. A final checkpoint and the evaluation close it. The pieces live beside it:
modes.py (allReduce, sharedGradients, averaging), step.py (one optimizer step), state.py (what checkpoints hold),
data.py, nonfinite.py, rank_agreement.py, reporting.py, evaluation.py, scalars.py (rank 0's TensorBoard curves).
"""

from __future__ import annotations

import os
import random
import sys
import time
from collections.abc import Callable, Generator
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from tandem.api import ParallelTrainingJobSpec, ParallelTrainingJobStatus
from tandem.api.training import TrainerSpec
from tandem.worker.checkpoint_owner import Lease
from tandem.worker.train.data import (
    advance,
    elastic_steps,
    elastic_steps_left,
    steps_left,
    training_loader,
    training_steps,
)
from tandem.worker.train.elastic import (
    batch_line,
    elastic_mode,
    lr_scale,
    regroup_line,
    say,
    share_state,
    step_examples,
)
from tandem.worker.train.evaluation import evaluate
from tandem.worker.train.membership import LeftGroup, Membership, Plan, is_group_failure
from tandem.worker.train.modes import TrainingMode, optimizer_settings, training_mode
from tandem.worker.train.nonfinite import StepRecord
from tandem.worker.train.optim import LearningRateSchedule, build_optimizer
from tandem.worker.train.rank_agreement import Agreement, Outcome
from tandem.worker.train.reporting import Reporter, Sink
from tandem.worker.train.scalars import ScalarLog, run_directory
from tandem.worker.train.state import Checkpointer, Position, TrainState, seed_rank
from tandem.worker.train.step import TrainStep

NOTHING_AGREED = Outcome()
ELASTIC_AGREEMENT_SECONDS = 0.25
"""How often an elastic job's ranks agree (rank_agreement.py): a rank asking to join or leave is taken in at the
exchange after the one that heard it, so 4 small all-reduces a second make a join wait about half a second, not
one to two."""


@dataclass(frozen=True)
class TakenDuties:
    """What a rank that becomes rank 0 takes on (RankZeroDuties.take)."""

    sinks: list[Sink]
    holder: Lease | None
    """The checkpoint directory's lease this rank writes under now."""
    run: str | None
    previous: ParallelTrainingJobStatus | None
    """The status the rank 0 before it published, where it can be read back (None: it goes on from its own)."""


class RankZeroDuties(Protocol):
    """What rank 0 holds beside training (the status sinks, the checkpoint directory's lease), which in an elastic job
    follow rank 0 of each generation (worker/train/entrypoint.py has them)."""

    def take(self) -> TakenDuties:
        """This rank becomes rank 0."""

    def hand_on(self) -> None:
        """This rank is rank 0 no more: its sinks closed, the lease let go."""


@dataclass
class RankContext:
    """Who this process is in the group, and where its outputs go."""

    rank: int
    world_size: int
    device: torch.device
    job: str
    checkpoint_dir: Path
    resume_from: Path | None = None
    run: str | None = None
    """The run whose checkpoints rank 0 writes (the checkpoint directory's record names it)."""
    holder: Lease | None = None
    """The checkpoint directory's lease rank 0 writes under (its own, or its launcher's): a checkpoint is refused
    once another holds the directory (worker/checkpoint_owner.py). None: nothing is checked."""
    sinks: list[Sink] = field(default_factory=list)
    listeners: list[Callable[[int, torch.nn.Module, torch.optim.Optimizer, bool], None]] = field(default_factory=list)
    """Called after every optimizer step with (step, model, optimizer, synchronised): DL4J's TrainingListener.
    `synchronised` is true when all replicas now hold the same parameters."""
    stop_requested: bool = False
    membership: Membership | None = None
    """An elastic job's (spec.elastic, recovery regroup): `rank` and `world_size` follow its generations."""
    regroups_before: int = 0
    """An elastic job's regroups in the groups before this one (status.recoveries.regroups counts on from it)."""
    share_listeners: list[Callable[[int, list[int]], None]] = field(default_factory=list)
    """Elastic jobs: called after each step this rank completes with (step, the indices of the examples it took)."""
    duties: RankZeroDuties | None = None
    """Elastic jobs: taken on when this rank becomes a generation's rank 0, handed on when it stops being it."""

    @property
    def is_master(self) -> bool:
        return self.rank == 0


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        # cuBLAS is deterministic only with a fixed workspace, which it reads when it starts: without it,
        # deterministic mode makes the first matrix product on a GPU raise.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        # MKL's matrix products give bitwise the same results whatever the buffers' alignment only in its strict
        # reproducibility mode, which it reads when it first runs: without it two layouts of the same ranks (their
        # allocations differ) ended with different weights on an AMD EPYC (tests/integration/test_ranks_per_pod.py).
        os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def train(spec: ParallelTrainingJobSpec, context: RankContext, model: torch.nn.Module, train_set: Dataset,
          eval_set: Dataset | None = None) -> ParallelTrainingJobStatus | None:
    """Train `model` in place on this rank; returns the final status on rank 0 (None elsewhere).

    In an elastic job (`context.membership`) the group may change under the loop: when a member is lost the step
    in flight is abandoned, the survivors regroup (membership.py) and the loop goes on in the next generation,
    rebuilt for its size (`begin_generation`), from the state the generation's source hands those behind it."""
    trainer = spec.trainer
    membership = context.membership
    seed_everything(trainer.seed, trainer.deterministic)
    model.to(context.device)
    optimizer = build_optimizer(model.parameters(), optimizer_settings(spec))
    joined_in = 0.0
    if membership is not None and membership.plan is None:
        # A replacement joins only now: what it can do alone (the first fused optimizer of a process takes about a
        # second) the group does not wait for.
        joined_in = time.monotonic()
        membership.start()
        joined_in = time.monotonic() - joined_in
        context.rank, context.world_size = membership.rank, membership.world_size
    mode = new_mode(spec, context, model)
    loader = training_loader(train_set, rank=context.rank, world_size=context.world_size,
                             batch_size=trainer.batch_size_per_worker, seed=trainer.seed)
    schedule = LearningRateSchedule(optimizer, trainer, total_steps=0)  # planned once the position is known
    scaler = torch.amp.GradScaler(context.device.type, enabled=trainer.mixed_precision == "fp16")
    state = TrainState(model, optimizer, scaler, schedule, mode, Position())
    checkpointer = Checkpointer(spec, rank=context.rank, world_size=context.world_size, job=context.job,
                                directory=context.checkpoint_dir, run=context.run, holder=context.holder,
                                by_examples=membership is not None,
                                wait=waits_for(membership))
    seed_rank(trainer.seed, context.rank)  # per-rank dropout noise; a resume restores it
    if context.resume_from is not None:
        checkpointer.resume(state, context.resume_from)
    position = state.position
    if membership is not None and share_state(state, membership.plan, membership.slot, membership.wait):
        seed_rank(trainer.seed, context.rank, step=position.step)  # a joiner: its own noise from the step it joins
    schedule.total_steps = total_steps = planned_steps(trainer, loader=loader, position=position) \
        if membership is None else elastic_planned_steps(spec, len(train_set), position, context.world_size)
    reporter = scalars = None
    if context.is_master and membership is not None and membership.plan.generation > 1:
        # A process that joined (slot 0's replacement, say) as its generation's rank 0: it reports the regroup that
        # took it in.
        reporter, scalars = take_rank_zero(spec, context, state, checkpointer, total_steps)
        report_regroup(spec, context, reporter, Regrouped(membership.plan, position.step, joined_in, took_state=True),
                       total_steps)
    elif context.is_master:
        reporter = Reporter(context.sinks, workers=context.world_size, total_steps=total_steps,
                            compression=mode.compression_report)
        reporter.status.recoveries.regroups = context.regroups_before
    if context.resume_from is not None:
        done = nothing_left(context.resume_from, position, trainer, total_steps)
        if reporter is not None:
            print(f"tandem worker: {done or resuming_line(context.resume_from, position, total_steps)}",
                  file=sys.stderr, flush=True)
            reporter.resumed(context.resume_from, step=position.step, epoch=epoch_shown(position),
                             metrics=checkpointer.metrics)
        if done is not None:  # nothing to train: its checkpoints are left as they are
            return None if reporter is None else reporter.final(
                "Succeeded", done, epoch=epoch_shown(position), metrics=checkpointer.metrics, bytes_sent=0,
                dense_bytes=0)
    if context.is_master and scalars is None:
        scalars = ScalarLog(run_directory(context.checkpoint_dir, context.run or context.job), position=position,
                            schedule=schedule, mode=mode)
    record = StepRecord(position, max_consecutive_bad_steps=trainer.max_consecutive_bad_steps,
                        counts_bad_steps=trainer.mixed_precision != "fp16",
                        on_read=scalars.losses if scalars is not None else None)
    every_steps = spec.checkpoint.every_steps
    generation = begin_generation(spec, context, state, loader, train_set)

    def report_progress() -> None:
        if reporter is not None:
            reporter.progress(epoch=epoch_shown(position), step=position.step, loss=record.running_loss,
                              samples=position.samples)

    def evaluate_checkpoint() -> dict[str, float]:
        # The evaluation's loader draws from torch's generator: restored, so that a checkpoint (one a signal asks
        # for, say) never changes the random numbers training draws next.
        cuda = [context.device.index or 0] if context.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            return evaluate(model, eval_set, rank=context.rank, world_size=context.world_size,
                            device=context.device, batch_size=trainer.batch_size_per_worker,
                            wait=waits_for(membership))

    def save(final: bool = False) -> None:
        record.flush()  # brings position's bad-step counts and the running loss up to date
        path = checkpointer.save(state, input_shape=generation.train_step.input_shape, final=final,
                                 evaluate=evaluate_checkpoint if eval_set is not None else None)
        generation.agreement.checkpoint_written()
        if reporter is not None and path is not None:
            report_progress()
            reporter.checkpoint(path, position.step, seconds=checkpointer.seconds, metrics=checkpointer.metrics)
            scalars.checkpoint(position.step, checkpointer.metrics)

    def run_steps() -> Outcome:
        """Steps until the planned total, a stop, or (elastic) a regroup the ranks agreed on."""
        outcome = NOTHING_AGREED
        agreement, train_step = generation.agreement, generation.train_step
        with closing(generation.steps) as steps:
            while position.step < generation.total_steps:
                work = next(steps, None)  # (the steps of a fixed group move the position as they are handed out)
                if work is None:
                    break
                outcome = NOTHING_AGREED
                if membership is None:
                    step_loss, found, examples = train_step(position.step, work)
                else:
                    micro_batches, share, step_size = work
                    step_loss, found, examples = train_step(position.step, micro_batches, step_examples=step_size)
                    advance(position, step_size, epoch_size=len(train_set))
                    for listener in context.share_listeners:
                        listener(position.step + 1, share)
                position.step += 1
                position.samples += examples
                record.add(position.step, step_loss, found)
                synchronised = state.mode.after_step(position.step, optimizer, step_loss, record)
                for listener in context.listeners:
                    listener(position.step, model, optimizer, synchronised)
                report_progress()
                if position.step == agreement.next_step:
                    record.flush()
                    leaving = context.stop_requested and membership is not None and not context.is_master
                    if leaving:  # an elastic job's rank other than 0, stopped: its pod goes (a scale-down)
                        membership.ask_to_leave()
                    outcome = agreement.exchange(position.step, stop_requested=context.stop_requested and not leaving,
                                                 regroup_wanted=membership is not None and membership.regroup_wanted())
                if position.step >= generation.total_steps or outcome.stop or outcome.regroup:
                    break
                if outcome.checkpoint or (every_steps is not None and position.step % every_steps == 0):
                    save()
        return outcome

    model.train()
    while True:
        try:
            outcome = run_steps()
            if outcome.stop or not outcome.regroup:
                # In the loop: an elastic job's member lost while the final checkpoint is written regroups, and the
                # survivors write it again.
                generation.agreement.close()
                save(final=True)
                communication = communication_totals(state.mode, wait=waits_for(membership))
                break
            generation.agreement.close()
            lost_at = None
        except Exception as error:
            if membership is None or not is_group_failure(error):
                raise
            lost_at = f"{type(error).__name__}: {error}"
        was_rank_zero = context.is_master
        try:
            generation, regrouped = regroup(spec, context, state, loader, train_set, checkpointer, record,
                                            why=lost_at)
        except LeftGroup as left:
            say(f"tandem worker: {left}, as asked (its pod is going)")
            return None
        total_steps = generation.total_steps
        if was_rank_zero and not context.is_master:  # slot 0's replacement joined: rank 0 again
            scalars.close()
            reporter = scalars = None
            context.duties.hand_on()
        elif context.is_master and not was_rank_zero:  # the rank 0 before this generation is lost
            reporter, scalars = take_rank_zero(spec, context, state, checkpointer, total_steps)
        if reporter is not None:
            report_regroup(spec, context, reporter, regrouped, total_steps)
            scalars.mode = state.mode
        record.on_read = scalars.losses if scalars is not None else None
    if scalars is not None:
        scalars.close()

    metrics = checkpointer.metrics  # the final checkpoint's evaluation: the trained model's
    if membership is not None:
        membership.finish()
    if reporter is None:
        return None
    return final_status(reporter, position, epochs=trainer.epochs, stopped=outcome.stop and position.step < total_steps,
                        metrics=metrics, communication=communication)


def new_mode(spec: ParallelTrainingJobSpec, context: RankContext, model: torch.nn.Module,
             previous: TrainingMode | None = None) -> TrainingMode:
    """The mode over the current group (`previous`: this rank's in an elastic job's generation before)."""
    membership = context.membership
    if membership is None:
        return training_mode(spec, model, context.device, context.world_size)
    return elastic_mode(spec, model, context.world_size, membership.wait,
                        first=membership.plan.generation == 1 and not membership.joining, previous=previous)


def take_rank_zero(spec: ParallelTrainingJobSpec, context: RankContext, state: TrainState, checkpointer: Checkpointer,
                   total_steps: int) -> tuple[Reporter, ScalarLog]:
    """This rank becomes its generation's rank 0 (an elastic job's): it takes on the sinks and the checkpoint
    directory's lease, goes on with the status the rank 0 before it published (where it can be read back), its next
    regroup counted by the caller, and writes the TensorBoard curves on in the same run folder (a new event file)."""
    taken = context.duties.take()
    context.sinks, context.holder, context.run = taken.sinks, taken.holder, taken.run
    checkpointer.holder, checkpointer.run = taken.holder, taken.run
    reporter = Reporter(context.sinks, workers=context.world_size, total_steps=total_steps,
                        compression=state.mode.compression_report)
    if taken.previous is not None:
        reporter.status = taken.previous.model_copy(update={"phase": "Running"})
    reporter.status.recoveries.regroups = context.regroups_before + context.membership.plan.generation - 2
    scalars = ScalarLog(run_directory(context.checkpoint_dir, context.run or context.job), position=state.position,
                        schedule=state.schedule, mode=state.mode)
    return reporter, scalars


def waits_for(membership: Membership | None) -> Callable[[dist.Work], None]:
    """How this rank waits for a collective: an elastic job's rank abandons it once a member stalls."""
    return membership.wait if membership is not None else dist.Work.wait


@dataclass
class Generation:
    """What the loop runs with in one generation of the group (all of a run, outside an elastic job)."""

    train_step: TrainStep
    agreement: Agreement
    steps: Generator
    total_steps: int


def begin_generation(spec: ParallelTrainingJobSpec, context: RankContext, state: TrainState, loader: DataLoader,
                     train_set: Dataset) -> Generation:
    trainer, position, membership = spec.trainer, state.position, context.membership
    every_minutes = spec.checkpoint.every_minutes
    agreement = Agreement(is_master=context.is_master, first_step=position.step + 1, wait=waits_for(membership),
                          checkpoint_every_seconds=every_minutes * 60 if every_minutes is not None else None,
                          target_seconds=ELASTIC_AGREEMENT_SECONDS if membership is not None else None)
    train_step = TrainStep(trainer, state.mode, state.optimizer, state.scaler, state.schedule, context.device,
                           context.world_size)
    if membership is None:
        steps = training_steps(loader, position, epochs=trainer.epochs,
                               accumulation=trainer.gradient_accumulation_steps,
                               prefetch=trainer.prefetch_for(context.device.type))
        return Generation(train_step, agreement, steps, state.schedule.total_steps)
    state.schedule.scale = lr_scale(spec, context.world_size)
    total_steps = elastic_planned_steps(spec, len(train_set), position, context.world_size)
    state.schedule.total_steps = total_steps
    steps = elastic_steps(train_set, position, epochs=trainer.epochs,
                          step_examples=step_examples(spec, context.world_size),
                          batch_size=trainer.batch_size_per_worker, rank=context.rank,
                          world_size=context.world_size, seed=trainer.seed)
    return Generation(train_step, agreement, steps, total_steps)


@dataclass(frozen=True)
class Regrouped:
    """How a regroup went: the generation's plan, the step this rank stopped at, the seconds it took, and whether
    this rank took the source's state."""

    plan: Plan
    stopped_at: int
    seconds: float
    took_state: bool


def report_regroup(spec: ParallelTrainingJobSpec, context: RankContext, reporter: Reporter, regrouped: Regrouped,
                   total_steps: int) -> None:
    """Rank 0: the regroup in its log and in the status."""
    say(regroup_line(regrouped.plan, stopped_at=regrouped.stopped_at, seconds=regrouped.seconds,
                     took_state=regrouped.took_state))
    say(f"tandem worker: {batch_line(spec, context.world_size)}")
    reporter.regrouped(regrouped.plan, workers=context.world_size, stopped_at=regrouped.stopped_at,
                       seconds=regrouped.seconds, total_steps=total_steps)


def regroup(spec: ParallelTrainingJobSpec, context: RankContext, state: TrainState, loader: DataLoader,
            train_set: Dataset, checkpointer: Checkpointer, record: StepRecord, *,
            why: str | None) -> tuple[Generation, Regrouped]:
    """Enter the next generation (a member lost: `why`; or a join agreed at this step) and rebuild the loop's
    parts for its size; the members behind the generation's source take its state."""
    membership, position = context.membership, state.position
    started, stopped_at = time.monotonic(), position.step
    if why is not None and context.is_master:
        say(f"tandem worker: the group lost a member at step {position.step} ({why.splitlines()[0][:200]}); "
            "regrouping")
    state.optimizer.zero_grad(set_to_none=True)  # an abandoned step's
    record.flush()  # this rank's bad-step counts onto its position, before a receiver takes the source's
    plan = membership.regroup(position.step)
    context.rank, context.world_size = membership.rank, membership.world_size
    state.mode = new_mode(spec, context, state.model, previous=state.mode)
    took = share_state(state, plan, membership.slot, membership.wait)
    checkpointer.regrouped(rank=context.rank, world_size=context.world_size)
    regrouped = Regrouped(plan, stopped_at, time.monotonic() - started, took)
    return begin_generation(spec, context, state, loader, train_set), regrouped


def epoch_shown(position: Position) -> int:
    """The epoch under way, counted from 1; at an epoch's last step, that epoch (the position has turned to the
    next, which has not begun)."""
    return max(1, position.epoch + (1 if position.epoch_begun else 0))


def resuming_line(source: Path, position: Position, total_steps: int) -> str:
    return f"resuming from {source.name} (step {position.step} of {total_steps})"


def nothing_left(source: Path, position: Position, trainer: TrainerSpec, total_steps: int) -> str | None:
    """Why a run resumed from `source` has nothing to train, None while steps remain: the checkpoint is at the job's
    last step (complete), or past it (`epochs` or `maxSteps` lowered since it was written)."""
    if position.step < total_steps:
        return None
    afresh = ("to train afresh, give the job another checkpoint.directory, or set checkpoint.resume: false and "
              "checkpoint.overwrite: true")
    past_epochs = position.epoch > trainer.epochs or (position.epoch == trainer.epochs and position.epoch_begun)
    past_steps = trainer.max_steps is not None and position.step > trainer.max_steps
    if past_epochs or past_steps:
        limit, value = ("trainer.epochs", trainer.epochs) if past_epochs else ("trainer.maxSteps", trainer.max_steps)
        return (f"{source.name} is at step {position.step} (epoch {epoch_shown(position)}), past this job's end "
                f"({limit}: {value}): nothing to train, its checkpoints left as they are. Raise {limit} to train on "
                f"from it; {afresh}")
    return (f"already complete: {source.name} is at step {position.step} of {total_steps}, the job's last: nothing "
            f"to train, its checkpoints left as they are. Raise trainer.epochs (or trainer.maxSteps) to train "
            f"further; {afresh}")


def planned_steps(trainer: TrainerSpec, *, loader: DataLoader, position: Position) -> int:
    """The step training ends at: the steps done plus those left in `epochs` from `position`, or `maxSteps` if
    fewer. From a position of this run's own making that is `epochs` worth of steps; after a resume at another
    world size, the steps done (counted at the old size) plus the rest at the new one."""
    total = position.step + steps_left(position, epochs=trainer.epochs, loader=loader,
                                       accumulation=trainer.gradient_accumulation_steps)
    return total if trainer.max_steps is None else min(total, trainer.max_steps)


def elastic_planned_steps(spec: ParallelTrainingJobSpec, epoch_size: int, position: Position, world_size: int) -> int:
    """An elastic job's last step at `world_size` ranks: the steps done plus those left at this size's step, or
    `maxSteps` if fewer. With batch global the same whatever the size."""
    trainer = spec.trainer
    total = position.step + elastic_steps_left(position, epochs=trainer.epochs, epoch_size=epoch_size,
                                               step_examples=step_examples(spec, world_size))
    return total if trainer.max_steps is None else min(total, trainer.max_steps)


def communication_totals(mode: TrainingMode, *, wait: Callable[[dist.Work], None]) -> tuple[int, int]:
    """(bytes sent, dense bytes) summed over ranks."""
    totals = torch.tensor([float(n) for n in mode.communication()], dtype=torch.float64)
    wait(dist.all_reduce(totals, async_op=True))
    return int(totals[0]), int(totals[1])


def final_status(reporter: Reporter, position: Position, *, epochs: int, stopped: bool, metrics: dict[str, float],
                 communication: tuple[int, int]) -> ParallelTrainingJobStatus:
    if position.bad_steps:
        metrics = {**metrics, "skippedSteps": float(position.bad_steps)}
    return reporter.final(
        "Suspended" if stopped else "Succeeded",
        f"stopped at step {position.step} on request; checkpoint written" if stopped else "training complete",
        epoch=min(epochs, epoch_shown(position)), metrics=metrics,
        bytes_sent=communication[0], dense_bytes=communication[1],
    )
