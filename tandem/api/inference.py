"""InferencePool: DL4J's ParallelInference as a Kubernetes resource, served over the Open Inference Protocol."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal, get_args

from pydantic import Field, StringConstraints, model_validator

from tandem.api.common import API_VERSION, ApiModel, CallableRef, Condition, ObjectMeta, PodSettings, ResourceName
from tandem.columns import file_name

InferenceMode = Literal["batched", "sequential", "inplace"]
PoolPhase = Literal["Pending", "Loading", "Ready", "Degraded", "Failed"]
POOL_PHASES: tuple[str, ...] = get_args(PoolPhase)
Datatype = Literal["BOOL", "UINT8", "INT8", "INT16", "INT32", "INT64", "FP16", "BF16", "FP32", "FP64"]


CheckpointName = Annotated[str, StringConstraints(pattern=r"^step-[0-9]{8,}\.pt$")]
MetricName = Annotated[str, StringConstraints(min_length=1, max_length=63, pattern=r"^[A-Za-z][A-Za-z0-9_.-]*$")]


class Promotion(ApiModel):
    """A gate on following a job: a server swaps to a new checkpoint only when the metric its job recorded for it
    (rank 0 evaluates on `evalData` at each checkpoint) beats the served checkpoint's by more than `minDelta`."""

    metric: MetricName
    """A metric the trainer records per checkpoint: `accuracy` or `evalLoss` (see status.checkpoint.history)."""
    mode: Literal["max", "min"] = "max"
    """`max`: higher is better (accuracy); `min`: lower is better (a loss)."""
    min_delta: Annotated[float, Field(ge=0)] = 0.0
    """How much better a candidate must be; with 0, any strict improvement (an equal value is skipped)."""


class FromTrainingJob(ApiModel):
    """Serve a checkpoint of a ParallelTrainingJob in the same namespace: its latest (followed, or gated by
    `promote`), or the one `checkpoint` names."""

    model_config = {"json_schema_extra": {"x-kubernetes-validations": [
        {"rule": "!has(self.checkpoint) || !has(self.promote)",
         "message": "checkpoint pins one checkpoint and promote gates following the job: set at most one"},
        {"rule": "!has(self.promote) || !has(self.follow) || self.follow",
         "message": "promote gates following the job: it needs follow: true"},
    ]}}

    name: ResourceName
    follow: bool = True
    """Load each new checkpoint as the job writes it (zero-drop hot swap)."""
    promote: Promotion | None = None
    """Follow only to better checkpoints: each new one is a candidate, promoted when its recorded metric beats the
    served one's, else skipped (status.lastSkipped, an Event); a server starts on the best checkpoint there is."""
    checkpoint: CheckpointName | None = None
    """Pin the servers to this checkpoint of the job (a file name in its checkpoint directory, as
    status.checkpoint.history lists them, e.g. `step-00000200.pt`); they load it and keep it (`follow` does not
    apply). Setting it rolls the servers back or forward; removing it follows the job again."""

    @model_validator(mode="after")
    def _pin_or_gate(self) -> FromTrainingJob:
        if self.checkpoint is not None and self.promote is not None:
            raise ValueError("checkpoint pins one checkpoint and promote gates following the job: set at most one")
        if self.promote is not None and not self.follow:
            raise ValueError("promote gates following the job: it needs follow: true")
        return self


class ModelSource(ApiModel):
    """The model to serve: exactly one of checkpoint, callable, fromTrainingJob."""

    model_config = {"json_schema_extra": {"oneOf": [
        {"required": ["checkpoint"]}, {"required": ["callable"]}, {"required": ["fromTrainingJob"]},
    ]}}

    name: ResourceName | None = None
    """Model name in the inference API (/v2/models/{name}); defaults to the pool's name."""
    version: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.-]+$")] = "1"
    checkpoint: Annotated[str, StringConstraints(min_length=1)] | None = None
    """Path of a Tandem trainer checkpoint (loaded with weights_only; the architecture comes from its manifest)."""
    callable: CallableRef | None = None
    """`module:callable` returning a torch.nn.Module with its weights."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for `callable`."""
    from_training_job: FromTrainingJob | None = None
    input_shape: list[Annotated[int, Field(ge=1)]] | None = None
    """Shape of one example (no batch dimension); read from the checkpoint when not given."""
    input_datatype: Datatype = "FP32"

    @model_validator(mode="after")
    def _exactly_one_source(self) -> ModelSource:
        sources = [
            name for name, value in
            (("checkpoint", self.checkpoint), ("callable", self.callable), ("fromTrainingJob", self.from_training_job))
            if value is not None
        ]
        if len(sources) != 1:
            found = ", ".join(sources) if sources else "none"
            raise ValueError(f"set exactly one of checkpoint, callable, fromTrainingJob (found: {found})")
        return self


