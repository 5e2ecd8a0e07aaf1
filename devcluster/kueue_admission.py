"""Kueue's admission decisions as pure functions (devcluster/kueue.py runs them against the API; its docstring says
what is emulated and what is not): flavor assignment, the choice of preemption victims, and `plan`, one whole
scheduling pass: the status each Workload should have now. Each function names the Kueue code it follows
(kubernetes-sigs/kueue at ff69552e: pkg/scheduler, pkg/scheduler/flavorassigner, pkg/scheduler/preemption,
pkg/workload, pkg/workload/evict, pkg/controller/core/workload_controller.go)."""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .kueue_objects import (
    Fr,
    Group,
    Queue,
    find,
    holds_quota,
    is_active,
    is_pending,
    is_true,
    podset_requests,
    priority,
    quantity,
    queue_key,
    set_condition,
    usage_of,
)

FIT, PREEMPT, NO_FIT = "Fit", "Preempt", "NoFit"
_SEVERITY = {"": 0, "WaitingForQuota": 2, "ExceedsMaxQuota": 3, "NoMatchingFlavor": 4}  # flavorassigner.go


# -- flavor assignment (flavorassigner.go) ---------------------------------------------------------------------------
@dataclass
class Assignment:
    mode: str = FIT
    podsets: list[dict[str, Any]] = field(default_factory=list)  # the admission's podSetAssignments
    usage: dict[Fr, int] = field(default_factory=dict)
    messages: list[str] = field(default_factory=list)
    reason: str = ""  # the NoFit reason of UnadmittedWorkloadsObservability

    @property
    def message(self) -> str:
        return "; ".join(self.messages)


def _selector_matches(pod_spec: Mapping[str, Any], flavor: Mapping[str, Any]) -> bool:
    """The pod's nodeSelector, on the keys this flavor labels, against its nodeLabels (affinity is not read)."""
    labels = (flavor.get("spec") or {}).get("nodeLabels") or {}
    return all(labels[key] == value for key, value in (pod_spec.get("nodeSelector") or {}).items() if key in labels)


def _find_flavor(group: Group, wanted: Mapping[str, int], pod_spec: Mapping[str, Any], flavors: Mapping[str, Any],
                 used: Mapping[Fr, int], assumed: Mapping[Fr, int], reclaimable: Mapping[Fr, int]
                 ) -> tuple[str | None, str, list[str], str]:
    """findFlavorForPodSets: (flavor, mode, reasons, NoFit reason) for one resource group of one pod set. The first
    flavor that fits wins; else the first where preemption could make room (whenCanPreempt: TryNextFlavor)."""
    reasons: list[str] = []
    chosen, group_reason = None, ""
    for name, quotas in group.flavors:
        if name not in flavors:
            reasons.append(f"flavor {name} not found")
            group_reason = _least(group_reason, "NoMatchingFlavor")
            continue
        if not _selector_matches(pod_spec, flavors[name]):
            reasons.append(f"flavor {name} doesn't match node affinity")
            group_reason = _least(group_reason, "NoMatchingFlavor")
            continue
        mode, flavor_reason = FIT, ""
        for resource in sorted(wanted):
            fr, request = (name, resource), wanted[resource]
            nominal, before = quotas.get(resource, 0), assumed.get((name, resource), 0)
            value = before + request
            if value > nominal:
                reasons.append(f"insufficient quota for {resource} in flavor {name}, previously considered podsets "
                               f"requests ({quantity(resource, before)}) + current podset request "
                               f"({quantity(resource, request)}) > maximum capacity ({quantity(resource, nominal)})")
                mode, flavor_reason = NO_FIT, _most(flavor_reason, "ExceedsMaxQuota")
                continue
            available = nominal - used.get(fr, 0)
            if value <= available:
                continue
            reasons.append(f"insufficient unused quota for {resource} in flavor {name}, "
                           f"{quantity(resource, value - available)} more needed")
            if used.get(fr, 0) - reclaimable.get(fr, 0) + value <= nominal:
                mode = PREEMPT if mode == FIT else mode
            else:
                mode, flavor_reason = NO_FIT, _most(flavor_reason, "WaitingForQuota")
        if mode == FIT:
            return name, FIT, [], ""
        if mode == PREEMPT and chosen is None:
            chosen = name
        group_reason = _least(group_reason, flavor_reason) if mode == NO_FIT else group_reason
    return chosen, PREEMPT if chosen else NO_FIT, sorted(reasons), group_reason


