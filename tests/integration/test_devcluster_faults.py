"""Fault injection in the test cluster (devcluster/faults.py): each fault as a real client sees it (the `kubernetes`
client configured with `Cluster.kubeconfig_for`, raw HTTP, aiohttp as kopf uses it), hooks at chosen moments, a
spawned process killed and started again, and a node lost and back (the only one, and one of two)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import textwrap
import time

import aiohttp
import kubernetes
import pytest
from kubernetes.client import ApiException

from devcluster import Cluster
from devcluster.faults import Faults, Served

NS = "default"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with Cluster(tmp_path_factory.mktemp("faults"), images=["python:*"]) as running:
        yield running
    assert not running.emulator.bugs, running.emulator.bugs


def core_for(cluster: Cluster, client: str) -> kubernetes.client.CoreV1Api:
    configuration = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(str(cluster.kubeconfig_for(client)), client_configuration=configuration)
    configuration.retries = False  # urllib3 would retry a 429/503 with Retry-After itself: each answer is seen here
    return kubernetes.client.CoreV1Api(kubernetes.client.ApiClient(configuration))


def configmap(name: str, **data: str) -> dict:
    return {"metadata": {"name": name}, "data": data}


def pod(name: str, code: str, **spec) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"restartPolicy": "Never", "containers": [{"name": "main", "image": "python:3.11",
                                                               "command": ["python", "-c", code]}], **spec}}


def condition(obj: dict, type_: str) -> dict:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def process_state(pid: int) -> str | None:
    """The process's state letter in /proc (R, S, T for stopped...); None once it is gone."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


# -- write errors -------------------------------------------------------------------------------------------------
def test_write_faults_answer_every_write_of_the_named_clients_and_write_nothing(cluster):
    operator, other = core_for(cluster, "operator"), core_for(cluster, "other")
    operator.create_namespaced_config_map(NS, configmap("wf-existing"))
    before = cluster.emulator.injected.copy()
    with cluster.faulty(Faults(clients=frozenset({"operator"}), write_fraction=1.0, write_codes=(429,),
                               retry_after=2)):
        for write in (lambda: operator.create_namespaced_config_map(NS, configmap("wf-new")),
                      lambda: operator.patch_namespaced_config_map("wf-existing", NS, {"data": {"a": "b"}}),
                      lambda: operator.delete_namespaced_config_map("wf-existing", NS)):
            with pytest.raises(ApiException) as error:
                write()
            assert error.value.status == 429 and error.value.headers["Retry-After"] == "2"
            body = json.loads(error.value.body)
            assert body["kind"] == "Status" and body["reason"] == "TooManyRequests" and body["code"] == 429
            assert body["details"]["retryAfterSeconds"] == 2 and "injected" in body["message"]
        assert not operator.read_namespaced_config_map("wf-existing", NS).data  # reads are served
        other.create_namespaced_config_map(NS, configmap("wf-other"))  # other clients are not hit
        cluster.core.create_namespaced_config_map(NS, configmap("wf-tests"))
    assert cluster.get("configmaps", NS, "wf-new") is None
    assert cluster.get("configmaps", NS, "wf-existing")["metadata"].get("deletionTimestamp") is None
    assert (cluster.get("configmaps", NS, "wf-existing").get("data") or {}) == {}
    injected = cluster.emulator.injected
    for method in ("POST", "PATCH", "DELETE"):
        assert injected["operator", "error-429", method, "configmaps"] == before[
            "operator", "error-429", method, "configmaps"] + 1
    assert sum(injected.values()) == sum(before.values()) + 3

    with cluster.faulty(Faults(clients=frozenset({"operator"}), write_codes=(500,), write_fraction=1.0)), \
            pytest.raises(ApiException) as error:
        operator.create_namespaced_config_map(NS, configmap("wf-500"))
    assert error.value.status == 500 and "Retry-After" not in error.value.headers
    assert json.loads(error.value.body)["reason"] == "InternalError"

    with cluster.faulty(Faults(clients=frozenset({"operator"}), write_fraction=0.0, write_codes=(503,))):
        operator.create_namespaced_config_map(NS, configmap("wf-zero"))
    assert cluster.get("configmaps", NS, "wf-zero") is not None
    assert not any(key[1] == "error-503" for key in cluster.emulator.injected)


