"""The kopf layer for InferencePools: thin handlers around the pure decisions (pools.py).

Each pool gets one daemon that reconciles it whenever something it depends on changes (the pool, one of its objects
or server pods, the ParallelTrainingJob it serves from) and every few seconds: read the pool's objects, its pods and
its job from kopf's in-memory indices, ask each ready server what it serves, decide, apply.

How the operator learns which checkpoint each replica serves: it asks each ready server pod (`GET
/v2/models/{m}/ready` on the pod's IP, a readiness endpoint and so open even behind the pool's token, which the
operator never reads; the answer's `parameters` carry `checkpoint`, `source` and `loaded_at`, the served checkpoint's
recorded metrics and a promotion gate's last skipped candidate). Chosen over
servers annotating their own pods because (1) a server then needs no write access to the API (its ServiceAccount
may only read its own pool, so a compromised server cannot write to the API), (2) what is reported is what the process
answering inference requests holds, not what it last managed to write, and (3) only ready pods are asked, so a
replica that stopped answering drops out of the status by itself. The same answer carries the batching settings the
server runs with, and the pool's settings it refused (its model failed its warm-up at them) with its error. The
operator sends the servers nothing: each reads its pool's batching settings itself (worker/serve/pool_watch.py, with
a ServiceAccount that may get and watch that one pool), so no port a client reaches takes a change. The cost: the
operator must reach the server pods' port (a NetworkPolicy that isolates them must admit the operator's pods; see
README).
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import UTC, datetime
from typing import Any

import aiohttp
import kopf
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from tandem.api import GROUP, VERSION
from tandem.api.inference import LIVE_FIELDS, BatchingSettings
from tandem.operator import daemon, lending, metrics
from tandem.operator.handlers import wake, wake_lenders
from tandem.operator.observed import read_resource
from tandem.operator.pool_objects import POOL_LABEL, POOL_PLURAL
from tandem.operator.pool_served import Served, refused_batching, served_metrics, skipped_candidate
from tandem.operator.pools import PoolPlan, Sources, reconcile_pool, sources
from tandem.operator.training_objects import JOB_PLURAL

CHILD_KINDS = {
    ("apps", "v1", "deployments"): "Deployment",
    ("", "v1", "configmaps"): "ConfigMap",
    ("", "v1", "services"): "Service",
    ("policy", "v1", "poddisruptionbudgets"): "PodDisruptionBudget",
    ("autoscaling", "v2", "horizontalpodautoscalers"): "HorizontalPodAutoscaler",
}
ASK_SECONDS = 2.0
INDEX_LAG_SECONDS = 30.0
log = logging.getLogger("tandem.operator")


def _index_children(group: str, version: str, plural: str) -> None:
    """One index per kind of a pool's objects (`pool_<plural>`): {(namespace, pool): [object]}, and a waker on each
    change."""

    api_version = f"{group}/{version}" if group else version

    @kopf.index(api_version, plural, labels={POOL_LABEL: kopf.PRESENT}, id=f"pool_{plural}")
    def index(namespace: str, labels: dict[str, str], body: kopf.Body, **_: Any) -> dict[tuple[str, str], dict]:
        return {(namespace, labels[POOL_LABEL]): dict(body)}

    @kopf.on.event(api_version, plural, labels={POOL_LABEL: kopf.PRESENT}, id=f"pool_{plural}_changed")
    async def changed(namespace: str, labels: dict[str, str], memo: kopf.Memo, **_: Any) -> None:
        wake(memo, namespace, labels[POOL_LABEL], "pool_wakers")
        if plural == "pods":  # a server pod the cluster cannot place may borrow a job's workers
            wake_lenders(memo, namespace)


for _group, _version, _plural in [*CHILD_KINDS, ("", "v1", "pods")]:  # the server pods: index `pool_pods`
    _index_children(_group, _version, _plural)


@kopf.index(GROUP, VERSION, JOB_PLURAL)
def training_jobs(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[tuple[str, str], dict]:
    return {(namespace, name): dict(body)}


@kopf.on.event(GROUP, VERSION, POOL_PLURAL)
async def pool_changed(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    wake(memo, namespace, name, "pool_wakers")
    wake_lenders(memo, namespace)


@kopf.daemon(GROUP, VERSION, POOL_PLURAL, cancellation_timeout=10, backoff=daemon.DAEMON_BACKOFF)
async def serve_pool(name: str, namespace: str, body: kopf.Body, stopped: kopf.DaemonStopped,
                     memo: kopf.Memo, pool_pods: kopf.Index, training_jobs: kopf.Index, **indices: Any) -> None:
    key = (namespace, name)
    waker = memo.pool_wakers.setdefault(key, asyncio.Event())
    state = daemon.Reconciliation(POOL_PLURAL, namespace, name)
    put = RecentlyPut()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=ASK_SECONDS)) as session:

        async def one_pass() -> float | None:
            observed = read_resource(state.observed(body))
            reads = sources(observed)
            memo.pool_sources[key] = reads.job if reads else None
            children = put.over({kind: next(iter(state.present(indices[f"pool_{plural}"].get(key, []))), None)
                                 for (_, _, plural), kind in CHILD_KINDS.items()})
            pods = state.present(pool_pods.get(key, []))
            job = next(iter(training_jobs.get((namespace, reads.job), [])), None) if reads and reads.job else None
            served = await _ask_servers(session, reads, pods) if reads else []
            plan = reconcile_pool(observed, children, pods, served, job, datetime.now(UTC),
                                  memo.settings.worker_image)
            jobs = [found_job for (job_namespace, _), found in list(training_jobs.items())
                    if job_namespace == namespace for found_job in found]
            plan.status["borrowed"] = lending.borrowed(name, jobs)
            borrowed = plan.status["borrowed"] or {}
            memo.pool_lenders[key] = {*(borrowed.get("from") or []), *(borrowed.get("unplaceableFor") or [])}
            await _apply(plan, observed.body, children, memo.cluster, put, state)
            memo.pool_phases.set(key, plan.status.get("phase"))
            metrics.observe_pool(key, observed.body.get("status") or {}, plan.status,
                                 observed.model.spec.replicas if observed.model else 0, plan.events)
            return plan.requeue_after

        try:
            await daemon.run(state, waker, stopped, one_pass)
        finally:
            memo.pool_wakers.pop(key, None)
            memo.pool_sources.pop(key, None)
            memo.pool_lenders.pop(key, None)
            memo.pool_phases.set(key, None)
            metrics.forget_pool(key)


async def _ask_servers(session: aiohttp.ClientSession, reads: Sources, pods: list[dict[str, Any]]) -> list[Served]:
    """What each ready, not terminating server pod says it serves; one that does not answer is left out."""
    ready = [p for p in pods if _ready(p)]
    answers = await asyncio.gather(*(_ask(session, p, reads.model, reads.port) for p in ready))
    return [served for served in answers if served is not None]


async def _ask(session: aiohttp.ClientSession, pod: dict[str, Any], model: str, port: int) -> Served | None:
    name = pod["metadata"]["name"]
    try:
        async with session.get(f"http://{pod['status']['podIP']}:{port}/v2/models/{model}/ready") as response:
            if response.status != 200:
                return None
            parameters = (await response.json()).get("parameters") or {}
    except (aiohttp.ClientError, TimeoutError, ValueError) as error:
        log.info("server pod %s did not say what it serves: %s", name, error)
        return None
    return Served(name, parameters.get("checkpoint"), str(parameters.get("source", "")),
                  str(parameters.get("loaded_at", "")), _reported_batching(parameters), served_metrics(parameters),
                  skipped_candidate(parameters), refused_batching(parameters))


def _reported_batching(parameters: dict[str, Any]) -> BatchingSettings | None:
    """The batching settings in a server's model metadata parameters (None from a server that does not report them)."""
    try:
        return BatchingSettings.model_validate({name: parameters[name] for name in LIVE_FIELDS})
    except (KeyError, ValidationError):
        return None