def _most(a: str, b: str) -> str:
    return a if _SEVERITY.get(a, 0) >= _SEVERITY.get(b, 0) else b


def _least(a: str, b: str) -> str:
    return b if not a or _SEVERITY.get(b, 0) < _SEVERITY.get(a, 0) else a


def assign_flavors(workload: Mapping[str, Any], queue: Queue, flavors: Mapping[str, Any], used: Mapping[Fr, int],
                   reclaimable: Mapping[Fr, int], ignore_undeclared: bool = False) -> Assignment:
    """assignFlavors: each pod set in order, each resource group it asks for, the quota its earlier pod sets took
    counted (a pod set that cannot be placed ends the search). `used` is the ClusterQueue's usage; `reclaimable`
    what the Workloads it could preempt hold, by (flavor, resource)."""
    result, assumed = Assignment(), defaultdict(int)
    for podset in (workload.get("spec") or {}).get("podSets") or []:
        name, count = podset.get("name", "main"), int(podset.get("count", 1))
        requests = podset_requests(podset)
        if queue.group_of("pods"):
            requests["pods"] = count
        pod_spec = (podset.get("template") or {}).get("spec") or {}
        chosen: dict[str, str] = {}
        reasons: list[str] = []
        mode, failed = FIT, None
        # Kueue meets the resources in Go's map order (random): a resource no group covers is reported first here
        undeclared = [r for r in sorted(requests) if requests[r] and queue.group_of(r) is None]
        if undeclared and not ignore_undeclared:
            failed = ([f"resource {undeclared[0]} unavailable in ClusterQueue"], "NoMatchingFlavor")
        for resource in sorted(requests) if failed is None else ():
            group = queue.group_of(resource)
            if group is None:
                continue
            if resource in chosen:
                continue
            wanted = {r: v for r, v in requests.items() if r in group.covered}
            flavor, group_mode, group_reasons, group_reason = _find_flavor(group, wanted, pod_spec, flavors, used,
                                                                           assumed, reclaimable)
            if flavor is None:
                failed = (group_reasons, group_reason)
                break
            chosen.update(dict.fromkeys(wanted, flavor))
            reasons += group_reasons
            mode = PREEMPT if group_mode == PREEMPT else mode
        if failed is not None:
            result.mode, result.reason = NO_FIT, failed[1]
            result.messages.append(f"couldn't assign flavors to pod set {name}: {', '.join(sorted(failed[0]))}")
            return result
        if mode == PREEMPT:
            result.mode = PREEMPT
            result.messages.append(f"couldn't assign flavors to pod set {name}: {', '.join(sorted(reasons))}")
        for resource, flavor in chosen.items():
            assumed[flavor, resource] += requests[resource]
        placed: dict[str, Any] = {"name": name, "count": count}
        if chosen:
            placed["flavors"] = dict(sorted(chosen.items()))
            placed["resourceUsage"] = {r: quantity(r, requests[r]) for r in sorted(chosen)}
        result.podsets.append(placed)
    result.usage = dict(assumed)
    return result


# -- preemption (preemption.go, common/ordering.go, common/preemption_policy.go) -----------------------------------
def may_preempt(policy: str, preemptor: Mapping[str, Any], candidate: Mapping[str, Any],
                seen: Mapping[str, int]) -> bool:
    """SatisfiesPreemptionPolicy within the ClusterQueue: LowerPriority, or LowerOrNewerEqualPriority (an equal
    priority Workload later in the queue order too); Never preempts nothing."""
    lower = priority(preemptor) > priority(candidate)
    if policy == "LowerPriority":
        return lower
    if policy == "LowerOrNewerEqualPriority":
        return lower or (priority(preemptor) == priority(candidate)
                         and queue_key(preemptor, seen)[1:] < queue_key(candidate, seen)[1:])
    return False


