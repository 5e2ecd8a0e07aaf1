"""A ParallelTrainingJob under Kueue, as pure functions over plain manifests (gangs.py: under a gang scheduler).

Kueue (a job labelled `kueue.x-k8s.io/queue-name`): the operator is the job's Kueue integration, as operators
outside Kueue's tree are (Kueue's Workload controller and scheduler never look at the owner's kind). It creates one
Workload per job (kueue.x-k8s.io/v1beta2, owned by the job), whose one pod set counts the rank pods and carries
their template (resources, GPUs included); it starts no rank pod until Kueue admits the Workload, then starts the
group with the assigned flavours' node labels and tolerations. Evicted (preempted, deactivated, its quota
reclaimed), the group is stopped as a suspension stops it (SIGTERM: the ranks checkpoint at an agreed step), and
once every pod is gone the operator gives the quota back (`released`: what Kueue's own job reconciler writes); the
job waits, Queued, and resumes from that checkpoint when admitted again. A finished job marks its Workload Finished.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from tandem.api import ParallelTrainingJob
from tandem.operator.observed import condition, with_condition
from tandem.operator.pod_template import MAX_NAME, object_metadata

KUEUE_GROUP, KUEUE_VERSION = "kueue.x-k8s.io", "v1beta2"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
"""A Kueue WorkloadPriorityClass for the job's Workload (before spec.priorityClassName, as Kueue reads them)."""
POD_SET = "ranks"
"""The Workload's one pod set: the rank pods."""


def queue_name(body: dict[str, Any]) -> str | None:
    return ((body.get("metadata") or {}).get("labels") or {}).get(QUEUE_LABEL) or None


def workload_name(body: dict[str, Any]) -> str:
    """Kueue's own naming of a job's Workload: `<kind>-<name>-<hash of the uid>`, within 63 characters."""
    metadata = body["metadata"]
    digest = hashlib.sha256(f"{metadata.get('uid', '')}{body.get('kind', '')}".encode()).hexdigest()[:5]
    prefix = f"paralleltrainingjob-{metadata['name']}"[:MAX_NAME - len(digest) - 1].rstrip("-")
    return f"{prefix}-{digest}"


@dataclass(frozen=True)
class Priority:
    """The class a Workload's priority comes from, and its value."""

    group: str
    kind: str
    name: str
    value: int


def priority_source(body: dict[str, Any], job: ParallelTrainingJob) -> tuple[str, str, str] | None:
    """(group, kind, name) of the priority class to read for the job's Workload, as Kueue reads a job's: its
    `kueue.x-k8s.io/priority-class` label (a WorkloadPriorityClass), else spec.priorityClassName (a PriorityClass);
    None: priority 0."""
    label = ((body.get("metadata") or {}).get("labels") or {}).get(PRIORITY_LABEL)
    if label:
        return KUEUE_GROUP, "WorkloadPriorityClass", label
    if job.spec.priority_class_name:
        return "scheduling.k8s.io", "PriorityClass", job.spec.priority_class_name
    return None


def workload(body: dict[str, Any], job: ParallelTrainingJob, pod: dict[str, Any], priority: Priority | None,
             labels: dict[str, str]) -> dict[str, Any]:
    """The job's Workload: one pod set of `job.spec.pods` pods shaped as `pod` (rank pod 0, whose resources are
    every rank pod's), in the job's LocalQueue; `labels`: the job's children's."""
    spec: dict[str, Any] = {
        "queueName": queue_name(body),
        "podSets": [{"name": POD_SET, "count": job.spec.pods,
                     "template": {"metadata": {"labels": pod["metadata"].get("labels", {})}, "spec": pod["spec"]}}],
    }
    if priority is not None:
        spec["priorityClassRef"] = {"group": priority.group, "kind": priority.kind, "name": priority.name}
        spec["priority"] = priority.value
    return {"apiVersion": f"{KUEUE_GROUP}/{KUEUE_VERSION}", "kind": "Workload",
            "metadata": object_metadata(body, workload_name(body), {**labels, QUEUE_LABEL: queue_name(body) or ""}),
            "spec": spec}


