"""A minimal Deployment controller (kube-controller-manager's part), a client of the API as the real one is: it lists
and watches Deployments and pods, and keeps each Deployment's pods. The harness runs it beside the kubelet.

- pods: `spec.replicas` (default 1) pods of the current template, named `<deployment>-<template hash>-<5 random>`
  (generateName), labelled with the template's labels plus `pod-template-hash`, annotated as the template, owned by
  the Deployment (ownerReference controller=true, blockOwnerDeletion=true). ReplicaSets are skipped: the pods are
  owned by the Deployment directly, and the template hash stands for a ReplicaSet (in conditions' messages too);
- RollingUpdate (the default strategy): after a template change, new pods are created while at most
  `replicas + maxSurge` pods exist, and old ones deleted (the not ready first) while at least `replicas -
  maxUnavailable` pods stay ready (25% each by default, maxSurge rounded up, maxUnavailable down; both 0 reads as
  maxUnavailable 1). With maxUnavailable 0 and maxSurge 1: one new pod; once it is Ready one old pod is deleted; and so
  on: the ready pods (not terminating) are never fewer than `replicas`;
- Recreate: every old pod is deleted, and the new ones are created once the old are all gone;
- scaling (`spec.replicas`, or the scale subresource as `kubectl scale` writes it): pods are created, or the excess
  deleted, the least useful first: unscheduled, then Pending, not ready, most restarted, newest;
- pods that end (Succeeded, Failed) are deleted and replaced, as are pods that vanish; pods being deleted
  (terminating) count for nothing;
- status, through the status subresource: observedGeneration, replicas (the pods not terminating), updatedReplicas,
  readyReplicas, availableReplicas, unavailableReplicas (a count of 0 is omitted, as the API server omits it), and
  conditions Available (MinimumReplicasAvailable / MinimumReplicasUnavailable) and Progressing (ReplicaSetUpdated
  while a rollout runs, NewReplicaSetAvailable once it is complete);
- deletion: the emulator's garbage collection deletes a deleted Deployment's pods (each terminating gracefully).

Not emulated: ReplicaSets and the rollout history (`deployment.kubernetes.io/revision`, `kubectl rollout undo`),
`paused`, `minReadySeconds` (available means ready), `progressDeadlineSeconds` (Progressing never turns False),
adopting or releasing pods by selector (only the pods it created are the Deployment's), proportional scaling of a
rollout's old and new pods, `revisionHistoryLimit`.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import itertools
import json
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .apiclient import MERGE_PATCH, Api, ApiError, Informer
from .writes import timestamp

logger = logging.getLogger(__name__)

HASH_LABEL = "pod-template-hash"
_HASH_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # the API server's safe-encoding alphabet
_COUNTS = ("replicas", "updatedReplicas", "readyReplicas", "availableReplicas", "unavailableReplicas")


def template_hash(template: Mapping[str, Any]) -> str:
    digest = int.from_bytes(hashlib.sha256(json.dumps(template, sort_keys=True).encode()).digest()[:8], "big")
    chars = []
    for _ in range(10):
        digest, index = divmod(digest, len(_HASH_ALPHABET))
        chars.append(_HASH_ALPHABET[index])
    return "".join(chars)


def controller_uid(pod: Mapping[str, Any]) -> str | None:
    """The uid of the Deployment that controls the pod, if one does."""
    return next((ref.get("uid") for ref in pod["metadata"].get("ownerReferences") or []
                 if ref.get("controller") and ref.get("kind") == "Deployment"
                 and ref.get("apiVersion") == "apps/v1"), None)


def _hash_of(pod: Mapping[str, Any]) -> str | None:
    return (pod["metadata"].get("labels") or {}).get(HASH_LABEL)


def is_ready(pod: Mapping[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def is_active(pod: Mapping[str, Any]) -> bool:
    return not pod["metadata"].get("deletionTimestamp") and \
        (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")


def _amount(value: Any, replicas: int, round_up: bool) -> int:
    """An IntOrString of a rolling update (`1`, `"25%"`) as a number of pods."""
    if isinstance(value, str) and value.endswith("%"):
        exact = replicas * int(value[:-1]) / 100
        return math.ceil(exact) if round_up else math.floor(exact)
    return int(value)


@dataclass(frozen=True)
class Strategy:
    recreate: bool
    max_surge: int
    max_unavailable: int

    @classmethod
    def of(cls, spec: Mapping[str, Any], replicas: int) -> Strategy:
        strategy = spec.get("strategy") or {}
        if strategy.get("type") == "Recreate":
            return cls(True, 0, 0)
        rolling = strategy.get("rollingUpdate") or {}
        surge = _amount(rolling.get("maxSurge", "25%"), replicas, round_up=True)
        unavailable = _amount(rolling.get("maxUnavailable", "25%"), replicas, round_up=False)
        return cls(False, surge, 1 if surge == 0 and unavailable == 0 else unavailable)


@dataclass
class Plan:
    """What one sync does: create `create` pods of the current template, delete `delete`."""

    create: int = 0
    delete: list[dict[str, Any]] = field(default_factory=list)


def plan(deployment: Mapping[str, Any], pods: Iterable[Mapping[str, Any]],
         deletion_order: Callable[[Mapping[str, Any]], Any]) -> Plan:
    """The next step towards the Deployment's spec, from the pods it owns (as the controller's cache has them)."""
    spec = deployment.get("spec") or {}
    replicas, current = spec.get("replicas", 1), template_hash(spec.get("template") or {})
    strategy = Strategy.of(spec, replicas)
    pods = list(pods)
    todo = Plan(delete=[p for p in pods if not p["metadata"].get("deletionTimestamp") and not is_active(p)])
    active = [p for p in pods if is_active(p)]
    new = sorted((p for p in active if _hash_of(p) == current), key=deletion_order)
    old = sorted((p for p in active if _hash_of(p) != current), key=deletion_order)
    if strategy.recreate and any(_hash_of(p) != current for p in pods):
        todo.delete += old  # the new ones wait until every old pod is gone
        return todo
    if not old or strategy.recreate:
        todo.create = max(replicas - len(new), 0)
        todo.delete += new[:max(len(new) - replicas, 0)]
        return todo
    total, ready = len(active), sum(map(is_ready, active))
    todo.create = max(min(replicas - len(new), replicas + strategy.max_surge - total), 0)
    min_available = replicas - strategy.max_unavailable
    budget = total - min_available - sum(not is_ready(p) for p in new)
    for pod in old:  # the old pods that are not ready go first, as far as the budget goes
        if budget > 0 and not is_ready(pod):
            todo.delete.append(pod)
            budget -= 1
    healthy = min(budget, ready - min_available)
    todo.delete += [p for p in old if is_ready(p)][:max(healthy, 0)]
    todo.delete += new[:max(len(new) - replicas, 0)]
    return todo


def status_of(deployment: Mapping[str, Any], pods: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The Deployment's status as its pods make it (conditions' times as in its current status where unchanged)."""
    meta, spec = deployment["metadata"], deployment.get("spec") or {}
    replicas, current = spec.get("replicas", 1), template_hash(spec.get("template") or {})
    active = [p for p in pods if is_active(p)]
    new = [p for p in active if _hash_of(p) == current]
    available = sum(map(is_ready, active))
    counts = {"replicas": len(active), "updatedReplicas": len(new), "readyReplicas": available,
              "availableReplicas": available, "unavailableReplicas": max(replicas - available, 0)}
    status: dict[str, Any] = {"observedGeneration": meta.get("generation", 1),
                              **{key: value for key, value in counts.items() if value}}
    replica_set = f'ReplicaSet "{meta["name"]}-{current}"'
    complete = len(new) == len(active) == replicas and available >= replicas
    minimum = available >= replicas - Strategy.of(spec, replicas).max_unavailable
    previous = {c["type"]: c for c in (deployment.get("status") or {}).get("conditions") or []}
    status["conditions"] = [
        _condition(previous.get("Available"), "Available", minimum,
                   *(("MinimumReplicasAvailable", "Deployment has minimum availability.") if minimum else
                     ("MinimumReplicasUnavailable", "Deployment does not have minimum availability."))),
        _condition(previous.get("Progressing"), "Progressing", True,
                   *(("NewReplicaSetAvailable", f"{replica_set} has successfully progressed.") if complete else
                     ("ReplicaSetUpdated", f"{replica_set} is progressing."))),
    ]
    return status


