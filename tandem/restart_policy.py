"""What happens when a ParallelTrainingJob's group fails, runs too long, or goes silent: pure functions of the spec,
the status and the clock, shared by the operator and `tandem run`, so one manifest behaves the same on a cluster
and on one machine.

- A failed rank (or a rank pod deleted or evicted) fails the whole group: every rank stops and the group starts
  again from the latest complete checkpoint, after an exponential backoff (base x 2^restarts so far, at most
  MAX_BACKOFF_SECONDS, as Kubernetes Jobs back off), until `backoffLimit` restarts have been spent; the next
  failure fails the job.
- A rank that meets a permanent failure (tandem/contract.py: a model or data that cannot work, InvalidModelOrData; a
  checkpoint directory that is not the run's, CheckpointDirectoryTaken) exits with PERMANENT_FAILURE_EXIT_CODE and
  its report: the job fails at once with the report's reason, without a restart: a restart would fail the same way.
- `activeDeadlineSeconds` counts from the job's start; past it the job fails (DeadlineExceeded).
- While running, rank 0 reports `progress.lastHeartbeat` at least every few seconds; silence longer than
  `heartbeatTimeoutSeconds` counts as a failure (a hung collective never crashes a rank).

Torch-free: the operator imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from tandem.contract import PermanentFailureReport

MAX_BACKOFF_SECONDS = 360.0


@dataclass(frozen=True)
class FailureDecision:
    action: Literal["restart", "fail"]
    restarts: int
    """status.restarts after this decision."""
    delay_seconds: float
    """How long to wait before starting the group again (restart only)."""
    reason: str
    message: str


def backoff_seconds(restarts_done: int, base_seconds: float) -> float:
    """The wait before restart number `restarts_done + 1`."""
    return min(MAX_BACKOFF_SECONDS, base_seconds * 2.0 ** restarts_done)


def after_failure(*, restarts_done: int, backoff_limit: int, base_seconds: float, cause: str,
                  permanent: PermanentFailureReport | None = None) -> FailureDecision:
    """The group failed (`cause` says how): restart it from the latest checkpoint, or fail the job when the
    restarts allowed are spent. A rank that met a permanent failure (`permanent`: its report) fails the job at once
    with the report's reason, spending no restart: a restart would fail the same way."""
    if permanent is not None:
        return FailureDecision(
            "fail", restarts_done, 0.0, permanent.reason,
            f"{permanent.report}\n{cause}; not restarted: a restart would fail the same way (fix the job's spec)")
    if restarts_done >= backoff_limit:
        return FailureDecision(
            "fail", restarts_done, 0.0, "BackoffLimitExceeded",
            f"{cause}; the group was restarted {restarts_done} time(s), backoffLimit is {backoff_limit}")
    delay = backoff_seconds(restarts_done, base_seconds)
    return FailureDecision(
        "restart", restarts_done + 1, delay, "Restarting",
        f"{cause}; restart {restarts_done + 1} of {backoff_limit} from the latest checkpoint in {delay:g} s")


def seconds_left(start_time: datetime | None, active_deadline_seconds: int | None, now: datetime) -> float | None:
    """Seconds until the deadline (negative once past it); None without a deadline or before the job starts."""
    if active_deadline_seconds is None or start_time is None:
        return None
    return active_deadline_seconds - (now - start_time).total_seconds()


def deadline_exceeded(start_time: datetime | None, active_deadline_seconds: int | None, now: datetime) -> bool:
    left = seconds_left(start_time, active_deadline_seconds, now)
    return left is not None and left <= 0


def heartbeat_expired(last_heartbeat: datetime | None, running_since: datetime | None, timeout_seconds: int,
                      now: datetime) -> bool:
    """Rank 0 has been silent longer than `timeout_seconds`: since its last heartbeat or since the group (re)started
    running, whichever is later (start-up, imports and the rendezvous get the same allowance, and a heartbeat
    from before a restart does not count against the new group)."""
    times = [t for t in (last_heartbeat, running_since) if t is not None]
    return bool(times) and (now - max(times)).total_seconds() > timeout_seconds
