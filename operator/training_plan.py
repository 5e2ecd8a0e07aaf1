"""What a ParallelTrainingJob's decision (training.py) takes besides the job and its children, and what it gives: the
operator's settings, what it read of a queued job's Workload, and the Plan to carry out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.operator import queueing

ETA_REMOVED = {"progress": {"etaSeconds": None, "etaText": None}}
"""The one patch of rank 0's status fields the operator sends (eta_removal)."""


def eta_removal(phase: str, status: dict[str, Any]) -> dict[str, Any]:
    """ETA_REMOVED while the job is not Running and its status still holds rank 0's ETA; else nothing. Rank 0 cannot
    remove it once it is gone, and its merge patches never remove a field: without this, kubectl's ETA column would
    go on showing the last estimate of a job that failed, restarts or is suspended."""
    held = (status.get("progress") or {}).keys() & ETA_REMOVED["progress"].keys()
    return ETA_REMOVED if phase != "Running" and held else {}


@dataclass(frozen=True)
class Settings:
    """`tandem operator`'s options, which reach the handlers as kopf's `memo.settings` (main.py)."""

    worker_image: str = "tandem-worker:latest"
    restart_backoff_seconds: float = 10.0
    kueue: bool = False
    """Admit jobs labelled kueue.x-k8s.io/queue-name through Kueue's Workloads (tandem operator --kueue)."""
    gang_scheduling: bool = False
    """Create PodGroups for jobs with spec.gang (tandem operator --gang-scheduling)."""


@dataclass(frozen=True)
class Queueing:
    """What the operator read for a job labelled kueue.x-k8s.io/queue-name."""

    workload: dict[str, Any] | None = None
    """Its Workload, as the API holds it."""
    priority: queueing.Priority | None = None
    """The priority its Workload is created with (read from its class)."""
    priority_problem: str | None = None
    """Why that class could not be read (it does not exist, say): the Workload waits for it."""
    placement: queueing.Placement = field(default_factory=queueing.Placement)
    """What its admission adds to the rank pods (the flavours read)."""


@dataclass
class Plan:
    create: list[dict[str, Any]] = field(default_factory=list)
    """Objects to create; a ConfigMap that exists already is replaced, anything else that exists is kept."""
    delete_pods: list[str] = field(default_factory=list)
    kill_at_once: bool = False
    """Delete those pods with no grace period: a hung group cannot write a checkpoint on SIGTERM."""
    stop_first: bool = False
    """Delete those pods before writing the status: a suspension, which the spec itself records (an operator
    stopped between the two suspends again from the spec), so a refused status patch does not hold the ranks up."""
    delete_job: bool = False
    delete_workload: str | None = None
    """The name of the job's Workload to delete (it left its queue, or no longer stands for the group)."""
    workload_status: dict[str, Any] | None = None
    """A merge patch of the Workload's status subresource (with the resourceVersion it was decided on)."""
    status: dict[str, Any] = field(default_factory=dict)
    """The operator's status fields (a merge patch of the status subresource)."""
    events: list[tuple[str, str, str]] = field(default_factory=list)
    """(type, reason, message) Events to post on the job."""
    requeue_after: float | None = None
