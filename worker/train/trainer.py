"""The training loop every rank runs, in every mode but `custom` (which runs the user's own command).

Read top to bottom: set up (seed, model, mode, optimizer, data), resume, then epochs of steps, each step
gradient-accumulated micro-batches, a NaN/Inf guard, clipping, the optimizer step, averaging when due,
progress, checkpoints, and a stop check that all ranks agree on. Evaluation and a final checkpoint close it.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import signal
import threading
from collections.abc import Callable
from contextlib import closing, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

from tandem.api import ParallelTrainingJobSpec, ParallelTrainingJobStatus
from tandem.worker import checkpoint
from tandem.worker.train.averaging import average_replicas
from tandem.worker.train.data import accumulation_groups, epoch_batches, evaluation_shard, to_device, training_loader
from tandem.worker.train.nonfinite import NonFiniteGuard, StepRecord
from tandem.worker.train.optim import LearningRateSchedule, build_optimizer
from tandem.worker.train.rank_agreement import Agreement, Outcome
from tandem.worker.train.reporting import Reporter, Sink
from tandem.worker.train.signals import STOP_SIGNALS, block_stop_signals

NOTHING_AGREED = Outcome()


@dataclass
class RankContext:
    """Who this process is in the group, and where its outputs go."""

    rank: int
    world_size: int
    device: torch.device
    job: str
    checkpoint_dir: Path
    resume_from: Path | None = None
    sinks: list[Sink] = field(default_factory=list)
    listeners: list[Callable[[int, torch.nn.Module, torch.optim.Optimizer, bool], None]] = field(default_factory=list)
    """Called after every optimizer step with (step, model, optimizer, synchronised): DL4J's TrainingListener.
    `synchronised` is true when all replicas now hold the same parameters."""
    stop_requested: bool = False

    @property
    def is_master(self) -> bool:
        return self.rank == 0


@dataclass
class Position:
    """Where training stands: restored from checkpoints, saved into them."""

    step: int = 0
    epoch: int = 0
    batches_done: int = 0
    """Micro-batches of `epoch` already consumed."""
    bad_steps: int = 0
    consecutive_bad_steps: int = 0
    samples: int = 0


def spec_hash(spec: ParallelTrainingJobSpec) -> str:
    payload = json.dumps(spec.to_dict(), sort_keys=True).encode()
    return hashlib.sha256(payload).hexdigest()[:16]


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def watch_stop_signals(context: RankContext) -> None:
    """SIGTERM / SIGINT ask for a clean stop: all ranks agree on the step, write a checkpoint, exit.

    The signals are taken by one thread with sigwait, never by an interrupt handler: delivered to an arbitrary
    thread, a signal interrupts whatever system call torch's or gloo's threads are in. The process must have
    blocked them (`block_stop_signals`) before any thread started, so every thread inherits the block.
    """

    def wait_for_signals() -> None:
        while True:
            signal.sigwait(STOP_SIGNALS)
            context.stop_requested = True

    block_stop_signals()
    threading.Thread(target=wait_for_signals, name="tandem-stop-signals", daemon=True).start()


def train(
    spec: ParallelTrainingJobSpec,
    context: RankContext,
    model: torch.nn.Module,
    train_set: Dataset,
    eval_set: Dataset | None = None,
) -> ParallelTrainingJobStatus | None:
    """Train `model` in place on this rank; returns the final status on rank 0 (None elsewhere)."""
    trainer = spec.trainer
    seed_everything(trainer.seed, trainer.deterministic)
    model.to(context.device)
    wrapped, compression = _wrap(model, spec, context)
    optimizer = build_optimizer(model.parameters(), trainer.optimizer)

    loader = training_loader(
        train_set, rank=context.rank, world_size=context.world_size,
        batch_size=trainer.batch_size_per_worker, seed=trainer.seed,
    )
    steps_per_epoch = math.ceil(len(loader) / trainer.gradient_accumulation_steps)
    total_steps = trainer.epochs * steps_per_epoch
    if trainer.max_steps is not None:
        total_steps = min(total_steps, trainer.max_steps)
    schedule = LearningRateSchedule(optimizer, trainer, total_steps)
    fp16 = trainer.mixed_precision == "fp16"
    scaler = torch.amp.GradScaler(context.device.type, enabled=fp16)
    autocast = _autocast(trainer.mixed_precision, context.device)

    position = Position()
    reporter = None
    if context.is_master:
        reporter = Reporter(context.sinks, workers=context.world_size, total_steps=total_steps)
    torch.manual_seed(trainer.seed + 1_000_003 * context.rank)  # per-rank dropout noise; a resume restores it
    if context.resume_from is not None:
        position = _resume(context, model, optimizer, scaler, compression, reporter)

    input_shape: list[int] | None = None
    bytes_sent = dense_bytes = 0
    parameters = list(model.parameters())
    parameter_bytes = sum(p.numel() * p.element_size() for p in parameters)
    guard = NonFiniteGuard(parameters, context.device)
    record = StepRecord(position, max_consecutive_bad_steps=trainer.max_consecutive_bad_steps,
                        counts_bad_steps=not fp16)
    every_minutes = spec.checkpoint.every_minutes
    agreement = Agreement(is_master=context.is_master, first_step=position.step + 1,
                          checkpoint_every_seconds=every_minutes * 60 if every_minutes is not None else None)
    on_cpu = context.device.type == "cpu"  # the loader's batches are already there

    def report_progress() -> None:
        if reporter is not None:
            reporter.progress(epoch=position.epoch + 1, step=position.step, loss=record.running_loss,
                              samples=position.samples)

    def save(final: bool = False) -> None:
        record.flush()  # brings position's bad-step counts up to date
        path = _save_checkpoint(context, spec, model, optimizer, schedule, scaler, compression, position,
                                input_shape, final=final)
        agreement.checkpoint_written()
        if reporter is not None and path is not None:
            report_progress()  # with the loss just read
            reporter.checkpoint(path, position.step)

    prefetch = trainer.prefetch_for(context.device.type)
    every_steps = spec.checkpoint.every_steps
    outcome = NOTHING_AGREED
    model.train()
    while position.step < total_steps and position.epoch < trainer.epochs and not outcome.stop:
        batches = epoch_batches(loader, position.epoch, skip=position.batches_done, prefetch=prefetch)
        with closing(batches):
            for micro_batches in accumulation_groups(batches, trainer.gradient_accumulation_steps):
                # One optimizer step over the accumulated micro-batches; DDP exchanges gradients on the last.
                losses = []
                for index, micro_batch in enumerate(micro_batches):
                    inputs, targets = micro_batch if on_cpu else to_device(micro_batch, context.device)
                    input_shape = input_shape or list(inputs.shape[1:])
                    last = index == len(micro_batches) - 1
                    no_sync = isinstance(wrapped, DistributedDataParallel) and not last
                    with wrapped.no_sync() if no_sync else nullcontext(), autocast:
                        loss = _loss(wrapped(inputs), targets)
                        if len(micro_batches) > 1:  # the mean over the step's examples; skipped when there is one
                            loss = loss / len(micro_batches)
                    scaler.scale(loss).backward()
                    losses.append(loss.detach())
                    position.samples += inputs.shape[0] * context.world_size
                position.batches_done += len(micro_batches)
                step_loss = losses[0] if len(losses) == 1 else torch.stack(losses).sum()

                # A step whose loss or gradients are not all finite is skipped on the device (train/nonfinite.py).
                # After the gradient exchange every rank holds the same gradients, so all skip together.
                scaler.unscale_(optimizer)
                schedule.apply(position.step)
                norm = None
                if trainer.gradient_clip_norm is not None:
                    norm = torch.nn.utils.clip_grad_norm_(parameters, trainer.gradient_clip_norm)
                found = guard.check(step_loss, norm)
                if not fp16:  # fp16: the gradient scaler hands the optimizer its own flag, for overflows
                    optimizer.found_inf = found  # the fused optimizer skips its update, on the device, when set
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                position.step += 1
                record.add(position.step, step_loss, found)

                synchronised = True
                if spec.training_mode == "averaging":
                    synchronised = position.step % spec.averaging.frequency == 0
                    if synchronised:
                        bytes_sent += _average(spec, model, optimizer, context)
                        if spec.averaging.report_score_after_averaging:
                            record.flush()
                            mean_loss = _mean_over_ranks(step_loss, context)
                            if math.isfinite(mean_loss):  # a skipped step's loss stays out, as in the record
                                record.running_loss = mean_loss
                elif spec.training_mode == "allReduce":
                    bytes_sent += parameter_bytes
                dense_bytes += parameter_bytes
                for listener in context.listeners:
                    listener(position.step, model, optimizer, synchronised)
                report_progress()

                outcome = NOTHING_AGREED
                if position.step == agreement.next_step:
                    record.flush()
                    outcome = agreement.exchange(position.step, stop_requested=context.stop_requested)
                if position.step >= total_steps or outcome.stop:
                    break
                if outcome.checkpoint or (every_steps is not None and position.step % every_steps == 0):
                    save()
        if position.batches_done >= len(loader):
            position.epoch, position.batches_done = position.epoch + 1, 0

    agreement.close()
    save(final=True)

    metrics = evaluate(model, eval_set, context, trainer.batch_size_per_worker) if eval_set is not None else {}
    if compression is not None:
        bytes_sent, dense_bytes = compression.bytes_sent, compression.dense_bytes
    totals = torch.tensor([float(bytes_sent), float(dense_bytes)], dtype=torch.float64)
    dist.all_reduce(totals)
    if reporter is None:
        return None
    reporter.refresh()
    status = reporter.status
    status.progress.epoch = min(trainer.epochs, position.epoch + (1 if position.batches_done else 0))
    status.metrics.update(metrics)
    status.communication.bytes_sent, status.communication.dense_bytes = int(totals[0]), int(totals[1])
    if position.bad_steps:
        status.metrics["skippedSteps"] = float(position.bad_steps)
    stopped = outcome.stop and position.step < total_steps
    return reporter.finish(
        "Suspended" if stopped else "Succeeded",
        f"stopped at step {position.step} on request; checkpoint written" if stopped else "training complete",
    )


def _wrap(model: torch.nn.Module, spec: ParallelTrainingJobSpec, context: RankContext):
    """DDP for allReduce and sharedGradients (with the threshold-encoding hook); the bare model for averaging,
    after making every replica start from rank 0's weights."""
    device_ids = [context.device.index] if context.device.type == "cuda" else None
    if spec.training_mode == "averaging":
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)
        return model, None
    ddp = DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)
    if spec.training_mode != "sharedGradients":
        return ddp, None
    from tandem.worker.train.compression import ThresholdCompression, threshold_hook

    shared = spec.shared_gradients
    state = ThresholdCompression(
        initial_threshold=shared.initial_threshold,
        min_sparsity=shared.target_sparsity.min,
        max_sparsity=shared.target_sparsity.max,
        threshold_decay=shared.threshold_decay,
        residual_clip_factor=shared.residual_clip.factor,
        residual_clip_every=shared.residual_clip.every,
    )
    ddp.register_comm_hook(state, threshold_hook)
    return ddp, state