def victim_key(workload: Mapping[str, Any], admitted_order: Mapping[str, int]) -> tuple:
    """CandidatesOrdering: already Evicted first, then lower priority, then the most recently admitted (the
    QuotaReserved transition, same-second ties by this controller's admission order), then uid."""
    status, meta = workload.get("status") or {}, workload["metadata"]
    since = (find(status, "QuotaReserved") or {}).get("lastTransitionTime", "")
    return (not is_true(status, "Evicted"), priority(workload), _descending(since),
            -admitted_order.get(meta["uid"], 0), meta["uid"])


def _descending(text: str) -> tuple[int, ...]:
    return tuple(-ord(char) for char in text)


def choose_victims(queue: Queue, need: Mapping[Fr, int], used: Mapping[Fr, int], candidates: list[Mapping[str, Any]],
                   admitted_order: Mapping[str, int]) -> list[Mapping[str, Any]] | None:
    """classicalPreemptions within one ClusterQueue: remove candidates in CandidatesOrdering until `need` fits the
    nominal quota, then add back, latest removed first (the last one excepted), those it still fits without. None
    when removing them all is not enough. Only candidates using a (flavor, resource) that needs room count."""
    short = {fr for fr, value in need.items() if used.get(fr, 0) + value > queue.nominal(fr)}
    remaining = dict(used)

    def fits() -> bool:
        return all(remaining.get(fr, 0) + value <= queue.nominal(fr) for fr, value in need.items())

    def move(workload: Mapping[str, Any], sign: int) -> None:
        for fr, value in usage_of(workload).items():
            remaining[fr] = remaining.get(fr, 0) + sign * value

    targets: list[Mapping[str, Any]] = []
    for candidate in sorted((c for c in candidates if short & set(usage_of(c))),
                            key=lambda c: victim_key(c, admitted_order)):
        move(candidate, -1)
        targets.append(candidate)
        if fits():
            for index in range(len(targets) - 2, -1, -1):
                move(targets[index], +1)
                if fits():
                    targets[index] = targets[-1]
                    targets.pop()
                else:
                    move(targets[index], -1)
            return targets
    return None


# -- one pass -------------------------------------------------------------------------------------------------------
@dataclass
class Decision:
    """The status a Workload should have now (`event`: admitted, preempted, deactivated, for the history)."""

    workload: Mapping[str, Any]
    status: dict[str, Any]
    event: str | None = None


@dataclass
class World:
    """What the controller's watches hold: objects by name (Workloads by uid, LocalQueues by (namespace, name))."""

    workloads: dict[str, dict[str, Any]]
    cluster_queues: dict[str, dict[str, Any]]
    local_queues: dict[tuple[str, str], dict[str, Any]]
    flavors: dict[str, dict[str, Any]]
    namespaces: dict[str, dict[str, Any]]
    seen: Mapping[str, int] = field(default_factory=dict)  # uid -> when first seen (queue order ties)
    admitted_order: Mapping[str, int] = field(default_factory=dict)  # uid -> when admitted here (victim order)


def _live(obj: Mapping[str, Any] | None) -> bool:
    return obj is not None and not obj["metadata"].get("deletionTimestamp")


_RANK = {"preempted": 0, "deactivated": 0, "admitted": 1}  # the order to write: evictions, admissions, the rest


