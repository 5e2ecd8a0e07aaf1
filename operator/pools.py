"""An InferencePool's decisions, as one pure function: (the pool, what exists of its objects, its server pods, what
each ready server reports serving, the ParallelTrainingJob it serves from, the clock) -> a PoolPlan (objects to
create or replace, objects to delete, the status, events, when to look again). What the servers' reports come to
(the served model, promotions, the batching settings they run) is pool_served.py's.

- The model: `checkpoint` and `callable` are the server's business (the pool's manifest says which). With
  `fromTrainingJob`, the job must exist, keep its checkpoints on a claim (an emptyDir cannot be shared) and have
  written one; until then a ModelSourceMissing condition says which is missing, no server is started, and the pool
  recovers on its own once the job has one. `follow: true` points the servers at the job's checkpoint directory
  (they load each new checkpoint in process); `follow: false` pins the checkpoint latest when the pool was created
  or last changed, and the servers move only when the pool changes.
- Batching (batchLimit, queueLimit, maxQueueDelayMicroseconds, requestTimeoutMs) never replaces a server: the pod
  template's hash leaves it out (pool_objects.py), and the servers read the pool's settings from the pool themselves
  (a watch, with a ServiceAccount that may get and watch that pool only: pool_objects.server_access), whether or not
  the pool has `spec.auth`. The operator sends nothing: it reports what the servers run, a BatchingDiffers condition
  while some run other settings (reason Refused, with the server's error, when its model failed at the pool's). The
  spec ConfigMap has them too, so that a server started later starts with them. The servers' ServiceAccount, Role and
  RoleBinding are created with the Deployment whenever it is put (an existing one is kept).
- `fromTrainingJob.checkpoint` pins the servers to that checkpoint of the job (a rollback is a patch of it);
  `fromTrainingJob.promote` leaves the gate to the servers (worker/serve/promotion.py) and reports what they did:
  `status.model.metrics` of the served checkpoint, `status.lastSkipped`, and an Event for each promotion and skip.
- The status tells what the servers do: `readyReplicas` from the Deployment, `model` from what the ready servers
  report serving (their `/v2/models/{m}`), a CheckpointsDiffer condition while they serve different ones (mid-swap),
  `batching` from the settings they report running with, a BatchingDiffers condition while some run other settings
  than the pool's,
  ModelLoadFailed with a server's own error when one cannot start, Progressing while a rollout or a load is under
  way, Available when every replica is ready. Phase: Pending (nothing running yet, or scaled to zero), Loading (servers
  up, none ready), Degraded (some ready), Ready (all ready), Failed (the model cannot be loaded and nothing serves).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from tandem.api import InferencePool, ParallelTrainingJob
from tandem.contract import checkpoint_step
from tandem.operator.observed import (
    WAITING_FAILURES,
    ParsedResource,
    condition,
    observe_pod,
    read_resource,
    with_condition,
)
from tandem.operator.pool_objects import (
    SPEC_HASH,
    autoscaler,
    deployment_name,
    disruption_budget,
    endpoint,
    model_name,
    server_access,
    server_deployment,
    service,
    spec_config_map,
)
from tandem.operator.pool_objects import selector as pool_selector
from tandem.operator.pool_served import (
    Served,
    batching_status,
    latest_skipped,
    model_status,
    promotion_events,
    refused_settings,
)

WATCH_SECONDS = 5.0
CHANGING_SECONDS = 1.0
"""How soon to look again while servers run other batching settings than the pool's (they are taking them), to show
them running the new ones."""


@dataclass
class PoolPlan:
    apply: list[dict[str, Any]] = field(default_factory=list)
    """Objects to create, or to replace where they exist."""
    delete: list[tuple[str, str]] = field(default_factory=list)
    """(kind, name) of objects to delete."""
    status: dict[str, Any] = field(default_factory=dict)
    events: list[tuple[str, str, str]] = field(default_factory=list)
    requeue_after: float | None = WATCH_SECONDS
    create: list[dict[str, Any]] = field(default_factory=list)
    """Objects to create before those in `apply` (one that exists is kept): the servers' access to their pool."""