def _condition(previous: Mapping[str, Any] | None, type_: str, ok: bool, reason: str, message: str) -> dict:
    status, now = "True" if ok else "False", timestamp()
    same = previous is not None and previous.get("status") == status
    unchanged = same and (previous.get("reason"), previous.get("message")) == (reason, message)
    return {"type": type_, "status": status,
            "lastUpdateTime": previous.get("lastUpdateTime", now) if unchanged else now,
            "lastTransitionTime": previous.get("lastTransitionTime", now) if same else now,
            "reason": reason, "message": message}


def _without_times(status: Mapping[str, Any] | None) -> dict[str, Any]:
    status = dict(status or {})
    status["conditions"] = [{k: v for k, v in c.items() if not k.endswith("Time")}
                            for c in status.get("conditions") or []]
    return status


def pod_for(deployment: Mapping[str, Any]) -> dict[str, Any]:
    """A new pod of the Deployment's current template."""
    meta, template = deployment["metadata"], (deployment.get("spec") or {}).get("template") or {}
    template_meta, current = template.get("metadata") or {}, template_hash(template)
    pod_meta = {"generateName": f"{meta['name']}-{current}-", "namespace": meta["namespace"],
                "labels": {**(template_meta.get("labels") or {}), HASH_LABEL: current},
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": meta["name"],
                                     "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}]}
    if template_meta.get("annotations"):
        pod_meta["annotations"] = dict(template_meta["annotations"])
    return {"apiVersion": "v1", "kind": "Pod", "metadata": pod_meta, "spec": copy.deepcopy(template.get("spec") or {})}


class DeploymentController:
    def __init__(self, url: str) -> None:
        self.api = Api(url, token="client-kubelet")
        self.deployments = Informer(self.api, "/apis/apps/v1/deployments", self._on_deployment)
        self.pods = Informer(self.api, "/api/v1/pods", self._on_pod)
        self._queue: dict[str, None] = {}  # uids of Deployments to sync, in order
        self._kick = asyncio.Event()
        self._seen: dict[str, int] = {}  # pod uid -> when this controller first saw it (newest: highest)
        self._counter = itertools.count()
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        await self.api.open()
        await self.deployments.start()
        await self.pods.start()
        self._task = asyncio.create_task(self._work(), name="deployment controller")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.pods.stop()
        await self.deployments.stop()
        await self.api.close()

    # -- what the watches tell ------------------------------------------------------------------------------------
    def _enqueue(self, uid: str) -> None:
        self._queue[uid] = None
        self._kick.set()

    def _on_deployment(self, type_: str, deployment: dict[str, Any]) -> None:
        self._enqueue(deployment["metadata"]["uid"])

    def _on_pod(self, type_: str, pod: dict[str, Any]) -> None:
        uid = pod["metadata"]["uid"]
        if type_ == "DELETED":
            self._seen.pop(uid, None)
        else:
            self._seen.setdefault(uid, next(self._counter))
        owner = controller_uid(pod)
        if owner is not None:
            self._enqueue(owner)

    def _deletion_order(self, pod: Mapping[str, Any]) -> tuple:
        status = pod.get("status") or {}
        restarts = sum(c.get("restartCount", 0) for c in status.get("containerStatuses") or [])
        phase = {"Pending": 0, "Unknown": 1, "Running": 2}.get(status.get("phase", "Pending"), 0)
        return (bool((pod.get("spec") or {}).get("nodeName")), phase, is_ready(pod), -restarts,
                -self._seen.get(pod["metadata"]["uid"], 0))

    # -- syncing --------------------------------------------------------------------------------------------------
    async def _work(self) -> None:
        while True:
            await self._kick.wait()
            self._kick.clear()
            while self._queue:
                uid = next(iter(self._queue))
                del self._queue[uid]
                try:
                    await self._sync(uid)
                except asyncio.CancelledError:
                    raise
                except Exception as error:  # an API hiccup, or a bug: try again shortly
                    logger.warning("deployments: syncing %s failed (%r); trying again", uid, error)
                    asyncio.get_running_loop().call_later(0.5, self._enqueue, uid)

    async def _sync(self, uid: str) -> None:
        deployment = self.deployments.objects.get(uid)
        if deployment is None or deployment["metadata"].get("deletionTimestamp"):
            return
        meta = deployment["metadata"]
        base = f"/apis/apps/v1/namespaces/{meta['namespace']}/deployments/{meta['name']}"
        owned = [p for p in self.pods.objects.values() if controller_uid(p) == uid]
        todo = plan(deployment, owned, self._deletion_order)
        if todo.create and await self._gone(deployment, base):
            return
        for _ in range(todo.create):
            created = await self.api.request("POST", f"/api/v1/namespaces/{meta['namespace']}/pods",
                                             pod_for(deployment))
            self._seen.setdefault(created["metadata"]["uid"], next(self._counter))
            self.pods.remember(created)
        for pod in todo.delete:
            await self._delete(pod)
        owned = [p for p in self.pods.objects.values() if controller_uid(p) == uid]
        status = status_of(deployment, owned)
        if _without_times(status) != _without_times(deployment.get("status")):
            patch = {"status": {**{key: None for key in _COUNTS}, **status}}  # null: a count now 0 is omitted
            try:
                self.deployments.remember(await self.api.request("PATCH", f"{base}/status", patch, MERGE_PATCH))
            except ApiError as error:
                if error.status != 404:
                    raise

    async def _gone(self, deployment: dict[str, Any], path: str) -> bool:
        """Whether the Deployment was deleted though its watch has not said so yet (its pods may be going because
        of it: no new ones then)."""
        if await self.api.get(path) is not None:
            return False
        self.deployments.remember(deployment, deleted=True)
        return True

    async def _delete(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        try:
            answer = await self.api.request("DELETE", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                                            {"preconditions": {"uid": meta["uid"]}})
        except ApiError as error:
            if error.status in (404, 409):
                return  # gone already
            raise
        self.pods.remember(answer, deleted=not answer["metadata"].get("deletionTimestamp"))