class Autoscaling(ApiModel):
    """Scale replicas on queue depth (a HorizontalPodAutoscaler on the pool's scale subresource)."""

    model_config = {"json_schema_extra": {"x-kubernetes-validations": [
        {"rule": "self.minReplicas <= self.maxReplicas", "message": "minReplicas must not exceed maxReplicas"},
    ]}}

    min_replicas: Annotated[int, Field(ge=1)] = 1
    max_replicas: Annotated[int, Field(ge=1)]
    target_queue_depth: Annotated[float, Field(gt=0)] = 8.0
    """Average pending requests per replica to aim for."""

    @model_validator(mode="after")
    def _ordered(self) -> Autoscaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"minReplicas ({self.min_replicas}) must not exceed maxReplicas ({self.max_replicas})")
        return self


class ModelRepository(ApiModel):
    """Triton's model-repository API, `POST /v2/repository/models/{m}/load` with a checkpoint: off unless enabled,
    since any client that reaches the port could otherwise make the server read files."""

    load: bool = False
    """Accept load requests; when false every load request answers 403."""
    root: Annotated[str, StringConstraints(min_length=1, pattern=r"^/")] | None = None
    """The directory whose checkpoints load requests may name (files under it only); default: the directory the
    server serves from (the followed job's checkpoint directory, or the served checkpoint's directory)."""


class Auth(ApiModel):
    """A bearer token in front of the pool's endpoints (HTTP `Authorization: Bearer <token>`, gRPC metadata
    `authorization: Bearer <token>`): inference, metadata and repository calls without it answer 401 /
    UNAUTHENTICATED. Health and readiness stay open (the kubelet's probes carry no token). The token is a key of a
    Secret in the pool's namespace, mounted into the server pods: a rotated Secret is picked up without a restart."""

    secret_name: ResourceName
    """The Secret holding the token."""
    key: Annotated[str, StringConstraints(min_length=1, pattern=r"^[-._a-zA-Z0-9]+$")] = "token"
    """The Secret's key whose value is the token."""
    metrics: Literal["open", "protected"] = "open"
    """`/metrics` open to any scraper, or behind the token too (Prometheus: `authorization.credentials_file`)."""


class BatchingSettings(ApiModel):
    """How a server batches and queues: the pool's fields that reach running servers without restarting them (each
    server reads them from its pool, `tandem serve --watch-pool`); each server reports the ones it runs with (`GET
    /v2/models/{m}/batching`, the parameters of the model's metadata and readiness, /metrics)."""

    batch_limit: Annotated[int, Field(ge=1)] = 32
    """Most requests merged into one forward pass (DL4J batchLimit; Triton max_batch_size)."""
    queue_limit: Annotated[int, Field(ge=1)] = 64
    """Most requests waiting; beyond it requests are rejected at once with 429 (DL4J queueLimit)."""
    max_queue_delay_microseconds: Annotated[int, Field(ge=0)] = 0
    """How long a batch may wait to fill (Triton's dynamic batcher). With 0 what is queued goes at once, but beside
    a forward running on the same device a free replica waits for a full batch, and a replica alone on its device for
    as many requests as its last forward had, at most about one forward's time."""
    request_timeout_ms: Annotated[int, Field(ge=1)] = 30000
    """How long a request may take, queue and forward together, before it is answered 504."""

    def summary(self) -> str:
        """For logs and conditions: `batchLimit 16, queueLimit 64, ...`."""
        return ", ".join(f"{key} {value}" for key, value in self.to_dict().items())


LIVE_FIELDS = tuple(BatchingSettings.model_fields)
"""The spec's fields a running server changes in place (the others roll the servers)."""


class InferencePoolSpec(BatchingSettings, PodSettings):
    """Desired state of an InferencePool. A change of batchLimit, queueLimit, maxQueueDelayMicroseconds or
    requestTimeoutMs reaches the running servers without replacing them (they read it from the pool); replicas and
    autoscaling scale them; any other change replaces them (a rolling update that fails no request)."""

    model_config = {"json_schema_extra": {"x-kubernetes-validations": [
        {"rule": "self.port != self.grpcPort", "message": "port and grpcPort must differ"},
    ]}}

    replicas: Annotated[int, Field(ge=0)] = 1
    """Server pods."""
    workers_per_replica: Annotated[int, Field(ge=1)] = 1
    """Model replicas in each pod: worker threads, one per GPU; on CPU, threads sharing one copy of the model."""
    processes_per_replica: Annotated[int, Field(ge=1)] = 1
    """Server processes in each pod (`tandem serve --processes`), served the pod's connections in turn by a
    supervisor: each has its own event loop and workersPerReplica model replicas; the pod's cores are shared between
    them all, and with GPUs every process places its replicas on the same GPUs; on CPU they serve one copy of the
    weights. On CPU, two processes of one worker serve 1.1-1.7x the requests of one process of two
    (bench/RESULTS.md, "Sixth pass")."""
    gpus_per_replica: Annotated[int, Field(ge=0)] = 0
    model: ModelSource
    inference_mode: InferenceMode = "batched"
    port: Annotated[int, Field(ge=1, le=65535)] = 8000
    """HTTP port of the Open Inference Protocol (and /metrics)."""
    grpc_port: Annotated[int, Field(ge=1, le=65535)] = 8001
    """gRPC port of the Open Inference Protocol (`inference.GRPCInferenceService`; 8001 as Triton's)."""
    http_front: Literal["native", "python"] = "native"
    """Who reads the HTTP and gRPC ports: `native`, a C front on a thread of its own that serves the common inference
    request (JSON over HTTP, ModelInfer with raw contents over gRPC; FP32 in and out) with no Python per request and
    hands every other request to the Python server (on CPU it leaves the model's forwards more of the cores:
    bench/RESULTS.md); or `python`, the Python server alone. Where the C front is not built, or cannot serve the
    model, the Python server serves everything and the log says why."""
    idle_timeout_seconds: Annotated[float, Field(gt=0)] = 60.0
    """A connection to either port with no request in flight is closed after this long (over HTTP/2 with GOAWAY),
    a minute as most load balancers keep (the server's Limits.idle_timeout_s); `tandem serve --idle-timeout`
    overrides it."""
    autoscaling: Autoscaling | None = None
    model_repository: ModelRepository = Field(default_factory=ModelRepository)
    auth: Auth | None = None
    """A bearer token the clients must present; none by default (anyone who reaches the Service may call it)."""

    @model_validator(mode="after")
    def _distinct_ports(self) -> InferencePoolSpec:
        if self.port == self.grpc_port:
            raise ValueError(f"port and grpcPort must differ (both are {self.port}); the default grpcPort is 8001")
        return self

    @property
    def batching(self) -> BatchingSettings:
        """The batching fields, which reach running servers without restarting them."""
        return BatchingSettings(**{name: getattr(self, name) for name in LIVE_FIELDS})


