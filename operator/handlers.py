"""The kopf layer: thin handlers around the pure decisions (training.py).

Each ParallelTrainingJob gets one daemon that reconciles it whenever something it depends on changes (the job
itself, one of its rank pods) and at least as often as the plan asks (backoffs, heartbeats, deadlines, TTLs):
read the job and its pods and ConfigMap from kopf's in-memory indices (no API reads, but for a LIST confirming pods
the index shows terminating, and a pod the API has said is gone is left out: daemon.py), decide, apply — in the loop
that pools share (daemon.py), under the operator's API error policy (api_policy.py). The job's status is patched
only when the operator's fields change, so its own writes do not wake it in a loop. kopf's progress is kept in
annotations: the status is shared with rank 0, and the operator writes only its own fields there.

Stateless: restarted mid-job, it rebuilds everything from the API (pods are named by rank, so nothing is created
twice).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import kopf

from tandem.api import GROUP, VERSION
from tandem.api.inference import POOL_PHASES
from tandem.operator import daemon, lending, metrics, queueing
from tandem.operator.api_policy import configure_kopf
from tandem.operator.cluster import Cluster, login
from tandem.operator.observed import ParsedResource, read_resource
from tandem.operator.pool_objects import POOL_PLURAL
from tandem.operator.training import Plan, Queueing, reconcile, regroup_events, regroups_reported
from tandem.operator.training_objects import (
    JOB_LABEL,
    JOB_PLURAL,
    config_map_name,
    is_coordinator,
    selector_string,
)

WORKLOADS = "workloads"
EVENT_SOURCE = "tandem-operator"


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.posting.level = 0  # the Events the decisions ask for; kopf posts nothing else (loggers stay off)
    settings.posting.reporting_component = EVENT_SOURCE  # kubectl describe's "From"
    settings.posting.reporting_instance = socket.gethostname()  # the operator's pod
    settings.posting.event_name_prefix = f"{EVENT_SOURCE}-"
    configure_kopf(settings)
    memo.cluster = Cluster(login())
    memo.wakers = {}
    memo.pool_wakers = {}
    memo.pool_sources = {}
    memo.lenders = set()
    memo.pool_lenders = {}
    memo.loans = {}
    memo.phases = metrics.PhaseCount()
    memo.pool_phases = metrics.PhaseCount(metrics.POOLS_BY_PHASE, POOL_PHASES)


@kopf.index("v1", "pods", labels={JOB_LABEL: kopf.PRESENT})
def job_pods(namespace: str, labels: dict[str, str], body: kopf.Body, **_: Any) -> dict[tuple[str, str], dict]:
    return {(namespace, labels[JOB_LABEL]): dict(body)}


@kopf.index("v1", "configmaps", labels={JOB_LABEL: kopf.PRESENT})
def job_specs(namespace: str, name: str, labels: dict[str, str], body: kopf.Body,
              **_: Any) -> dict[tuple[str, str], dict] | None:
    job = labels[JOB_LABEL]
    return {(namespace, job): dict(body)} if name == config_map_name(job) else None


@kopf.index(GROUP, VERSION, POOL_PLURAL)
def namespace_pools(namespace: str, body: kopf.Body, **_: Any) -> dict[str, dict]:
    """The InferencePools of each namespace: those a job's spec.elastic.lendTo may select."""
    return {namespace: dict(body)}


@kopf.on.event("v1", "pods", labels={JOB_LABEL: kopf.PRESENT})
async def pod_changed(namespace: str, labels: dict[str, str], memo: kopf.Memo, **_: Any) -> None:
    wake(memo, namespace, labels[JOB_LABEL])


