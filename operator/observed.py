"""What the operator reads from the cluster, reduced to the facts its decisions use: a resource parsed by the API
models (once per pass), a rank pod's state, and Kubernetes-style conditions kept with their transition times."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from tandem.contract import PERMANENT_FAILURE_EXIT_CODE, PermanentFailureReport, permanent_failure_report
from tandem.manifest import ManifestError, Resource, parse
from tandem.operator.training_objects import GROUP_LABEL, POD_INDEX_LABEL, RANK_LABEL

MESSAGE_TAIL = 600
"""Characters of a failed rank's termination message carried into the job's status."""
LAUNCHER_CAUSE = re.compile(r"^rank (?P<rank>\d+) \(local rank (?P<local_rank>\d+)\) (?P<how>.*)$")
"""The first line a pod's launcher writes in its termination message when one of its ranks failed
(tandem.worker.train.launch): which rank, which local rank, and how it ended."""
PEER_LOST = re.compile(r"by peer|remote process exited|communicator was aborted", re.IGNORECASE)
"""How gloo and NCCL say that another rank went away."""
WAITING_FAILURES = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError",
                    "CreateContainerError", "CrashLoopBackOff"}


@dataclass(frozen=True)
class ParsedResource:
    """A job or pool as one reconciliation pass reads it: its body as the API holds it (status and all), and the API
    models' reading of its spec, parsed once and handed to every decision of the pass that needs it."""

    body: dict[str, Any]
    model: Resource | None
    """None for a spec the API models reject (`problems` names each field wrong)."""
    problems: list[str] = field(default_factory=list)


def read_resource(body: dict[str, Any]) -> ParsedResource:
    """A ParallelTrainingJob or InferencePool as the API models read it (its status and the rest of its metadata
    left out), or the problems that keep them from it."""
    metadata = body.get("metadata", {})
    document = {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
                "metadata": {"name": metadata.get("name"), "namespace": metadata.get("namespace")},
                "spec": body.get("spec")}
    try:
        return ParsedResource(body, parse(document, source=f"{body.get('kind')} {metadata.get('name')}"))
    except ManifestError as error:
        return ParsedResource(body, None, error.problems)


@dataclass(frozen=True)
class RankPod:
    """One rank pod, as far as the job's state goes; an elastic job's coordinator pod is read the same way (the
    reconciler tells it apart by its role label, training_objects.is_coordinator)."""

    index: int
    """Its index among the job's rank pods (ranks index x ranksPerPod on); -1 for the coordinator's pod (it hosts
    no rank)."""
    name: str
    group: int
    phase: str
    """Pending, Running, Succeeded, Failed (Unknown counts as Pending)."""
    ready: bool
    terminating: bool
    exit_code: int | None = None
    termination_message: str = ""
    """The container's terminated reason and message (its last log lines on a failure)."""
    permanent_failure: PermanentFailureReport | None = None
    """A rank that met a permanent failure (its exit code PERMANENT_FAILURE_EXIT_CODE, its output ending with the
    report: a model or data that cannot work, a checkpoint directory that is not the run's): the reason and report."""
    failed_rank: tuple[str, str, str] | None = None
    """In a pod of several ranks: the launcher's word on the rank that failed, (rank, local rank, how it ended:
    `exited with code 1`), kept whole apart from the message's tail."""
    pending_reason: str = ""
    pending_message: str = ""
    finished_at: str = ""
    """When its container terminated (RFC 3339: sorts as time)."""

    @property
    def finished(self) -> bool:
        return self.phase in ("Succeeded", "Failed")

    @property
    def lost_a_peer(self) -> bool:
        """Whether its rank failed because another went away (gloo's or NCCL's words say so): an effect, not a
        cause."""
        return bool(PEER_LOST.search(self.termination_message))

    @property
    def live(self) -> bool:
        """Running or about to: neither finished nor on its way out."""
        return not self.finished and not self.terminating