def same_pod_set(existing: dict[str, Any], wanted: dict[str, Any]) -> bool:
    """Whether a Workload still stands for the group the job wants: the same queue, pod count and pods'
    resources, node selector and tolerations (what Kueue's quota and flavours read). Otherwise it is replaced, as
    Kueue's job reconciler replaces a Workload that no longer matches its job. (Its priority may change in place.)"""
    def shape(manifest: dict[str, Any]) -> tuple:
        spec = manifest.get("spec") or {}
        pod_sets = []
        for pod_set in spec.get("podSets") or []:
            pod = (pod_set.get("template") or {}).get("spec") or {}
            pod_sets.append((pod_set.get("name"), pod_set.get("count", 1),
                             [c.get("resources") for c in pod.get("containers") or []],
                             pod.get("nodeSelector") or {}, pod.get("tolerations") or []))
        return spec.get("queueName"), pod_sets
    return shape(existing) == shape(wanted)


@dataclass(frozen=True)
class Admission:
    """What a Workload's status says of the job's place in its queue."""

    admitted: bool
    evicted: bool
    holds_quota: bool
    finished: bool
    reason: str
    message: str
    cluster_queue: str | None = None
    flavors: tuple[str, ...] = ()
    pod_set_updates: tuple[dict[str, Any], ...] = ()


def admission_of(manifest: dict[str, Any]) -> Admission:
    status = manifest.get("status") or {}
    conditions = status.get("conditions") or []

    def true(kind: str) -> dict[str, Any] | None:
        found = condition(conditions, kind)
        return found if found and found.get("status") == "True" else None

    reserved, evicted = true("QuotaReserved"), true("Evicted")
    admission = status.get("admission")
    holds_quota = reserved is not None and admission is not None
    admitted = holds_quota and true("Admitted") is not None and evicted is None
    if evicted is not None:
        preempted = true("Preempted")
        reason, message = evicted.get("reason", "Evicted"), (preempted or evicted).get("message", "")
    elif admitted:
        reason, message = "Admitted", (true("Admitted") or {}).get("message", "")
    elif holds_quota:  # quota reserved, not admitted: admission checks (provisioning, say) are not all Ready yet
        unready = [f"{check.get('name')} ({check.get('state')})" for check in status.get("admissionChecks") or []
                   if check.get("state") != "Ready"]
        reason = (condition(conditions, "Admitted") or {}).get("reason") or "UnsatisfiedChecks"
        message = f"{reserved.get('message') or 'quota reserved'}; waiting for admission checks: " + (
            ", ".join(unready) or "none reported yet")
    else:
        waiting = condition(conditions, "QuotaReserved") or {}
        reason = waiting.get("reason") or "Pending"
        message = waiting.get("message") or "waiting for Kueue to consider the workload"
    assignments = [a for a in (admission or {}).get("podSetAssignments") or [] if a.get("name") == POD_SET]
    flavors = tuple(sorted({f for a in assignments for f in (a.get("flavors") or {}).values()}))
    updates = tuple(update for check in status.get("admissionChecks") or []
                    for update in check.get("podSetUpdates") or [] if update.get("name") == POD_SET)
    return Admission(admitted=admitted, evicted=evicted is not None, holds_quota=holds_quota,
                     finished=true("Finished") is not None, reason=reason, message=message,
                     cluster_queue=(admission or {}).get("clusterQueue"), flavors=flavors, pod_set_updates=updates)


@dataclass(frozen=True)
class Placement:
    """What an admission adds to the rank pods: its flavours' node labels and tolerations, and its admission
    checks' pod set updates."""

    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)


