"""The operator's API error policy (operator/api_policy.py) and the daemon loop every job and pool runs
(operator/daemon.py), without a cluster: table-driven cases of what each answer means, the retries of one call
(the `kubernetes` client's own exception types, raised by a fake method: no API server is needed to show them), the
metrics by verb, kind and code, the APIRequestRefused condition, and the status the operator may write. The same
policy against the emulated API server, with faults injected, is tests/integration/test_chaos.py."""

from __future__ import annotations

import asyncio
import logging
import random
from datetime import UTC, datetime

import pytest
import urllib3
from kubernetes.client.exceptions import ApiException
from prometheus_client import REGISTRY

from tandem.operator import api_policy, daemon
from tandem.operator.api_policy import Backoff, Refused, Stale, Unavailable, call, classify
from tandem.operator.observed import REFUSED, with_refusal
from tandem.operator.training_plan import ETA_REMOVED

NOW = datetime(2026, 12, 1, tzinfo=UTC)


@pytest.mark.parametrize(("verb", "code", "expected"), [
    ("create", 429, "transient"),
    ("patch", 500, "transient"),
    ("replace", 502, "transient"),
    ("delete", 503, "transient"),
    ("create", 504, "transient"),
    ("create", "timeout", "transient"),
    ("patch", "connection", "transient"),
    ("create", 409, "exists"),
    ("replace", 409, "stale"),
    ("patch", 409, "stale"),
    ("delete", 404, "gone"),
    ("replace", 404, "gone"),
    ("create", 400, "refused"),
    ("create", 403, "refused"),
    ("patch", 422, "refused"),
    ("create", 413, "refused"),
], ids=lambda value: str(value))
def test_what_each_answer_means(verb, code, expected):
    assert classify(verb, code) == expected


@pytest.mark.parametrize(("attempt", "retry_after", "low", "high"), [
    (0, None, 0.1, 0.2),
    (2, None, 0.4, 0.8),
    (10, None, 1.5, 3.0),   # capped at a few seconds
    (0, 1.0, 1.0, 1.0),     # never sooner than Retry-After
    (10, 7.0, 7.0, 7.0),    # Retry-After beyond the cap is still honoured
])
def test_delays_are_jittered_exponential_capped_and_honour_retry_after(attempt, retry_after, low, high):
    rng = random.Random(0)
    delays = {Backoff().delay(attempt, retry_after, rng) for _ in range(50)}
    assert all(low <= d <= high for d in delays)
    if retry_after is None:
        assert len(delays) > 1, "jittered"


def api_error(code: int, headers: dict | None = None, body: str = "") -> ApiException:
    error = ApiException(status=code, reason={403: "Forbidden", 409: "Conflict", 429: "Too Many Requests",
                                              503: "Service Unavailable"}.get(code, "Error"))
    error.headers, error.body = headers or {}, body
    return error


class Answers:
    """A `kubernetes` client method that answers from a script: an exception to raise, or a value to return."""

    def __init__(self, *answers):
        self.answers, self.calls = list(answers), 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer


@pytest.fixture
def slept(monkeypatch):
    """The delays `call` waits between attempts, without waiting them."""
    delays = []

    async def sleep(seconds):
        delays.append(seconds)

    monkeypatch.setattr(api_policy.asyncio, "sleep", sleep)
    return delays


