"""The pod status a kubelet writes: phase, conditions, addresses and the first container's status.

States: `waiting` (ContainerCreating, ErrImagePull, ImagePullBackOff, CreateContainerConfigError, CrashLoopBackOff),
`running` (startedAt), `terminated` (exitCode, reason Completed/Error/StartError, message, startedAt,
finishedAt). With `terminationMessagePolicy: FallbackToLogsOnError` a non-zero exit's message is the tail of the
container's log, at most 80 lines and 2048 bytes: the kubelet's MaxContainerTerminationMessageLogLines and
MaxContainerTerminationMessageLogLength (its 4096-byte limit is for messages written to the termination file).
Conditions PodScheduled, Initialized, ContainersReady and Ready keep their lastTransitionTime until their status
changes. A running container is `started` and `ready` as its probes say (probes.py); ContainersReady and Ready follow
`ready`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from .writes import timestamp

TERMINATION_LOG_LINES = 80
TERMINATION_LOG_BYTES = 2048


def waiting(reason: str, message: str | None = None) -> dict[str, Any]:
    return {"waiting": {"reason": reason, **({"message": message} if message else {})}}


def running(started_at: str) -> dict[str, Any]:
    return {"running": {"startedAt": started_at}}


def terminated(exit_code: int, started_at: str | None, *, reason: str | None = None, message: str | None = None,
               container_id: str | None = None) -> dict[str, Any]:
    state = {"exitCode": exit_code, "reason": reason or ("Completed" if exit_code == 0 else "Error"),
             "startedAt": started_at, "finishedAt": timestamp()}
    if message:
        state["message"] = message
    if container_id:
        state["containerID"] = container_id
    return {"terminated": state}


def qos_class(pod: dict[str, Any]) -> str:
    containers = pod.get("spec", {}).get("containers") or []
    resources = [c.get("resources") or {} for c in containers]
    if not any(r.get("requests") or r.get("limits") for r in resources):
        return "BestEffort"
    guaranteed = all((r.get("limits") or {}).get(name) and
                     (r.get("requests") or {}).get(name, r["limits"][name]) == r["limits"][name]
                     for r in resources for name in ("cpu", "memory"))
    return "Guaranteed" if guaranteed else "Burstable"


def log_tail(path: Path | None) -> str:
    """What FallbackToLogsOnError puts in the termination message."""
    if path is None or not path.exists():
        return ""
    with open(path, "rb") as log:
        log.seek(0, 2)
        log.seek(max(0, log.tell() - TERMINATION_LOG_BYTES))
        data = log.read()
    lines = data.splitlines(keepends=True)[-TERMINATION_LOG_LINES:]
    return b"".join(lines).decode(errors="replace")


class StatusBook:
    """One pod's status as its kubelet last wrote it."""

    def __init__(self, pod: dict[str, Any], node: str, ip: str) -> None:
        self.pod, self.node, self.ip = pod, node, ip
        self.container = pod["spec"]["containers"][0]
        self.start_time = timestamp()
        self._since = {c["type"]: (c["status"], c.get("lastTransitionTime"))
                       for c in (pod.get("status") or {}).get("conditions") or []}

    def _condition(self, type_: str, ok: bool, reason: str | None = None, message: str | None = None) -> dict:
        status = "True" if ok else "False"
        previous = self._since.get(type_)
        since = previous[1] if previous and previous[0] == status and previous[1] else timestamp()
        self._since[type_] = (status, since)
        condition = {"type": type_, "status": status, "lastProbeTime": None, "lastTransitionTime": since}
        if reason:
            condition.update(reason=reason, **({"message": message} if message else {}))
        return condition

    def status(self, state: dict[str, Any], *, phase: str, restarts: int = 0,
               last_state: dict[str, Any] | None = None, container_id: str | None = None, started: bool = True,
               ready: bool = True) -> dict[str, Any]:
        started, ready = "running" in state and started, "running" in state and started and ready
        name, image = self.container["name"], self.container.get("image", "")
        not_ready = ("PodCompleted", None) if phase in ("Succeeded", "Failed") else \
            ("ContainersNotReady", f"containers with unready status: [{name}]")
        container_status = {
            "name": name, "image": image, "imageID": "" if "waiting" in state and restarts == 0 else
            f"{image}@sha256:{hashlib.sha256(image.encode()).hexdigest()}",
            "ready": ready, "started": started, "restartCount": restarts, "state": state, "lastState": last_state or {},
        }
        if container_id:
            container_status["containerID"] = container_id
        return {
            "phase": phase, "hostIP": "127.0.0.1", "hostIPs": [{"ip": "127.0.0.1"}],
            "podIP": self.ip, "podIPs": [{"ip": self.ip}], "startTime": self.start_time,
            "qosClass": qos_class(self.pod),
            "conditions": [
                self._condition("PodScheduled", True),
                self._condition("Initialized", True),
                self._condition("ContainersReady", ready, *(() if ready else not_ready)),
                self._condition("Ready", ready, *(() if ready else not_ready)),
            ],
            "containerStatuses": [container_status],
        }