def _autocast(precision: str, device: torch.device):
    if precision == "none":
        return nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def _loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy for integer class labels, mean squared error for float targets."""
    if targets.is_floating_point():
        return F.mse_loss(outputs.float(), targets.reshape(outputs.shape).float())
    return F.cross_entropy(outputs.float(), targets)


def _mean_over_ranks(value: torch.Tensor, context: RankContext) -> float:
    total = value.detach().reshape(1).to("cpu", torch.float64)
    dist.all_reduce(total)
    return total.item() / context.world_size


def _average(spec: ParallelTrainingJobSpec, model, optimizer, context: RankContext) -> int:
    return average_replicas(model, optimizer if spec.averaging.average_optimizer_state else None, context.world_size)


def _replicas_differ(spec: ParallelTrainingJobSpec, step: int) -> bool:
    """In averaging mode each rank's replica drifts from the others between averagings, and its optimizer state
    always does when `averageOptimizerState` is off."""
    averaging = spec.averaging
    return spec.training_mode == "averaging" and (
        step % averaging.frequency != 0 or not averaging.average_optimizer_state
    )


def _rank_state(compression, replica: dict[str, Any] | None) -> dict[str, Any]:
    """This rank's own part of a checkpoint, on the host."""
    state: dict[str, Any] = {"torch_rng": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda_rng"] = torch.cuda.get_rng_state()
    if compression is not None:
        state["compression"] = _host_copy(compression.state_dict())
    if replica is not None:
        state["replica"] = replica
    return state


def _save_checkpoint(context, spec, model, optimizer, schedule, scaler, compression, position, input_shape, *,
                     final: bool):
    """Gather every rank's own state (RNG, residuals, and its replica while replicas differ) to rank 0, which
    alone writes. Where replicas differ, the checkpoint's model is their average (what serving and a resume at
    another world size take); each rank then carries on from its own replica, so a checkpoint never changes the
    course of training, and at the end the average stays."""
    replica = None
    if _replicas_differ(spec, position.step):
        replica = _host_copy({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
        _average(spec, model, optimizer, context)
    per_rank = [None] * context.world_size if context.is_master else None
    dist.gather_object(_rank_state(compression, replica), per_rank, dst=0)
    try:
        return _write_checkpoint(context, spec, model, optimizer, schedule, scaler, position, input_shape, per_rank)
    finally:
        if replica is not None and not final:
            model.load_state_dict(replica["model"])
            optimizer.load_state_dict(replica["optimizer"])


def _write_checkpoint(context, spec, model, optimizer, schedule, scaler, position, input_shape, per_rank):
    if not context.is_master:
        return None
    trainer = spec.trainer
    manifest = checkpoint.build_manifest(
        spec_hash=spec_hash(spec), model=trainer.model, model_args=trainer.model_args,
        input_shape=input_shape, input_dtype="FP32", step=position.step, epoch=position.epoch,
        world_size=context.world_size, training_mode=spec.training_mode, job=context.job,
    )
    state = {
        "manifest": manifest,
        "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "lr_schedule": schedule.describe(position.step),
        "scaler": scaler.state_dict(),
        "position": position.__dict__.copy(),
        "per_rank": per_rank,
        "python_rng": random.getstate(),
        "numpy_rng": _numpy_rng_state(),
    }
    return checkpoint.save(context.checkpoint_dir, state, step=position.step, keep_last=spec.checkpoint.keep_last)


def _host_copy(value: Any) -> Any:
    """`value` with every tensor in it copied to the host: a snapshot that later updates in place leave alone."""
    if torch.is_tensor(value):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _host_copy(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_host_copy(v) for v in value)
    return value


def _numpy_rng_state() -> dict[str, Any]:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached": float(cached)}


def _resume(context, model, optimizer, scaler, compression, reporter) -> Position:
    state = checkpoint.load(context.resume_from, map_location="cpu")
    checkpoint.restore_model(model, state["model"], context.resume_from)
    try:
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
    except (KeyError, ValueError, RuntimeError) as error:
        raise checkpoint.CheckpointError(
            f"{context.resume_from}: optimizer state does not fit this job ({error})"
        ) from error
    position = Position(**state["position"])
    per_rank = state.get("per_rank", [])
    if len(per_rank) == context.world_size:
        mine = per_rank[context.rank]
        torch.set_rng_state(mine["torch_rng"])
        if "cuda_rng" in mine and torch.cuda.is_available():
            torch.cuda.set_rng_state(mine["cuda_rng"])
        if compression is not None and "compression" in mine:
            compression.load_state_dict(mine["compression"])
        if "replica" in mine:  # averaging, stopped between averagings: this rank's own replica carries on
            model.load_state_dict(mine["replica"]["model"])
            optimizer.load_state_dict(mine["replica"]["optimizer"])
    random.setstate(_tuples(state["python_rng"]))
    numpy_state = state["numpy_rng"]
    np.random.set_state((numpy_state["name"], numpy_state["keys"].numpy().astype(np.uint32), numpy_state["pos"],
                         numpy_state["has_gauss"], numpy_state["cached"]))
    if reporter is not None:
        reporter.checkpoint(Path(context.resume_from), position.step)
        reporter.status.progress.step, reporter.status.progress.epoch = position.step, position.epoch + 1
    return position


def _tuples(value: Any) -> Any:
    """random.setstate wants the tuples it gave (a checkpoint round trip may turn them into lists)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list | tuple) else value


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataset: Dataset, context: RankContext, batch_size: int) -> dict[str, float]:
    """Eval loss and, for integer labels, accuracy (0..1) over the whole eval set, sharded across ranks."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, count
    shard = evaluation_shard(dataset, rank=context.rank, world_size=context.world_size)
    for inputs, targets in DataLoader(shard, batch_size=max(batch_size, 256)):
        inputs, targets = inputs.to(context.device), targets.to(context.device)
        outputs = model(inputs)
        totals[0] += float(_loss(outputs, targets)) * len(targets)
        if not targets.is_floating_point():
            totals[1] += float((outputs.argmax(dim=1) == targets).sum())
        totals[2] += len(targets)
    dist.all_reduce(totals)
    model.train(was_training)
    count = max(totals[2].item(), 1.0)
    metrics = {"evalLoss": totals[0].item() / count}
    if not dataset[0][1].is_floating_point():
        metrics["accuracy"] = totals[1].item() / count
    return metrics