@kopf.on.event(GROUP, VERSION, JOB_PLURAL)
async def job_changed(namespace: str, name: str, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    wake(memo, namespace, name)
    wake_pools_of(memo, namespace, name)
    lent = (body.get("status") or {}).get("lent") or {}
    named = {*(lent.get("to") or []), *(entry.get("name") for entry in lent.get("unplaceable") or [])}
    for (pool_namespace, pool), lenders in list(memo.pool_lenders.items()):  # every pool its daemon runs
        if pool_namespace == namespace and (pool in named or name in lenders):
            wake(memo, namespace, pool, "pool_wakers")


def watch_workloads() -> None:
    """Index the jobs' Kueue Workloads (`job_workloads`) and wake a job when its Workload changes. Registered by
    `tandem operator --kueue` only: without it the operator neither watches nor may read Workloads."""
    api_version = f"{queueing.KUEUE_GROUP}/{queueing.KUEUE_VERSION}"

    @kopf.index(api_version, WORKLOADS, labels={JOB_LABEL: kopf.PRESENT}, id="job_workloads")
    def job_workloads(namespace: str, labels: dict[str, str], body: kopf.Body,
                      **_: Any) -> dict[tuple[str, str], dict]:
        return {(namespace, labels[JOB_LABEL]): dict(body)}

    @kopf.on.event(api_version, WORKLOADS, labels={JOB_LABEL: kopf.PRESENT}, id="workload_changed")
    async def workload_changed(namespace: str, labels: dict[str, str], memo: kopf.Memo, **_: Any) -> None:
        wake(memo, namespace, labels[JOB_LABEL])


@kopf.daemon(GROUP, VERSION, JOB_PLURAL, cancellation_timeout=10, backoff=daemon.DAEMON_BACKOFF)
async def supervise(name: str, namespace: str, body: kopf.Body, stopped: kopf.DaemonStopped, memo: kopf.Memo,
                    job_pods: kopf.Index, job_specs: kopf.Index, namespace_pools: kopf.Index,
                    **indices: Any) -> None:
    key = (namespace, name)
    waker = memo.wakers.setdefault(key, asyncio.Event())
    state = daemon.Reconciliation(JOB_PLURAL, namespace, name)
    reads = QueueReads()

    async def one_pass() -> float | None:
        observed = read_resource(state.observed(body))
        config_map = next(iter(job_specs.get(key, [])), None)
        pods = await state.confirm_deletions(state.present(job_pods.get(key, [])), lambda: memo.cluster.pod_uids(
            namespace, selector_string(name)))
        queued = None
        if memo.settings.kueue and queueing.queue_name(observed.body):
            workloads = state.present(indices.get("job_workloads", {}).get(key, []))  # none: no Kueue CRDs
            queued = await reads.read(memo.cluster, observed, next(iter(workloads), None))
        borrowers = _borrowers(observed, pods, state.present(namespace_pools.get(namespace, [])),
                               indices.get("pool_pods", {}), state,
                               lambda: _other_loans(key, memo.loans, indices.get("training_jobs", {})))
        if borrowers is None:
            memo.lenders.discard(key)
        else:
            memo.lenders.add(key)
        plan = reconcile(observed, pods, config_map, datetime.now(UTC), memo.settings, queued, borrowers)
        memo.loans[key] = plan.status.get("lent")  # before any await: the next job's pass sees this loan
        held = observed.body.get("status") or {}
        plan.events += regroup_events(held, state.regroups_seen)
        state.regroups_seen = regroups_reported(held)
        await _apply(plan, observed.body, pods, memo.cluster, state, reads)
        memo.phases.set(key, plan.status.get("phase"))
        return daemon.FINISHED if plan.delete_job else plan.requeue_after

    try:
        await daemon.run(state, waker, stopped, one_pass)
    finally:
        memo.wakers.pop(key, None)
        memo.lenders.discard(key)
        memo.loans.pop(key, None)
        memo.phases.set(key, None)


def _other_loans(key: tuple[str, str], decided: dict[tuple[str, str], dict[str, Any] | None],
                 training_jobs: Any) -> list[dict[str, Any] | None]:
    """The status.lent of the other jobs in the job's namespace: as their daemons last decided it (`decided`: the
    watch may not have brought their patch yet, or they may not have sent it), else as kopf's index holds it."""
    namespace = key[0]
    lents = {other: (body.get("status") or {}).get("lent") for other, bodies in list(training_jobs.items())
             for body in bodies if other[0] == namespace}
    lents.update((other, lent) for other, lent in decided.items() if other[0] == namespace)
    lents.pop(key, None)
    return list(lents.values())


def _borrowers(job: ParsedResource, pods: list[dict[str, Any]], pools: list[dict[str, Any]], pool_pods: Any,
               state: daemon.Reconciliation,
               others: Callable[[], list[dict[str, Any] | None]]) -> list[lending.Borrower] | None:
    """The pools a job's spec.elastic.lendTo selects, with their demand; None for a job that lends to none.
    `others`: the other jobs' status.lent in its namespace (read only for a job that lends)."""
    elastic = job.model.spec.elastic if job.model is not None else None
    if elastic is None or elastic.lend_to is None:
        return None
    namespace = job.body["metadata"].get("namespace")
    rank_pod = next((pod for pod in pods if not is_coordinator(pod)), None)
    return lending.borrowers(elastic.lend_to, pools, {
        pool["metadata"]["name"]: state.present(pool_pods.get((namespace, pool["metadata"]["name"]), []))
        for pool in pools}, rank_pod, others())


class QueueReads:
    """What a queued job's daemon reads beside kopf's indices: the priority class of a Workload to create, the
    ResourceFlavors of an admission (once per admission), and the Workload as its own last status patch left it
    (until the index catches up with it)."""

    def __init__(self) -> None:
        self.patched: tuple[str | None, dict[str, Any]] | None = None
        """(the resourceVersion the patch was decided on, the Workload the API answered)."""
        self.flavors: tuple[tuple[str, ...], dict[str, dict[str, Any]]] = ((), {})
        self.indexed: dict[str, Any] | None = None
        """The Workload kopf's index held at the last read."""

    async def read(self, cluster: Cluster, job: ParsedResource, indexed: dict[str, Any] | None) -> Queueing:
        self.indexed = workload = indexed
        if indexed is not None and self.patched is not None and (
                indexed["metadata"].get("resourceVersion") == self.patched[0]):
            workload = self.patched[1]  # the index has not caught up with the operator's own patch
        if workload is None:
            return await self._priority(cluster, job)
        admission = queueing.admission_of(workload)
        if admission.admitted and self.flavors[0] != admission.flavors:
            found = {}
            for flavor in admission.flavors:
                read = await cluster.read_cluster_custom(queueing.KUEUE_GROUP, queueing.KUEUE_VERSION,
                                                         "resourceflavors", flavor)
                found[flavor] = (read or {}).get("spec") or {}
            self.flavors = (admission.flavors, found)
        flavors = self.flavors[1] if admission.admitted else {}
        return Queueing(workload=workload, placement=queueing.placement(admission, flavors))

    @staticmethod
    async def _priority(cluster: Cluster, job: ParsedResource) -> Queueing:
        if job.model is None:
            return Queueing()  # the decision reports the spec's problems
        source = queueing.priority_source(job.body, job.model)
        if source is None:
            return Queueing()
        group, kind, name = source
        if kind == "PriorityClass":
            value = await cluster.priority_class_value(name)
        else:
            found = await cluster.read_cluster_custom(group, queueing.KUEUE_VERSION, "workloadpriorityclasses", name)
            value = None if found is None else found.get("value")
        if value is None:
            return Queueing(priority_problem=f"the {kind} {name} the job's Workload takes its priority from does "
                                             f"not exist: create it, or name another")
        return Queueing(priority=queueing.Priority(group, kind, name, int(value)))


async def _apply(plan: Plan, body: dict[str, Any], pods: list[dict[str, Any]], cluster: Cluster,
                 state: daemon.Reconciliation, reads: QueueReads) -> None:
    """The decision first (the status), then the pods: an operator stopped between the two finds its decision in
    the status when it starts again (a group torn down is still Restarting, its failure counted once; a group being
    created is Pending and its missing ranks are created), never pods without the decision that made them. A
    suspension stops the ranks first (`Plan.stop_first`). Objects of one kind are created, and pods deleted,
    concurrently: their retries overlap instead of adding up."""
    grace = 0 if plan.kill_at_once else None

    indexed = {pod["metadata"]["name"]: pod for pod in pods}

    async def delete_pod(name: str) -> None:
        if not await cluster.delete("Pod", name, state.namespace, grace_seconds=grace) and name in indexed:
            state.found_gone(indexed[name])

    async def delete_pods() -> None:
        await daemon.all_of(delete_pod(pod) for pod in plan.delete_pods)

    if plan.stop_first:
        await delete_pods()
    if plan.workload_status is not None:  # before the job's status: an eviction is counted once it is given back
        metadata = plan.workload_status["metadata"]
        reads.patched = (metadata["resourceVersion"], await cluster.patch_custom_status(
            queueing.KUEUE_GROUP, queueing.KUEUE_VERSION, WORKLOADS, state.namespace, metadata["name"],
            plan.workload_status))
    before = (body.get("status") or {}).get("restarts", 0)
    changed = await daemon.publish(cluster, state, body, plan.status, plan.events)
    if changed.get("restarts", 0) > before:
        metrics.RESTARTS.inc(changed["restarts"] - before)
    metrics.RANK_REPLACEMENTS.inc(sum(reason == "ReplacingRank" for _, reason, _ in plan.events))
    if regroups := regroups_reported(body.get("status") or {}):
        metrics.REGROUPS.labels(state.namespace, state.name).set(regroups)
    await daemon.all_of(cluster.create(m) for m in plan.create if m["kind"] != "Pod")  # what the pods mount
    await daemon.all_of(cluster.create(m) for m in plan.create if m["kind"] == "Pod")
    if not plan.stop_first:
        await delete_pods()
    if plan.delete_workload is not None and not await cluster.delete_custom(
            WORKLOADS, plan.delete_workload, state.namespace, queueing.KUEUE_GROUP, queueing.KUEUE_VERSION) and (
            reads.indexed is not None):
        state.found_gone(reads.indexed)
    if plan.delete_job:
        await cluster.delete_custom(JOB_PLURAL, state.name, state.namespace)


def wake(memo: kopf.Memo, namespace: str, name: str, wakers: str = "wakers") -> None:
    """Wake the daemon of the job (or, with wakers="pool_wakers", the pool) `name`. On the event loop only (the
    handlers that call it are async: kopf runs a plain `def` handler in a worker thread, where setting an
    asyncio.Event races the loop's own use of it)."""
    waker = getattr(memo, wakers, {}).get((namespace, name))
    if waker is not None:
        waker.set()


def wake_lenders(memo: kopf.Memo, namespace: str) -> None:
    """Wake the jobs of `namespace` that may lend to its pools (spec.elastic.lendTo): a pool, or one of its pods,
    changed."""
    for job_namespace, job in list(getattr(memo, "lenders", ())):
        if job_namespace == namespace:
            wake(memo, namespace, job)


def wake_pools_of(memo: kopf.Memo, namespace: str, job: str) -> None:
    """Wake the pools that serve from a job: its checkpoint, or the job itself, may have come or gone."""
    for (pool_namespace, pool), source in list(getattr(memo, "pool_sources", {}).items()):
        if pool_namespace == namespace and source == job:
            wake(memo, namespace, pool, "pool_wakers")