def reconcile_pool(parsed: ParsedResource, children: dict[str, dict[str, Any] | None], pods: list[dict[str, Any]],
                   served: list[Served], job: dict[str, Any] | None, now: datetime,
                   worker_image: str) -> PoolPlan:
    """`children`: the pool's Deployment, ConfigMap, Service, PodDisruptionBudget and HorizontalPodAutoscaler as
    they exist (None where they do not), by kind."""
    body, pool = parsed.body, parsed.model
    status = dict(body.get("status") or {})
    conditions = list(status.get("conditions") or [])
    phase_before = status.get("phase") or "Pending"
    plan = PoolPlan()
    if pool is None:
        message = "; ".join(parsed.problems)
        conditions = with_condition(conditions, "InvalidSpec", True, "InvalidSpec", message, now)
        plan.status = {"conditions": conditions, "message": f"invalid spec: {message}"}
        return plan
    namespace = body["metadata"].get("namespace")
    if condition(conditions, "InvalidSpec"):
        conditions = with_condition(conditions, "InvalidSpec", False, "SpecValid", "the spec is valid", now)

    source_job, missing = _model_job(pool, job)
    if missing is None:
        if condition(conditions, "ModelSourceMissing"):
            conditions = with_condition(conditions, "ModelSourceMissing", False, "Found", "the model's source is there",
                                        now)
        deployment = server_deployment(body, pool, job=source_job, pinned_step=_pinned_step(
            pool, body, children.get("Deployment"), job), default_image=worker_image)
        plan.apply += _changed(children, [spec_config_map(body, pool), service(body, pool), deployment])
        if any(o["kind"] == "Deployment" for o in plan.apply):
            plan.create += server_access(body, pool)
        _optional(plan, children, "PodDisruptionBudget", disruption_budget(body, pool) if pool.spec.replicas > 1
                  else None, deployment_name(pool.metadata.name))
        _optional(plan, children, "HorizontalPodAutoscaler", autoscaler(body, pool) if pool.spec.autoscaling
                  else None, pool.metadata.name)
    else:
        conditions = with_condition(conditions, "ModelSourceMissing", True, "ModelSourceMissing", missing, now)

    observed = children.get("Deployment") or {}
    counts = observed.get("status") or {}
    ready = int(counts.get("readyReplicas") or 0)
    updated = int(counts.get("updatedReplicas") or 0)
    load_failure = _load_failure(pods)
    if load_failure is not None:
        conditions = with_condition(conditions, "ModelLoadFailed", True, "ModelLoadFailed", load_failure, now)
    elif condition(conditions, "ModelLoadFailed"):
        conditions = with_condition(conditions, "ModelLoadFailed", False, "Loaded", "the servers load the model", now)
    model, differ = model_status(pool, served)
    last_skipped = latest_skipped(served) or status.get("lastSkipped")
    if pool.spec.model.from_training_job is not None and pool.spec.model.from_training_job.promote is not None:
        plan.events += promotion_events(status, model, last_skipped)
    if differ:
        conditions = with_condition(conditions, "CheckpointsDiffer", True, "Swapping", differ, now)
    elif condition(conditions, "CheckpointsDiffer"):
        conditions = with_condition(conditions, "CheckpointsDiffer", False, "Same", "every ready replica serves one "
                                    "checkpoint", now)
    batching = pool.spec.batching
    refused = refused_settings(batching, served)
    running_batching, differ = batching_status(batching, served, refused)
    if differ:
        conditions = with_condition(conditions, "BatchingDiffers", True, "Refused" if refused else "Changing", differ,
                                    now)
    elif condition(conditions, "BatchingDiffers"):
        conditions = with_condition(conditions, "BatchingDiffers", False, "Same", "every ready server runs the pool's "
                                    "batching settings", now)
    replicas = pool.spec.replicas
    replacing = any(o["kind"] == "Deployment" for o in plan.apply) and bool(observed)
    # A Deployment without a status yet is one just created: its servers are loading, not rolling.
    rolling = replacing or bool(counts) and (updated < replicas or int(observed["metadata"].get("generation", 0) or 0)
                                             > int(counts.get("observedGeneration") or 0))
    progressing = bool(rolling) or (ready < replicas and load_failure is None)
    conditions = with_condition(conditions, "Progressing", progressing, "Rolling" if rolling else
                                ("Loading" if progressing else "Complete"),
                                "servers are being replaced or are loading the model" if progressing else
                                "every server runs the pool's spec", now)
    conditions = with_condition(conditions, "Available", replicas > 0 and ready >= replicas,
                                "Ready" if ready >= replicas > 0 else "NotReady", f"{ready}/{replicas} replicas ready",
                                now)
    phase, message = _phase(replicas, ready, pods, missing, load_failure)
    if phase != phase_before:
        plan.events.append((event_type(phase, phase_before, rolling, load_failure), phase, message))
    plan.status = {
        "phase": phase, "message": message, "conditions": conditions, "replicas": int(counts.get("replicas") or 0),
        "readyReplicas": ready, "readySummary": f"{ready}/{replicas}", "endpoint": endpoint(pool, namespace),
        "observedGeneration": body["metadata"].get("generation"), "selector": ",".join(
            f"{k}={v}" for k, v in pool_selector(pool.metadata.name).items()),
    }
    if model is not None:
        plan.status["model"] = model
    if running_batching is not None:
        plan.status["batching"] = running_batching
    if last_skipped is not None:
        plan.status["lastSkipped"] = last_skipped
    plan.requeue_after = CHANGING_SECONDS if differ and not refused else WATCH_SECONDS
    return plan