def plan(world: World, now: str, granular: bool = False, ignore_undeclared: bool = False) -> list[Decision]:
    """One scheduling pass over every ClusterQueue: deactivations, then per ClusterQueue admissions in queue order,
    preemptions and the pending Workloads' reasons. Returns only the Workloads whose status changes, in the order to
    write them: evictions, then admissions (each in the order decided), then the rest."""
    statuses = {uid: copy.deepcopy(w.get("status") or {}) for uid, w in world.workloads.items()}
    events: dict[str, str] = {}
    for uid, workload in world.workloads.items():
        _deactivation(workload, statuses[uid], now, events)
    by_queue: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for uid, workload in world.workloads.items():
        if not is_pending(workload, statuses[uid]):
            continue
        meta, status = workload["metadata"], statuses[uid]
        local = world.local_queues.get((meta["namespace"], workload["spec"]["queueName"]))
        if not _live(local):
            _unset(status, workload, "Misconfigured" if granular else "Inadmissible",
                   f"LocalQueue {workload['spec']['queueName']} is terminating or missing", now, granular, False)
            continue
        cq = (local.get("spec") or {}).get("clusterQueue", "")
        if not _live(world.cluster_queues.get(cq)):
            _unset(status, workload, "Misconfigured" if granular else "Inadmissible",
                   f"ClusterQueue {cq} is terminating or missing", now, granular, False)
            continue
        by_queue[cq].append(workload)
    for cq_name in sorted(by_queue):
        _schedule(world, Queue.of(world.cluster_queues[cq_name]), by_queue[cq_name], statuses, events, now, granular,
                  ignore_undeclared)
    order = {uid: index for index, uid in enumerate(events)}  # the order of the decisions
    changed = [uid for uid, status in statuses.items() if status != (world.workloads[uid].get("status") or {})]
    changed.sort(key=lambda uid: (_RANK.get(events.get(uid, ""), 2), order.get(uid, len(order))))
    return [Decision(world.workloads[uid], statuses[uid], events.get(uid)) for uid in changed]


def _deactivation(workload: Mapping[str, Any], status: dict[str, Any], now: str, events: dict[str, str]) -> None:
    """The workload controller: an inactive Workload is Evicted (Deactivated) once; a reactivated one whose owner
    held it with Requeued=False (Deactivated) is Requeued=True (Reactivated)."""
    generation, uid = workload["metadata"].get("generation"), workload["metadata"]["uid"]
    if is_true(status, "Finished"):
        return
    if not is_active(workload):
        if not is_true(status, "Evicted"):
            _evict(status, "Deactivated", "The workload is deactivated", now, generation)
            events[uid] = "deactivated"
        status.pop("requeueState", None)
        return
    requeued = find(status, "Requeued")
    if requeued and requeued.get("status") == "False" and requeued.get("reason") == "Deactivated":
        set_condition(status, "Requeued", True, "Reactivated", "The workload was reactivated", now, generation)


def _evict(status: dict[str, Any], reason: str, message: str, now: str, generation: int | None) -> None:
    """evict.prepareForEviction: Evicted=True, nominations cleared, and the eviction counted in schedulingStats."""
    set_condition(status, "Evicted", True, reason, message, now, generation)
    status.pop("clusterName", None)
    status.pop("nominatedClusterNames", None)
    evictions = status.setdefault("schedulingStats", {}).setdefault("evictions", [])
    entry = next((e for e in evictions if e.get("reason") == reason and not e.get("underlyingCause")), None)
    if entry is None:
        evictions.append({"reason": reason, "underlyingCause": "", "count": 1})
    else:
        entry["count"] = entry.get("count", 0) + 1


def _unset(status: dict[str, Any], workload: Mapping[str, Any], reason: str, message: str, now: str,
           granular: bool, requests: bool = True) -> None:
    """UnsetQuotaReservationWithCondition and SyncAdmittedCondition for a Workload that stays pending, and (the
    scheduler's, `requests`) PropagateResourceRequests."""
    set_condition(status, "QuotaReserved", False, reason, message, now, workload["metadata"].get("generation"))
    status.pop("admission", None)
    if granular or is_true(status, "Admitted"):
        set_condition(status, "Admitted", False, "NoReservation", "The workload has no reservation", now,
                      workload["metadata"].get("generation"))
    if not requests:
        return
    status["resourceRequests"] = [
        {"name": ps.get("name", "main"),
         "resources": {r: quantity(r, v) for r, v in sorted(podset_requests(ps).items())}}
        for ps in (workload.get("spec") or {}).get("podSets") or []]


