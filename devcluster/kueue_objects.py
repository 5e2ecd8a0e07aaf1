"""What the emulated Kueue (devcluster/kueue.py) reads from the objects, as pure functions: quantities, a pod set's
requests, conditions, a Workload's state and a ClusterQueue's quotas. Each names the Kueue code it follows
(kubernetes-sigs/kueue at ff69552e: pkg/resources, pkg/workload, k8s.io/component-helpers' PodRequests).

Amounts are Kueue's integers (`resources.ResourceValue`): milli-units for cpu, units (rounded up) for everything
else; `quantity` writes them back as Kubernetes quantities the way Kueue's ResourceFormatter does ("500m", "2",
"1Gi", "1G").
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes.utils import parse_quantity

from .selectors import format_match_labels, labels_match, parse_labels

_DECIMAL = {-3: "m", 0: "", 3: "k", 6: "M", 9: "G", 12: "T", 15: "P", 18: "E"}
_BINARY = ("", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei")
Fr = tuple[str, str]  # (flavor, resource)


# -- quantities ---------------------------------------------------------------------------------------------------
def amount(resource: str, value: Any) -> int:
    """A quantity as Kueue counts it: cpu in milli-units, anything else in units, rounded up."""
    parsed = parse_quantity(value)
    return math.ceil(parsed * 1000) if resource == "cpu" else math.ceil(parsed)


def quantity(resource: str, value: int) -> str:
    """Kueue's amount as its ResourceFormatter writes it: cpu as a milli-quantity, memory, ephemeral-storage and
    hugepages in binary units when exact (1Gi), else decimal SI (500m, 2, 1G, 1k)."""
    if resource == "cpu":
        return _decimal_si(value, -3)
    if (resource in ("memory", "ephemeral-storage") or resource.startswith("hugepages-")) and abs(value) >= 1024:
        power = 0
        while power < 6 and value % 1024 ** (power + 1) == 0:
            power += 1
        if power:
            return f"{value // 1024 ** power}{_BINARY[power]}"
    return _decimal_si(value, 0)


def _decimal_si(mantissa: int, exponent: int) -> str:
    if mantissa == 0:
        return "0"
    while mantissa % 1000 == 0 and exponent < 18:
        mantissa, exponent = mantissa // 1000, exponent + 3
    return f"{mantissa}{_DECIMAL[exponent]}"


def _add(total: dict[str, int], more: Mapping[str, int]) -> dict[str, int]:
    for name, value in more.items():
        total[name] = total.get(name, 0) + value
    return total


def container_requests(container: Mapping[str, Any]) -> dict[str, int]:
    """A container's requests, its limits standing for the requests it lacks (UseLimitsAsMissingRequestsInPod)."""
    resources = container.get("resources") or {}
    requests, limits = resources.get("requests") or {}, resources.get("limits") or {}
    return {name: amount(name, requests.get(name, limits.get(name))) for name in {*requests, *limits}}


def pod_requests(spec: Mapping[str, Any]) -> dict[str, int]:
    """One pod's requests as resourcehelpers.PodRequests sums them: the containers, restartable init containers
    (sidecars) added, the largest init container's need where larger, plus the pod's overhead."""
    total: dict[str, int] = {}
    for container in spec.get("containers") or []:
        _add(total, container_requests(container))
    sidecars: dict[str, int] = {}
    init_max: dict[str, int] = {}
    for container in spec.get("initContainers") or []:
        own = container_requests(container)
        if container.get("restartPolicy") == "Always":
            _add(total, own)
            need = dict(_add(sidecars, own))
        else:
            need = _add(dict(own), sidecars)
        for name, value in need.items():
            init_max[name] = max(init_max.get(name, 0), value)
    for name, value in init_max.items():
        total[name] = max(total.get(name, 0), value)
    return _add(total, {name: amount(name, value) for name, value in (spec.get("overhead") or {}).items()})


def podset_requests(podset: Mapping[str, Any]) -> dict[str, int]:
    """A pod set's total: count x one pod's requests (negative amounts floored to 0)."""
    count = int(podset.get("count", 1))
    spec = (podset.get("template") or {}).get("spec") or {}
    return {name: max(value, 0) * count for name, value in pod_requests(spec).items()}


# -- conditions (apimeta.SetStatusCondition) -------------------------------------------------------------------------
def find(status: Mapping[str, Any] | None, type_: str) -> dict[str, Any] | None:
    return next((c for c in (status or {}).get("conditions") or [] if c.get("type") == type_), None)


def is_true(status: Mapping[str, Any] | None, type_: str) -> bool:
    return (find(status, type_) or {}).get("status") == "True"