def sample(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_transient_errors_are_retried_within_the_call_and_counted_by_verb_kind_and_code(slept):
    labels = {"verb": "create", "kind": "Pod", "code": "503"}
    errors, retries = sample("tandem_operator_api_errors_total", **labels), \
        sample("tandem_operator_api_retries_total", **labels)
    method = Answers(api_error(503), api_error(429, {"Retry-After": "2"}), "created")
    assert asyncio.run(call("create", "Pod", "default/p", method, "default", {})) == "created"
    assert method.calls == 3
    assert slept[1] >= 2.0, "Retry-After honoured"
    assert all(d <= 3.0 for d in slept[:1])
    assert sample("tandem_operator_api_errors_total", **labels) == errors + 1
    assert sample("tandem_operator_api_retries_total", **labels) == retries + 1
    assert sample("tandem_operator_api_retries_total", verb="create", kind="Pod", code="429") >= 1


def test_timeouts_and_reset_connections_are_transient(slept):
    method = Answers(urllib3.exceptions.ReadTimeoutError(None, "/api", "Read timed out."),
                     urllib3.exceptions.ProtocolError("Connection aborted.", ConnectionResetError(104, "reset")),
                     "patched")
    before = sample("tandem_operator_api_errors_total", verb="patch", kind="paralleltrainingjobs/status",
                    code="timeout")
    assert asyncio.run(call("patch", "paralleltrainingjobs/status", "default/j", method)) == "patched"
    assert sample("tandem_operator_api_errors_total", verb="patch", kind="paralleltrainingjobs/status",
                  code="timeout") == before + 1
    assert sample("tandem_operator_api_errors_total", verb="patch", kind="paralleltrainingjobs/status",
                  code="connection") >= 1


def test_a_call_that_keeps_failing_is_unavailable_after_its_attempts(slept):
    method = Answers(*[api_error(500)] * Backoff().attempts)
    with pytest.raises(Unavailable) as raised:
        asyncio.run(call("delete", "Pod", "default/p", method, "p", "default"))
    assert method.calls == Backoff().attempts and len(slept) == Backoff().attempts - 1
    assert raised.value.code == 500


@pytest.mark.parametrize(("verb", "code", "raised"), [
    ("create", 409, ApiException),   # it exists: the caller keeps it (or replaces a ConfigMap)
    ("delete", 404, ApiException),   # it is gone: done
    ("replace", 409, Stale),          # re-read and decide again
    ("create", 403, Refused),
    ("create", 422, Refused),
    ("patch", 400, Refused),
], ids=lambda value: getattr(value, "__name__", str(value)))
def test_answers_that_are_not_retried(slept, verb, code, raised):
    method = Answers(api_error(code, body='{"kind": "Status", "message": "the API\'s own words"}'))
    with pytest.raises(raised) as error:
        asyncio.run(call(verb, "Pod", "default/p", method))
    assert method.calls == 1 and not slept
    if raised is Refused:
        assert error.value.message == "the API's own words"


@pytest.mark.parametrize(("verb", "kind", "code", "fix"), [
    ("create", "Pod", 403, "grant the operator's ServiceAccount the verb 'create' on 'pods'"),
    ("replace", "Deployment", 403, "the verb 'update' on 'deployments'"),
    ("patch", "paralleltrainingjobs/status", 403, "the verb 'patch' on 'paralleltrainingjobs/status'"),
    ("create", "Pod", 422, "correct the spec field the message names"),
    ("create", "Workload", 404, "install the CRDs of the project that defines the kind (Kueue for Workloads"),
])
def test_a_refusal_names_its_fix(verb, kind, code, fix):
    assert fix in Refused(verb, kind, "default/x", code, "Forbidden", "no").fix()


def test_the_refused_condition_is_set_once_with_an_event_and_cleared_when_calls_are_accepted():
    conditions, event = with_refusal([], "create Pod default/x was refused: 403", "Forbidden", NOW)
    assert conditions == [{"type": REFUSED, "status": "True", "reason": "Forbidden", "lastTransitionTime":
                           "2026-12-01T00:00:00Z", "message": "create Pod default/x was refused: 403"}]
    assert event == ("Warning", REFUSED, "create Pod default/x was refused: 403")
    again, event = with_refusal(conditions, "create Pod default/x was refused: 403", "Forbidden", NOW)
    assert again == conditions and event is None, "the same refusal: no second Event"
    cleared, event = with_refusal(again, None, "", NOW)
    assert cleared[0]["status"] == "False" and cleared[0]["reason"] == "Accepted" and event is None
    assert with_refusal([], None, "", NOW) == ([], None), "no refusal ever: no condition"


@pytest.mark.parametrize(("message", "labels", "level"), [
    ("Request attempt #1/6 failed; will retry: PATCH http://127.0.0.1:1/apis/tandem.dev/v1alpha1/namespaces/default/"
     "paralleltrainingjobs/j -> APIServerError('boom', status=503)", ("patch", "paralleltrainingjobs", "503"),
     logging.WARNING),
    ("Request attempt #2/6 failed; will retry: POST http://127.0.0.1:1/api/v1/namespaces/default/events -> "
     "APITooManyRequestsError('slow down', status=429)", ("post", "events", "429"), logging.WARNING),
    ("Request attempt #6/6 failed; escalating: GET http://127.0.0.1:1/api/v1/pods?watch=true -> "
     "ServerTimeoutError('Timeout on reading data from socket')", ("get", "pods", "timeout"), logging.ERROR),
])
def test_kopfs_own_failed_requests_are_counted_and_a_retry_is_a_warning(message, labels, level):
    before = sample("tandem_operator_api_errors_total", verb=labels[0], kind=labels[1], code=labels[2])
    record = logging.LogRecord("kopf.objects", logging.ERROR, __file__, 1, message, None, None)
    assert api_policy.KopfRequestFailures().filter(record)
    assert record.levelno == level
    assert sample("tandem_operator_api_errors_total", verb=labels[0], kind=labels[1], code=labels[2]) == before + 1


class Recorder:
    """The operator's Cluster, as far as `publish` uses it: the status patches it is asked to send."""

    def __init__(self):
        self.patches = []

    async def patch_status(self, plural, name, namespace, status):
        self.patches.append(status)


def test_publish_sends_only_the_operators_changed_fields_even_when_its_view_of_rank_zeros_lags():
    """The body the operator reads holds rank 0's fields as the watch last brought them (older than what rank 0 has
    written since); the patch must carry none of them, only the operator's fields that changed."""
    body = {"metadata": {"name": "j", "namespace": "default"},
            "status": {"phase": "Running", "restarts": 0, "message": "2 ranks running",
                       "progress": {"step": 10}, "metrics": {"accuracy": 0.5}, "communication": {"bytesSent": 1},
                       "checkpoint": {"latest": "/c/step-00000010.pt"}}}
    cluster, state = Recorder(), daemon.Reconciliation("paralleltrainingjobs", "default", "j")
    changed = asyncio.run(daemon.publish(cluster, state, body, {"phase": "Running", "restarts": 1,
                                                                "message": "2 ranks running"}, []))
    assert cluster.patches == [{"restarts": 1}] == [changed]
    assert state.written == {"phase": "Running", "restarts": 1, "message": "2 ranks running"}


@pytest.mark.parametrize("field", ["progress", "metrics", "communication", "checkpoint"])
def test_publish_refuses_rank_zeros_fields(field):
    body = {"metadata": {"name": "j", "namespace": "default"}, "status": {}}
    with pytest.raises(ValueError, match="rank 0's"):
        asyncio.run(daemon.publish(Recorder(), daemon.Reconciliation("paralleltrainingjobs", "default", "j"), body,
                                   {"phase": "Running", field: {}}, []))


def test_publish_sends_the_removal_of_rank_zeros_eta_and_keeps_it_out_of_the_operators_written_fields():
    body = {"metadata": {"name": "j", "namespace": "default"},
            "status": {"phase": "Running", "progress": {"step": 10, "etaSeconds": 4.0, "etaText": "4s"}}}
    cluster, state = Recorder(), daemon.Reconciliation("paralleltrainingjobs", "default", "j")
    asyncio.run(daemon.publish(cluster, state, body, {"phase": "Failed", **ETA_REMOVED}, []))
    assert cluster.patches == [{"phase": "Failed", "progress": {"etaSeconds": None, "etaText": None}}]
    assert state.written == {"phase": "Failed"}  # laid over the body it reads: rank 0's progress stays whole
    with pytest.raises(ValueError, match="rank 0's"):  # any other write of progress is refused
        asyncio.run(daemon.publish(cluster, state, body, {"phase": "Failed", "progress": {"etaSeconds": None}}, []))


def test_a_refused_call_becomes_a_condition_at_the_next_publish_and_is_cleared_after_a_clean_pass(monkeypatch):
    events = []
    monkeypatch.setattr(daemon.kopf, "event", lambda body, **event: events.append(event))
    state = daemon.Reconciliation("paralleltrainingjobs", "default", "j")
    state.refusal = Refused("create", "Pod", "default/j-worker-0", 403, "Forbidden",
                            'pods "j-worker-0" is forbidden: cannot create')
    body = {"metadata": {"name": "j", "namespace": "default"}, "status": {}}
    cluster = Recorder()
    asyncio.run(daemon.publish(cluster, state, body, {"phase": "Pending", "conditions": []}, []))
    condition = cluster.patches[0]["conditions"][0]
    assert condition["type"] == REFUSED and condition["status"] == "True" and condition["reason"] == "Forbidden"
    assert condition["message"].startswith("create Pod default/j-worker-0 was refused: 403 Forbidden: pods")
    assert "grant the operator's ServiceAccount the verb 'create' on 'pods'" in condition["message"]
    assert events == [{"type": "Warning", "reason": REFUSED, "message": condition["message"]}]
    state.refusal = None
    asyncio.run(daemon.publish(cluster, state, {**body, "status": state.written},
                               {"phase": "Pending", "conditions": state.written["conditions"]}, []))
    assert cluster.patches[1]["conditions"][0]["status"] == "False"


def loop_waits(monkeypatch, script, state: daemon.Reconciliation | None = None
               ) -> tuple[list[float | None], daemon.Reconciliation]:
    """Runs the daemon loop over `script`, one item a pass: an exception the pass raises, a coroutine function the
    pass awaits (its result is the pass's), or what the pass returns; after the last, FINISHED. Returns the wait the
    loop asked for after each pass and the loop's state (`state`, or a job's new one). `daemon.sleep` is replaced
    so that the waits are recorded instead of waited: the loop's decision is the seconds it asks for, and a loaded
    machine cannot stretch those."""
    waits = []

    async def sleep(waker, stopped, seconds):
        waits.append(seconds)

    monkeypatch.setattr(daemon, "sleep", sleep)
    passes = iter(script)

    async def one_pass():
        answer = next(passes, daemon.FINISHED)
        if callable(answer):
            answer = await answer()
        if isinstance(answer, Exception):
            raise answer
        return answer

    class Running:  # kopf's DaemonStopped is false until the daemon is stopped
        def __bool__(self):
            return False

    state = state or daemon.Reconciliation("paralleltrainingjobs", "default", "j")
    asyncio.run(daemon.run(state, asyncio.Event(), Running(), one_pass))
    return waits, state


def test_the_loop_decides_a_failed_pass_again_within_seconds_and_a_clean_pass_clears_a_refusal(monkeypatch):
    """The loop's waits, recorded instead of waited: after each failure the pass runs again, within seconds for a
    transient failure or a stale read, never kopf's 60 s; a refusal waits for a change or REFUSED_SECONDS; the
    clean pass after a refusal is followed at once by one that clears its condition."""
    waits, state = loop_waits(monkeypatch, [Unavailable("create", "Pod", "x", 503, "", "", retry_after=None),
                                            Unavailable("create", "Pod", "x", 429, "", "", retry_after=2.0),
                                            Stale("replace", "Deployment", "x", 409, "", ""),
                                            Refused("create", "Pod", "x", 403, "Forbidden", ""),
                                            5.0, 5.0])
    assert len(waits) == 6
    assert 0.25 <= waits[0] <= 0.5 and waits[1] >= 2.0 and waits[1] <= 5.0
    assert waits[2] == daemon.STALE_SECONDS and waits[3] == daemon.REFUSED_SECONDS
    assert waits[4] == 0.0 and state.refusal is None, "a clean pass after a refusal: at once again, to clear it"
    assert waits[5] == 5.0


FIRST, SECOND, THIRD, FOURTH, CAPPED = (0.25, 0.5), (0.5, 1.0), (1.0, 2.0), (2.0, 4.0), (2.5, 5.0)
"""PASS_BACKOFF's jittered waits after 1, 2, 3, 4 and more transient failures in a row: between c/2 and c, where c
doubles from 0.5 s to its cap, 5 s."""
CLEAN = 10.0
"""What a clean pass in these scripts asks for: look again in 10 s."""
STALE = Stale("replace", "ConfigMap", "default/j-spec", 409, "Conflict", "")
GONE = api_error(404)  # an object gone under a call whose caller does not absorb the 404
FORBIDDEN = Refused("create", "Pod", "default/j-worker-0", 403, "Forbidden", "")


def unavailable(retry_after: float | None = None) -> Unavailable:
    return Unavailable("create", "Pod", "default/j-worker-0", 503, "Service Unavailable", "", retry_after)


@pytest.mark.parametrize(("script", "expected"), [
    pytest.param([unavailable()] * 7, [FIRST, SECOND, THIRD, FOURTH, CAPPED, CAPPED, CAPPED],
                 id="doubling-up-to-the-cap"),
    pytest.param([unavailable(), unavailable(), unavailable(), CLEAN, unavailable(), unavailable()],
                 [FIRST, SECOND, THIRD, CLEAN, FIRST, SECOND], id="started-over-by-a-clean-pass"),
    pytest.param([unavailable(3.0), unavailable(), unavailable(0.1), unavailable(8.0)], [3.0, SECOND, THIRD, 8.0],
                 id="retry-after-the-least-even-past-the-cap"),
    pytest.param([unavailable(), unavailable(), STALE, GONE, unavailable()],
                 [FIRST, SECOND, daemon.STALE_SECONDS, daemon.STALE_SECONDS, THIRD], id="stale-or-gone-in-between"),
    pytest.param([unavailable(), FORBIDDEN, unavailable(), FORBIDDEN, CLEAN, CLEAN, unavailable()],
                 [FIRST, daemon.REFUSED_SECONDS, SECOND, daemon.REFUSED_SECONDS, 0.0, CLEAN, FIRST],
                 id="refused-in-between"),
])
def test_the_wait_after_each_pass_follows_the_transient_failures_in_a_row(monkeypatch, script, expected):
    """The loop over a run of pass outcomes (the waits recorded, not waited; the jitter is real, and each expected
    wait is the range it falls in, or an exact number): each transient failure in a row doubles the wait up to the
    cap, never below the server's Retry-After (which may exceed the cap) and without that Retry-After changing the
    count; a clean pass starts the count over; a stale read, an object gone, or a refusal waits its own fixed time
    and leaves the count as it was (they are not transient failures, nor a pass that got through); the clean pass
    after a refusal is followed at once by one that clears its condition."""
    waits, _ = loop_waits(monkeypatch, script)
    expected = [wait if isinstance(wait, tuple) else (wait, wait) for wait in expected]
    assert len(waits) == len(expected), waits
    assert all(low <= wait <= high for wait, (low, high) in zip(waits, expected, strict=True)), waits


def test_the_servers_retry_after_travels_from_the_failed_call_to_the_next_pass(monkeypatch, slept):
    """A pass whose create is answered 503 with Retry-After: 3 on every attempt (the `kubernetes` client's
    ApiException raised by a fake client method: `call` reads the answer as the client hands it over, no API server
    is needed) waits 3 s between its attempts (recorded by `slept`, not waited) and ends Unavailable; the loop then
    decides the pass again no sooner than the server asked, though its own backoff would start at half a second.
    The next pass's create is answered and the loop goes on as that pass asks."""
    method = Answers(*[api_error(503, {"Retry-After": "3"})] * Backoff().attempts, "created")

    async def creates():
        await call("create", "Pod", "default/j-worker-0", method, "default", {})
        return CLEAN

    waits, _ = loop_waits(monkeypatch, [creates, creates])
    assert slept == [3.0] * (Backoff().attempts - 1)
    assert waits == [3.0, CLEAN]


def test_every_event_handler_runs_on_the_event_loop():
    """The event handlers wake the daemons' asyncio.Events: kopf runs a plain `def` handler in a worker thread,
    where setting an Event races the loop's own use of it (the chaos suite met 'deque mutated during iteration')."""
    import inspect

    import kopf

    from tandem.operator import handlers, pool_handlers  # noqa: F401 (registers the handlers)

    found = {h.id: inspect.iscoroutinefunction(h.fn) for h in kopf.get_default_registry()._watching.get_all_handlers()}
    assert {"pod_changed", "job_changed", "pool_changed", "pool_pods_changed"} <= set(found)
    assert all(found.values()), found


def test_a_child_the_api_says_is_gone_is_left_out_while_kopfs_index_still_holds_it():
    """kopf's relist after a watch's 410 Gone reports no deletions: a pod deleted meanwhile stays in its index for
    good. Once the API has answered 404 for it, the daemon leaves it out; a new pod of the same name (another uid)
    is there."""
    ghost, live = ({"metadata": {"name": f"j-worker-{rank}", "uid": f"u{rank}"}} for rank in (0, 1))
    state = daemon.Reconciliation("paralleltrainingjobs", "default", "j")
    assert state.present([ghost, live]) == [ghost, live]
    state.found_gone(ghost)
    assert state.present([ghost, live]) == [live]
    recreated = {"metadata": {"name": "j-worker-0", "uid": "u2"}}
    assert state.present([recreated, live]) == [recreated, live]


def test_a_pod_delete_answered_404_marks_the_pod_gone():
    """handlers._apply: the plan deletes two pods; the API has one of them no more."""
    from tandem.operator import handlers
    from tandem.operator.training import Plan

    class Deleter(Recorder):
        async def delete(self, kind, name, namespace, grace_seconds=None):
            return name != "j-worker-0"

    state = daemon.Reconciliation("paralleltrainingjobs", "default", "j")
    pods = [{"metadata": {"name": f"j-worker-{rank}", "uid": f"u{rank}"}} for rank in (0, 1)]
    body = {"metadata": {"name": "j", "namespace": "default"}, "status": {}}
    asyncio.run(handlers._apply(Plan(delete_pods=["j-worker-0", "j-worker-1"]), body, pods, Deleter(), state,
                                handlers.QueueReads()))
    assert state.gone == {"u0"}


def test_a_pools_child_answered_404_is_marked_gone_and_the_pass_decided_again():
    """pool_handlers._apply: the index holds a Deployment and a Service the API has no more; replacing the one
    (404: the pass ends, to be decided again) and deleting the other mark both gone."""
    from tandem.operator import pool_handlers
    from tandem.operator.pools import PoolPlan

    class Vanished(Recorder):
        async def put(self, manifest, existing):
            raise ApiException(status=404, reason="Not Found")

        async def delete(self, kind, name, namespace, grace_seconds=None):
            return False

    deployment = {"kind": "Deployment", "metadata": {"name": "p-server", "uid": "d1"}}
    service = {"kind": "Service", "metadata": {"name": "p", "uid": "s1"}}
    state = daemon.Reconciliation("inferencepools", "default", "p")
    body = {"metadata": {"name": "p", "namespace": "default"}, "status": {}}
    delete = PoolPlan(delete=[("Service", "p")])
    asyncio.run(pool_handlers._apply(delete, body, {"Service": service}, Vanished(), pool_handlers.RecentlyPut(),
                                     state))
    replace = PoolPlan(apply=[{"kind": "Deployment", "metadata": {"name": "p-server"}}])
    with pytest.raises(ApiException):
        asyncio.run(pool_handlers._apply(replace, body, {"Deployment": deployment}, Vanished(),
                                         pool_handlers.RecentlyPut(), state))
    assert state.gone == {"d1", "s1"}


def test_pods_the_index_shows_terminating_are_confirmed_by_a_list_at_most_every_two_seconds(monkeypatch):
    """A pod whose deletion the watch missed stays terminating in kopf's index: while a pass waits on terminating
    pods, a LIST (at most every CONFIRM_SECONDS) leaves out those the API no longer holds; without a terminating pod
    nothing is listed."""
    clock = [100.0]
    monkeypatch.setattr(daemon.time, "monotonic", lambda: clock[0])
    lists = []

    def listed(uids):
        async def list_uids():
            lists.append(uids)
            return uids
        return list_uids

    running = {"metadata": {"name": "j-worker-0", "uid": "u0"}}
    ghost = {"metadata": {"name": "j-worker-1", "uid": "u1", "deletionTimestamp": "2026-12-01T00:00:00Z"}}
    stopping = {"metadata": {"name": "j-worker-2", "uid": "u2", "deletionTimestamp": "2026-12-01T00:00:00Z"}}
    state = daemon.Reconciliation("paralleltrainingjobs", "default", "j")
    assert asyncio.run(state.confirm_deletions([running], listed({"u0"}))) == [running] and lists == []
    pods = [running, ghost, stopping]
    assert asyncio.run(state.confirm_deletions(pods, listed({"u0", "u2"}))) == [running, stopping]
    assert state.present(pods) == [running, stopping]
    clock[0] += 1.0
    assert asyncio.run(state.confirm_deletions([running, stopping], listed({"u0"}))) == [running, stopping]
    assert len(lists) == 1, "listed again within CONFIRM_SECONDS"
    clock[0] += daemon.CONFIRM_SECONDS
    assert asyncio.run(state.confirm_deletions([running, stopping], listed({"u0"}))) == [running]