def placement(admission: Admission, flavors: dict[str, dict[str, Any]]) -> Placement:
    """`flavors`: the ResourceFlavors the admission names, by name (their spec)."""
    result = Placement()
    for name in admission.flavors:
        spec = flavors.get(name) or {}
        result.node_selector.update(spec.get("nodeLabels") or {})
        result.tolerations.extend(t for t in spec.get("tolerations") or [] if t not in result.tolerations)
    for update in admission.pod_set_updates:
        result.node_selector.update(update.get("nodeSelector") or {})
        result.tolerations.extend(t for t in update.get("tolerations") or [] if t not in result.tolerations)
        result.labels.update(update.get("labels") or {})
        result.annotations.update(update.get("annotations") or {})
    return result


def placed(pod: dict[str, Any], where: Placement) -> dict[str, Any]:
    """A rank pod with an admission's placement added (the job's own node selector and tolerations kept)."""
    metadata, spec = pod["metadata"], pod["spec"]
    node_selector = {**spec.get("nodeSelector", {}), **where.node_selector}
    tolerations = [*spec.get("tolerations", []), *(t for t in where.tolerations
                                                   if t not in spec.get("tolerations", []))]
    spec = {**spec, **({"nodeSelector": node_selector} if node_selector else {}),
            **({"tolerations": tolerations} if tolerations else {})}
    metadata = {**metadata, "labels": {**where.labels, **metadata.get("labels", {})}}
    if where.annotations:
        metadata["annotations"] = {**where.annotations, **metadata.get("annotations", {})}
    return {**pod, "metadata": metadata, "spec": spec}


def _status(manifest: dict[str, Any], conditions: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    """A merge patch of a Workload's status, guarded by the version read (a 409 if Kueue wrote meanwhile)."""
    metadata = manifest["metadata"]
    return {"metadata": {"name": metadata["name"], "resourceVersion": metadata.get("resourceVersion")},
            "status": {"conditions": conditions, **fields}}


def released(manifest: dict[str, Any], now: datetime) -> dict[str, Any]:
    """The group of an evicted Workload has stopped: give its quota back (Kueue's job reconciler: Requeued, True
    when preempted; QuotaReserved False; the admission cleared, Admitted False)."""
    conditions = (manifest.get("status") or {}).get("conditions") or []
    evicted = condition(conditions, "Evicted") or {}
    reason, message = evicted.get("reason", "Evicted"), evicted.get("message") or "evicted"
    requeued = reason in ("Preempted", "NodeFailures")
    conditions = with_condition(conditions, "Requeued", requeued, reason, message, now)
    conditions = with_condition(conditions, "QuotaReserved", False, "Pending", message, now)
    if condition(conditions, "Admitted") is not None:
        conditions = with_condition(conditions, "Admitted", False, "NoReservation", "The workload has no reservation",
                                    now)
    return _status(manifest, conditions, admission=None)


def finished(manifest: dict[str, Any], succeeded: bool, message: str, now: datetime) -> dict[str, Any] | None:
    """Mark the Workload Finished (Kueue releases its quota), once."""
    conditions = (manifest.get("status") or {}).get("conditions") or []
    if (condition(conditions, "Finished") or {}).get("status") == "True":
        return None
    return _status(manifest, with_condition(conditions, "Finished", True, "Succeeded" if succeeded else "Failed",
                                            message, now))


def pods_ready(manifest: dict[str, Any], ready: bool, now: datetime) -> dict[str, Any] | None:
    """Kueue's PodsReady condition (what its waitForPodsReady waits for), when it changes."""
    conditions = (manifest.get("status") or {}).get("conditions") or []
    value = "True" if ready else "False"
    if (condition(conditions, "PodsReady") or {}).get("status") == value:
        return None
    reason, message = ("PodsReady", "All pods reached readiness and the workload is running") if ready else (
        "WaitForStart", "Not all pods are ready or succeeded")
    return _status(manifest, with_condition(conditions, "PodsReady", ready, reason, message, now))