def set_condition(status: dict[str, Any], type_: str, value: bool, reason: str, message: str, now: str,
                  generation: int | None = None) -> None:
    """As apimeta.SetStatusCondition: lastTransitionTime moves only when the status changes; reason, message and
    observedGeneration are always written (a generation of None omits it, as Kueue's Preempted condition does)."""
    conditions = status.setdefault("conditions", [])
    new = {"type": type_, "status": "True" if value else "False", "reason": reason, "message": message[:32768]}
    if generation is not None:
        new["observedGeneration"] = generation
    old = find(status, type_)
    new["lastTransitionTime"] = old["lastTransitionTime"] if old and old.get("status") == new["status"] else now
    if old is None:
        conditions.append(new)
    else:
        conditions[conditions.index(old)] = new


# -- workloads ------------------------------------------------------------------------------------------------------
def priority(workload: Mapping[str, Any]) -> int:
    return int((workload.get("spec") or {}).get("priority") or 0)


def is_active(workload: Mapping[str, Any]) -> bool:
    return (workload.get("spec") or {}).get("active", True) is not False


def holds_quota(workload: Mapping[str, Any]) -> bool:
    """HasActiveQuotaReservation: QuotaReserved=True with an admission, active and not Finished: what counts in its
    ClusterQueue's usage (an Evicted one counts until its owner clears the reservation)."""
    status = workload.get("status") or {}
    return (is_true(status, "QuotaReserved") and bool(status.get("admission")) and is_active(workload)
            and not is_true(status, "Finished"))


def is_pending(workload: Mapping[str, Any], status: Mapping[str, Any]) -> bool:
    """IsAdmissible, plus Kueue's queue rules: in a queue, not being deleted, and not held by Requeued=False."""
    quota = find(status, "QuotaReserved") or {}
    requeued = find(status, "Requeued") or {}
    return (is_active(workload) and bool((workload.get("spec") or {}).get("queueName"))
            and not workload["metadata"].get("deletionTimestamp") and not is_true(status, "Finished")
            and quota.get("status") != "True" and not (quota.get("status") == "False" and quota.get("reason") ==
                                                        "OnHold") and requeued.get("status") != "False")


def usage_of(workload: Mapping[str, Any]) -> dict[Fr, int]:
    """What the Workload's admission reserves, by (flavor, resource)."""
    used: dict[Fr, int] = defaultdict(int)
    for assignment in ((workload.get("status") or {}).get("admission") or {}).get("podSetAssignments") or []:
        flavors = assignment.get("flavors") or {}
        for resource, value in (assignment.get("resourceUsage") or {}).items():
            if resource in flavors:
                used[flavors[resource], resource] += amount(resource, value)
    return dict(used)


def queue_key(workload: Mapping[str, Any], seen: Mapping[str, int]) -> tuple:
    """The queue order: priority (higher first), then creationTimestamp (older first). Same-second ties break by the
    order the controller first saw the Workloads (creation order), where Kueue breaks them by uid."""
    meta = workload["metadata"]
    return -priority(workload), meta.get("creationTimestamp", ""), seen.get(meta["uid"], 0), meta["uid"]


# -- ClusterQueues ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Group:
    covered: tuple[str, ...]
    flavors: tuple[tuple[str, dict[str, int]], ...]  # (flavor, nominal quota by resource), in order


@dataclass(frozen=True)
class Queue:
    """A ClusterQueue as the scheduler reads it."""

    name: str
    groups: tuple[Group, ...]
    policy: str = "Never"  # spec.preemption.withinClusterQueue
    strict: bool = False  # queueingStrategy StrictFIFO
    namespace_selector: Mapping[str, Any] | None = None

    @classmethod
    def of(cls, obj: Mapping[str, Any]) -> Queue:
        spec = obj.get("spec") or {}
        groups = tuple(Group(tuple(g.get("coveredResources") or []), tuple(
            (f["name"], {r["name"]: amount(r["name"], r.get("nominalQuota", 0)) for r in f.get("resources") or []})
            for f in g.get("flavors") or [])) for g in spec.get("resourceGroups") or [])
        return cls(obj["metadata"]["name"], groups, (spec.get("preemption") or {}).get("withinClusterQueue", "Never"),
                   spec.get("queueingStrategy") == "StrictFIFO", spec.get("namespaceSelector"))

    def group_of(self, resource: str) -> Group | None:
        return next((g for g in self.groups if resource in g.covered), None)

    def nominal(self, fr: Fr) -> int:
        return next((quotas.get(fr[1], 0) for g in self.groups for name, quotas in g.flavors if name == fr[0]), 0)

    def flavor_names(self) -> set[str]:
        return {name for g in self.groups for name, _ in g.flavors}

    def admits_namespace(self, namespace: Mapping[str, Any] | None) -> bool:
        """A null selector admits no namespace, `{}` every one (metav1.LabelSelectorAsSelector)."""
        if self.namespace_selector is None or namespace is None:
            return False
        meta = namespace["metadata"]
        labels = {"kubernetes.io/metadata.name": meta["name"], **(meta.get("labels") or {})}
        return labels_match(parse_labels(format_match_labels(self.namespace_selector)), labels)