@dataclass(frozen=True)
class Sources:
    """What a pool's decision reads besides its own objects: the job it serves from, and where its servers answer."""

    job: str | None
    model: str
    port: int


def sources(parsed: ParsedResource) -> Sources | None:
    """None for a pool its spec does not parse (its InvalidSpec condition says why)."""
    pool = parsed.model
    if pool is None:
        return None
    source = pool.spec.model.from_training_job
    return Sources(source.name if source else None, model_name(pool), pool.spec.port)


def _model_job(pool: InferencePool, job: dict[str, Any] | None) -> tuple[ParallelTrainingJob | None, str | None]:
    """The job a pool serves from, or why it cannot be served yet."""
    source = pool.spec.model.from_training_job
    if source is None:
        return None, None
    if job is None:
        return None, f"ParallelTrainingJob {source.name} does not exist in this namespace: waiting for it"
    served = read_resource(job)
    if served.model is None:
        return None, f"ParallelTrainingJob {source.name} is not valid: {'; '.join(served.problems)}"
    checkpoint = served.model.spec.checkpoint
    if checkpoint.persistent_volume_claim is None:
        return None, (f"ParallelTrainingJob {source.name} keeps its checkpoints on an emptyDir, which its pods alone "
                      "see: set its spec.checkpoint.persistentVolumeClaim to serve them")
    if checkpoint.directory.startswith("/"):
        return None, (f"ParallelTrainingJob {source.name}'s checkpoint.directory {checkpoint.directory} is absolute: "
                      "only a directory relative to its claim can be served")
    if not ((job.get("status") or {}).get("checkpoint") or {}).get("latest"):
        return None, f"ParallelTrainingJob {source.name} has written no checkpoint yet: waiting for its first"
    return served.model, None


def _pinned_step(pool: InferencePool, body: dict[str, Any], deployment: dict[str, Any] | None,
                 job: dict[str, Any] | None) -> int | None:
    """The step of the checkpoint the servers serve when they do not follow the job: the one `checkpoint` names;
    with follow: false, the job's latest when the pool was created or last changed (its generation moved past the
    one last observed), kept until it changes again."""
    source = pool.spec.model.from_training_job
    if source is not None and source.checkpoint is not None:
        return checkpoint_step(source.checkpoint)
    if source is None or source.follow:
        return None
    observed_generation = (body.get("status") or {}).get("observedGeneration")
    if deployment is not None and observed_generation == body["metadata"].get("generation"):
        kept = _served_step(deployment)
        if kept is not None:
            return kept
    return int(((job or {}).get("status") or {}).get("checkpoint", {}).get("step") or 0)


