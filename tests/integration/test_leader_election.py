"""Leader election end to end: two `tandem operator --leader-elect` replicas as real processes against the emulated
API server, one leading through a coordination.k8s.io/v1 Lease and one standing by. The leader killed, stopped,
paused or served API faults; what the API server served says who wrote what. Mocked: nothing of Tandem's (the API
server, kubelet and scheduler are devcluster's emulations). Short election durations keep each case to seconds;
outcomes are asserted, not timings (bench/bench_failover.py measures those)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
from jobs import ROOT
from operator_runs import API_FAULTS, GROUP, JOBS, NS, STARTUP, VERSION, custom_job, job_pods

from devcluster import Cluster
from devcluster.faults import WRITES, Served
from devcluster.network import free_port

TIMING = ["--leader-elect-lease-duration", "6", "--leader-elect-renew-deadline", "4",
          "--leader-elect-retry-period", "1"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    with Cluster(tmp_path_factory.mktemp("cluster")) as cluster:
        yield cluster


@pytest.fixture
def served(cluster) -> Iterator[list[tuple[str, str, str | None, str | None]]]:
    """Every request the API server serves from now on, in order: (client, method, plural, name). The hook's
    predicate records and never accepts, so it never fires."""
    record: list[tuple[str, str, str | None, str | None]] = []
    lock = threading.Lock()

    def note(request: Served) -> bool:
        with lock:
            record.append((request.client, request.method, request.plural, request.name))
        return False

    cluster.after(note, lambda _: None)
    yield record


class Replicas:
    """Operator replicas electing through Lease `lease` (one per test), each the API client of its own name."""

    def __init__(self, cluster: Cluster, lease: str) -> None:
        self.cluster, self.lease = cluster, lease
        self.names: list[str] = []
        self.metrics: dict[str, int] = {}

    def start(self, name: str) -> None:
        self.metrics[name] = free_port()
        self.cluster.spawn([sys.executable, "-m", "tandem.cli", "operator", "--namespace", NS,
                            "--restart-backoff-seconds", "0", "--worker-image", "tandem-worker:test",
                            "--metrics-port", str(self.metrics[name]), "--leader-elect", "--leader-election-id",
                            self.lease, *TIMING], name=name, cwd=ROOT, client=name)
        self.names.append(name)
        self.cluster.wait_for(lambda: "standing by" in self.cluster.process_log(name), STARTUP, f"{name} to start")

    def spec(self) -> dict:
        return (self.cluster.get("leases", NS, self.lease) or {}).get("spec") or {}

    def leader(self) -> str | None:
        """The replica the Lease names (each logs its identity when it stands by)."""
        holder = self.spec().get("holderIdentity")
        return next((name for name in self.names if holder and holder in self.cluster.process_log(name)), None)

    def wait_leader(self, name: str, timeout: float = 30) -> None:
        try:
            self.cluster.wait_for(lambda: self.leader() == name, timeout, f"{name} to lead")
        except TimeoutError:
            raise AssertionError(f"{name} does not lead: {self.spec()}\n" + self.logs()) from None

    def process(self, name: str):
        return self.cluster._processes[name][0]

    def logs(self) -> str:
        return "\n".join(f"--- {name}\n{self.cluster.process_log(name)[-3000:]}" for name in self.names)

    def stop_all(self) -> None:
        for name in self.names:
            process = self.process(name)
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGCONT)
                self.cluster.stop_process(name)


@pytest.fixture
def replicas(cluster) -> Iterator[Replicas]:
    group = Replicas(cluster, f"tandem-operator-{uuid.uuid4().hex[:8]}")  # a Lease of the test's own
    yield group
    # The jobs go while a replica still runs to take its finalizer off: a job deleted with none would be finalized
    # by the next test's first leader, whose write for it could be in flight when that test pauses it.
    for job in cluster.list(JOBS, NS):
        cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, NS, JOBS, job["metadata"]["name"])
    with contextlib.suppress(TimeoutError):  # no replica left leading: the next test's leader finalizes them
        cluster.wait_for(lambda: not cluster.list(JOBS, NS), 30, "the jobs to be finalized")
    group.stop_all()


def apply(cluster: Cluster, name: str) -> None:
    cluster.custom.create_namespaced_custom_object(GROUP, VERSION, NS, JOBS, custom_job(name))


def job_status(cluster: Cluster, name: str) -> dict:
    return (cluster.get(JOBS, NS, name) or {}).get("status") or {}


def running(cluster: Cluster, name: str, restarts: int = 0) -> bool:
    pods = job_pods(cluster, name)
    status = job_status(cluster, name)
    return (len(pods) == 2 and all(p["status"].get("phase") == "Running" for p in pods)
            and status.get("phase") == "Running" and status.get("restarts", 0) == restarts)


def metric(replicas: Replicas, name: str, line: str) -> float | None:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{replicas.metrics[name]}/metrics", timeout=5) as response:
        for found in response.read().decode().splitlines():
            if found.startswith(line + " "):
                return float(found.split()[-1])
    return None


def test_a_killed_leaders_standby_starts_new_jobs_and_restarts_a_group_whose_rank_died_meanwhile(cluster, replicas):
    replicas.start("kill-a")
    replicas.wait_leader("kill-a")
    replicas.start("kill-b")
    assert metric(replicas, "kill-a", "tandem_operator_leader") == 1.0
    assert metric(replicas, "kill-b", "tandem_operator_leader") == 0.0, "a standby says it does not lead"
    apply(cluster, "before")
    cluster.wait_for(lambda: running(cluster, "before"), STARTUP, "the leader to start a job")

    cluster.kill_process("kill-a")
    cluster.kubelet.kill(NS, "before-worker-1")  # a rank dies while nobody leads
    apply(cluster, "meanwhile")  # and a job comes
    replicas.wait_leader("kill-b")
    cluster.wait_for(lambda: running(cluster, "meanwhile") and running(cluster, "before", restarts=1), STARTUP,
                     "the new leader to start the new job and restart the failed group")
    assert replicas.spec()["leaseTransitions"] == 1
    assert metric(replicas, "kill-b", "tandem_operator_leader") == 1.0
    assert metric(replicas, "kill-b", "tandem_operator_leader_transitions") == 1.0


def test_a_stopped_leader_releases_its_lease_after_its_last_write_and_the_standby_takes_over(cluster, replicas):
    replicas.start("term-a")
    replicas.wait_leader("term-a")
    replicas.start("term-b")
    replicas.start("term-c")
    assert cluster.stop_process("term-c", grace=20) == 0, "a standby stops cleanly"
    assert replicas.leader() == "term-a" and "released" not in cluster.process_log("term-c")
    assert cluster.stop_process("term-a", grace=20) == 0
    assert "released Lease" in cluster.process_log("term-a")
    replicas.wait_leader("term-b", timeout=10)  # a retry period, not a lease duration (6 s), after the release
    apply(cluster, "handed-over")
    cluster.wait_for(lambda: running(cluster, "handed-over"), STARTUP, "the new leader to start a job")
    assert replicas.spec()["leaseTransitions"] == 1


def test_a_leader_paused_mid_pass_past_its_lease_never_writes_after_the_standby_took_over(cluster, replicas):
    """The leader is paused (SIGSTOP) right after the API server served its first write for a new job, before the
    answer reaches it: on waking, its pass goes on with the next writes before it can learn that it lost the lease.
    The API server receives none of them (each is refused before it is sent: leadership.py)."""
    replicas.start("pause-a")
    replicas.wait_leader("pause-a")
    replicas.start("pause-b")
    paused = replicas.process("pause-a")
    hook = cluster.after(lambda request: request.client == "pause-a" and request.method in WRITES
                         and request.plural == JOBS and request.name == "late",
                         lambda _: os.kill(paused.pid, signal.SIGSTOP))
    apply(cluster, "late")
    try:
        assert hook.fired.wait(STARTUP), "the leader wrote for the new job"
        replicas.wait_leader("pause-b")
        took_over = len(cluster.emulator.received())
        cluster.wait_for(lambda: running(cluster, "late"), STARTUP, "the new leader to start the job")
    finally:
        os.kill(paused.pid, signal.SIGCONT)
    try:
        assert paused.wait(30) == 1, "the old leader exits once it learns it lost the lease"
    except Exception:
        raise AssertionError(replicas.logs()) from None
    late_writes = [request for request in cluster.emulator.received(took_over)  # but a renewal it had begun:
                   if request[0] == "pause-a" and request[1] in WRITES and request[2] != "leases"]  # refused, 409
    assert late_writes == [], f"the paused leader sent writes after the takeover: {late_writes}\n{replicas.logs()}"
    assert "leadership of Lease" in cluster.process_log("pause-a") and replicas.leader() == "pause-b"


@pytest.mark.parametrize("fault", ["api-errors", "hangs"])
def test_renewals_ride_out_the_chaos_suites_api_faults_without_losing_leadership(cluster, replicas, fault):
    replicas.start("faults-a")
    replicas.wait_leader("faults-a")
    replicas.start("faults-b")
    with cluster.faulty(dataclasses.replace(API_FAULTS[fault], clients=frozenset({"faults-a", "faults-b"}))):
        time.sleep(12)  # twelve retry periods, three renew deadlines
    hit = sum(n for (client, _, method, plural), n in cluster.emulator.injected.items()
              if client == "faults-a" and plural == "leases" and method in ("GET", "PUT"))
    assert hit >= 1, "the leader's renewals met injected faults"
    assert replicas.process("faults-a").poll() is None, replicas.logs()
    assert replicas.leader() == "faults-a" and replicas.spec()["leaseTransitions"] == 0
    apply(cluster, f"after-{fault}")
    cluster.wait_for(lambda: running(cluster, f"after-{fault}"), STARTUP, "the leader to go on leading")
