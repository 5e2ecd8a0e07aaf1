"""The operator's Prometheus metrics (served on --metrics-port): jobs and pools by phase, group restarts, each pool's
ready and desired replicas, its checkpoint swaps and its refusals (a candidate its promotion gate skipped, batching
settings its servers refused), how long a reconciliation takes, failed and retried API calls, passes an API failure
ended early."""

from __future__ import annotations

import contextlib
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from tandem.api.training import TRAINING_PHASES

JOBS_BY_PHASE = Gauge("tandem_operator_jobs", "ParallelTrainingJobs by phase, as last reconciled", ["phase"])
POOLS_BY_PHASE = Gauge("tandem_operator_pools", "InferencePools by phase, as last reconciled", ["phase"])
POOL_READY = Gauge("tandem_operator_pool_ready_replicas", "An InferencePool's ready server replicas",
                   ["namespace", "pool"])
POOL_DESIRED = Gauge("tandem_operator_pool_replicas", "An InferencePool's desired server replicas (spec.replicas)",
                     ["namespace", "pool"])
POOL_SWAPS = Counter("tandem_operator_pool_swaps_total", "Checkpoint swaps an InferencePool's servers made (the "
                     "checkpoint its status names changed)", ["namespace", "pool"])
POOL_REFUSALS = Counter("tandem_operator_pool_refusals_total", "What an InferencePool refused: a checkpoint its "
                        "promotion gate skipped (promotion), batching settings its servers refused (batching)",
                        ["namespace", "pool", "what"])
RESTARTS = Counter("tandem_operator_restarts_total", "Whole-group restarts of ParallelTrainingJobs after a failure")
RANK_REPLACEMENTS = Counter("tandem_operator_rank_replacements_total", "Rank pods of elastic ParallelTrainingJobs "
                            "replaced alone while the other ranks regrouped and trained on")
REGROUPS = Gauge("tandem_operator_job_regroups", "An elastic ParallelTrainingJob's regroups in process "
                 "(status.recoveries.regroups, rank 0's count)", ["namespace", "job"])
RECONCILE_SECONDS = Histogram("tandem_operator_reconcile_seconds", "Time to reconcile one job and apply the plan",
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
API_ERRORS = Counter("tandem_operator_api_errors_total", "Failed attempts of Kubernetes API calls (the operator's and "
                     "kopf's), by verb, kind and code (an HTTP status, or timeout / connection)",
                     ["verb", "kind", "code"])
API_RETRIES = Counter("tandem_operator_api_retries_total", "Failed API calls attempted again within the pass",
                      ["verb", "kind", "code"])
LEADER = Gauge("tandem_operator_leader", "1 on the replica that leads (holds the leader Lease, or runs without "
               "--leader-elect), 0 on a standby")
LEADER_TRANSITIONS = Gauge("tandem_operator_leader_transitions", "How many times the leader Lease changed holder "
                           "(its leaseTransitions, as this replica last read it)")
PASS_FAILURES = Counter("tandem_operator_pass_failures_total", "Reconciliation passes of a job or pool that an API "
                        "failure ended early, by outcome (unavailable, stale, refused); each is decided again",
                        ["resource", "outcome"])



class PhaseCount:
    """Each job's (or pool's) last phase, so the gauge counts them, not transitions."""

    def __init__(self, gauge: Gauge = JOBS_BY_PHASE, phases: tuple[str, ...] = TRAINING_PHASES) -> None:
        self.gauge = gauge
        self.names = phases
        self.phases: dict[tuple[str, str], str] = {}

    def set(self, key: tuple[str, str], phase: str | None) -> None:
        if phase is None:
            self.phases.pop(key, None)
        else:
            self.phases[key] = phase
        for name in self.names:
            self.gauge.labels(name).set(sum(1 for p in self.phases.values() if p == name))


def pool_changes(before: dict[str, Any], after: dict[str, Any],
                 events: list[tuple[str, str, str]]) -> tuple[bool, list[str]]:
    """From a pool's status before and after a pass, and the pass's Events: whether its servers swapped checkpoints,
    and what it refused in the pass (promotion, batching)."""
    served_before = (before.get("model") or {}).get("checkpoint")
    served_after = (after.get("model") or {}).get("checkpoint")
    swapped = served_before is not None and served_after is not None and served_before != served_after
    refused = ["promotion" for _, reason, _ in events if reason == "PromotionSkipped"]
    if _batching_refused(after) and not _batching_refused(before):
        refused.append("batching")
    return swapped, refused


def _batching_refused(status: dict[str, Any]) -> bool:
    return any(c.get("type") == "BatchingDiffers" and c.get("status") == "True" and c.get("reason") == "Refused"
               for c in status.get("conditions") or [])


def observe_pool(key: tuple[str, str], before: dict[str, Any], after: dict[str, Any], desired: int,
                 events: list[tuple[str, str, str]]) -> None:
    """Set pool `key`'s (namespace, name) metrics from a pass's status (`before`, `after`) and Events."""
    labels = {"namespace": key[0], "pool": key[1]}
    POOL_READY.labels(**labels).set(int(after.get("readyReplicas") or 0))
    POOL_DESIRED.labels(**labels).set(desired)
    swapped, refused = pool_changes(before, after, events)
    if swapped:
        POOL_SWAPS.labels(**labels).inc()
    for what in refused:
        POOL_REFUSALS.labels(**labels, what=what).inc()


def forget_pool(key: tuple[str, str]) -> None:
    """Pool `key` is gone: its series go (its counters with them)."""
    for gauge in (POOL_READY, POOL_DESIRED, POOL_SWAPS):
        with contextlib.suppress(KeyError):
            gauge.remove(*key)
    for what in ("promotion", "batching"):
        with contextlib.suppress(KeyError):
            POOL_REFUSALS.remove(*key, what)
