"""An emulation of Kueue's admission, not Kueue: the ClusterQueue's quota, the queue order, preemption within a
ClusterQueue and the Workload's status conditions, as Kueue's scheduler and workload controller write them
(kueue.x-k8s.io/v1beta2; read from kubernetes-sigs/kueue at ff69552e, main after release v0.19.2). It lets an operator
that creates Workloads for its jobs (the job integration's part) be tested on the emulated cluster. Like the
Deployment controller (deployments.py), it is a client of the API: it lists and watches Workloads, ClusterQueues,
LocalQueues, ResourceFlavors and Namespaces, and writes Workloads' status through the status subresource (a merge
patch with the resourceVersion it read: a conflict is decided again, on what the watch brought). `Cluster(kueue=True)`
installs Kueue's CRDs (`KUEUE_CRDS`: written here after Kueue's API, devcluster/crds/) and runs it; its requests are
client `kueue`'s (faults.py). The decisions are pure functions: kueue_admission.py (flavors, victims, one pass) over
kueue_objects.py (quantities, requests, conditions, a ClusterQueue's quotas).

What it does (Kueue's wording throughout):

- a pending Workload (spec.active not false, not Finished, QuotaReserved not True, not held by Requeued=False or
  QuotaReserved=False/OnHold, in a queue) whose LocalQueue (spec.queueName, in its namespace) exists and points to
  an existing ClusterQueue is queued there; otherwise QuotaReserved=False, reason Inadmissible, "LocalQueue <q> is
  terminating or missing" or "ClusterQueue <cq> is terminating or missing";
- each ClusterQueue takes its pending Workloads by priority (spec.priority, absent = 0; higher first), then
  creationTimestamp (older first). A Workload is admitted if every pod set fits the unused nominal quota (count x
  the pod's requests: containers summed, a container's limits standing for its missing requests, sidecars added,
  the largest init container where larger, overhead; `pods` when the ClusterQueue covers it), trying each resource
  group's flavors in order (a flavor whose nodeLabels contradict the pod's nodeSelector is skipped: "flavor <f>
  doesn't match node affinity"). Admission writes status.admission {clusterQueue, podSetAssignments [{name, flavors,
  resourceUsage, count}]}, QuotaReserved=True (QuotaReserved, "Quota reserved in ClusterQueue <cq>"), Admitted=True
  (Admitted, "The workload is admitted") and turns an Evicted or Preempted condition that is True to False (reason
  QuotaReserved, "Previously: <message>");
- one that does not fit: QuotaReserved=False, reason Pending, "couldn't assign flavors to pod set <name>: insufficient
  unused quota for cpu in flavor <f>, 1 more needed" (or "insufficient quota for ... > maximum capacity (2)" when it
  exceeds the nominal quota, "resource <r> unavailable in ClusterQueue" for a resource no resource group covers, as
  Kueue's default quotaCheckStrategy BlockUndeclared refuses it), and status.resourceRequests. BestEffortFIFO (the
  default): it does not block the smaller ones behind it; StrictFIFO: it does. Only changes are written;
- a ClusterQueue with spec.namespaceSelector null admits no namespace (`{}` admits all): "workload namespace doesn't
  match ClusterQueue selector"; one naming a ResourceFlavor that does not exist: "ClusterQueue <cq> is inactive";
- preemption (spec.preemption.withinClusterQueue LowerPriority or LowerOrNewerEqualPriority; Never is the default):
  when the head does not fit but would within the nominal quota, victims are chosen among the ClusterQueue's
  Workloads holding quota that the policy allows (already Evicted first, then lowest priority, then most recently
  admitted), the fewest that make room (Kueue's remove-then-add-back heuristic). Each gets Evicted=True (Preempted,
  "Preempted to accommodate a workload (UID: <uid>, JobUID: <label kueue.x-k8s.io/job-uid or UNKNOWN>) due to
  prioritization in the ClusterQueue; preemptor path: /<cq>; preemptee path: /<cq>"), Preempted=True
  (InClusterQueue, same message) and a status.schedulingStats.evictions count; one already Evicted is not evicted
  again. A victim keeps its quota until its owner (the job integration) clears the reservation (status.admission
  removed, QuotaReserved=False, as UnsetQuotaReservationWithCondition). The preemptor stays pending meanwhile
  ("<message>. Pending the preemption of <n> workload(s)") at the head of its ClusterQueue: nothing behind it is
  admitted while it waits, as in Kueue, where it is requeued to the head immediately;
- spec.active=false: Evicted=True (Deactivated, "The workload is deactivated"), once, and it leaves the queue; as in
  Kueue's cache its quota stops counting at once (HasActiveQuotaReservation). Made active again after its owner set
  Requeued=False (Deactivated): Requeued=True (Reactivated, "The workload was reactivated");
- Finished=True (the owner's): its quota is released, nothing else written. A deleted Workload releases its quota.

`granular_reasons = True` writes the reasons of Kueue's UnadmittedWorkloadsObservability gate (off in v0.19.2, on at
the snapshot's main): WaitingForQuota, ExceedsMaxQuota, NoMatchingFlavor, WaitingForPreemptedWorkloads, Misconfigured,
Suspended instead of Pending/Inadmissible, and Admitted=False (NoReservation) on pending Workloads.
`ignore_undeclared = True` is quotaCheckStrategy IgnoreUndeclared. For tests and benchmarks, `history` keeps the
latest decisions as (time.time(), event, "namespace/name"), event one of admitted, preempted, deactivated and
released (a Workload that held quota no longer does: cleared, finished, deactivated or deleted). Decisions are logged
at debug level; no Events are written.

Not emulated: cohorts, borrowing and lending limits, reclaimWithinCohort, fair sharing and admission fair sharing,
admission checks (and ProvisioningRequests), topology-aware scheduling, waitForPodsReady (its timeouts and blocking
admission), partial admission (minCount), elastic workloads, requeue backoff (requeueState, requeuingLimit),
maximumExecutionTimeSeconds, stopPolicy and HoldAndDrain, flavorFungibility other than the default (a fitting flavor
is looked for in every flavor, then the first one preemption can make room in), node affinity and taints of flavors
(only the nodeSelector is matched), resource transformations and excluded resource prefixes, reclaimablePods,
DRA, pod-level resources (spec.resources of the pod) and LimitRanges, MultiKueue, the ClusterQueue's and LocalQueue's
status (usage, pending counts), WorkloadPriorityClass resolution (the Workload's spec.priority is read, as Kueue's
scheduler does; the job integration sets it), the Workload finalizer, v1beta1 (only the storage version v1beta2 is
served: catalog.py), Kueue's webhooks (the CRDs' OpenAPI schemas and CEL rules are enforced by the emulator; of the
webhook's checks only one is, as a rule of KUEUE_CRDS: spec.podSets is immutable while the Workload holds a quota
reservation), and the job integration itself (suspending a job, clearing a reservation, Finished: the operator's
part, or a test's).
Deviations: same-second creation or admission times are ordered by when this controller saw the Workloads (Kueue: by
uid); where Kueue meets a pod set's resources in Go's (random) map order, they are taken sorted here, an uncovered
resource first.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from pathlib import Path
from typing import Any

from .apiclient import MERGE_PATCH, Api, ApiError, Informer
from .kueue_admission import Decision, World, plan
from .kueue_objects import holds_quota
from .writes import timestamp

logger = logging.getLogger(__name__)

# Other projects' APIs as written here (devcluster/crds/README.md: what each follows and leaves out)
OTHER_CRDS = Path(__file__).resolve().parent / "crds"
KUEUE_CRDS = OTHER_CRDS / "kueue.yaml"  # Workload, ClusterQueue, LocalQueue, ResourceFlavor, WorkloadPriorityClass
COSCHEDULING_CRDS = OTHER_CRDS / "coscheduling.yaml"  # scheduler-plugins' scheduling.x-k8s.io/v1alpha1 PodGroup
VOLCANO_CRDS = OTHER_CRDS / "volcano.yaml"  # scheduling.volcano.sh/v1beta1 PodGroup
API = "/apis/kueue.x-k8s.io/v1beta2"
HISTORY_LIMIT = 10_000


def one_queue(namespace: str, *, cpus: str, flavor_labels: dict[str, str]) -> list[dict[str, Any]]:
    """What a platform team creates for one team, as tests and benchmarks need it: a ResourceFlavor `cpu` of the
    nodes labelled `flavor_labels`, a ClusterQueue `team` of `cpus` CPUs that preempts lower priorities, a LocalQueue
    `team-a` in `namespace`, and the WorkloadPriorityClasses `low` (10) and `high` (1000)."""
    version = "kueue.x-k8s.io/v1beta2"
    return [
        {"apiVersion": version, "kind": "ResourceFlavor", "metadata": {"name": "cpu"},
         "spec": {"nodeLabels": flavor_labels}},
        {"apiVersion": version, "kind": "ClusterQueue", "metadata": {"name": "team"},
         "spec": {"namespaceSelector": {}, "preemption": {"withinClusterQueue": "LowerPriority"},
                  "resourceGroups": [{"coveredResources": ["cpu"], "flavors": [
                      {"name": "cpu", "resources": [{"name": "cpu", "nominalQuota": cpus}]}]}]}},
        {"apiVersion": version, "kind": "LocalQueue", "metadata": {"name": "team-a", "namespace": namespace},
         "spec": {"clusterQueue": "team"}},
        {"apiVersion": version, "kind": "WorkloadPriorityClass", "metadata": {"name": "low"}, "value": 10},
        {"apiVersion": version, "kind": "WorkloadPriorityClass", "metadata": {"name": "high"}, "value": 1000},
    ]


class KueueController:
    def __init__(self, url: str, *, granular_reasons: bool = False, ignore_undeclared: bool = False) -> None:
        self.api = Api(url, token="client-kueue")
        self.granular_reasons, self.ignore_undeclared = granular_reasons, ignore_undeclared
        self.workloads = Informer(self.api, f"{API}/workloads", self._on_workload)
        self._others = {name: Informer(self.api, path, self._on_other) for name, path in (
            ("clusterqueues", f"{API}/clusterqueues"), ("localqueues", f"{API}/localqueues"),
            ("resourceflavors", f"{API}/resourceflavors"), ("namespaces", "/api/v1/namespaces"))}
        self.history: collections.deque[tuple[float, str, str]] = collections.deque(maxlen=HISTORY_LIMIT)
        self.passes = 0  # scheduling passes run, for benchmarks
        self._seen: dict[str, int] = {}
        self._admitted: dict[str, int] = {}
        self._holding: set[str] = set()
        self._counter = itertools.count(1)
        self._kick = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        await self.api.open()
        for informer in (*self._others.values(), self.workloads):
            await informer.start()
        self._task = asyncio.create_task(self._work(), name="kueue controller")
        self._kick.set()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for informer in (self.workloads, *self._others.values()):
            await informer.stop()
        await self.api.close()

    # -- what the watches tell ------------------------------------------------------------------------------------
    def _on_workload(self, type_: str, workload: dict[str, Any]) -> None:
        uid = workload["metadata"]["uid"]
        self._seen.setdefault(uid, next(self._counter))
        held = type_ != "DELETED" and holds_quota(workload)
        if uid in self._holding and not held:
            self._record("released", workload)
        self._holding.discard(uid)
        if held:
            self._holding.add(uid)
        if type_ == "DELETED":
            self._seen.pop(uid, None)
            self._admitted.pop(uid, None)
        self._kick.set()

    def _on_other(self, type_: str, obj: dict[str, Any]) -> None:
        self._kick.set()

    def _record(self, event: str, workload: dict[str, Any]) -> None:
        meta = workload["metadata"]
        self.history.append((time.time(), event, f"{meta['namespace']}/{meta['name']}"))

    # -- passes ---------------------------------------------------------------------------------------------------
    def world(self) -> World:
        """What the watches hold now, as `plan` reads it."""
        objects = {name: list(informer.objects.values()) for name, informer in self._others.items()}
        return World(
            workloads=dict(self.workloads.objects),
            cluster_queues={o["metadata"]["name"]: o for o in objects["clusterqueues"]},
            local_queues={(o["metadata"]["namespace"], o["metadata"]["name"]): o for o in objects["localqueues"]},
            flavors={o["metadata"]["name"]: o for o in objects["resourceflavors"]},
            namespaces={o["metadata"]["name"]: o for o in objects["namespaces"]},
            seen=self._seen, admitted_order=self._admitted)

    async def _work(self) -> None:
        while True:
            await self._kick.wait()
            self._kick.clear()
            try:
                await self._pass()
            except asyncio.CancelledError:
                raise
            except Exception as error:  # an API hiccup, or a bug: try again shortly
                logger.warning("kueue: a scheduling pass failed (%r); trying again", error)
                asyncio.get_running_loop().call_later(0.5, self._kick.set)

    async def _pass(self) -> None:
        self.passes += 1
        for decision in plan(self.world(), timestamp(), self.granular_reasons, self.ignore_undeclared):
            await self._write(decision)

    async def _write(self, decision: Decision) -> None:
        workload, meta = decision.workload, decision.workload["metadata"]
        old = workload.get("status") or {}
        patch = {key: decision.status.get(key) for key in {*old, *decision.status}
                 if old.get(key) != decision.status.get(key)}
        path = f"{API}/namespaces/{meta['namespace']}/workloads/{meta['name']}/status"
        try:
            answer = await self.api.request("PATCH", path, {"metadata": {"resourceVersion": meta["resourceVersion"]},
                                                            "status": patch}, MERGE_PATCH)
        except ApiError as error:
            if error.status in (404, 409):  # gone, or changed since read: decided again on what the watch brings
                logger.debug("kueue: %s/%s not written (%s)", meta["namespace"], meta["name"], error)
                asyncio.get_running_loop().call_later(0.2, self._kick.set)
                return
            raise
        logger.debug("kueue: %s/%s %s: %s", meta["namespace"], meta["name"], decision.event or "status",
                     [(c["type"], c["status"], c["reason"]) for c in decision.status.get("conditions") or []])
        if decision.event == "admitted":
            self._admitted[meta["uid"]] = next(self._counter)
        if decision.event:
            self._record(decision.event, workload)
        self.workloads.remember(answer)
        self._on_workload("MODIFIED", answer)