def _served_step(deployment: dict[str, Any]) -> int | None:
    command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    path = command[command.index("--checkpoint") + 1] if "--checkpoint" in command else ""
    return checkpoint_step(path.rsplit("/", 1)[-1])


def _changed(children: dict[str, dict[str, Any] | None], desired: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The desired objects that are missing or differ from what exists, in what the operator decides."""
    out = []
    for manifest in desired:
        existing = children.get(manifest["kind"])
        if existing is None or _differs(manifest, existing):
            out.append(manifest)
    return out


def _differs(desired: dict[str, Any], existing: dict[str, Any]) -> bool:
    kind = desired["kind"]
    if kind == "ConfigMap":
        return desired["data"] != existing.get("data")
    if kind == "Deployment":
        want, have = desired["spec"], existing.get("spec") or {}
        return (want["replicas"] != have.get("replicas") or want["template"]["metadata"]["annotations"][SPEC_HASH]
                != ((have.get("template") or {}).get("metadata") or {}).get("annotations", {}).get(SPEC_HASH))
    if kind in ("PodDisruptionBudget", "HorizontalPodAutoscaler"):
        return desired["spec"] != {k: v for k, v in (existing.get("spec") or {}).items() if k in desired["spec"]}
    return False


def _optional(plan: PoolPlan, children: dict[str, dict[str, Any] | None], kind: str,
              manifest: dict[str, Any] | None, name: str) -> None:
    """Create or update an object the pool wants (`manifest`), or delete the one it no longer wants."""
    if manifest is not None:
        plan.apply += _changed(children, [manifest])
    elif children.get(kind) is not None:
        plan.delete.append((kind, name))


def _load_failure(pods: list[dict[str, Any]]) -> str | None:
    """A server's own error, when a server container is down with one (the model could not be loaded, say): ended
    with a non-zero code, or waiting to be restarted after that (its message is then the last run's)."""
    for pod in pods:
        for container in (pod.get("status") or {}).get("containerStatuses") or []:
            state = container.get("state") or {}
            terminated, waiting = state.get("terminated") or {}, state.get("waiting") or {}
            if terminated.get("exitCode") not in (None, 0):
                detail = terminated.get("message") or terminated.get("reason") or f"exit code {terminated['exitCode']}"
            elif waiting.get("reason") in WAITING_FAILURES:
                last = (container.get("lastState") or {}).get("terminated") or {}
                detail = last.get("message") or waiting.get("message") or waiting["reason"]
            else:
                continue
            return f"pod {pod['metadata']['name']}: {detail.strip()[-600:]}"
    return None


def event_type(phase: str, phase_before: str, rolling: bool, load_failure: str | None) -> str:
    """Warning for what needs a person: Failed, a model that does not load, and replicas lost by a pool that was
    Ready outside a rollout; Normal for the replicas a rollout or a start is still bringing up."""
    lost = phase_before == "Ready" and not rolling
    return "Warning" if phase == "Failed" or (phase == "Degraded" and (load_failure is not None or lost)) else "Normal"


def _phase(replicas: int, ready: int, pods: list[dict[str, Any]], missing: str | None,
           load_failure: str | None) -> tuple[str, str]:
    if replicas == 0:
        return "Pending", "scaled to zero replicas"
    if ready >= replicas:
        return "Ready", f"{ready}/{replicas} replicas ready"
    if load_failure is not None:
        return ("Degraded" if ready else "Failed"), f"model load failed: {load_failure}"
    if ready:
        return "Degraded", f"{ready}/{replicas} replicas ready"
    if missing is not None:
        return "Pending", missing
    running = [p for p in pods if (p.get("status") or {}).get("phase") == "Running"]
    if running:
        return "Loading", f"{len(running)} server(s) loading the model"
    pending = next((p for p in pods if (p.get("status") or {}).get("phase") in (None, "Pending")), None)
    if pending is not None:
        reason = _pending_reason(pending)
        return "Pending", f"pod {pending['metadata']['name']}: {reason}"
    return "Pending", "waiting for the server pods"


def _pending_reason(pod: dict[str, Any]) -> str:
    observed = observe_pod(pod)
    return observed.pending_reason + (f": {observed.pending_message}" if observed.pending_message else "")