def observe_pod(pod: dict[str, Any]) -> RankPod:
    metadata, status = pod.get("metadata", {}), pod.get("status") or {}
    labels = metadata.get("labels") or {}
    container = next(iter(status.get("containerStatuses") or []), {})
    state = container.get("state") or {}
    terminated, waiting = state.get("terminated") or {}, state.get("waiting") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    phase = status.get("phase") or "Pending"
    reason, message = "", ""
    if phase in ("Pending", "Unknown"):
        scheduled = conditions.get("PodScheduled", {})
        if scheduled.get("status") == "False":
            reason, message = scheduled.get("reason") or "Unschedulable", scheduled.get("message") or ""
        elif waiting:
            reason, message = waiting.get("reason") or "ContainerCreating", waiting.get("message") or ""
        else:
            reason = "ContainerCreating"
    ended = terminated if terminated.get("reason") or terminated.get("message") or phase != "Failed" else status
    said = (ended.get("message") or "").strip()
    head, _, rest = said.partition("\n")
    launcher = LAUNCHER_CAUSE.match(head)
    # The reason (OOMKilled, Evicted, Error) is kept whole; of the message (the log's tail), its end.
    tail = (rest if launcher else said).strip()[-MESSAGE_TAIL:]
    termination = " ".join(part for part in (ended.get("reason"), tail) if part)
    return RankPod(
        index=int(labels.get(POD_INDEX_LABEL, labels.get(RANK_LABEL, -1))),  # (a pod from before ranksPerPod: a rank)
        name=metadata.get("name", ""),
        group=int(labels.get(GROUP_LABEL, 0)),
        phase="Pending" if phase == "Unknown" else phase,
        ready=conditions.get("Ready", {}).get("status") == "True",
        terminating=bool(metadata.get("deletionTimestamp")),
        exit_code=terminated.get("exitCode"),
        termination_message=termination,
        permanent_failure=permanent_failure_report(said)
        if terminated.get("exitCode") == PERMANENT_FAILURE_EXIT_CODE else None,
        failed_rank=launcher.group("rank", "local_rank", "how") if launcher else None,
        pending_reason=reason,
        pending_message=message,
        finished_at=terminated.get("finishedAt") or "",
    )


def timestamp(value: str | datetime | None) -> datetime | None:
    if value is None or isinstance(value, datetime):
        return value
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def isoformat(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(conditions: list[dict[str, Any]], kind: str) -> dict[str, Any] | None:
    return next((c for c in conditions if c.get("type") == kind), None)


def with_condition(conditions: list[dict[str, Any]], kind: str, status: bool, reason: str, message: str,
                   now: datetime) -> list[dict[str, Any]]:
    """`conditions` with `kind` set; its lastTransitionTime moves only when its status changes."""
    value = "True" if status else "False"
    previous = condition(conditions, kind)
    since = previous["lastTransitionTime"] if previous and previous.get("status") == value else isoformat(now)
    updated = {"type": kind, "status": value, "reason": reason, "message": message, "lastTransitionTime": since}
    return [*(c for c in conditions if c.get("type") != kind), updated]


REFUSED = "APIRequestRefused"


def with_refusal(conditions: list[dict[str, Any]], refusal: str | None, reason: str, now: datetime
                 ) -> tuple[list[dict[str, Any]], tuple[str, str, str] | None]:
    """`conditions` with the APIRequestRefused condition as `refusal` (the refused call, the API's message and the
    fix; None once the API accepts the operator's calls again) says, and the Warning Event a new refusal deserves."""
    previous = condition(conditions, REFUSED)
    if refusal is None:
        if previous is None or previous.get("status") != "True":
            return conditions, None
        return with_condition(conditions, REFUSED, False, "Accepted", "the API server accepts the operator's calls",
                              now), None
    repeated = previous is not None and previous.get("status") == "True" and previous.get("message") == refusal
    return (with_condition(conditions, REFUSED, True, reason or "Refused", refusal, now),
            None if repeated else ("Warning", REFUSED, refusal))
