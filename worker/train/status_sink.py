"""Rank 0's report into its ParallelTrainingJob's status subresource, and what it promises while the API server
misbehaves (429 with Retry-After, 500/502/503/504, timeouts, reset connections):

- training is never slowed or stopped by the API: `publish()` hands the newest status to a background sender (a
  one-slot mailbox, newer replaces older) and returns; nothing raises into training;
- transient errors are retried with jittered exponential backoff capped at a few seconds, at least as long as
  the server's Retry-After; each retry sends the newest status handed over, never an older one;
- updates go out one at a time, in order: `progress.step` and `checkpoint` never go backwards from what this
  process sent, and a restarted group's first patch keeps the stored `checkpoint.history` (read once, by a GET
  of the job, before the first patch);
- 404 (the job was deleted) ends reporting quietly; 400/401/403/422 are not retried: one line on stderr names
  the job, the API's message and the fix, and the next new status is tried once more;
- `close()` waits for the final status to be delivered, retrying, up to `deadline` seconds, then gives up with
  one line on stderr.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

from tandem.api import GROUP, VERSION, ParallelTrainingJobStatus
from tandem.api_errors import TRANSIENT_CODES, Backoff, api_message, retry_after
from tandem.worker.train.preemption import preemption_cost

PLURAL = "paralleltrainingjobs"

HISTORY_LIMIT = 10
"""Checkpoint records kept in status.checkpoint.history, oldest first."""

BACKOFF = Backoff(base=0.25, cap=4.0)
"""Between the attempts of one status (a longer Retry-After is honoured up to RETRY_AFTER_CAP)."""
RETRY_AFTER_CAP = 30.0

FIXES = {
    400: "the status does not fit the installed CRD: install the CRDs of this Tandem version (`tandem crds`)",
    401: "rank 0's credentials were refused: check the ServiceAccount token mounted in its pod",
    403: "rank 0's ServiceAccount lacks `{verb}` on {resource} for this job: the Role the operator creates for the "
         "job grants get and patch on paralleltrainingjobs and paralleltrainingjobs/status; check that Role and its "
         "RoleBinding",
    422: "the status does not fit the installed CRD: install the CRDs of this Tandem version (`tandem crds`)",
}


class Gone(Exception):
    """The job was deleted (404): reporting ends."""


class Refused(Exception):
    """The API refused the request for a reason retrying will not change (400, 401, 403, 422, ...)."""


class KubernetesStatusSink:
    """Rank 0's report into its ParallelTrainingJob's status subresource: `progress` (with `lastHeartbeat`),
    `metrics`, `communication`, `checkpoint` and `preemptionCost` (what a preemption would cost at that progress),
    and nothing else (phase, conditions, workers and the rest are the operator's). A merge patch at most every
    `interval` seconds, at once when the checkpoint changes, and at close. Logs in with in-cluster config, else
    KUBECONFIG.

    One background thread sends (see the module's docstring for the promises under API faults). `timeout` bounds
    each request; `deadline` bounds how long `close()` waits for the final status: it must fit within the pod's
    termination grace period, after the checkpoint written on SIGTERM (the operator gives rank pods 60 s)."""

    FIELDS = ("progress", "metrics", "communication", "checkpoint", "preemptionCost", "lastRecovery")
    """Rank 0's fields of the status (and `recoveries.regroups`: the operator writes `recoveries.restarts`)."""

    def __init__(self, job: str, namespace: str, *, interval: float = 5.0, timeout: float = 5.0,
                 deadline: float = 30.0):
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))  # read now, not at import
        self.api = client.CustomObjectsApi()
        self.job, self.namespace = job, namespace
        self.interval, self.timeout, self.deadline = interval, timeout, deadline
        self.gone = False
        self._wake = threading.Condition()
        self._newest: ParallelTrainingJobStatus | None = None
        self._handed = 0  # statuses handed over so far; the newest is number `_handed`
        self._due = 0  # the number of the newest status that must go out
        self._settled = 0  # the number of the newest status delivered, or refused for good
        self._last_due = float("-inf")
        self._checkpoint_handed: str | None = None
        self._stopped = False
        self._stored_checkpoint: dict[str, Any] | None = None
        self._failing: str | None = None  # the transient error of the current run of failures (logged once)
        self._refused: str | None = None  # the last refusal (logged once until a request succeeds)
        self._thread = threading.Thread(target=self._run, name=f"status-{namespace}/{job}", daemon=True)
        self._thread.start()

    # -- the training thread's side: never blocks on the API --------------------------------------------------------
    def publish(self, status: ParallelTrainingJobStatus) -> None:
        with self._wake:
            if self.gone or self._stopped:
                return
            status = self._not_behind(status)
            self._newest, self._handed = status, self._handed + 1
            clock = time.monotonic()
            if status.checkpoint.latest != self._checkpoint_handed or clock - self._last_due >= self.interval:
                self._due, self._last_due, self._checkpoint_handed = self._handed, clock, status.checkpoint.latest
                self._wake.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the status due now is delivered (or refused, or the job is gone); False on timeout."""
        with self._wake:
            return self._wake.wait_for(lambda: self.gone or self._stopped or self._settled >= self._due, timeout)

    def close(self) -> None:
        """Send the newest status and wait, at most `deadline` seconds, until it is delivered."""
        with self._wake:
            if self._stopped:
                return
            self._due = self._handed
            self._wake.notify_all()
            done = self._wake.wait_for(lambda: self.gone or self._settled >= self._handed, self.deadline)
            self._stopped = True
            self._wake.notify_all()
        if not done:
            cause = f" (last error: {self._failing})" if self._failing else ""
            print(f"tandem worker: the final status of {self._name} was not delivered within {self.deadline:g} s"
                  f"{cause}; giving up", file=sys.stderr)

    def _not_behind(self, status: ParallelTrainingJobStatus) -> ParallelTrainingJobStatus:
        """A copy of `status` (the Reporter edits its own afterwards) whose progress and checkpoint are not behind
        those already handed over, and its preemption cost counted from those."""
        status = status.model_copy(deep=True)
        before = self._newest
        if before is None:
            return status
        if status.progress.step < before.progress.step:
            status.progress = before.progress.model_copy(deep=True)
        if _checkpoint_step(status) < _checkpoint_step(before):
            status.checkpoint = before.checkpoint.model_copy(deep=True)
            status.preemption_cost = before.preemption_cost  # with the seconds that checkpoint took
        if status.preemption_cost is not None:
            status.preemption_cost = preemption_cost(status, status.preemption_cost.checkpoint_seconds)
        return status

    # -- the sender thread ------------------------------------------------------------------------------------------
    @property
    def _name(self) -> str:
        return f"{self.namespace}/{self.job}"

    def _run(self) -> None:
        try:
            self._read_stored()
            while True:
                with self._wake:
                    self._wake.wait_for(lambda: self._stopped or self._settled < self._due)
                    if self._stopped:
                        return
                self._deliver()
        except Gone:
            with self._wake:
                self.gone = True
                self._wake.notify_all()
            print(f"tandem worker: {self._name} is gone: status reporting ends", file=sys.stderr)
        except Exception as error:  # a bug here must not leave close() waiting for its deadline
            with self._wake:
                self._stopped = True
                self._wake.notify_all()
            print(f"tandem worker: status reporting of {self._name} stopped: {type(error).__name__}: {error}",
                  file=sys.stderr)

    def _read_stored(self) -> None:
        """The stored checkpoint (a restarted group's first patch must keep its history), read once."""
        try:
            job = self._retrying(lambda: self.api.get_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, self.job, _request_timeout=self.timeout))
        except Refused as refusal:
            self._log_refusal(refusal, "get")
            return
        if job is not None:
            self._stored_checkpoint = ((job.get("status") or {}).get("checkpoint")) or {}

    def _deliver(self) -> None:
        """Patch the newest status; each retry takes whatever is newest by then."""
        number = 0

        def patch() -> None:
            nonlocal number
            with self._wake:
                number, status = self._handed, self._newest
            self.api.patch_namespaced_custom_object_status(
                GROUP, VERSION, self.namespace, PLURAL, self.job, self._body(status),
                _content_type="application/merge-patch+json", _request_timeout=self.timeout)

        try:
            self._retrying(patch)
        except Refused as refusal:
            self._log_refusal(refusal, "patch")
        with self._wake:
            self._settled = max(self._settled, number)
            self._wake.notify_all()

    def _body(self, status: ParallelTrainingJobStatus) -> dict[str, Any]:
        wire = status.to_dict()
        body = {field: wire[field] for field in self.FIELDS if field in wire}
        if status.recoveries.regroups:
            body["recoveries"] = {"regroups": status.recoveries.regroups}
        if self._stored_checkpoint is not None:
            body["checkpoint"] = keep_stored_history(self._stored_checkpoint, body.get("checkpoint") or {})
        return {"status": body}

    def _retrying(self, call):
        """`call()` until it succeeds, retrying transient errors; Gone on 404, Refused on other client errors. None
        if the sink was closed (and gave up) meanwhile."""
        from kubernetes.client.exceptions import ApiException

        attempt = 0
        while True:
            try:
                result = call()
            except ApiException as error:
                if error.status == 404:
                    raise Gone() from error
                if error.status and error.status not in TRANSIENT_CODES:
                    raise Refused(error) from error
                delay = BACKOFF.delay(attempt, min(RETRY_AFTER_CAP, retry_after(error) or 0.0))
                self._log_failure(f"{error.status} {error.reason}")
            except Exception as error:  # the network, a timeout, the API server restarting
                delay = BACKOFF.delay(attempt)
                self._log_failure(f"{type(error).__name__}: {error}")
            else:
                self._failing = self._refused = None
                return result
            attempt += 1
            with self._wake:
                if self._wake.wait_for(lambda: self._stopped, delay):
                    return None

    def _log_failure(self, error: str) -> None:
        if self._failing is None:
            print(f"tandem worker: status update of {self._name} failed ({error}); retrying with backoff",
                  file=sys.stderr)
        self._failing = error

    def _log_refusal(self, refusal: Refused, verb: str) -> None:
        error = refusal.args[0]
        said = f"{error.status} {error.reason}: {api_message(error)}"
        if said != self._refused:
            resource = f"{PLURAL}/status" if verb == "patch" else PLURAL
            fix = FIXES.get(error.status, "see the API's message").format(verb=verb, resource=resource)
            print(f"tandem worker: status of {self._name} not updated ({verb}): {said}. Fix: {fix}. Training goes "
                  f"on; the next status is tried once more", file=sys.stderr)
        self._refused = said


def _checkpoint_step(status: ParallelTrainingJobStatus) -> int:
    checkpoint = status.checkpoint
    return -1 if checkpoint.latest is None else (checkpoint.step or 0)


def keep_stored_history(stored: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    """`own` (a checkpoint status on the wire) with the stored history kept: the stored records first (a record of
    the same path keeps its stored time: a resumed group records its checkpoint again), then this process's, the
    last HISTORY_LIMIT. Without a `latest` of its own, the merge patch leaves the stored one."""
    records: dict[str, dict[str, Any]] = {}
    for record in [*(stored.get("history") or []), *(own.get("history") or [])]:
        if isinstance(record, dict) and record.get("path") and record["path"] not in records:
            records[record["path"]] = record
    merged = {**own, "history": list(records.values())[-HISTORY_LIMIT:]}
    known = records.get(own.get("latest"))
    if known is not None and "time" in known:
        merged["time"] = known["time"]
    return merged