class ModelStatus(ApiModel):
    source: str | None = None
    """What is loaded: `checkpoint`, `callable` or `fromTrainingJob/<name>`."""
    checkpoint: str | None = None
    checkpoint_file: str | None = None
    """The file name of `checkpoint` (`step-00000230.pt`): kubectl's CHECKPOINT column."""
    loaded_at: datetime | None = None
    metrics: dict[str, float] = Field(default_factory=dict)
    """The metrics its job recorded for the served checkpoint (empty for one written without evalData)."""
    gate_metric: str | None = None
    """With fromTrainingJob.promote: the gate's metric of the served checkpoint to four significant figures
    (`accuracy=0.9722`), written by the operator: kubectl's `-o wide` METRIC column."""

    @model_validator(mode="after")
    def _file(self) -> ModelStatus:
        self.checkpoint_file = file_name(self.checkpoint)
        return self


class SkippedCandidate(ApiModel):
    """A checkpoint the promotion gate did not swap to."""

    checkpoint: str
    metric: float | None = None
    """Its value of the gate's metric (absent when the checkpoint has none recorded)."""
    reason: str


class Borrowed(ApiModel):
    """Workers the pool borrows from ParallelTrainingJobs (their spec.elastic.lendTo), for replicas the cluster could
    not otherwise place."""

    workers: Annotated[int, Field(ge=0)] = 0
    """Ranks lent to it, in all."""
    from_: list[str] = Field(default_factory=list, alias="from")
    """The jobs that lend them."""
    since: datetime | None = None
    """When the earliest of those loans began."""
    unplaceable_for: list[str] = Field(default_factory=list)
    """The jobs that took their workers back because this pool placed none of its replicas with them (its pods
    cannot run where their ranks run: compare its nodeSelector, affinity and tolerations with theirs); they lend it
    nothing more while its pods stay short and placed so."""


class InferencePoolStatus(ApiModel):
    """Observed state of an InferencePool."""

    phase: PoolPhase = "Pending"
    conditions: list[Condition] = Field(default_factory=list)
    replicas: Annotated[int, Field(ge=0)] = 0
    ready_replicas: Annotated[int, Field(ge=0)] = 0
    ready_summary: str = ""
    """`readyReplicas/replicas`, for kubectl's column."""
    endpoint: str | None = None
    """Base URL of the Open Inference Protocol (v2) endpoint."""
    model: ModelStatus = Field(default_factory=ModelStatus)
    batching: BatchingSettings | None = None
    """The batching settings the ready servers report running with (see the BatchingDiffers condition while they
    differ)."""
    last_skipped: SkippedCandidate | None = None
    """With fromTrainingJob.promote: the latest candidate checkpoint the servers did not promote, and why."""
    borrowed: Borrowed | None = None
    """Workers lent to the pool by training jobs; unset when none are."""
    message: str = ""
    observed_generation: int | None = None
    selector: str | None = None
    """Label selector of the server pods (the scale subresource's labelSelectorPath)."""

    @model_validator(mode="after")
    def _summary(self) -> InferencePoolStatus:
        self.ready_summary = f"{self.ready_replicas}/{self.replicas}"
        return self


class InferencePool(ApiModel):
    """Batched, multi-replica inference for a PyTorch model."""

    api_version: Literal["tandem.dev/v1alpha1"] = API_VERSION
    kind: Literal["InferencePool"] = "InferencePool"
    metadata: ObjectMeta
    spec: InferencePoolSpec
    status: InferencePoolStatus | None = None
