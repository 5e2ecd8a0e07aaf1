"""ParallelTrainingJob: DL4J's ParallelWrapper as a Kubernetes resource."""

from __future__ import annotations

import math
import re
from datetime import datetime
from typing import Annotated, Any, Literal, get_args

from pydantic import AfterValidator, Field, StringConstraints, field_serializer, field_validator, model_validator

from tandem.api.common import (
    API_VERSION,
    CALLABLE_REF,
    ApiModel,
    CallableRef,
    Condition,
    ObjectMeta,
    PodSettings,
    Quantity,
    SubdomainName,
    valid_quantity,
)
from tandem.columns import eta_text, file_name, four_figures, rate_text

TrainingMode = Literal["allReduce", "sharedGradients", "averaging", "custom"]
TrainingPhase = Literal["Queued", "Pending", "Running", "Restarting", "Succeeded", "Failed", "Suspended"]
TRAINING_PHASES: tuple[str, ...] = get_args(TrainingPhase)
DataRef = Annotated[str, StringConstraints(min_length=1)]

# DL4J's AdaptiveThresholdAlgorithm: decay 0.5 per 20 steps, sparsity target 1e-4..1e-2.
DL4J_THRESHOLD_DECAY = 0.965936
GPU_PREFETCH_BUFFER = 4
"""prefetchBuffer when unset and training on a GPU (torch's DataLoader keeps 2 batches per loader process)."""


class Optimizer(ApiModel):
    """The optimizer every rank runs (torch.optim)."""

    name: Literal["sgd", "adam", "adamw"] = "sgd"
    lr: Annotated[float, Field(gt=0)] = 0.05
    """Peak learning rate (reached after lrWarmupSteps)."""
    weight_decay: Annotated[float, Field(ge=0)] = 0.0
    momentum: Annotated[float, Field(ge=0, lt=1)] = 0.9
    """SGD momentum; ignored by adam/adamw."""


