"""Fault injection, switchable per test: what an API server's misbehaviour looks like to its clients.

`Faults` says what to do to whose requests; `Cluster.inject(faults)` (or `with cluster.faulty(faults):`) switches it
on for the emulator, from any thread. Clients are known by their bearer token (`Emulator.client_of`):
`client-<name>` (a kubeconfig from `Cluster.kubeconfig_for(name)`, e.g. the operator spawned with `client=`) is
`<name>`; a pod's own token `pod-<uid>` is `pods`; the test kubelet's and the Deployment controller's `client-kubelet`
is `kubelet`; anything else (the tests' own clients) is `tests`.

Every fault is a real API answer or a real network failure, never an exception inside the emulator: errors are JSON
`Status` objects (InternalError, ServiceUnavailable, TooManyRequests...) with `Retry-After` where the API server sends
it; a hung request is held unanswered and never applied, then its connection dropped; a watch ends (cleanly, or with
its TCP connection cut) or answers a resume with a 410 Gone ERROR event. What was injected is counted in
`Emulator.injected`, by `(client, fault, method, plural)`.

`Served` and `Hook`: `Cluster.after(predicate, action)` calls `action(served)` once, right after the emulator served
(and committed) a request that `predicate(served)` accepts, before the answer goes back to the client: the moment to
kill the operator between two of its writes (`Cluster.kill_process`).

`node_lost_status`: what kube-controller-manager's node lifecycle controller and PodGC write when a node stops
posting status (see `Kubelet.lose`).
"""

from __future__ import annotations

import logging
import math
import random
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
REASONS = {429: "TooManyRequests", 500: "InternalError", 503: "ServiceUnavailable", 504: "Timeout",
           502: "BadGateway", 409: "Conflict", 400: "BadRequest", 403: "Forbidden", 422: "Invalid"}
HANG_LIMIT = 120.0  # seconds a hung request is held at most


@dataclass(frozen=True)
class Faults:
    clients: frozenset[str] = frozenset({"operator", "pods"})  # whose requests are hit
    resources: frozenset[str] | None = None  # which resources' requests (plurals, e.g. {"pods"}); None: all
    write_fraction: float = 0.0  # of POST/PUT/PATCH/DELETE, answered with one of `write_codes`, nothing written
    write_codes: tuple[int, ...] = (500, 503, 429)
    retry_after: float | None = 1.0  # 429 and 503 carry Retry-After and details.retryAfterSeconds
    latency: float = 0.0  # seconds added before serving each request of those clients (watches: before the stream)
    hang_fraction: float = 0.0  # of non-watch requests: held unanswered and never applied, then dropped
    watch_end_after: float | None = None  # each watch stream of those clients ends after this many seconds
    watch_end_abruptly: bool = False  # False: a clean end (EOF after a complete line); True: the connection is cut
    gone_on_resume: float = 0.0  # of watches with a resourceVersion: answered with a 410 Gone ERROR event
    seed: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.clients, str):
            object.__setattr__(self, "clients", frozenset({self.clients}))
        elif not isinstance(self.clients, frozenset):
            object.__setattr__(self, "clients", frozenset(self.clients))
        if self.resources is not None and not isinstance(self.resources, frozenset):
            object.__setattr__(self, "resources", frozenset(self.resources))


class Counts(Counter):
    """A Counter that other threads may read while the event loop adds to it: its views are copies (taken without
    releasing the GIL), so iterating never meets a dict that changed size."""

    def __iter__(self):
        return iter(list(dict.keys(self)))

    def keys(self):  # type: ignore[override]
        return list(dict.keys(self))

    def values(self):  # type: ignore[override]
        return list(dict.values(self))

    def items(self):  # type: ignore[override]
        return list(dict.items(self))


def status(code: int, message: str, retry_after: float | None) -> tuple[dict[str, Any], dict[str, str]]:
    """The Status object and headers of an injected error (Retry-After for 429 and 503, as the API server)."""
    reason = REASONS.get(code, "InternalError")
    body: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                            "message": message, "reason": reason, "code": code}
    headers: dict[str, str] = {}
    if retry_after is not None and code in (429, 503):
        seconds = max(0, math.ceil(retry_after))
        body["details"] = {"retryAfterSeconds": seconds}
        headers["Retry-After"] = str(seconds)
    return body, headers