def _schedule(world: World, queue: Queue, pending: list[dict[str, Any]], statuses: dict[str, dict[str, Any]],
              events: dict[str, str], now: str, granular: bool, ignore_undeclared: bool) -> None:
    holding = [w for w in world.workloads.values() if holds_quota(w)
               and (w["status"]["admission"] or {}).get("clusterQueue") == queue.name]
    used: dict[Fr, int] = defaultdict(int)
    for workload in holding:
        for fr, value in usage_of(workload).items():
            used[fr] += value
    missing = sorted(queue.flavor_names() - set(world.flavors))
    admitted = False
    for workload in sorted(pending, key=lambda w: queue_key(w, world.seen)):
        uid, meta = workload["metadata"]["uid"], workload["metadata"]
        status = statuses[uid]
        if missing:
            _unset(status, workload, "Suspended" if granular else "Pending",
                   f"ClusterQueue {queue.name} is inactive", now, granular)
            continue
        if not queue.admits_namespace(world.namespaces.get(meta["namespace"])):
            _unset(status, workload, "Misconfigured" if granular else "Pending",
                   "workload namespace doesn't match ClusterQueue selector", now, granular)
            continue
        candidates = [w for w in holding if may_preempt(queue.policy, workload, w, world.seen)]
        reclaimable: dict[Fr, int] = defaultdict(int)
        for candidate in candidates:
            for fr, value in usage_of(candidate).items():
                reclaimable[fr] += value
        assignment = assign_flavors(workload, queue, world.flavors, used, reclaimable, ignore_undeclared)
        if assignment.mode == FIT:
            _admit(status, workload, queue, assignment, now)
            events[uid] = "admitted"
            admitted = True
            for fr, value in assignment.usage.items():
                used[fr] += value
            continue
        if assignment.mode == PREEMPT and admitted:
            return  # its victims are chosen on the next pass, among the Workloads just admitted too (Kueue's cycle)
        victims = None
        if assignment.mode == PREEMPT:
            victims = choose_victims(queue, assignment.usage, used, candidates, world.admitted_order)
        if victims:
            for victim in victims:
                _preempt(statuses[victim["metadata"]["uid"]], victim, workload, queue, now, events)
            _unset(status, workload, "WaitingForPreemptedWorkloads" if granular else "Pending",
                   f"{assignment.message}. Pending the preemption of {len(victims)} workload(s)", now, granular)
            return  # it stays at the head of its ClusterQueue: nothing behind it is admitted while it waits
        _unset(status, workload, (assignment.reason or "WaitingForQuota") if granular else "Pending",
               assignment.message, now, granular)
        if queue.strict:
            return  # StrictFIFO: the head blocks the rest


def _admit(status: dict[str, Any], workload: Mapping[str, Any], queue: Queue, assignment: Assignment,
           now: str) -> None:
    """SetQuotaReservation and SyncAdmittedCondition (no admission checks): QuotaReserved and Admitted True, an
    active Evicted or Preempted condition reset to False ("Previously: ...")."""
    generation = workload["metadata"].get("generation")
    status["admission"] = {"clusterQueue": queue.name, "podSetAssignments": assignment.podsets}
    set_condition(status, "QuotaReserved", True, "QuotaReserved", f"Quota reserved in ClusterQueue {queue.name}", now,
                  generation)
    for type_ in ("Evicted", "Preempted"):
        previous = find(status, type_)
        if previous and previous.get("status") == "True":
            set_condition(status, type_, False, "QuotaReserved", f"Previously: {previous.get('message', '')}", now,
                          generation)
    set_condition(status, "Admitted", True, "Admitted", "The workload is admitted", now, generation)


def _preempt(status: dict[str, Any], victim: Mapping[str, Any], preemptor: Mapping[str, Any], queue: Queue,
             now: str, events: dict[str, str]) -> None:
    """IssuePreemptions: Evicted=True (Preempted) and Preempted=True (InClusterQueue); one already Evicted is left
    as it is (its preemption is under way)."""
    if is_true(status, "Evicted"):
        return
    labels = preemptor["metadata"].get("labels") or {}
    message = (f"Preempted to accommodate a workload (UID: {preemptor['metadata']['uid']}, JobUID: "
               f"{labels.get('kueue.x-k8s.io/job-uid') or 'UNKNOWN'}) due to prioritization in the ClusterQueue; "
               f"preemptor path: /{queue.name}; preemptee path: /{queue.name}")
    set_condition(status, "Preempted", True, "InClusterQueue", message, now)
    _evict(status, "Preempted", message, now, victim["metadata"].get("generation"))
    events[victim["metadata"]["uid"]] = "preempted"