def test_faults_for_some_resources_only_and_a_refusal_as_the_api_server_words_it(cluster):
    operator = core_for(cluster, "operator")
    with cluster.faulty(Faults(clients={"operator"}, resources={"configmaps"}, write_fraction=1.0, write_codes=(403,),
                               retry_after=None)):
        with pytest.raises(ApiException) as error:
            operator.create_namespaced_config_map(NS, configmap("rf-refused"))
        operator.create_namespaced_secret(NS, {"metadata": {"name": "rf-served"}})  # another resource: served
    assert error.value.status == 403 and "Retry-After" not in (error.value.headers or {})
    body = json.loads(error.value.body)
    assert (body["reason"], body["code"]) == ("Forbidden", 403) and "details" not in body
    assert cluster.get("configmaps", NS, "rf-refused") is None and cluster.get("secrets", NS, "rf-served")


def test_a_fraction_of_writes_with_a_seed_and_the_clients_by_their_tokens(cluster):
    operator = core_for(cluster, "operator")
    answers = []
    with cluster.faulty(Faults(write_fraction=0.5, write_codes=(503,), seed=7)):
        for i in range(20):
            try:
                operator.create_namespaced_config_map(NS, configmap(f"frac-{i}"))
                answers.append(201)
            except ApiException as error:
                assert error.status == 503 and error.headers["Retry-After"] == "1"
                answers.append(error.status)
    assert 3 <= answers.count(503) <= 17
    assert sum(cluster.get("configmaps", NS, f"frac-{i}") is not None for i in range(20)) == answers.count(201)

    seen: list[Served] = []
    hook = cluster.after(lambda s: s.plural == "pods" and s.subresource == "status" and s.name == "who",
                         seen.append)
    code = textwrap.dedent("""
        import sys, kubernetes
        kubernetes.config.load_kube_config()
        try:
            kubernetes.client.CoreV1Api().create_namespaced_config_map("default", {"metadata": {"name": "from-pod"}})
        except kubernetes.client.ApiException as error:
            sys.exit(f"status {error.status}")
    """)
    with cluster.faulty(Faults(clients=frozenset({"pods"}), write_fraction=1.0, write_codes=(503,))):
        cluster.core.create_namespaced_pod(NS, pod("who", code))  # the tests' own write is not hit
        done = cluster.wait_for(lambda: (p := cluster.get("pods", NS, "who"))["status"].get("phase") == "Failed"
                                and p, 20, "the pod to fail")
    assert "status 503" in cluster.logs(NS, "who")
    assert done["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 1
    assert cluster.get("configmaps", NS, "from-pod") is None
    assert cluster.emulator.injected["pods", "error-503", "POST", "configmaps"] == 1
    assert hook.fired.is_set() and seen[0].client == "kubelet" and seen[0].method == "PATCH"


# -- latency, hangs -----------------------------------------------------------------------------------------------
def test_latency_delays_only_the_named_clients(cluster):
    operator = core_for(cluster, "operator")
    operator.list_namespaced_config_map(NS)  # a connection open, discovery done
    with cluster.faulty(Faults(clients=frozenset({"operator"}), latency=0.4)):
        start = time.monotonic()
        operator.list_namespaced_config_map(NS)
        slow = time.monotonic() - start
        start = time.monotonic()
        cluster.core.list_namespaced_config_map(NS)
        fast = time.monotonic() - start
    assert slow >= 0.4 and fast < 0.3
    assert cluster.emulator.injected["operator", "latency", "GET", "configmaps"] == 1


def test_a_hung_request_times_out_at_the_client_and_is_not_applied(cluster):
    operator = core_for(cluster, "operator")
    with cluster.faulty(Faults(clients=frozenset({"operator"}), hang_fraction=1.0)):
        start = time.monotonic()
        with pytest.raises(Exception) as error:  # urllib3's ReadTimeoutError (perhaps wrapped)
            operator.create_namespaced_config_map(NS, configmap("hung"), _request_timeout=0.5)
        assert 0.5 <= time.monotonic() - start < 5 and "timed out" in str(error.value).lower()
        assert cluster.emulator.injected["operator", "hang", "POST", "configmaps"] == 1
        time.sleep(0.3)  # the emulator sees the connection closed and drops it
    assert cluster.get("configmaps", NS, "hung") is None
    operator.create_namespaced_config_map(NS, configmap("hung"))  # the same client goes on, on a new connection


# -- watches ------------------------------------------------------------------------------------------------------
def test_watches_end_cleanly_or_abruptly(cluster):
    operator = core_for(cluster, "operator")
    version = operator.list_namespaced_config_map(NS).metadata.resource_version
    with cluster.faulty(Faults(clients=frozenset({"operator"}), watch_end_after=0.5)):
        start = time.monotonic()
        events = list(kubernetes.watch.Watch().stream(operator.list_namespaced_config_map, NS,
                                                      resource_version=version, timeout_seconds=30))
        assert events == [] and 0.5 <= time.monotonic() - start < 5  # a clean end, long before its timeout
    assert cluster.emulator.injected["operator", "watch-end", "GET", "configmaps"] == 1

    with cluster.faulty(Faults(clients=frozenset({"operator"}), watch_end_after=0.5, watch_end_abruptly=True)):
        with pytest.raises(Exception) as broken:  # urllib3's ProtocolError: the chunked body never ended
            list(kubernetes.watch.Watch().stream(operator.list_namespaced_config_map, NS,
                                                 resource_version=version, timeout_seconds=30))
        assert "ended" in str(broken.value).lower() or "incomplete" in str(broken.value).lower()

        async def raw_watch(token: str) -> tuple[int, str]:
            lines = 0
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as session:
                url = f"{cluster.url}/api/v1/namespaces/{NS}/configmaps?watch=true&resourceVersion={version}"
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as response:
                    try:
                        async for _ in response.content:
                            lines += 1
                    except aiohttp.ClientPayloadError as error:
                        return lines, type(error).__name__
            return lines, "clean"

        assert asyncio.run(raw_watch("client-operator"))[1] == "ClientPayloadError"  # as kopf would see it
    assert cluster.emulator.injected["operator", "watch-end", "GET", "configmaps"] == 3


def test_a_resumed_watch_is_gone(cluster):
    operator = core_for(cluster, "operator")
    version = operator.list_namespaced_config_map(NS).metadata.resource_version
    with cluster.faulty(Faults(clients=frozenset({"operator"}), gone_on_resume=1.0)):
        with pytest.raises(ApiException) as gone:
            list(kubernetes.watch.Watch().stream(operator.list_namespaced_config_map, NS,
                                                 resource_version=version, timeout_seconds=5))
        assert gone.value.status == 410
        # a watch that is no resume (no resourceVersion) is served: its initial ADDED events, then its timeout
        fresh = list(kubernetes.watch.Watch().stream(operator.list_namespaced_config_map, NS, timeout_seconds=1))
        assert fresh and {e["type"] for e in fresh} == {"ADDED"}
    assert cluster.emulator.injected["operator", "gone", "GET", "configmaps"] == 1


# -- hooks and processes ------------------------------------------------------------------------------------------
def test_a_hook_fires_once_after_the_served_request_with_its_result(cluster):
    calls: list[tuple[Served, dict | None]] = []
    hook = cluster.after(lambda s: s.method == "POST" and s.plural == "configmaps"
                         and (s.body or {}).get("metadata", {}).get("name", "").startswith("hooked"),
                         lambda s: calls.append((s, cluster.get("configmaps", NS, s.name or s.result["metadata"][
                             "name"]))))
    cancelled = cluster.after(lambda s: s.plural == "configmaps", lambda s: calls.append((s, None)))
    cancelled.cancel()
    first = core_for(cluster, "hooker").create_namespaced_config_map(NS, configmap("hooked-1", a="1"))
    cluster.core.create_namespaced_config_map(NS, configmap("hooked-2"))
    assert hook.fired.wait(5) and not cancelled.fired.is_set() and len(calls) == 1
    served, stored = calls[0]
    assert (served.client, served.method, served.plural, served.namespace, served.subresource) == (
        "hooker", "POST", "configmaps", NS, None)
    assert served.body["data"] == {"a": "1"} and served.result["metadata"]["uid"] == first.metadata.uid
    assert stored is not None and stored["metadata"]["uid"] == first.metadata.uid  # committed before the action


def test_kill_a_process_right_after_its_write_and_spawn_it_again(cluster):
    script = textwrap.dedent("""
        import sys, kubernetes
        print("started", flush=True)
        kubernetes.config.load_kube_config()
        api = kubernetes.client.CoreV1Api()
        for name in ("victim-a", "victim-b"):
            api.create_namespaced_config_map("default", {"metadata": {"name": name}})
            print("created", name, flush=True)
    """)
    hook = cluster.after(lambda s: s.client == "victim" and s.method == "POST" and s.plural == "configmaps",
                         lambda s: cluster.kill_process("victim"))
    process = cluster.spawn([sys.executable, "-c", script], name="victim", client="victim")
    assert hook.fired.wait(20) and process.wait(5) == -9
    assert cluster.get("configmaps", NS, "victim-a") is not None and cluster.get("configmaps", NS, "victim-b") is None
    assert "started" in cluster.process_log("victim") and "created" not in cluster.process_log("victim")

    again = cluster.spawn([sys.executable, "-c", "import time; print('second', flush=True); time.sleep(60)"],
                          name="victim")
    cluster.wait_for(lambda: "second" in cluster.process_log("victim"), 10, "the second run's output")
    assert cluster.process_log("victim").index("started") < cluster.process_log("victim").index("second")
    assert cluster.kill_process("victim") == -9 and again.returncode == -9


def test_faults_and_hooks_on_the_kmock_dsl_path(tmp_path):
    with Cluster(tmp_path, crds=None, kubelet=False, deployments=False) as small:
        small.emulator["get", "/never/served"] << 404  # a reaction of a test's own: every request goes via kmock
        hook = small.after(lambda s: s.method == "POST" and s.plural == "configmaps", lambda s: None)
        operator = core_for(small, "operator")
        with small.faulty(Faults(write_fraction=1.0, write_codes=(503,))):
            with pytest.raises(ApiException) as error:
                operator.create_namespaced_config_map(NS, configmap("dsl"))
            assert error.value.status == 503 and error.value.headers["Retry-After"] == "1"
            small.core.create_namespaced_config_map(NS, configmap("dsl"))
        assert hook.fired.wait(5) and hook.served.client == "tests" and hook.served.result["metadata"]["uid"]
        assert small.emulator.injected["operator", "error-503", "POST", "configmaps"] == 1
        version = operator.list_namespaced_config_map(NS).metadata.resource_version
        with small.faulty(Faults(watch_end_after=0.3, watch_end_abruptly=True)), pytest.raises(Exception) as cut:
            list(kubernetes.watch.Watch().stream(operator.list_namespaced_config_map, NS, resource_version=version,
                                                 timeout_seconds=10))
        assert "ended prematurely" in str(cut.value)
        assert not small.emulator.bugs


# -- a node lost --------------------------------------------------------------------------------------------------
def test_a_lost_node_fails_its_pods_schedules_nothing_and_comes_back(cluster):
    cluster.core.create_namespaced_pod(NS, pod("lost-running", "import time; time.sleep(600)"))
    lingering = pod("lost-terminating", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                        "time.sleep(600)", terminationGracePeriodSeconds=60)
    cluster.core.create_namespaced_pod(NS, lingering)
    cluster.core.create_namespaced_pod(NS, pod("lost-done", "pass"))
    for name in ("lost-running", "lost-terminating"):
        cluster.wait_for(lambda n=name: cluster.kubelet.pid(NS, n), 15, f"{name} to run")
    cluster.wait_for(lambda: cluster.get("pods", NS, "lost-done")["status"].get("phase") == "Succeeded", 15)
    pids = [cluster.kubelet.pid(NS, name) for name in ("lost-running", "lost-terminating")]
    cluster.core.delete_namespaced_pod("lost-terminating", NS)  # it ignores SIGTERM: Terminating for 60 s
    cluster.wait_for(lambda: cluster.get("pods", NS, "lost-terminating")["metadata"].get("deletionTimestamp"), 5)

    cluster.lose_node(down_seconds=3)
    assert [process_state(pid) for pid in pids] == ["T", "T"]  # frozen, not killed: a dead machine's processes
    assert not cluster.node_ready()
    node = cluster.get("nodes", None, "tandem-node")
    assert condition(node, "Ready")["status"] == "Unknown" and condition(node, "Ready")["reason"] == "NodeStatusUnknown"
    lost = cluster.get("pods", NS, "lost-running")
    assert lost["status"]["phase"] == "Failed" and lost["status"]["reason"] == "NodeLost"
    assert lost["status"]["message"] == "Node tandem-node which was running pod lost-running is " \
                                        "unresponsive"
    assert condition(lost, "DisruptionTarget")["status"] == "True"
    assert condition(lost, "DisruptionTarget")["reason"] == "DeletionByPodGC"
    assert condition(lost, "Ready")["status"] == "False"
    assert cluster.get("pods", NS, "lost-done")["status"]["phase"] == "Succeeded"  # finished: left as it was
    assert cluster.get("pods", NS, "lost-terminating")["status"]["phase"] == "Failed"

    cluster.core.create_namespaced_pod(NS, pod("lost-new", "print('ran after the outage')"))
    waiting = cluster.wait_for(lambda: condition(cluster.get("pods", NS, "lost-new"), "PodScheduled").get(
        "reason") == "Unschedulable" and cluster.get("pods", NS, "lost-new"), 5, "lost-new to be unschedulable")
    assert "not ready" in condition(waiting, "PodScheduled")["message"] and waiting["status"]["phase"] == "Pending"
    assert not waiting["spec"].get("nodeName")
    cluster.core.delete_namespaced_pod("lost-running", NS)  # a Failed pod goes at once, node or no node
    assert cluster.get("pods", NS, "lost-terminating") is not None  # its deletion waits for the kubelet

    cluster.wait_for(cluster.node_ready, 10, "the node to come back")
    for pid in pids:  # killed (and reaped) as the node came back: its machine rebooted
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    cluster.wait_for(lambda: cluster.get("pods", NS, "lost-new")["status"].get("phase") == "Succeeded", 15,
                     "lost-new to run after the outage")
    assert "ran after the outage" in cluster.logs(NS, "lost-new")
    cluster.wait_for(lambda: cluster.get("pods", NS, "lost-terminating") is None, 5, "lost-terminating to go")
    assert cluster.get("pods", NS, "lost-running") is None
    assert cluster.get("pods", NS, "lost-done")["status"]["phase"] == "Succeeded"



SERVER = """
import socket, sys
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
peers = []
while True:
    peer, _ = server.accept()
    peer.sendall(b"hi")
    peers.append(peer)
"""


def test_one_of_two_nodes_lost_fails_only_its_pods_while_the_other_node_runs_on(tmp_path):
    """The lost node's pod, a TCP server, is frozen: its process stopped, a connection to it open and silent (no
    EOF) while the node is down; the connection ends only when the process is killed, as the node comes back."""
    def one_cpu(name: str, code: str) -> dict:
        spec = pod(name, code)
        spec["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "1"}}
        return spec

    def scheduled(name: str) -> dict:
        return condition(two.get("pods", NS, name), "PodScheduled")

    with Cluster(tmp_path, crds=None, deployments=False, images=["python:*"], nodes=2, capacity={"cpu": "1"}) as two:
        assert sorted(n["metadata"]["labels"]["kubernetes.io/hostname"] for n in two.list("nodes")) == [
            "tandem-node", "tandem-node-2"]
        server = one_cpu("spread-a", SERVER)
        server["spec"]["containers"][0]["args"] = ["0.0.0.0"]  # the pod's own address (network.bind_to_pod)
        two.core.create_namespaced_pod(NS, server)
        two.core.create_namespaced_pod(NS, one_cpu("spread-b", "import time; time.sleep(600)"))
        pids = {name: two.wait_for(lambda n=name: two.kubelet.pid(NS, n), 15, f"{name} to run")
                for name in ("spread-a", "spread-b")}
        lost, kept = (two.get("pods", NS, name)["spec"]["nodeName"] for name in ("spread-a", "spread-b"))
        assert sorted([lost, kept]) == ["tandem-node", "tandem-node-2"]  # one cpu each: one pod per node
        port = int(two.wait_for(lambda: two.logs(NS, "spread-a").strip(), 10, "spread-a to listen"))
        peer = socket.create_connection((two.get("pods", NS, "spread-a")["status"]["podIP"], port), timeout=5)
        assert peer.recv(16) == b"hi"

        two.lose_node(down_seconds=3, node=lost)
        assert process_state(pids["spread-a"]) == "T"  # frozen, not killed: a dead machine's process
        peer.settimeout(0.5)
        with pytest.raises(TimeoutError):  # silence: no FIN, no RST, as from a machine gone
            peer.recv(16)
        assert two.kubelet.pid(NS, "spread-b") == pids["spread-b"]
        assert two.get("pods", NS, "spread-b")["status"]["phase"] == "Running"
        assert not two.node_ready(lost) and two.node_ready(kept)
        assert condition(two.get("nodes", None, lost), "Ready")["status"] == "Unknown"
        failed = two.get("pods", NS, "spread-a")["status"]
        assert (failed["phase"], failed["reason"]) == ("Failed", "NodeLost")
        assert failed["message"] == f"Node {lost} which was running pod spread-a is unresponsive"

        two.core.create_namespaced_pod(NS, one_cpu("spread-c", "print('ran on the recovered node')"))
        two.wait_for(lambda: scheduled("spread-c").get("reason") == "Unschedulable", 5, "spread-c's verdict")
        assert scheduled("spread-c")["message"] == \
            "0/2 nodes are available: 1 Insufficient cpu, 1 node(s) were not ready."
        two.core.create_namespaced_pod(NS, pod("beside", "print('ran during the outage')"))  # no cpu asked for
        two.wait_for(lambda: two.get("pods", NS, "beside")["status"].get("phase") == "Succeeded", 10,
                     "a pod to run on the node left while the other is down")
        assert two.get("pods", NS, "beside")["spec"]["nodeName"] == kept
        assert not two.get("pods", NS, "spread-c")["spec"].get("nodeName")

        two.wait_for(lambda: two.node_ready(lost), 10, f"{lost} to come back")
        assert process_state(pids["spread-a"]) is None  # killed as its machine rebooted: the connection ends now
        peer.settimeout(5)
        assert peer.recv(16) == b""  # FIN: it had nothing unread
        peer.close()
        two.wait_for(lambda: two.get("pods", NS, "spread-c")["status"].get("phase") == "Succeeded", 15,
                     "spread-c to run on the recovered node")
        assert two.get("pods", NS, "spread-c")["spec"]["nodeName"] == lost
        assert "ran on the recovered node" in two.logs(NS, "spread-c")
        assert two.kubelet.pid(NS, "spread-b") == pids["spread-b"]
        assert two.get("pods", NS, "spread-a")["status"]["phase"] == "Failed"
    assert not two.emulator.bugs, two.emulator.bugs

OPERATOR = '''
import kopf

@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_):
    settings.networking.error_backoffs = [0.2] * 50
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="test.tandem.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="test.tandem.dev")

@kopf.on.create("configmaps")
def created(patch, **_):
    patch.metadata.annotations["handled"] = "yes"
'''


def test_kopf_sees_an_injected_429_as_the_api_s_and_retries_after_it(cluster, tmp_path):
    (tmp_path / "operator.py").write_text(OPERATOR)
    cluster.core.create_namespace({"metadata": {"name": "kopf-faults"}})
    refused = cluster.emulator.injected["operator", "error-429", "PATCH", "configmaps"]
    with cluster.faulty(Faults(clients=frozenset({"operator"}), write_fraction=1.0, write_codes=(429,))):
        cluster.spawn([sys.executable, "-m", "kopf", "run", "--namespace", "kopf-faults", "--verbose",
                       str(tmp_path / "operator.py")], name="kopf", client="operator")
        cluster.core.create_namespaced_config_map("kopf-faults", configmap("handled"))
        key = ("operator", "error-429", "PATCH", "configmaps")
        cluster.wait_for(lambda: cluster.emulator.injected[key] > refused, 20, "kopf's first patch to be refused")
    handled = cluster.wait_for(lambda: (cm := cluster.get("configmaps", "kopf-faults", "handled"))["metadata"].get(
        "annotations", {}).get("handled") == "yes" and cm, 20, "kopf to handle the ConfigMap after the faults")
    assert handled["metadata"]["annotations"]["handled"] == "yes"
    log = cluster.process_log("kopf")
    assert "APITooManyRequestsError" in log and "retry-after 1s from the server" in log, log
    assert cluster.stop_process("kopf") == 0