class Injector:
    """The emulator's faults now, and the dice; `faults` is read on the event loop, set from any thread."""

    def __init__(self) -> None:
        self.faults: Faults | None = None
        self.rng = random.Random()
        self.counts = Counts()

    def set(self, faults: Faults | None) -> None:
        if faults is not None:
            self.rng = random.Random(faults.seed)
        self.faults = faults

    def roll(self, fraction: float) -> bool:
        return fraction > 0 and (fraction >= 1 or self.rng.random() < fraction)

    def count(self, client: str, fault: str, method: str, plural: str) -> None:
        self.counts[client, fault, method, plural] += 1


@dataclass(frozen=True)
class Served:
    """A request the emulator served (status < 400): who, what, and the decoded request and answer bodies."""
    client: str
    method: str
    plural: str | None
    namespace: str | None
    name: str | None
    subresource: str | None
    body: Any
    result: Any


@dataclass(eq=False)
class Hook:
    """`action(served)` once, after the first served request `predicate` accepts; `fired` is set after it ran."""
    predicate: Callable[[Served], bool]
    action: Callable[[Served], Any]
    fired: threading.Event = field(default_factory=threading.Event)
    served: Served | None = None
    error: BaseException | None = None
    _hooks: Hooks | None = field(default=None, repr=False)

    def cancel(self) -> None:
        if self._hooks is not None:
            self._hooks.remove(self)

    def wait(self, timeout: float | None = None) -> bool:
        return self.fired.wait(timeout)


class Hooks:
    """The hooks not yet spent; added and cancelled from any thread, run on the event loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.pending: list[Hook] = []  # replaced, never mutated: the event loop reads it without the lock

    def add(self, predicate: Callable[[Served], bool], action: Callable[[Served], Any]) -> Hook:
        hook = Hook(predicate, action, _hooks=self)
        with self._lock:
            self.pending = [*self.pending, hook]
        return hook

    def remove(self, hook: Hook) -> bool:
        with self._lock:
            if hook not in self.pending:
                return False
            self.pending = [h for h in self.pending if h is not hook]
            return True

    def run(self, served: Served) -> None:
        for hook in self.pending:
            try:
                matches = hook.predicate(served)
            except Exception:
                logger.exception("a hook's predicate failed")
                continue
            if not matches or not self.remove(hook):
                continue
            hook.served = served
            try:
                hook.action(served)
            except Exception as error:
                hook.error = error
                logger.exception("a hook's action failed")
            finally:
                hook.fired.set()


def node_lost_status(pod: dict[str, Any], node: str, now: str) -> dict[str, Any]:
    """The status PodGC gives a pod bound to a node that stopped responding (kube-controller-manager marks it Failed
    with a DisruptionTarget condition before deleting it; here it is only marked)."""
    conditions = [c for c in (pod.get("status") or {}).get("conditions") or []
                  if c.get("type") not in ("Ready", "ContainersReady", "DisruptionTarget")]
    message = f"Node {node} which was running pod {pod['metadata']['name']} is unresponsive"
    conditions += [
        {"type": "DisruptionTarget", "status": "True", "reason": "DeletionByPodGC",
         "message": "PodGC: node no longer exists", "lastProbeTime": None, "lastTransitionTime": now},
        {"type": "Ready", "status": "False", "reason": "NodeLost", "message": message, "lastProbeTime": None,
         "lastTransitionTime": now},
        {"type": "ContainersReady", "status": "False", "reason": "NodeLost", "message": message,
         "lastProbeTime": None, "lastTransitionTime": now}]
    return {**(pod.get("status") or {}), "phase": "Failed", "reason": "NodeLost", "message": message,
            "conditions": conditions}


def node_unknown_conditions(now: str) -> list[dict[str, Any]]:
    return [{"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown",
             "message": "Kubelet stopped posting node status.", "lastHeartbeatTime": now,
             "lastTransitionTime": now}]
