"""The restart policy (tandem/restart_policy.py), one case per rule, as the operator and `tandem run` apply it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from tandem.restart_policy import MAX_BACKOFF_SECONDS, after_failure, deadline_exceeded, heartbeat_expired, seconds_left

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize(("restarts_done", "limit", "base", "action", "restarts", "delay", "reason"), [
    (0, 3, 10, "restart", 1, 10, "Restarting"),
    (1, 3, 10, "restart", 2, 20, "Restarting"),
    (2, 3, 10, "restart", 3, 40, "Restarting"),
    (3, 3, 10, "fail", 3, 0, "BackoffLimitExceeded"),
    (0, 0, 10, "fail", 0, 0, "BackoffLimitExceeded"),
    (0, 3, 0, "restart", 1, 0, "Restarting"),
    (9, 20, 10, "restart", 10, MAX_BACKOFF_SECONDS, "Restarting"),
], ids=["first", "second doubles", "third doubles", "limit spent", "no restarts allowed", "no backoff", "capped"])
def test_a_failed_group_restarts_with_exponential_backoff_until_the_limit(
        restarts_done, limit, base, action, restarts, delay, reason):
    decision = after_failure(restarts_done=restarts_done, backoff_limit=limit, base_seconds=base,
                             cause="rank 1 exited with code 1")
    assert (decision.action, decision.restarts, decision.delay_seconds, decision.reason) == (
        action, restarts, delay, reason)
    assert decision.message.startswith("rank 1 exited with code 1; ")
    assert f"backoffLimit is {limit}" in decision.message if action == "fail" else f"of {limit}" in decision.message


@pytest.mark.parametrize(("start", "deadline", "left", "exceeded"), [
    (None, 60, None, False),
    (NOW - timedelta(seconds=30), None, None, False),
    (NOW - timedelta(seconds=30), 60, 30.0, False),
    (NOW - timedelta(seconds=60), 60, 0.0, True),
    (NOW - timedelta(seconds=90), 60, -30.0, True),
], ids=["not started", "no deadline", "inside", "at the deadline", "past it"])
def test_the_active_deadline_counts_from_the_start(start, deadline, left, exceeded):
    assert seconds_left(start, deadline, NOW) == left
    assert deadline_exceeded(start, deadline, NOW) is exceeded


@pytest.mark.parametrize(("heartbeat", "running_since", "expired"), [
    (None, None, False),
    (NOW - timedelta(seconds=10), NOW - timedelta(seconds=500), False),
    (NOW - timedelta(seconds=400), NOW - timedelta(seconds=500), True),
    (None, NOW - timedelta(seconds=100), False),
    (None, NOW - timedelta(seconds=400), True),
    (NOW - timedelta(seconds=900), NOW - timedelta(seconds=100), False),
], ids=["not running", "fresh", "silent too long", "starting up", "never reported", "heartbeat from before a restart"])
def test_a_silent_rank_zero_counts_as_a_failure_after_the_timeout(heartbeat, running_since, expired):
    assert heartbeat_expired(heartbeat, running_since, 300, NOW) is expired
