"""The training modes (`spec.trainingMode`), one object each, holding what the loop needs from its mode: the module
to run forward and backward, whether micro-batches skip the gradient exchange, what follows an optimizer step,
what a checkpoint needs, the bytes exchanged, and the mode's own per-rank state. The loop never asks which mode
it runs.

- allReduce: DistributedDataParallel's gradient all-reduce, every step.
- sharedGradients: DDP with the threshold-encoding communication hook (compression/): error-feedback residuals,
  momentum-correction velocities and an adaptive threshold per rank, checkpointed per rank (at another world size
  the residuals and velocities are reset and the threshold kept); under momentum correction the optimizer runs
  without momentum.
- averaging: ranks step on their own replicas; every `frequency` steps parameters, buffers and (by default)
  optimizer state are averaged (averaging.py). Between averagings the replicas differ: a checkpoint then holds
  their average as the model and each rank's own replica besides, and training carries on from the replicas.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.nn.parallel import DistributedDataParallel

from tandem.api import ParallelTrainingJobSpec
from tandem.api.training import Optimizer
from tandem.worker.train.averaging import average_replicas
from tandem.worker.train.compression import ThresholdCompression, threshold_hook
from tandem.worker.train.nonfinite import StepRecord
from tandem.worker.train.state import to_host


def parameter_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


class AllReduceMode:
    """allReduce: DDP averages the gradients of every step; replicas are identical after each step."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.model = model
        device_ids = [device.index] if device.type == "cuda" else None
        self.module = DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)
        self.bytes_per_step = parameter_bytes(model)
        self.steps = 0

    def no_sync(self, last_micro_batch: bool) -> AbstractContextManager:
        """Micro-batches before a step's last accumulate locally; the last one's backward exchanges."""
        return nullcontext() if last_micro_batch else self.module.no_sync()

    def exchange(self) -> None:
        """After a step's backward passes: exchange what the backward passes did not (DDP exchanged already)."""

    def after_step(self, step: int, optimizer: torch.optim.Optimizer, step_loss: torch.Tensor,
                   record: StepRecord) -> bool:
        """Whatever follows an optimizer step; True when every replica now holds the same parameters."""
        self.steps += 1
        return True

    def communication(self) -> tuple[int, int]:
        """(bytes this rank sent, bytes a dense fp32 all-reduce of the same gradients sends)."""
        dense = self.steps * self.bytes_per_step
        return dense, dense

    def compression_report(self) -> dict[str, float | int] | None:
        """What status.communication shows while training, besides the byte totals (the same on every rank)."""
        return None

    def for_checkpoint(self, step: int, optimizer: torch.optim.Optimizer, *, final: bool) -> AbstractContextManager:
        """Around writing a checkpoint: yields this rank's own replica state when replicas differ (else None)."""
        return nullcontext()

    def state_dict(self) -> dict[str, Any]:
        """This rank's own state for checkpoints."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def reset_for_world_size(self, saved: list[dict[str, Any]], rank: int) -> list[str]:
        """Resuming at another world size from `saved`, the old ranks' own states: set this rank's state from
        them where they can be mapped; returns what was reset, for the log line."""
        return []


class ThresholdCompressed:
    """What sharedGradients adds to a mode, however its gradients travel: the threshold-encoding state
    (`self.compression`), its optimizer (without momentum under momentum correction), its byte counts, report and
    checkpointed state."""

    compression: ThresholdCompression

    def communication(self) -> tuple[int, int]:
        return self.compression.bytes_sent, self.compression.dense_bytes

    def compression_report(self) -> dict[str, float | int] | None:
        return self.compression.report()

    def state_dict(self) -> dict[str, Any]:
        return {"compression": self.compression.state_dict(), "exchange": self.exchange_kind}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "compression" not in state:
            return
        saved = state["compression"]
        if state.get("exchange", "ddp") != self.exchange_kind:
            # The residuals and velocities are keyed by the other exchange's bucket order: reset, as at another
            # world size; the rest (the threshold, this rank's byte counts) carries on.
            saved = {**saved, "residuals": {}, "velocities": {}}
        self.compression.load_state_dict(saved)

    def shared_state(self) -> dict[str, Any]:
        """What every rank holds the same (the threshold, its calibration, the step, the shared counters): what an
        elastic job's source hands the members behind it, so that all encode against the same threshold."""
        return {key: value for key, value in self.compression.state_dict().items() if key not in RANK_OWN}

    def take_shared_state(self, shared: dict[str, Any]) -> None:
        """The source's shared state, this rank's own residuals, velocities and byte counts kept (a joiner's: none
        yet). A lost or leaving rank's residuals, its gradient mass not yet sent, go with it."""
        self.compression.load_state_dict({**self.compression.state_dict(), **shared})

    def reset_for_world_size(self, saved: list[dict[str, Any]], rank: int) -> list[str]:
        """The residuals and velocities are reset: each was one old rank's own, and the old ranks are not this
        run's. The threshold (the same on every rank) is kept: it follows the size of one rank's accumulated
        gradient, the mean over that rank's own batch, which the number of ranks does not change; reset to
        initialThreshold it would send nearly dense bitmaps for dozens of steps while it climbs back. The byte
        counters' sums carry on, held by rank 0, so the job's communication totals stay whole; the counts of
        entries and bitmap steps (the same on every rank) carry on as they were."""
        states = [state["compression"] for state in saved if "compression" in state]
        if not states:
            return []
        first = states[0]
        self.compression.load_state_dict({
            **{key: value for key, value in first.items() if key not in ("residuals", "velocities")},
            "bytes_sent": sum(int(s["bytes_sent"]) for s in states) if rank == 0 else 0,
            "dense_bytes": sum(int(s["dense_bytes"]) for s in states) if rank == 0 else 0,
            "residuals": {},
            "velocities": {},
        })
        reset = "residuals and velocities" if self.compression.settings.momentum_correction else "residuals"
        return [f"sharedGradients {reset} (the threshold, {float(first['threshold']):.3g}, is kept)"]


