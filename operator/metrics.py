"""The operator's Prometheus metrics (served on --metrics-port): jobs by phase, group restarts, how long a
reconciliation takes, failed and retried API calls, passes an API failure ended early."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from tandem.api.training import TRAINING_PHASES

JOBS_BY_PHASE = Gauge("tandem_operator_jobs", "ParallelTrainingJobs by phase, as last reconciled", ["phase"])
RESTARTS = Counter("tandem_operator_restarts_total", "Whole-group restarts of ParallelTrainingJobs after a failure")
RECONCILE_SECONDS = Histogram("tandem_operator_reconcile_seconds", "Time to reconcile one job and apply the plan",
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
API_ERRORS = Counter("tandem_operator_api_errors_total", "Failed attempts of Kubernetes API calls (the operator's and "
                     "kopf's), by verb, kind and code (an HTTP status, or timeout / connection)",
                     ["verb", "kind", "code"])
API_RETRIES = Counter("tandem_operator_api_retries_total", "Failed API calls attempted again within the pass",
                      ["verb", "kind", "code"])
PASS_FAILURES = Counter("tandem_operator_pass_failures_total", "Reconciliation passes of a job or pool that an API "
                        "failure ended early, by outcome (unavailable, stale, refused); each is decided again",
                        ["resource", "outcome"])



class PhaseCount:
    """Each job's last phase, so the gauge counts jobs, not transitions."""

    def __init__(self) -> None:
        self.phases: dict[tuple[str, str], str] = {}

    def set(self, key: tuple[str, str], phase: str | None) -> None:
        if phase is None:
            self.phases.pop(key, None)
        else:
            self.phases[key] = phase
        for name in TRAINING_PHASES:
            JOBS_BY_PHASE.labels(name).set(sum(1 for p in self.phases.values() if p == name))
