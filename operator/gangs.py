"""A ParallelTrainingJob's gang without Kueue (`spec.gang`), as pure functions over plain manifests: a PodGroup of
the rank pods with minMember = their number, for scheduler-plugins' coscheduling or Volcano, and the label or
annotation each expects on the pods, scheduled by that scheduler."""

from __future__ import annotations

from typing import Any

from kubernetes.utils import parse_quantity

from tandem.api import ParallelTrainingJob
from tandem.operator.pod_template import object_metadata

COSCHEDULING = {"apiVersion": "scheduling.x-k8s.io/v1alpha1", "label": "scheduling.x-k8s.io/pod-group",
                "scheduler": "scheduler-plugins-scheduler"}
VOLCANO = {"apiVersion": "scheduling.volcano.sh/v1beta1", "annotation": "scheduling.k8s.io/group-name",
           "scheduler": "volcano"}
GANGS = {"coscheduling": COSCHEDULING, "volcano": VOLCANO}


def pod_group_name(job: str) -> str:
    return job


def pod_group(owner: dict[str, Any], job: ParallelTrainingJob, labels: dict[str, str]) -> dict[str, Any]:
    """The job's PodGroup for its gang scheduler: every rank pod or none (minMember: the pods, minResources: their
    requests, so the scheduler waits for room for all of them)."""
    gang = job.spec.gang
    assert gang is not None
    kind = GANGS[gang.scheduler]
    spec: dict[str, Any] = {"minMember": job.spec.pods}
    requests = _pod_requests(job)
    if requests:
        spec["minResources"] = requests
    if gang.scheduler == "coscheduling" and gang.schedule_timeout_seconds is not None:
        spec["scheduleTimeoutSeconds"] = gang.schedule_timeout_seconds
    if gang.scheduler == "volcano":
        if gang.queue:
            spec["queue"] = gang.queue
        if job.spec.priority_class_name:
            spec["priorityClassName"] = job.spec.priority_class_name
    return {"apiVersion": kind["apiVersion"], "kind": "PodGroup",
            "metadata": object_metadata(owner, pod_group_name(job.metadata.name), labels),
            "spec": spec}


def _pod_requests(job: ParallelTrainingJob) -> dict[str, str]:
    """The whole group's requests: every pod's (a limit standing for a missing request, as schedulers read them)
    times the pods."""
    resources = job.spec.resources.to_dict()
    per_pod = {**resources.get("limits", {}), **resources.get("requests", {})}
    gpus = job.spec.ranks_per_pod * job.spec.gpus_per_worker
    if gpus:
        per_pod["nvidia.com/gpu"] = gpus
    return {name: format((parse_quantity(str(amount)) * job.spec.pods).normalize(), "f")
            for name, amount in per_pod.items()}


def gang_member(pod: dict[str, Any], job: ParallelTrainingJob) -> dict[str, Any]:
    """A rank pod as its gang scheduler expects it: in the PodGroup (a label, or Volcano's annotation) and
    scheduled by that scheduler unless spec.schedulerName names another."""
    gang = job.spec.gang
    if gang is None:
        return pod
    kind, group = GANGS[gang.scheduler], pod_group_name(job.metadata.name)
    metadata = dict(pod["metadata"])
    if "label" in kind:
        metadata["labels"] = {**metadata.get("labels", {}), kind["label"]: group}
    else:
        metadata["annotations"] = {**metadata.get("annotations", {}), kind["annotation"]: group}
    return {**pod, "metadata": metadata,
            "spec": {**pod["spec"], "schedulerName": job.spec.scheduler_name or kind["scheduler"]}}
