"""Leader election's decisions (operator/election.py) and the write check every write passes (operator/leadership.py,
in the operator's client and kopf's session), without a cluster. tests/integration/test_leader_election.py runs real
operator replicas."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from kubernetes import client
from kubernetes.config import kube_config
from urllib3.connection import HTTPConnection

from tandem.operator import api_policy, leadership
from tandem.operator.cluster import login
from tandem.operator.election import LeaseRecord, Timing, decide, lease_manifest, released_manifest
from tandem.operator.leadership import Leadership, NotLeading

TIMING = Timing()  # 15 s lease, 10 s renew deadline, 2 s retry period
ME, OTHER = "operator-a_1", "operator-b_2"
NOW = datetime(2026, 12, 3, 12, 0, 0, 123456, tzinfo=UTC)


def record(holder: str = OTHER, duration: float | None = 15, transitions: int = 3, version: str = "41") -> LeaseRecord:
    return LeaseRecord(holder, duration, NOW, NOW, transitions, version)


@pytest.mark.parametrize("name, lease, seen_at, now, expected", [
    ("no lease: create it", None, 0.0, 100.0, "create"),
    ("mine: renew it", record(ME), 0.0, 100.0, "renew"),
    ("released (no holder): take it at once", record(""), 99.9, 100.0, "take"),
    ("another's, seen renewed 14.9 s ago: wait", record(), 85.1, 100.0, "wait"),
    ("another's, seen renewed 15 s ago: take it", record(), 85.0, 100.0, "take"),
    ("the holder's own duration counts, not ours", record(duration=30), 80.0, 100.0, "wait"),
    ("a lease without a duration runs ours", record(duration=None), 85.0, 100.0, "take"),
])
def test_what_a_replica_does_with_the_lease_it_read(name, lease, seen_at, now, expected):
    assert decide(lease, ME, seen_at, now, TIMING) == expected, name


@pytest.mark.parametrize("name, lease, action, holder, transitions, acquired, version", [
    ("create: no version, no transition", None, "create", ME, 0, NOW, None),
    ("renew: the version read, the acquire time kept", record(ME), "renew", ME, 3, record().acquire_time, "41"),
    ("take over: one more transition, acquired now", record(), "take", ME, 4, NOW, "41"),
    ("take a released lease: one more transition", record(""), "take", ME, 4, NOW, "41"),
])
def test_the_lease_a_replica_writes(name, lease, action, holder, transitions, acquired, version):
    later = NOW.replace(second=5)
    manifest = lease_manifest("tandem-operator", "tandem-system", ME, lease, action,
                              later if action == "renew" else NOW, TIMING)
    spec = manifest["spec"]
    assert (spec["holderIdentity"], spec["leaseTransitions"], spec["leaseDurationSeconds"]) == (holder, transitions,
                                                                                                15), name
    assert spec["acquireTime"] == acquired.strftime("%Y-%m-%dT%H:%M:%S.%fZ"), name
    assert spec["renewTime"].endswith("Z") and spec["renewTime"] >= spec["acquireTime"], name
    assert manifest["metadata"].get("resourceVersion") == version, name


def test_a_released_lease_names_no_holder_and_runs_out_in_a_second():
    spec = released_manifest("tandem-operator", "tandem-system", record(ME), NOW)["spec"]
    assert (spec["holderIdentity"], spec["leaseDurationSeconds"], spec["leaseTransitions"]) == ("", 1, 3)
    assert decide(LeaseRecord("", 1, NOW, NOW, 3, "42"), OTHER, 100.0, 100.0, TIMING) == "take"


@pytest.mark.parametrize("name, timing, fix", [
    ("defaults", Timing(), None),
    ("renew deadline not under the lease", Timing(10, 10, 2), "--leader-elect-renew-deadline (10 s) must be shorter"),
    ("retry not under the renew deadline", Timing(15, 2, 2), "--leader-elect-retry-period (2 s) must be above 0"),
    ("no retry period", Timing(15, 10, 0), "--leader-elect-retry-period (0 s) must be above 0"),
])
def test_election_durations_that_cannot_elect_safely_are_refused_naming_the_flag(name, timing, fix):
    problem = timing.problem()
    assert (problem is None) if fix is None else problem.startswith(fix), (name, problem)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_leader_may_write_until_the_renew_deadline_of_the_renewal_it_last_sent():
    clock = Clock()
    held = Leadership(clock=clock)
    assert not held.may_write()  # a standby
    held.renewed(sent_at=1000.0, renew_deadline=10.0)
    clock.now = 1009.9
    assert held.may_write()
    clock.now = 1010.0  # paused past the deadline (SIGSTOP): the monotonic clock ran on
    assert not held.may_write()
    with pytest.raises(NotLeading, match="does not hold the leader lease"):
        held.check("patch", "paralleltrainingjobs/status x")
    held.check("get", "pods")  # reads stay allowed
    held.check("WATCH", "pods")
    held.renewed(sent_at=1010.0, renew_deadline=10.0)
    assert held.may_write()
    held.lose()
    assert not held.may_write() and not held.leading


def test_a_replica_without_election_always_may_write():
    assert Leadership(always=True, clock=lambda: 1e12).may_write()
    assert leadership.current.may_write()


@pytest.fixture
def standby():
    """The process's leadership replaced by a standby's for the test (the checks read `leadership.current`)."""
    saved = leadership.current
    held = Leadership()
    leadership.install(held)
    yield held
    leadership.install(saved)


@pytest.fixture
def api_server(tmp_path, monkeypatch):
    """A local HTTP server standing in for the API server (it answers every request `{}` and records its method),
    and the kubeconfig both clients log in with."""
    received: list[str] = []

    class Answer(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def answer(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            received.append(self.command)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = answer

        def log_message(self, *_: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    config = {"apiVersion": "v1", "kind": "Config", "current-context": "c",
              "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{server.server_port}"}}],
              "users": [{"name": "u", "user": {"token": "t"}}],
              "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}
    (tmp_path / "kubeconfig").write_text(json.dumps(config))
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(tmp_path / "kubeconfig"))  # read at import
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    yield received
    server.shutdown()
    server.server_close()


def test_the_operators_writes_are_refused_before_they_are_sent_while_it_may_not_write(standby, api_server):
    """The operator's own client (cluster.login) against a local server: a write while the replica may not write
    raises NotLeading, once (the policy does not retry it), and nothing reaches the server; reads pass; the
    election's own client (unguarded) writes; once the replica leads, the operator's writes pass."""
    core = client.CoreV1Api(login())
    with pytest.raises(NotLeading, match="does not hold the leader lease"):
        asyncio.run(api_policy.call("create", "Pod", "default/x-0", core.create_namespaced_pod, "default", {}))
    assert api_server == [], "nothing reaches the API"
    asyncio.run(api_policy.call("get", "Pod", "default/x-0", core.read_namespaced_pod, "x-0", "default"))
    leases = client.CoordinationV1Api(login(guarded=False))
    asyncio.run(api_policy.call("create", "leases", "x", leases.create_namespaced_lease, "default", {}))
    standby.renewed(sent_at=time.monotonic(), renew_deadline=60)
    asyncio.run(api_policy.call("create", "Pod", "default/x-0", core.create_namespaced_pod, "default", {}))
    assert api_server == ["GET", "POST", "POST"]


def test_a_pause_while_connecting_is_caught_by_the_check_made_once_connected(api_server, monkeypatch):
    """The check is made once the connection is made, right before the request's bytes: a replica paused (SIGSTOP)
    while it connected, past its deadline, refuses the write it had begun. The pause is the clock moved on while
    the connection is made."""
    clock = Clock()
    held = Leadership(clock=clock)
    held.renewed(sent_at=clock.now, renew_deadline=10)
    monkeypatch.setattr(leadership, "current", held)
    connect = HTTPConnection.connect

    def paused_while_connecting(self) -> None:
        connect(self)
        clock.now += 11

    monkeypatch.setattr(HTTPConnection, "connect", paused_while_connecting)
    core = client.CoreV1Api(login())
    with pytest.raises(NotLeading):
        asyncio.run(api_policy.call("patch", "Pod", "default/x-0", core.patch_namespaced_pod, "x-0", "default", {}))
    assert api_server == []


def test_kopfs_own_writes_go_through_a_session_that_refuses_them_while_the_replica_may_not_write(standby, api_server):
    """kopf's requests (finalizers, progress annotations, status from return values, Events) through the session
    `guarded_login` gives kopf, against a local server: reads pass, writes are refused before they are sent, and
    pass once the replica leads."""
    import kopf

    from tandem.operator.election import guarded_login

    async def scenario() -> None:
        login = await guarded_login(logger=logging.getLogger("test"), settings=kopf.OperatorSettings())
        session = login.aiohttp_session
        try:
            url = f"{login.server}/api/v1/namespaces/default/pods"
            async with session.get(url) as response:
                assert response.status == 200
            with pytest.raises(NotLeading):
                await session.patch(url + "/x", json={})
            standby.renewed(sent_at=time.monotonic(), renew_deadline=60)
            async with session.post(url, json={}) as response:
                assert response.status == 200
        finally:
            await session.close()

    asyncio.run(scenario())
    assert api_server == ["GET", "POST"], "the PATCH never reached the server"


def test_a_standby_answers_liveness_on_the_health_port_until_it_leads():
    """kopf's liveness endpoint exists only once kopf runs (on the leader): a standby answers /healthz itself, on the
    same port, and frees the port for kopf when it leads."""
    import socket
    import urllib.error
    import urllib.request

    from tandem.operator.main import standby_health

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with standby_health(port):
        with opener.open(f"http://127.0.0.1:{port}/healthz", timeout=5) as response:
            assert response.status == 200
        with pytest.raises(urllib.error.HTTPError, match="404"):
            opener.open(f"http://127.0.0.1:{port}/metrics", timeout=5)
    with socket.socket() as kopf_listens:
        kopf_listens.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp's site binds
        kopf_listens.bind(("0.0.0.0", port))  # free again