class TrainerSpec(ApiModel):
    """What to train and how: the user's code, the loop's knobs."""

    model: CallableRef
    """`module:callable` returning a torch.nn.Module, e.g. `tandem.examples.digits:mlp`."""
    model_args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the model callable."""
    data: DataRef
    """Training data: a `module:callable` returning a torch Dataset, or a `.npz` file with arrays x and y."""
    eval_data: DataRef | None = None
    """Evaluation data, same forms as `data`; reported as metrics.accuracy (0..1) for classifiers."""
    data_args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the data callables."""
    epochs: Annotated[int, Field(ge=1)] = 1
    max_steps: Annotated[int, Field(ge=1)] | None = None
    """Stop after this many optimizer steps, even if epochs remain."""
    batch_size_per_worker: Annotated[int, Field(ge=1)] = 32
    """Examples per rank per micro-batch; the global batch is workers x this x gradientAccumulationSteps."""
    optimizer: Optimizer = Field(default_factory=Optimizer)
    lr_warmup_steps: Annotated[int, Field(ge=0)] = 0
    """Linear warm-up from 0 to optimizer.lr over this many optimizer steps."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """After warm-up: constant, or cosine decay to 0 at the last step."""
    gradient_clip_norm: Annotated[float, Field(gt=0)] | None = None
    """Clip the global gradient norm to this value (torch.nn.utils.clip_grad_norm_)."""
    gradient_accumulation_steps: Annotated[int, Field(ge=1)] = 1
    mixed_precision: Literal["none", "bf16", "fp16"] = "none"
    """bf16 autocast, or fp16 autocast with a gradient scaler."""
    seed: Annotated[int, Field(ge=0)] = 0
    deterministic: bool = False
    """torch.use_deterministic_algorithms(True), MKL's strict reproducibility on CPUs (MKL_CBWR=AUTO,STRICT unless
    set) and no data-loader nondeterminism."""
    require_gpu: bool = Field(False, alias="requireGPU")
    """Fail before training when CUDA is unavailable, instead of falling back to CPU."""
    prefetch_buffer: Annotated[int, Field(ge=0)] | None = None
    """Batches each rank loads ahead on a background thread (DL4J prefetchBuffer). Unset: 4 when training on
    a GPU, 0 on CPU, where a loader thread takes cores from the training itself. 0 loads on the training
    thread."""
    max_consecutive_bad_steps: Annotated[int, Field(ge=1)] = 10
    """Steps with a NaN/Inf loss or gradient are skipped and counted; this many in a row fails the job."""

    def prefetch_for(self, device_type: str) -> int:
        """The prefetch depth in effect on this device type."""
        if self.prefetch_buffer is not None:
            return self.prefetch_buffer
        return GPU_PREFETCH_BUFFER if device_type == "cuda" else 0

    @field_validator("data", "eval_data")
    @classmethod
    def _data_ref(cls, value: str | None) -> str | None:
        if value is None or value.endswith(".npz") or re.match(CALLABLE_REF, value):
            return value
        raise ValueError(
            f"{value!r} is neither a `module:callable` reference nor a path to a .npz file with arrays x and y"
        )


class Averaging(ApiModel):
    """trainingMode averaging: independent steps, parameters averaged every `frequency` steps."""

    frequency: Annotated[int, Field(ge=1)] = 1
    """Average every this many optimizer steps (DL4J averagingFrequency)."""
    average_optimizer_state: bool = True
    """Also average optimizer state such as momentum buffers (DL4J averageUpdaters)."""
    report_score_after_averaging: bool = True
    """Report the mean loss across ranks after each averaging (DL4J reportScoreAfterAveraging)."""


class TargetSparsity(ApiModel):
    """The band, as a fraction of gradient entries sent per step (over all ranks), that the adaptive threshold aims
    for: above `max` it rises, below `min` it falls (DL4J's band is 1e-4..1e-2)."""

    model_config = {"json_schema_extra": {"x-kubernetes-validations": [
        {"rule": "self.min <= self.max", "message": "targetSparsity.min must not exceed targetSparsity.max"},
    ]}}

    min: Annotated[float, Field(gt=0, le=1)] = 1e-5
    """Below this the threshold falls by thresholdDecay a step. Low on purpose: as training converges the
    gradients shrink and fewer entries pass; a threshold that followed them down would spend bytes on noise."""
    max: Annotated[float, Field(gt=0, le=1)] = 5e-3

    @model_validator(mode="after")
    def _ordered(self) -> TargetSparsity:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must not exceed max ({self.max})")
        return self


class ResidualClip(ApiModel):
    """Clip each rank's residual to factor x threshold every `every` steps (DL4J ResidualClippingPostProcessor)."""

    factor: Annotated[float, Field(gt=0)] = 5.0
    every: Annotated[int, Field(ge=1)] = 5


class MomentumCorrection(ApiModel):
    """Deep Gradient Compression's momentum correction: each rank accumulates its own velocity, not the raw
    gradient, and the optimizer runs without momentum (the exchanged updates carry it). For optimizer sgd; adam
    and adamw keep their own moments and exchange raw gradients."""

    enabled: bool = True
    momentum: Annotated[float, Field(ge=0, lt=1)] | None = 0.7
    """The velocity's own momentum. Its input is scaled by (1 - momentum) / (1 - optimizer.momentum), so a steady
    gradient moves the weights as far per step as the optimizer's momentum would. Lower than the optimizer's
    because the residual already accumulates: a long velocity on top of it pushes entries long after they were
    sent. null: the optimizer's momentum (DGC exactly)."""
    masking: bool = False
    """Momentum factor masking (DGC): zero the velocity of every entry a rank sent."""


class SparsityWarmup(ApiModel):
    """Start with a wider target band and narrow it geometrically to targetSparsity over `steps` steps (DGC's
    exponential warm-up): the first steps, where a model moves most, send more entries."""

    steps: Annotated[int, Field(ge=0)] = 0
    """0: no warm-up (the default: with per-parameter calibration a warm-up bought no accuracy for its bytes,
    bench/RESULTS.md)."""
    initial_sparsity: Annotated[float, Field(gt=0, le=1)] = 1 / 16
    """The band's top at the first step (1/16: as many entries as fit before the bucket goes as a bitmap)."""


class SharedGradients(ApiModel):
    """trainingMode sharedGradients: Strom-style threshold encoding with error feedback (DL4J SHARED_GRADIENTS),
    with Deep Gradient Compression's corrections. DL4J's algorithm: momentumCorrection.enabled false,
    calibration off, warmup.steps 0, targetSparsity 1e-4..1e-2."""

    initial_threshold: Annotated[float, Field(gt=0)] = 1e-3
    """The first step's threshold with calibration off (DL4J AdaptiveThresholdAlgorithm's)."""
    calibration: Literal["perParameter", "shared", "off"] = "perParameter"
    """How the first step sets the threshold from the gradients themselves (one float per rank and parameter,
    exchanged once). shared: one threshold, the mean over ranks of the value that the top targetSparsity.max
    (warm-up's top during a warm-up) of each rank's entries reach. perParameter: that threshold, and each
    parameter's own ratio to it, fixed from then on (as DGC selects per layer: a global threshold starves the
    parameters whose gradients are small but matter, such as batch norm's); the threshold then adapts for all.
    off: the threshold climbs from initialThreshold, sending near-dense bitmaps meanwhile (DL4J)."""
    target_sparsity: TargetSparsity = Field(default_factory=TargetSparsity)
    threshold_decay: Annotated[float, Field(gt=0, lt=1)] = DL4J_THRESHOLD_DECAY
    """Multiplicative threshold step when the encoded fraction leaves the target band."""
    residual_clip: ResidualClip = Field(default_factory=ResidualClip)
    momentum_correction: MomentumCorrection = Field(default_factory=MomentumCorrection)
    local_gradient_clip: Annotated[float, Field(gt=0)] | None = None
    """DGC's local gradient clipping: each rank scales each parameter's gradient down to this L2 norm before
    accumulating it. null: off."""
    warmup: SparsityWarmup = Field(default_factory=SparsityWarmup)


class Custom(ApiModel):
    """trainingMode custom: run your own command in every rank with the worker contract env (DL4J CUSTOM)."""

    command: Annotated[list[str], Field(min_length=1)]
    args: list[str] = Field(default_factory=list)


class CheckpointSpec(ApiModel):
    """Where and how often rank 0 writes checkpoints."""

    directory: Annotated[str, StringConstraints(min_length=1)] = "checkpoints"
    """Checkpoint directory; a relative path resolves under the working directory locally and under the
    checkpoint volume's mount in pods. It holds one run's checkpoints (named in its `tandem-run.json`) and has one
    writer at a time (`tandem-lease.json`: a second run of it is refused, naming the holder)."""
    persistent_volume_claim: str | None = None
    """A PersistentVolumeClaim the operator mounts for checkpoints (shared by all restarts)."""
    every_steps: Annotated[int, Field(ge=1)] | None = None
    every_minutes: Annotated[float, Field(gt=0)] | None = None
    keep_last: Annotated[int, Field(ge=1)] = 3
    """The run's newest checkpoints kept: its older ones are deleted as it writes new ones (another run's, never)."""
    resume: bool = True
    """Resume from the latest complete checkpoint in `directory` when one exists: the run that wrote it carries on.
    false: a new run, refused in a directory holding another run's checkpoints (unless `overwrite`)."""
    overwrite: bool = False
    """With `resume: false`, move another run's checkpoints found in `directory` (and its run record) into a
    subdirectory named after that run, `run-<id>`, before starting; nothing is deleted. Without it such a start is
    refused."""


class Gang(ApiModel):
    """Gang scheduling without Kueue: the operator creates a PodGroup of the job's rank pods with `minMember` = the
    number of pods, so that the scheduler places all of them or none (no GPUs held idle by a part of the group)."""

    scheduler: Literal["coscheduling", "volcano"]
    """`coscheduling`: scheduler-plugins' PodGroup (scheduling.x-k8s.io/v1alpha1), the pods labelled
    `scheduling.x-k8s.io/pod-group` and scheduled by `scheduler-plugins-scheduler`; `volcano`: Volcano's PodGroup
    (scheduling.volcano.sh/v1beta1), the pods annotated `scheduling.k8s.io/group-name` and scheduled by `volcano`.
    spec.schedulerName, when set, names the scheduler instead."""
    schedule_timeout_seconds: Annotated[int, Field(ge=1)] | None = None
    """coscheduling: how long the scheduler waits for the whole group before it gives the placed pods' resources
    back and tries again (scheduler-plugins' default: 60)."""
    queue: SubdomainName | None = None
    """volcano: the Volcano Queue the PodGroup goes to (Volcano's default: `default`)."""


class PoolSelector(ApiModel):
    """Which InferencePools of the job's namespace may borrow its workers."""

    match_labels: dict[str, str] = Field(default_factory=dict)
    """The labels a pool must carry, every one of them (a LabelSelector's matchLabels); empty: every pool of the
    namespace."""


class LendTo(ApiModel):
    """Lend workers to InferencePools whose replicas the cluster cannot place (one budget of GPUs for training and
    serving): a selected pool's replica Pending as Unschedulable for want of a resource the rank pods hold
    (nvidia.com/gpu, say) makes the job leave just enough ranks at a step boundary, in process (never below
    elastic.minWorkers); once the pool's demand has fallen for stabilizationWindowSeconds, the job takes them back
    (they join at a step boundary). status.lent tells what is lent and to whom; the pool's status.borrowed, from
    whom."""

    pool_selector: PoolSelector
    stabilization_window_seconds: Annotated[int, Field(ge=0)] = 300
    """How long a borrowing pool's demand must stay below its loan before the job takes the workers back (as a
    HorizontalPodAutoscaler's scale-down stabilization window keeps replicas): a pool's demand that dips and comes
    back within it keeps its loan, so the job and the pool never trade the same GPU back and forth."""
    placement_deadline_seconds: Annotated[int, Field(ge=1)] = 60
    """How long a borrowing pool may leave its new replicas unplaced once the lent ranks' pods are gone before the
    job takes its workers back: its pods cannot run where the ranks ran (nodeSelector, affinity, tolerations), and it
    is lent nothing more while they stay so (status.lent.unplaceable)."""


class Elastic(ApiModel):
    """Elastic training (issue 38): the job trains on while ranks are lost or lent, between minWorkers and maxWorkers
    ranks, instead of restarting the whole group."""

    model_config = {"json_schema_extra": {"x-kubernetes-validations": [
        {"rule": "!has(self.minWorkers) || !has(self.maxWorkers) || self.minWorkers <= self.maxWorkers",
         "message": "elastic.minWorkers must not exceed elastic.maxWorkers: lower minWorkers or raise maxWorkers"},
        {"rule": "!has(self.lendTo) || !has(self.recovery) || self.recovery == 'regroup'",
         "message": "elastic.lendTo needs elastic.recovery regroup (a lent worker leaves at a step boundary, the "
                    "others training on): set recovery regroup or remove lendTo"},
    ]}}

    min_workers: Annotated[int, Field(ge=1)] = 1
    """The fewest ranks the job trains on while ranks are lost or lent; below it the job falls back to a whole-group
    restart."""
    max_workers: Annotated[int, Field(ge=1)] | None = None
    """The most ranks `kubectl scale` may ask for. Unset: no bound but `workers` itself (`kubectl scale` sets it):
    the job trains on the ranks it is given."""
    recovery: Literal["regroup", "restart"] = "regroup"
    """How the job comes back from a lost rank. regroup: the loss costs the step in flight; the survivors keep their
    processes and go on at the smaller size, and a replacement joins at a step boundary, receiving the state from a
    live peer. Rank 0 too: the group's store and planner run in a coordinator of their own (the pod
    <job>-coordinator), whose loss restarts the group. restart: the whole group restarts from the latest checkpoint
    (as without elastic)."""
    batch: Literal["global", "perRank"] = "global"
    """global: the global batch (workers x batchSizePerWorker x gradientAccumulationSteps, at spec.workers) is the
    same at every size, the ranks alive sharing each step's examples, so that no hyperparameter depends on how many
    ranks are alive. perRank: each rank keeps batchSizePerWorker x gradientAccumulationSteps, the global batch
    follows the size, and the learning rate follows lrScaling."""
    lr_scaling: Literal["linear", "sqrt", "none"] = "linear"
    """With batch perRank, the learning rate at W ranks: optimizer.lr x W / workers (linear), x sqrt(W / workers)
    (sqrt), or optimizer.lr (none). Ignored with batch global."""
    regroup_deadline_seconds: Annotated[int, Field(ge=1)] = 60
    """A regroup not complete within this falls back to a whole-group restart from the latest checkpoint (and the
    status says so)."""
    lend_to: LendTo | None = None
    """InferencePools that may borrow the job's workers down to minWorkers while they cannot place their replicas
    (recovery regroup only). Not with Kueue: a job labelled kueue.x-k8s.io/queue-name lends nothing (its
    LendingRefused condition says why)."""

    @model_validator(mode="after")
    def _ordered(self) -> Elastic:
        if self.max_workers is not None and self.min_workers > self.max_workers:
            raise ValueError(f"elastic.minWorkers ({self.min_workers}) must not exceed elastic.maxWorkers "
                             f"({self.max_workers}): lower minWorkers or raise maxWorkers")
        if self.lend_to is not None and self.recovery != "regroup":
            raise ValueError("elastic.lendTo needs elastic.recovery regroup (a lent worker leaves at a step boundary, "
                             "the others training on): set recovery regroup or remove lendTo")
        return self


class ParallelTrainingJobSpec(PodSettings):
    """Desired state of a ParallelTrainingJob."""

    model_config = {"json_schema_extra": {"x-kubernetes-validations": [
        {"rule": "self.trainingMode != 'custom' || has(self.custom)",
         "message": "trainingMode custom needs custom.command (the command every rank runs)"},
        {"rule": "self.trainingMode != 'sharedGradients' || self.trainer.mixedPrecision != 'fp16'",
         "message": "sharedGradients encodes gradients against a threshold, which fp16's changing loss scale "
                    "would move; use mixedPrecision bf16 or none"},
        {"rule": "!has(self.trainer.requireGPU) || !self.trainer.requireGPU || self.gpusPerWorker >= 1",
         "message": "trainer.requireGPU needs gpusPerWorker >= 1: a rank given no GPU trains on CPU"},
        {"rule": "!has(self.gang) || !has(self.gang.queue) || self.gang.scheduler == 'volcano'",
         "message": "gang.queue is a Volcano queue: set gang.scheduler to volcano, or use Kueue's "
                    "kueue.x-k8s.io/queue-name label for a Kueue queue"},
        {"rule": "!has(self.gang) || !has(self.gang.scheduleTimeoutSeconds) || self.gang.scheduler == 'coscheduling'",
         "message": "gang.scheduleTimeoutSeconds is scheduler-plugins' coscheduling timeout: set gang.scheduler to "
                    "coscheduling, or remove it"},
        {"rule": "!has(self.ranksPerPod) || self.workers % self.ranksPerPod == 0",
         "message": "workers must be a multiple of ranksPerPod (every pod hosts ranksPerPod ranks): change workers "
                    "(or the replicas of kubectl scale, which counts ranks) or ranksPerPod"},
        {"rule": "!has(self.elastic) || !has(self.elastic.minWorkers) || self.elastic.minWorkers <= self.workers",
         "message": "workers must be at least elastic.minWorkers: kubectl scale may ask for any size in "
                    "[minWorkers, maxWorkers]; raise workers (or the replicas of kubectl scale) or lower "
                    "elastic.minWorkers"},
        {"rule": "!has(self.elastic) || !has(self.elastic.maxWorkers) || self.workers <= self.elastic.maxWorkers",
         "message": "workers must not exceed elastic.maxWorkers: kubectl scale may ask for any size in "
                    "[minWorkers, maxWorkers]; lower workers (or the replicas of kubectl scale) or raise "
                    "elastic.maxWorkers"},
        {"rule": "!has(self.elastic) || !has(self.trainingMode) || self.trainingMode != 'custom'",
         "message": "elastic needs Tandem's trainer, which regroups the ranks; a trainingMode custom command "
                    "cannot: remove elastic or choose another trainingMode"},
        {"rule": "!has(self.elastic) || !has(self.ranksPerPod) || self.ranksPerPod == 1",
         "message": "elastic needs ranksPerPod 1 for now (every rank its own pod, so that a lost rank is replaced "
                    "alone): remove elastic or set ranksPerPod 1"},
    ]}}

    workers: Annotated[int, Field(ge=1)] = 1
    """Number of ranks (DL4J workers; `kubectl scale` counts them too), ranksPerPod to a pod."""
    ranks_per_pod: Annotated[int, Field(ge=1)] = 1
    """Ranks in each pod (Kubeflow's nprocPerNode, torchrun's --nproc-per-node): a node's GPUs in one pod, where
    NCCL joins them by NVLink or shared memory instead of the network. `workers` must be a multiple of it: the job
    has workers / ranksPerPod pods, each started by a launcher that runs its ranks (LOCAL_RANK 0..ranksPerPod-1,
    each on cuda:LOCAL_RANK with all the pod's GPUs visible) and fails the pod when one of them fails. `resources`
    are each pod's, shared by its ranks (they split its CPU cores). Locally (`tandem run`) every rank is on the one
    machine anyway: it changes nothing there."""
    gpus_per_worker: Annotated[int, Field(ge=0)] = 0
    """GPUs given to each rank (its pod's nvidia.com/gpu limit is ranksPerPod x this); a rank trains on one of them
    with NCCL. 0: the ranks train on CPU with gloo, even where CUDA is visible."""
    shm_size: Annotated[Quantity, AfterValidator(valid_quantity)] = "1Gi"
    """The size of each rank pod's /dev/shm (a memory-backed emptyDir, counted in the pod's memory): NCCL's
    shared-memory transport between a pod's ranks and the data loaders' worker processes need more than a
    container's default 64 MiB."""
    trainer: TrainerSpec
    training_mode: TrainingMode = "allReduce"
    averaging: Averaging = Field(default_factory=Averaging)
    shared_gradients: SharedGradients = Field(default_factory=SharedGradients)
    custom: Custom | None = None
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    backoff_limit: Annotated[int, Field(ge=0)] = 3
    """Restarts (of the whole group, from the latest checkpoint) before the job fails."""
    active_deadline_seconds: Annotated[int, Field(ge=1)] | None = None
    ttl_seconds_after_finished: Annotated[int, Field(ge=0)] | None = None
    suspend: bool = False
    heartbeat_timeout_seconds: Annotated[int, Field(ge=1)] = 300
    """Rank 0 must report progress this often, or the job is restarted as hung."""
    gang: Gang | None = None
    """Schedule the rank pods as one gang through a PodGroup (scheduler-plugins' coscheduling or Volcano). Not
    needed under Kueue (label the job `kueue.x-k8s.io/queue-name`), which admits the job's pods together."""
    elastic: Elastic | None = None
    """Train on while ranks are lost or lent, and let `kubectl scale` resize the job in [minWorkers, maxWorkers],
    rather than restart the whole group. Unset: every lost rank restarts the whole group from the latest
    checkpoint."""

    @model_validator(mode="after")
    def _mode_settings(self) -> ParallelTrainingJobSpec:
        if self.training_mode == "custom" and self.custom is None:
            raise ValueError("trainingMode custom needs `custom.command` (the command every rank runs)")
        if self.training_mode == "sharedGradients" and self.trainer.mixed_precision == "fp16":
            raise ValueError(
                "trainingMode sharedGradients encodes gradients against a threshold, which fp16's changing loss "
                "scale would move; use trainer.mixedPrecision bf16 or none"
            )
        if self.trainer.require_gpu and self.gpus_per_worker == 0:
            raise ValueError("trainer.requireGPU needs gpusPerWorker >= 1: a rank given no GPU trains on CPU")
        if self.gang is not None and self.gang.queue is not None and self.gang.scheduler != "volcano":
            raise ValueError("gang.queue is a Volcano queue: set gang.scheduler to volcano, or use Kueue's "
                             "kueue.x-k8s.io/queue-name label for a Kueue queue")
        if (self.gang is not None and self.gang.schedule_timeout_seconds is not None
                and self.gang.scheduler != "coscheduling"):
            raise ValueError("gang.scheduleTimeoutSeconds is scheduler-plugins' coscheduling timeout: set "
                             "gang.scheduler to coscheduling, or remove it")
        if self.workers % self.ranks_per_pod:
            raise ValueError(
                f"workers ({self.workers}) must be a multiple of ranksPerPod ({self.ranks_per_pod}): every pod hosts "
                f"ranksPerPod ranks; change workers (or the replicas of kubectl scale, which counts ranks) or "
                f"ranksPerPod")
        if self.elastic is not None:
            self._elastic_settings(self.elastic)
        return self

    def _elastic_settings(self, elastic: Elastic) -> None:
        if elastic.min_workers > self.workers:
            raise ValueError(
                f"workers ({self.workers}) must be at least elastic.minWorkers ({elastic.min_workers}): kubectl scale "
                f"may ask for any size in [minWorkers, maxWorkers]; raise workers (or the replicas of kubectl scale) "
                f"or lower elastic.minWorkers")
        if elastic.max_workers is not None and self.workers > elastic.max_workers:
            raise ValueError(
                f"workers ({self.workers}) must not exceed elastic.maxWorkers ({elastic.max_workers}): kubectl scale "
                f"may ask for any size in [minWorkers, maxWorkers]; lower workers (or the replicas of kubectl scale) "
                f"or raise elastic.maxWorkers")
        if self.training_mode == "custom":
            raise ValueError("elastic needs Tandem's trainer, which regroups the ranks; a trainingMode custom command "
                             "cannot: remove elastic or choose another trainingMode")
        if self.ranks_per_pod != 1:
            raise ValueError(f"elastic needs ranksPerPod 1 for now, not {self.ranks_per_pod} (every rank its own pod, "
                             f"so that a lost rank is replaced alone): remove elastic or set ranksPerPod 1")

    @property
    def regroups(self) -> bool:
        """Whether a lost rank is recovered in process (spec.elastic with recovery regroup)."""
        return self.elastic is not None and self.elastic.recovery == "regroup"

    @property
    def pods(self) -> int:
        """How many rank pods the job has."""
        return self.workers // self.ranks_per_pod



class WorkersStatus(ApiModel):
    """Ranks, and the pods that host them (ranksPerPod to a pod)."""

    ready: Annotated[int, Field(ge=0)] = 0
    """Ranks in pods running and ready."""
    total: Annotated[int, Field(ge=0)] = 0
    """Ranks: spec.workers."""
    summary: str = ""
    """`ready/total` ranks, for kubectl's column."""
    ready_pods: Annotated[int, Field(ge=0)] = 0
    pods: Annotated[int, Field(ge=0)] = 0
    """Rank pods: workers / ranksPerPod."""

    @model_validator(mode="after")
    def _summary(self) -> WorkersStatus:
        self.summary = f"{self.ready}/{self.total}"
        return self


class MasterStatus(ApiModel):
    pod: str | None = None
    address: str | None = None
    port: Annotated[int, Field(ge=1, le=65535)] | None = None


class ProgressStatus(ApiModel):
    epoch: Annotated[int, Field(ge=0)] = 0
    step: Annotated[int, Field(ge=0)] = 0
    total_steps: Annotated[int, Field(ge=0)] = 0
    loss: float | None = None
    """The running loss over this group's steps, at full precision; on the wire only while finite (JSON has no NaN:
    `lossText` says `NaN` or `Inf`)."""
    loss_text: str | None = None
    """`loss` to four significant figures (`0.06094`, `2.000`, `1.234e-05`), or `NaN`, `Inf`, `-Inf`: kubectl's
    LOSS column."""
    samples_per_second: float | None = None
    """Examples per second over all ranks since this group started (DL4J's PerformanceListener's samples/sec)."""
    samples_per_second_text: str | None = None
    """`samplesPerSecond` rounded (`1523`, `45.2`, `0.452`): kubectl's SAMPLES/S column."""
    eta_seconds: float | None = None
    """Time left at the measured rate (the remaining steps over the steps per second so far). Only while the job is
    Running: once it is not, the operator removes it (rank 0 may be gone), and `tandem run`'s status has none."""
    eta_text: str | None = None
    """`etaSeconds` as kubectl prints an age (`45s`, `2m5s`, `65m`, `3h5m`): kubectl's ETA column; removed with
    `etaSeconds`."""
    last_heartbeat: datetime | None = None
    summary: str = ""
    """`step/totalSteps`, for kubectl's column."""

    @model_validator(mode="after")
    def _summary(self) -> ProgressStatus:
        self.summary = f"{self.step}/{self.total_steps}"
        if self.loss is not None:  # else keep the text: a loss that was not finite is off the wire, its text is not
            self.loss_text = four_figures(self.loss)
        self.samples_per_second_text = rate_text(self.samples_per_second)
        self.eta_text = eta_text(self.eta_seconds)
        return self

    @field_serializer("loss", when_used="json")
    def _finite_loss(self, loss: float | None) -> float | None:
        return loss if loss is not None and math.isfinite(loss) else None


class CommunicationStatus(ApiModel):
    """Gradient-exchange volume, summed over ranks (at the end of training), and what sharedGradients'
    compression is doing (while it trains)."""

    bytes_sent: Annotated[int, Field(ge=0)] = 0
    dense_bytes: Annotated[int, Field(ge=0)] = 0
    """What a dense fp32 all-reduce of the same gradients would have sent."""
    threshold: float | None = None
    """sharedGradients: the threshold now (the same on every rank)."""
    sent_fraction: Annotated[float, Field(ge=0, le=1)] | None = None
    """sharedGradients: the fraction of gradient entries sent, over all ranks and steps so far."""
    bitmap_steps: Annotated[int, Field(ge=0)] | None = None
    """sharedGradients: steps whose exchange went (in part) as 2-bit bitmaps rather than index lists."""


class CheckpointRecord(ApiModel):
    path: str
    step: Annotated[int, Field(ge=0)]
    time: datetime
    metrics: dict[str, float] = Field(default_factory=dict)
    """What rank 0 measured on evalData for this checkpoint (evalLoss, and accuracy for class labels); also in the
    checkpoint's manifest (`metrics`). Empty without evalData."""


class CheckpointStatus(ApiModel):
    latest: str | None = None
    """Path of the latest checkpoint complete on disk (written only after it is)."""
    latest_file: str | None = None
    """The file name of `latest` (`step-00000230.pt`): kubectl's CHECKPOINT column."""
    step: Annotated[int, Field(ge=0)] | None = None
    time: datetime | None = None
    history: list[CheckpointRecord] = Field(default_factory=list)

    @model_validator(mode="after")
    def _file(self) -> CheckpointStatus:
        self.latest_file = file_name(self.latest)
        return self


class QueueStatus(ApiModel):
    """Where a job labelled `kueue.x-k8s.io/queue-name` stands in Kueue (written by the operator from its
    Workload)."""

    name: str
    """The LocalQueue (the label's value)."""
    workload: str | None = None
    cluster_queue: str | None = None
    """The ClusterQueue that admitted it (while admitted)."""
    priority: int | None = None
    admitted: bool = False
    reason: str = ""
    """Why it waits (Kueue's reason: Pending, Inadmissible, Preempted, ...) or `Admitted`."""
    message: str = ""
    evictions: Annotated[int, Field(ge=0)] = 0
    """Times the group was stopped by Kueue (preempted, deactivated, its quota reclaimed) and queued again."""


class PreemptionCost(ApiModel):
    """What stopping the group now would cost (written by rank 0 with its progress), for an administrator or a
    queue choosing what to evict: with a grace period, the ranks checkpoint at an agreed step and lose nothing but
    `checkpointSeconds`; killed outright, they lose the steps since the last complete checkpoint."""

    steps_since_checkpoint: Annotated[int, Field(ge=0)] = 0
    checkpoint_seconds: Annotated[float, Field(ge=0)] | None = None
    """How long the latest checkpoint took to write (rank 0's wall time, from the agreed step to complete on
    disk)."""


class Recoveries(ApiModel):
    """How the job came back from lost ranks (spec.elastic)."""

    regroups: Annotated[int, Field(ge=0)] = 0
    """Recoveries in which the survivors went on without restarting (ranks lost, or replacements joined)."""
    restarts: Annotated[int, Field(ge=0)] = 0
    """Whole-group restarts from the latest checkpoint after a lost rank or a failed regroup."""


class Recovery(ApiModel):
    """One recovery from lost ranks (spec.elastic)."""

    kind: Literal["regroup", "restart"]
    """regroup: the survivors went on without restarting; restart: the whole group restarted from the latest
    checkpoint."""
    lost: list[int] = Field(default_factory=list)
    """The ranks lost."""
    added: list[int] = Field(default_factory=list)
    """The ranks that joined."""
    workers: Annotated[int, Field(ge=1)]
    """Ranks after it."""
    stopped_at_step: Annotated[int, Field(ge=0)]
    """The last step complete when the loss was noticed."""
    resumed_at_step: Annotated[int, Field(ge=0)]
    """The step training went on from (a restart's: the latest checkpoint's); the steps in between were lost."""
    seconds: Annotated[float, Field(ge=0)] | None = None
    """From the loss noticed to training going on again (a regroup: the new group formed and its state shared; a
    restart: the new group's pods running); unset while the recovery is under way."""
    time: datetime | None = None
    """When the loss was noticed."""
    message: str = ""
    """What happened, e.g. why a regroup fell back to a restart."""


class PoolLoan(ApiModel):
    """What one InferencePool borrows from the job (spec.elastic.lendTo)."""

    name: str
    """The pool."""
    workers: Annotated[int, Field(ge=1)]
    """Ranks lent to it."""
    base_replicas: Annotated[int, Field(ge=0)]
    """The replicas it had placed when it began to borrow: its demand is its replicas beyond these."""
    workers_per_replica: Annotated[float, Field(gt=0)]
    """Rank pods' worth of the traded resource (nvidia.com/gpu, say) one of its replicas needs."""
    surplus_since: datetime | None = None
    """Since when its demand has been below its loan (the stabilization window's clock); unset while it holds."""
    unplaced_since: datetime | None = None
    """Since when none of its replicas beyond baseReplicas has been placed, the lent ranks' pods gone: past
    lendTo.placementDeadlineSeconds the loan is taken back (its pods cannot run where the ranks ran)."""


class UnplaceablePool(ApiModel):
    """A pool whose replicas stayed unplaced with the job's lent workers free: lent nothing more while it is short
    with pods placed as then."""

    name: str
    """The pool."""
    placement: str
    """A digest of its short pods' nodeSelector, affinity and tolerations: a pool changed there is lent to again."""
    since: datetime | None = None
    """When its loan was taken back."""


class Lent(ApiModel):
    """Workers the job has lent to InferencePools (spec.elastic.lendTo), written by the operator."""

    workers: Annotated[int, Field(ge=0)] = 0
    """Ranks lent, in all: the job trains on spec.workers less these."""
    to: list[str] = Field(default_factory=list)
    """The pools that borrow them."""
    since: datetime | None = None
    """When the loan began."""
    pools: list[PoolLoan] = Field(default_factory=list)
    unplaceable: list[UnplaceablePool] = Field(default_factory=list)
    """Pools given their loan back because they placed none of their replicas with it: lent nothing more while
    still short with the same placement (nodeSelector, affinity, tolerations)."""


class ParallelTrainingJobStatus(ApiModel):
    """Observed state of a ParallelTrainingJob, written by the operator and rank 0."""

    phase: TrainingPhase = "Pending"
    conditions: list[Condition] = Field(default_factory=list)
    workers: WorkersStatus = Field(default_factory=WorkersStatus)
    master: MasterStatus = Field(default_factory=MasterStatus)
    progress: ProgressStatus = Field(default_factory=ProgressStatus)
    metrics: dict[str, float] = Field(default_factory=dict)
    """Named metrics; `accuracy` is evaluation accuracy in 0..1."""
    communication: CommunicationStatus = Field(default_factory=CommunicationStatus)
    checkpoint: CheckpointStatus = Field(default_factory=CheckpointStatus)
    preemption_cost: PreemptionCost | None = None
    queue: QueueStatus | None = None
    restarts: Annotated[int, Field(ge=0)] = 0
    """Whole-group restarts from the latest checkpoint, whatever their cause; a regroup is not one."""
    recoveries: Recoveries = Field(default_factory=Recoveries)
    last_recovery: Recovery | None = None
    """The latest recovery from lost ranks: which, and what it cost."""
    lent: Lent | None = None
    """Workers lent to InferencePools (spec.elastic.lendTo); unset when none are."""
    start_time: datetime | None = None
    completion_time: datetime | None = None
    message: str = ""
    observed_generation: int | None = None
    selector: str | None = None
    """Label selector of the worker pods (the scale subresource's labelSelectorPath)."""

    @model_validator(mode="after")
    def _eta_only_while_running(self) -> ParallelTrainingJobStatus:
        if self.phase != "Running":
            self.progress.eta_seconds = self.progress.eta_text = None
        return self


class ParallelTrainingJob(ApiModel):
    """Data-parallel training of a PyTorch model over `workers` ranks."""

    api_version: Literal["tandem.dev/v1alpha1"] = API_VERSION
    kind: Literal["ParallelTrainingJob"] = "ParallelTrainingJob"
    metadata: ObjectMeta
    spec: ParallelTrainingJobSpec
    status: ParallelTrainingJobStatus | None = None
