"""The one reconciliation loop that the daemon of every ParallelTrainingJob and every InferencePool runs.

A pass reads the object and its children from kopf's indices, decides (a pure function), and applies the decision
through the API. The loop runs a pass whenever the object or a child changes (its waker), when the decision asks to
look again, and after an API failure, by the operator's error policy (api_policy.py):

- `Unavailable` (transient errors on every attempt of a call): the pass is decided again within seconds (jittered,
  doubling from 0.5 s to at most 5 s, never sooner than the server's Retry-After), never left to kopf's 60 s
  default;
- `Stale` (409 on a replace), or an object gone under a call (a 404 its caller does not absorb): decided again in
  a moment, on the newer state the watch brings;
- `Refused` (400, 403, 422): an APIRequestRefused condition on the object names the call, the API's message and
  the fix, with a Warning Event; decided again on any change, or after REFUSED_SECONDS (RBAC may be fixed).

kopf's relist after a watch's 410 Gone reports no deletions, so a child deleted meanwhile stays in its index for
good. A child the API answers 404 for, or that a LIST no longer holds while the index shows it terminating
(`Reconciliation.confirm_deletions`), is left out of every later pass (`Reconciliation.present`).

An API failure ends a pass, nothing more: it never restarts a group and never counts toward `backoffLimit` (those
are decided from the pods alone). The operator's status fields are kept as last written (`written`) and laid over
the body the pass reads, because the watch can lag behind the operator's own patch; they are only ever the
operator's fields, so rank 0's (progress, metrics, communication, checkpoint, preemptionCost) are never patched
from a stale view.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from tandem.manifest import merge_patched, without_nulls
from tandem.operator import metrics
from tandem.operator.api_policy import Backoff, Refused, Stale, Unavailable
from tandem.operator.observed import with_refusal
from tandem.operator.training_plan import ETA_REMOVED

log = logging.getLogger("tandem.operator")

PASS_BACKOFF = Backoff(base=0.5, cap=5.0)
STALE_SECONDS = 0.2
CONFIRM_SECONDS = 2.0
REFUSED_SECONDS = 30.0
DAEMON_BACKOFF = 1.0
"""kopf's backoff after a daemon raised something unexpected (a bug): a last resort, never kopf's 60 s default."""
OPERATOR_FIELDS = frozenset({"phase", "conditions", "workers", "master", "restarts", "startTime", "completionTime",
                             "message", "observedGeneration", "selector", "replicas", "readyReplicas", "readySummary",
                             "endpoint", "model", "lastSkipped", "queue", "batching", "recoveries", "lastRecovery",
                             "lent", "borrowed"})
"""The status fields the operator writes; the rest of a job's status (progress, metrics, communication,
checkpoint, preemptionCost) is rank 0's. Two are shared, each writer merging in its own part: `recoveries` (the
operator's `restarts`, rank 0's `regroups`) and `lastRecovery` (the operator's when it restarts the group, rank 0's
when it regroups; each sent only when it writes a new one)."""
OWN_FIELDS = OPERATOR_FIELDS - {"recoveries"}
"""The fields the operator alone writes: `publish` deletes a key of theirs it no longer sends (a null in the merge
patch). In the others (`recoveries`, whose writers each send their own keys, and rank 0's `progress`, of which it
sends ETA_REMOVED) what it leaves out is left as it is."""
FINISHED = -1.0
"""What a pass returns when the object needs no daemon any more (a job deleted after its TTL)."""


@dataclass
class Reconciliation:
    """What one object's daemon keeps between passes."""

    plural: str
    namespace: str
    name: str
    written: dict[str, Any] = field(default_factory=dict)
    """The operator's status fields as last patched (the watch may not have brought them yet)."""
    refusal: Refused | None = None
    """The last call the API refused, until a pass completes."""
    gone: set[str] = field(default_factory=set)
    """Uids of children the API no longer holds while kopf's index still does: kopf's relist after a watch's 410
    Gone reports no deletions, so a child deleted meanwhile stays in the index for good."""
    confirmed_at: float = -CONFIRM_SECONDS
    """When `confirm_deletions` last listed the children (time.monotonic())."""
    regroups_seen: int | None = None
    """An elastic job's status.recoveries.regroups at the last pass (None before the first): each regroup rank 0
    reports after it gets an Event."""

    def observed(self, body: kopf.Body) -> dict[str, Any]:
        """The body, with the operator's own status fields as last written; of the two it shares with rank 0, its
        part of `recoveries` merged into rank 0's, and `lastRecovery` as the body has it (rank 0's may be newer)."""
        held = body.get("status") or {}
        status = {**held, **{key: value for key, value in self.written.items() if key != "lastRecovery"}}
        if "recoveries" in self.written:
            status["recoveries"] = {**(held.get("recoveries") or {}), **self.written["recoveries"]}
        return {**body, "status": status}

    def present(self, children: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
        """The children kopf's index holds, less those the API has said are gone."""
        return [child for child in children if child["metadata"].get("uid") not in self.gone]

    async def confirm_deletions(self, children: list[dict[str, Any]],
                                listed: Callable[[], Awaitable[set[str]]]) -> list[dict[str, Any]]:
        """`children` less the terminating ones the API no longer holds. While the index shows a child terminating
        (a pass waits for it to go), at most every CONFIRM_SECONDS, `listed()` (a LIST: the uids the API holds)
        confirms it is still there: a deletion the watch missed would otherwise be waited for forever."""
        if (not any(child["metadata"].get("deletionTimestamp") for child in children)
                or time.monotonic() - self.confirmed_at < CONFIRM_SECONDS):
            return children
        self.confirmed_at = time.monotonic()
        held = await listed()
        for child in children:
            if child["metadata"].get("uid") not in held:
                self.found_gone(child)
        return self.present(children)

    def found_gone(self, child: dict[str, Any]) -> None:
        """The API answered 404 for `child`, which the index held: from now on it is not `present`, whatever the
        index says (a new object of the same name has another uid)."""
        log.info("%s %s was deleted while a watch was down; kopf's index still holds it", child.get("kind", "object"),
                 child["metadata"]["name"])
        self.gone.add(child["metadata"].get("uid"))

async def run(state: Reconciliation, waker: asyncio.Event, stopped: kopf.DaemonStopped,
              one_pass: Callable[[], Awaitable[float | None]]) -> None:
    """Run `one_pass` (which returns when to look again: seconds, None for "on a change only", or FINISHED) until
    the daemon is stopped, deciding again after every API failure as the policy says."""
    failures = 0
    while not stopped:
        waker.clear()
        started = time.perf_counter()
        try:
            requeue = await one_pass()
        except Refused as error:
            metrics.PASS_FAILURES.labels(state.plural, "refused").inc()
            state.refusal, requeue = error, REFUSED_SECONDS
        except (Stale, ApiException):  # a replace that met a newer version; an object gone under a call
            metrics.PASS_FAILURES.labels(state.plural, "stale").inc()
            requeue = STALE_SECONDS
        except Unavailable as error:
            metrics.PASS_FAILURES.labels(state.plural, "unavailable").inc()
            requeue = PASS_BACKOFF.delay(failures, error.retry_after)
            failures += 1
        else:
            failures = 0
            if state.refusal is not None:  # accepted now: one more pass clears the condition
                state.refusal, requeue = None, 0.0
        finally:
            metrics.RECONCILE_SECONDS.observe(time.perf_counter() - started)
        if requeue == FINISHED:
            return
        await sleep(waker, stopped, requeue)


async def publish(cluster: Any, state: Reconciliation, body: dict[str, Any], status: dict[str, Any],
                  events: list[tuple[str, str, str]]) -> dict[str, Any]:
    """Patch the operator's status fields that differ from `body`'s (so its own writes do not wake it in a loop),
    with the APIRequestRefused condition as the last refusal says; post the decision's Events; return what was
    patched. Only the operator's fields are ever sent, and ETA_REMOVED."""
    foreign = {key for key, value in status.items() if key not in OPERATOR_FIELDS and ETA_REMOVED.get(key) != value}
    if foreign:
        raise ValueError(f"the operator never writes status fields {sorted(foreign)}: they are rank 0's")
    status = dict(status)
    if "conditions" in status:
        status["conditions"], event = with_refusal(status["conditions"], describe_refusal(state.refusal),
                                                   state.refusal.reason if state.refusal else "",
                                                   datetime.now(UTC))
        events = [*events, event] if event else events
    current = body.get("status") or {}
    patches = {key: merge_patch(current.get(key), value) if key in OWN_FIELDS else value
               for key, value in status.items()}
    # The body's status fields as last written may hold nulls; the object the API holds has none.
    changed = {key: patch for key, patch in patches.items()
               if without_nulls(merge_patched(current.get(key), patch)) != without_nulls(current.get(key))}
    if changed:
        await cluster.patch_status(state.plural, state.name, state.namespace, changed)
    state.written = {key: value for key, value in status.items() if key in OPERATOR_FIELDS}
    for kind, reason, message in events:
        kopf.event(body, type=kind, reason=reason, message=message)
    return changed


def merge_patch(current: Any, new: Any) -> Any:
    """The JSON merge patch (RFC 7386) that makes `current` into `new`: `new`, with a null for each key of a dict that
    `new` no longer has, at any depth (a merge patch keeps what it does not name; a list it replaces whole)."""
    if not isinstance(current, dict) or not isinstance(new, dict):
        return new
    return {**dict.fromkeys(current.keys() - new.keys()),
            **{key: merge_patch(current.get(key), value) for key, value in new.items()}}


def describe_refusal(refusal: Refused | None) -> str | None:
    if refusal is None:
        return None
    return (f"{refusal.verb} {refusal.kind} {refusal.target} was refused: {refusal.code} {refusal.reason}: "
            f"{refusal.message}; fix: {refusal.fix()}")


async def all_of(calls: Iterable[Awaitable[Any]]) -> list[Any]:
    """Run `calls` concurrently and wait for every one; then raise the first failure, if any (none is left running
    unobserved)."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


async def sleep(waker: asyncio.Event, stopped: kopf.DaemonStopped, seconds: float | None) -> None:
    """Until something about the object changes, the daemon is stopped, or `seconds` pass."""
    waits = [asyncio.ensure_future(waker.wait()), asyncio.ensure_future(stopped.wait())]
    try:
        await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
