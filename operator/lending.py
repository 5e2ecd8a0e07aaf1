"""The trade of workers between an elastic ParallelTrainingJob and the InferencePools it lends to
(spec.elastic.lendTo), as pure functions: (the job's loan as its status holds it, what the selected pools want and
cannot place, the clock) -> the loan now, and the Events that tell it.

- **A pool's demand.** A selected pool borrows when some of its pods are Pending as Unschedulable for want of a
  resource the job's rank pods hold (the scheduler's `Insufficient nvidia.com/gpu`). Its loan begins with the
  replicas it had placed then (`baseReplicas`: its pods less those it could not place); its demand is its replicas
  (what its autoscaler or `kubectl scale` asks) beyond them, in rank pods' worth of the resource
  (`workersPerReplica`: a replica's request over a rank pod's, of the scarcest resource named).
- **Lending.** A pool short of room borrows up to its demand, within what the job can spare (its rank pods less
  `elastic.minWorkers`, less what it lends already), and only while the group runs at its size with no rank coming
  or going: a loan in flight (its ranks still leaving) is never counted twice for the pods it frees. Demand comes
  from the pool's replicas, not from its pending pods, so a pass that finds the same pods still pending (the
  scheduler has not placed them yet) lends nothing more.
- **Taking back.** Once a pool's demand has stayed below its loan for `stabilizationWindowSeconds` (its
  `surplusSince`), the job takes back the difference; demand that comes back within the window resets the clock.
  A pool no longer selected, or gone, gives its loan back at once.
- **A loan that placed nothing.** A pool that, with the lent ranks' pods gone, has placed none of its replicas
  beyond `baseReplicas` for `placementDeadlineSeconds` (60 s: the scheduler tries a pending pod again on each pod
  deletion, and within 10 s of backoff) cannot run its pods where the ranks ran (its nodeSelector, affinity or
  tolerations keep it off their nodes): its loan is taken back at once, and it is lent nothing more while it stays
  short with its pods placed as then (`unplaceable`, with a digest of their nodeSelector, affinity and tolerations).
- Several jobs may lend to one pool: each loan begins from the replicas the pool had placed then, or from those the
  other jobs' loans pay for where they reach further (`covered`: a loan whose ranks are still leaving has placed
  nothing yet), so two jobs never lend for the same replica, and the later loan is given back first.

The job's rank pods follow the loan (training.py): `spec.workers` less `lent.workers` of them, the highest indices
leaving at a step boundary (the existing elastic shrink), and joining again when taken back.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Any

from tandem.api.training import LendTo
from tandem.operator.observed import RankPod, isoformat, observe_pod, timestamp
from tandem.pod_requests import requests_of

INSUFFICIENT = re.compile(r"Insufficient ([^\s,.]+(?:\.[^\s,.]+)*)")
"""A resource kube-scheduler's message says no node has enough of: `0/2 nodes are available: 2 Insufficient
nvidia.com/gpu.`"""


@dataclass(frozen=True)
class Borrower:
    """A selected InferencePool, as the trade sees it."""

    name: str
    replicas: int
    """What its autoscaler (or `kubectl scale`) asks for: its spec.replicas."""
    pods: int
    """Its server pods, live (not terminating, not finished)."""
    short: int
    """Of those, the ones Pending as Unschedulable for want of a resource the job's rank pods hold."""
    workers_per_replica: float
    """Rank pods' worth of the scarcest such resource one replica needs (0 when none is short)."""
    placement: str = ""
    """A digest of the short pods' nodeSelector, affinity and tolerations (where they may run)."""
    covered: int = 0
    """The replicas the other jobs' loans to it reach: the furthest of their baseReplicas plus the replicas a loan
    pays for (a new loan begins there, not below)."""


@dataclass
class Trade:
    lent: dict[str, Any] | None
    """status.lent as it is now (None: nothing lent)."""
    events: list[tuple[str, str, str]] = field(default_factory=list)
    look_again: float | None = None
    """Seconds until a pool's stabilization window runs out, if one runs: when to look again, to take back then."""

    @property
    def workers(self) -> int:
        return int((self.lent or {}).get("workers") or 0)


def selects(lend_to: LendTo, pool: dict[str, Any]) -> bool:
    labels = pool.get("metadata", {}).get("labels") or {}
    return all(labels.get(key) == value for key, value in lend_to.pool_selector.match_labels.items())


def borrowers(lend_to: LendTo, pools: list[dict[str, Any]], pool_pods: dict[str, list[dict[str, Any]]],
              rank_pod: dict[str, Any] | None, others: list[dict[str, Any]] | None = None) -> list[Borrower]:
    """The pools `lend_to` selects, by name, each with its demand's facts. `rank_pod`: one of the job's rank pods
    (what one holds); without one, nothing is short of what the job holds. `others`: the other jobs' status.lent
    in the namespace (None for a job that lends nothing)."""
    held = {name: amount for name, amount in requests_of(rank_pod).items()
            if amount > 0 and name != "pods"} if rank_pod else {}
    found = []
    for pool in sorted(pools, key=lambda p: p["metadata"]["name"]):
        if not selects(lend_to, pool):
            continue
        name = pool["metadata"]["name"]
        live = [(pod, observed) for pod in pool_pods.get(name, []) if (observed := observe_pod(pod)).live]
        short, ratio, placements = 0, Decimal(0), set()
        for pod, observed in live:
            wanting = [resource for resource in _insufficient(observed) if resource in held]
            if wanting:
                short += 1
                asked = requests_of(pod)
                ratio = max([ratio, *(asked.get(resource, Decimal(0)) / held[resource] for resource in wanting)])
                placements.add(_placement(pod))
        found.append(Borrower(name, int((pool.get("spec") or {}).get("replicas", 1)), len(live), short,
                              float(ratio), "+".join(sorted(placements)), _covered(name, others or [])))
    return found


def _covered(pool: str, lents: list[dict[str, Any] | None]) -> int:
    """The replicas of `pool` that the loans in `lents` reach (0: none lends to it)."""
    return max((int(loan["baseReplicas"]) + math.floor(int(loan["workers"]) / float(loan["workersPerReplica"])
                                                        + 1e-9)
                for lent in lents for loan in (lent or {}).get("pools") or [] if loan.get("name") == pool),
               default=0)


def trade(lent: dict[str, Any] | None, pools: list[Borrower], *, spare: int, may_lend: bool, window_seconds: float,
          now: datetime, placement_seconds: float) -> Trade:
    """The loan after this look (see the module's docstring). `spare`: the rank pods the job may be without (its
    pods less minWorkers); `may_lend`: the group runs at its size, no rank coming or going; `window_seconds` and
    `placement_seconds`: lendTo's stabilizationWindowSeconds and placementDeadlineSeconds."""
    loans = [dict(loan) for loan in (lent or {}).get("pools") or []]
    by_name = {pool.name: pool for pool in pools}
    events: list[tuple[str, str, str]] = []
    look_again: float | None = None
    unplaceable = [entry for entry in (lent or {}).get("unplaceable") or []
                   if entry["name"] in by_name and by_name[entry["name"]].placement == entry["placement"]]
    kept = []
    for loan in loans:
        pool = by_name.get(loan["name"])
        if pool is None:
            events.append(_took_back(loan["workers"], loan["name"], "it is gone or no longer selected by "
                                                                     "spec.elastic.lendTo"))
            continue
        if may_lend and pool.short and pool.pods - pool.short <= int(loan["baseReplicas"]):
            since = timestamp(loan.get("unplacedSince")) or now
            waited = (now - since).total_seconds()
            if waited >= placement_seconds:
                events.append(_took_back(
                    loan["workers"], pool.name,
                    f"none of its replicas was placed in {placement_seconds:g} s with them free, so its pods cannot "
                    "run where the ranks ran (compare its nodeSelector, affinity and tolerations with the job's); "
                    "it is lent nothing more while its pods stay short and placed so"))
                unplaceable.append({"name": pool.name, "placement": pool.placement, "since": isoformat(now)})
                continue
            loan["unplacedSince"] = isoformat(since)
            look_again = _sooner(look_again, placement_seconds - waited)
        else:
            loan.pop("unplacedSince", None)
        needed = _demand(pool, loan)
        if needed >= loan["workers"]:
            loan.pop("surplusSince", None)
        else:
            since = timestamp(loan.get("surplusSince")) or now
            if (now - since).total_seconds() >= window_seconds:
                events.append(_took_back(loan["workers"] - needed, pool.name,
                                         f"its demand fell to {needed} for {window_seconds:g} s "
                                         "(spec.elastic.lendTo.stabilizationWindowSeconds)"))
                loan["workers"] = needed
                loan.pop("surplusSince", None)
            else:
                loan["surplusSince"] = isoformat(since)
                look_again = _sooner(look_again, window_seconds - (now - since).total_seconds())
        if loan["workers"] > 0:
            kept.append(loan)
    loans = kept
    while sum(loan["workers"] for loan in loans) > spare:  # the job was scaled down under its loan
        loan = loans[-1]
        given = min(loan["workers"], sum(loan["workers"] for loan in loans) - spare)
        events.append(_took_back(given, loan["name"], "the job's workers were lowered (elastic.minWorkers holds)"))
        loan["workers"] -= given
        if loan["workers"] == 0:
            loans.pop()
    if may_lend:
        for pool in pools:
            if not pool.short or any(entry["name"] == pool.name for entry in unplaceable):
                continue
            loan = next((loan for loan in loans if loan["name"] == pool.name), None)
            if loan is None:
                loan = {"name": pool.name, "workers": 0,
                        "baseReplicas": max(0, pool.pods - pool.short, pool.covered),
                        "workersPerReplica": pool.workers_per_replica or 1.0}
            left = spare - sum(loan["workers"] for loan in loans)
            more = min(_demand(pool, loan) - loan["workers"], left)
            if more > 0:
                if loan["workers"] == 0:
                    loans.append(loan)
                loan["workers"] += more
                loan.pop("surplusSince", None)
                events.append(("Normal", "Lent", f"Lent {_workers(more)} to InferencePool {pool.name}: "
                                                 f"{_workers(pool.short, 'replica')} could not be placed for want "
                                                 "of what the ranks hold; they leave at a step boundary, the "
                                                 "others train on (spec.elastic.lendTo)"))
    if not loans and not unplaceable:
        return Trade(None, events)
    held_since = (lent or {}).get("since") if (lent or {}).get("pools") else None
    return Trade({"workers": sum(loan["workers"] for loan in loans), "to": [loan["name"] for loan in loans],
                  "since": (held_since or isoformat(now)) if loans else None, "pools": loans,
                  "unplaceable": unplaceable}, events, look_again)


def _sooner(first: float | None, second: float) -> float:
    return second if first is None else min(first, second)


def _demand(pool: Borrower, loan: dict[str, Any]) -> int:
    """Rank pods' worth of the pool's replicas beyond those it had placed when its loan began."""
    beyond = max(0, pool.replicas - int(loan["baseReplicas"]))
    per_replica = float(loan["workersPerReplica"])
    return math.ceil(beyond * per_replica - 1e-9)


def _took_back(count: int, pool: str, why: str) -> tuple[str, str, str]:
    return ("Normal", "TookBack", f"Took back {_workers(count)} from InferencePool {pool}: {why}; they join at a "
                                  "step boundary")


def _workers(count: int, noun: str = "worker") -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _placement(pod: dict[str, Any]) -> str:
    """A digest of where a pod may run: its nodeSelector, affinity and tolerations."""
    spec = pod.get("spec") or {}
    where = json.dumps([spec.get("nodeSelector") or {}, spec.get("affinity") or {}, spec.get("tolerations") or []],
                       sort_keys=True)
    return hashlib.sha256(where.encode()).hexdigest()[:12]


def _insufficient(pod: RankPod) -> list[str]:
    """The resources the scheduler said no node has enough of for this pod (none once it is placed)."""
    return INSUFFICIENT.findall(pod.pending_message) if pod.pending_reason == "Unschedulable" else []


def borrowed(pool: str, jobs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """An InferencePool's status.borrowed: what the jobs' status.lent says they lend it, and which of them found it
    could not use their workers (None: nothing of either)."""
    workers, lenders, since, refusing = 0, set(), [], set()
    for job in jobs:
        lent = (job.get("status") or {}).get("lent") or {}
        for loan in lent.get("pools") or []:
            if loan.get("name") == pool:
                workers += int(loan["workers"])
                lenders.add(job["metadata"]["name"])
                since += [lent["since"]] if lent.get("since") else []
        if any(entry.get("name") == pool for entry in lent.get("unplaceable") or []):
            refusing.add(job["metadata"]["name"])
    if not lenders and not refusing:
        return None
    # since None: the pool holds no loan now (publish deletes the key)
    return {"workers": workers, "from": sorted(lenders), "since": min(since) if since else None,
            "unplaceableFor": sorted(refusing)}