RANK_OWN = ("residuals", "velocities", "bytes_sent", "dense_bytes")
"""What of the compression state is each rank's own."""


class SharedGradientsMode(ThresholdCompressed, AllReduceMode):
    """sharedGradients: DDP with the threshold-encoding hook; residuals, velocities and threshold are each rank's
    own (the threshold is the same on every rank)."""

    exchange_kind = "ddp"

    def __init__(self, model: torch.nn.Module, device: torch.device, spec: ParallelTrainingJobSpec):
        super().__init__(model, device)
        self.compression = ThresholdCompression(**compression_settings(spec))
        self.module.register_comm_hook(self.compression, threshold_hook)


class ExchangedAllReduceMode(AllReduceMode):
    """allReduce in an elastic job: the gradients are all-reduced after the step's backward passes, a bucket at a
    time in asynchronous collectives waited on with an eye on the members' heartbeats (`wait`:
    membership.Membership.wait). DDP waits inside backward, where a stopped peer would hold the step until the
    group's timeout; and DDP needs every rank to run a forward pass, where an elastic step may give a rank no
    examples (it sends zeros)."""

    def __init__(self, model: torch.nn.Module, world_size: int, wait: Callable[[dist.Work], None]):
        self.model = self.module = model
        self.world_size = world_size
        self.wait = wait
        self.bytes_per_step = parameter_bytes(model)
        self.steps = 0

    def no_sync(self, last_micro_batch: bool) -> AbstractContextManager:
        return nullcontext()

    def gradients(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """Each trained parameter with its gradient (zeros where this rank's backward gave it none)."""
        found = []
        for parameter in self.model.parameters():
            if parameter.requires_grad:
                if parameter.grad is None:
                    parameter.grad = torch.zeros_like(parameter)
                found.append((parameter, parameter.grad))
        return found

    def exchange(self) -> None:
        exchanges = []
        for bucket in gradient_buckets(self.gradients()):
            flat = _flatten_dense_tensors(bucket.tensors)
            exchanges.append((bucket, flat, dist.all_reduce(flat, async_op=True)))
        for bucket, flat, work in exchanges:
            self.wait(work)
            flat /= self.world_size
            bucket.take(flat)


class ExchangedSharedGradientsMode(ThresholdCompressed, ExchangedAllReduceMode):
    """sharedGradients in an elastic job: the threshold-encoding hook run on each bucket of gradients after the
    step's backward passes, its collectives waited on as ExchangedAllReduceMode's are. `compression`: the state a
    survivor carries from one generation of the group to the next (its residuals are its own untransmitted
    gradient mass, kept at any size); None: a fresh state (a joiner takes the source's threshold and counters,
    `elastic.share_state`, with residuals of its own from zero)."""

    exchange_kind = "elastic"

    def __init__(self, model: torch.nn.Module, world_size: int, wait: Callable[[dist.Work], None],
                 spec: ParallelTrainingJobSpec, compression: ThresholdCompression | None = None):
        super().__init__(model, world_size, wait)
        self.compression = compression or ThresholdCompression(**compression_settings(spec))
        self.compression.wait = wait

    def exchange(self) -> None:
        buckets = gradient_buckets(self.gradients())
        for index, bucket in enumerate(buckets):
            flat = _flatten_dense_tensors(bucket.tensors)
            decoded = threshold_hook(self.compression, bucket.as_hook_bucket(flat, last=index == len(buckets) - 1))
            self.wait(decoded)
            bucket.take(decoded.value())


BUCKET_BYTES = 25 * 2**20
"""DDP's bucket_cap_mb: collectives of this size overlap one another's transfers and reductions."""


@dataclass
class GradientBucket:
    """Gradients exchanged together, and their parameters."""

    parameters: list[torch.nn.Parameter] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)

    def take(self, flat: torch.Tensor) -> None:
        """Set the gradients from `flat`, the exchanged bucket (flattened as `_flatten_dense_tensors` lays it)."""
        for gradient, value in zip(self.tensors, _unflatten_dense_tensors(flat, self.tensors), strict=True):
            gradient.copy_(value)

    def as_hook_bucket(self, flat: torch.Tensor, *, last: bool) -> HookBucket:
        return HookBucket(flat, self.parameters, last)