def _ready(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    return (not pod["metadata"].get("deletionTimestamp") and bool(status.get("podIP"))
            and any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []))


class RecentlyPut:
    """The objects a pool's daemon created, until kopf's indices show them: a pass woken by the event of its own
    first create would otherwise read the indices before they hold the rest, and create those again (409s)."""

    def __init__(self) -> None:
        self.objects: dict[str, tuple[dict[str, Any], float]] = {}

    def over(self, indexed: dict[str, dict[str, Any] | None]) -> dict[str, dict[str, Any] | None]:
        """The indices' objects, with one this daemon created in the last INDEX_LAG_SECONDS where they show none
        (after that, an object missing from the index is taken as deleted)."""
        now = time.monotonic()
        self.objects = {kind: (o, at) for kind, (o, at) in self.objects.items()
                        if indexed.get(kind) is None and now - at < INDEX_LAG_SECONDS}
        recent = {kind: o for kind, (o, _) in self.objects.items()}
        return {kind: indexed[kind] or recent.get(kind) for kind in indexed}

    def add(self, written: dict[str, Any]) -> None:
        self.objects[written["kind"]] = (written, time.monotonic())


async def _apply(plan: PoolPlan, body: dict[str, Any], children: dict[str, dict[str, Any] | None], cluster,
                 put: RecentlyPut, state: daemon.Reconciliation) -> None:
    """The servers' access to their pool created (kept where it exists), the pool's objects put and deleted (each
    concurrently: their retries overlap), then the status."""

    async def put_one(manifest: dict[str, Any]) -> None:
        existing = children.get(manifest["kind"])
        try:
            written = await cluster.put(manifest, existing)
        except ApiException:  # 404 on the replace: gone, though the index holds it; decided again
            if existing is not None:
                state.found_gone(existing)
            raise
        if written is not None and existing is None:
            put.add(written)

    async def delete_one(kind: str, name: str) -> None:
        existing = children.get(kind)
        if not await cluster.delete(kind, name, state.namespace) and existing and existing["metadata"]["name"] == name:
            state.found_gone(existing)

    await daemon.all_of(cluster.create(manifest) for manifest in plan.create)
    await daemon.all_of(put_one(manifest) for manifest in plan.apply)
    await daemon.all_of(delete_one(kind, name) for kind, name in plan.delete)
    await daemon.publish(cluster, state, body, plan.status, plan.events)