@dataclass
class HookBucket:
    """What threshold_hook reads of DDP's dist.GradBucket: the flat gradients, their parameters, whether it is the
    step's last bucket."""

    flat: torch.Tensor
    bucket_parameters: list[torch.nn.Parameter]
    last: bool

    def buffer(self) -> torch.Tensor:
        return self.flat

    def parameters(self) -> list[torch.nn.Parameter]:
        return self.bucket_parameters

    def is_last(self) -> bool:
        return self.last


def gradient_buckets(gradients: list[tuple[torch.nn.Parameter, torch.Tensor]]) -> list[GradientBucket]:
    """(parameter, gradient) pairs in consecutive buckets of one dtype and device, each of at most BUCKET_BYTES (or
    one gradient)."""
    buckets: list[GradientBucket] = []
    size = 0
    for parameter, tensor in gradients:
        nbytes = tensor.numel() * tensor.element_size()
        last = buckets[-1] if buckets else None
        if (last is None or size + nbytes > BUCKET_BYTES or last.tensors[0].dtype != tensor.dtype
                or last.tensors[0].device != tensor.device):
            buckets.append(GradientBucket())
            size = 0
        buckets[-1].parameters.append(parameter)
        buckets[-1].tensors.append(tensor)
        size += nbytes
    return buckets


def optimizer_settings(spec: ParallelTrainingJobSpec) -> Optimizer:
    """The optimizer every rank runs: the spec's; under sharedGradients' momentum correction, without momentum
    (`without_momentum`). Known before any group forms (an elastic job's replacement builds it before it joins)."""
    if spec.training_mode == "sharedGradients" and compression_settings(spec)["momentum_correction"]:
        return without_momentum(spec.trainer.optimizer)
    return spec.trainer.optimizer


def without_momentum(optimizer: Optimizer) -> Optimizer:
    """The optimizer under momentum correction, where the exchanged updates carry the momentum: without its own,
    and with its weight decay (applied on every rank to the parameters they share, so never exchanged) divided by
    1 - momentum, the factor by which momentum would have scaled it in the steady state."""
    return optimizer.model_copy(update={"momentum": 0.0,
                                        "weight_decay": optimizer.weight_decay / (1 - optimizer.momentum)})


def compression_settings(spec: ParallelTrainingJobSpec) -> dict[str, Any]:
    """spec.sharedGradients as the hook's settings (compression.Settings)."""
    shared, optimizer = spec.shared_gradients, spec.trainer.optimizer
    correction = shared.momentum_correction
    return {
        "initial_threshold": shared.initial_threshold,
        "calibration": shared.calibration,
        "min_sparsity": shared.target_sparsity.min,
        "max_sparsity": shared.target_sparsity.max,
        "threshold_decay": shared.threshold_decay,
        "residual_clip_factor": shared.residual_clip.factor,
        "residual_clip_every": shared.residual_clip.every,
        # Adam and AdamW keep per-entry moments of their own: their gradients are exchanged as they are.
        "momentum_correction": correction.enabled and optimizer.name == "sgd",
        "optimizer_momentum": optimizer.momentum if optimizer.name == "sgd" else 0.0,
        "momentum": correction.momentum,
        "momentum_masking": correction.masking,
        "local_gradient_clip": shared.local_gradient_clip,
        "warmup_steps": shared.warmup.steps,
        "warmup_sparsity": shared.warmup.initial_sparsity,
    }


class AveragingMode:
    """averaging: every rank steps on its own replica; every `frequency` steps the replicas are averaged."""

    def __init__(self, model: torch.nn.Module, spec: ParallelTrainingJobSpec, world_size: int, *,
                 wait: Callable[[dist.Work], None] = dist.Work.wait, same_start: bool = True):
        """`same_start`: every replica starts from rank 0's weights (an elastic job's later generations keep their
        own: a joiner has taken its source's). `wait`: how a collective is waited for."""
        if same_start:
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor.data, src=0)
        self.model = self.module = model
        self.settings = spec.averaging
        self.world_size = world_size
        self.wait = wait
        self.bytes_per_step = parameter_bytes(model)
        self.steps = 0
        self.bytes_sent = 0

    def no_sync(self, last_micro_batch: bool) -> AbstractContextManager:
        return nullcontext()

    def exchange(self) -> None:
        """Nothing: the replicas step on their own gradients."""

    def after_step(self, step: int, optimizer: torch.optim.Optimizer, step_loss: torch.Tensor,
                   record: StepRecord) -> bool:
        self.steps += 1
        if step % self.settings.frequency != 0:
            return False
        self.average(optimizer)
        if self.settings.report_score_after_averaging:
            record.flush()
            mean_loss = self._mean_over_ranks(step_loss)
            if math.isfinite(mean_loss):  # a skipped step's loss stays out, as in the record
                record.running_loss = mean_loss
        return True

    def average(self, optimizer: torch.optim.Optimizer) -> None:
        state = optimizer if self.settings.average_optimizer_state else None
        self.bytes_sent += average_replicas(self.model, state, self.world_size, wait=self.wait)

    def communication(self) -> tuple[int, int]:
        return self.bytes_sent, self.steps * self.bytes_per_step

    def compression_report(self) -> dict[str, float | int] | None:
        return None

    def replicas_differ(self, step: int) -> bool:
        """Between averagings the replicas differ; their optimizer states always do when not averaged."""
        return step % self.settings.frequency != 0 or not self.settings.average_optimizer_state

    @contextmanager
    def for_checkpoint(self, step: int, optimizer: torch.optim.Optimizer, *, final: bool) -> Iterator[Any]:
        """The checkpoint's model is the replicas' average; each rank's own replica goes into its part of the
        checkpoint, and training carries on from it (a checkpoint never changes what training does next). At the
        end the average stays: it is the trained model."""
        if not self.replicas_differ(step):
            yield None
            return
        replica = to_host({"model": self.model.state_dict(), "optimizer": optimizer.state_dict()}, copy=True)
        self.average(optimizer)
        try:
            yield replica
        finally:
            if not final:
                self.model.load_state_dict(replica["model"])
                optimizer.load_state_dict(replica["optimizer"])

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def reset_for_world_size(self, saved: list[dict[str, Any]], rank: int) -> list[str]:
        return []  # the replicas are the train state's (TrainState.reset_rank_state)

    def _mean_over_ranks(self, value: torch.Tensor) -> float:
        total = value.detach().reshape(1).to("cpu", torch.float64)
        self.wait(dist.all_reduce(total, async_op=True))
        return total.item() / self.world_size


TrainingMode = AllReduceMode | SharedGradientsMode | AveragingMode


def training_mode(spec: ParallelTrainingJobSpec, model: torch.nn.Module, device: torch.device,
                  world_size: int) -> TrainingMode:
    if spec.training_mode == "averaging":
        return AveragingMode(model, spec, world_size)
    if spec.training_mode == "sharedGradients":
        return SharedGradientsMode(model, device, spec)
    return AllReduceMode(model, device)
