"""The emulated cluster's Deployments (devcluster/deployments.py), the kubelet's probes and preStop hooks, and pods
that bind 0.0.0.0 on one port: real HTTP server processes, as the InferencePool's end-to-end test runs them."""

from __future__ import annotations

import re
import textwrap
import time
import urllib.request

import kubernetes
import pytest

from devcluster import Cluster
from devcluster.deployments import HASH_LABEL, is_ready, plan, template_hash
from devcluster.network import free_port

NS = "default"
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))

SERVER = textwrap.dedent("""
    import argparse, http.server, os, signal, time
    parser = argparse.ArgumentParser()
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--state")  # a directory of this machine: markers the test writes, records the server writes
    args = parser.parse_args()
    name = os.environ["HOSTNAME"]  # the pod's name

    def record(line):
        with open(os.path.join(args.state, name + ".log"), "a") as out:
            out.write(f"{time.monotonic():.3f} {line}\\n")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/ready":
                ok = os.path.exists(os.path.join(args.state, "ready"))
            elif self.path == "/live":
                ok = not os.path.exists(os.path.join(args.state, name + ".sick"))
            else:
                ok = True
            record(f"GET {self.path} {200 if ok else 503}")
            body = f"{name} {self.server.server_address[0]}".encode()
            self.send_response(200 if ok else 503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_):
            pass

    def stop(*_):
        record("SIGTERM")
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    server = http.server.ThreadingHTTPServer((args.host, args.port), Handler)
    record(f"listening {args.host}:{args.port}")
    server.serve_forever()
""")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with Cluster(tmp_path_factory.mktemp("cluster"), crds=None) as running:
        running.kubelet.restart_backoff = 0.2
        yield running
    assert not running.emulator.bugs, running.emulator.bugs


@pytest.fixture
def state(tmp_path):
    """The servers' directory: the script, the markers, what each pod's server recorded."""
    (tmp_path / "server.py").write_text(SERVER)
    return tmp_path


def server(state, port: int, **probes) -> dict:
    return {"name": "server", "image": "python:3.11", "ports": [{"name": "http", "containerPort": port}],
            "command": ["python", str(state / "server.py"), "--host", "0.0.0.0", "--port", str(port),
                        "--state", str(state)], **probes}


def deployment(name: str, container: dict, replicas: int = 2, strategy: dict | None = None) -> dict:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
            "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}},
                     "strategy": strategy or {"type": "RollingUpdate",
                                              "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
                     "template": {"metadata": {"labels": {"app": name}},
                                  "spec": {"containers": [container], "terminationGracePeriodSeconds": 5}}}}


READY_PROBE = {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 1, "failureThreshold": 1}


def records(state, pod: str) -> list[str]:
    path = state / f"{pod}.log"
    return path.read_text().splitlines() if path.exists() else []


def ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions") or [])


def get(url: str) -> str:
    with _NO_PROXY.open(url, timeout=5) as response:
        return response.read().decode()


def test_readiness_gates_ready_and_two_pods_serve_one_port_on_their_own_addresses(cluster, state):
    port = free_port()
    cluster.apps.create_namespaced_deployment(NS, deployment("web", server(state, port, readinessProbe=READY_PROBE)))
    pods = cluster.wait_for(lambda: len(ps := cluster.deployment_pods(NS, "web")) == 2 and all(
        any("GET /ready 503" in line for line in records(state, p["metadata"]["name"])) for p in ps)
        and cluster.deployment_pods(NS, "web"), 10, "two servers probed, and not ready")
    stored = cluster.get("deployments", NS, "web")
    current = template_hash(stored["spec"]["template"])
    for pod in pods:
        status = pod["status"]["containerStatuses"][0]
        assert pod["status"]["phase"] == "Running" and "running" in status["state"]
        assert status["started"] and not status["ready"] and not ready(pod)
        assert re.fullmatch(rf"web-{current}-[a-z0-9]{{5}}", pod["metadata"]["name"])
        assert pod["metadata"]["labels"] == {"app": "web", "pod-template-hash": current}
        owner = pod["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
            "Deployment", "web", stored["metadata"]["uid"], True)
    waiting = cluster.get("deployments", NS, "web")["status"]
    assert waiting["replicas"] == waiting["updatedReplicas"] == 2 and "readyReplicas" not in waiting
    assert {c["type"]: c["status"] for c in waiting["conditions"]}["Available"] == "False"

    # both asked for 0.0.0.0 and one port: each listens on its own pod IP
    addresses = sorted(p["status"]["podIP"] for p in pods)
    assert len(set(addresses)) == 2
    for pod in pods:
        ip, name = pod["status"]["podIP"], pod["metadata"]["name"]
        assert f"listening {ip}:{port}" in records(state, name)[0]
        assert get(f"http://{ip}:{port}/") == f"{name} {ip}"

    (state / "ready").touch()
    done = cluster.wait_for(lambda: (d := cluster.get("deployments", NS, "web"))["status"].get("readyReplicas") == 2
                            and d["status"], 10, "the Deployment's two ready replicas")
    assert (done["observedGeneration"], done["availableReplicas"]) == (1, 2) and "unavailableReplicas" not in done
    conditions = {c["type"]: c for c in done["conditions"]}
    assert conditions["Available"]["status"] == "True"
    assert conditions["Progressing"]["reason"] == "NewReplicaSetAvailable"
    cluster.apply({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"}, "spec": {
        "selector": {"app": "web"}, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}})
    assert cluster.endpoints(NS, "web") == [f"{ip}:{port}" for ip in addresses]


def test_a_template_change_rolls_without_fewer_ready_pods_than_replicas(cluster, state):
    (state / "ready").touch()
    cluster.apps.create_namespaced_deployment(NS, deployment("roll", server(state, free_port(),
                                                                            readinessProbe=READY_PROBE)))
    cluster.wait_for(lambda: cluster.get("deployments", NS, "roll")["status"].get("readyReplicas") == 2, 10,
                     "two ready replicas")
    old = {p["metadata"]["name"] for p in cluster.deployment_pods(NS, "roll")}
    cluster.apps.patch_namespaced_deployment("roll", NS, {"spec": {"template": {"metadata": {
        "annotations": {"rollout": "2"}}}}})
    current = template_hash(cluster.get("deployments", NS, "roll")["spec"]["template"])
    ready_counts, pod_counts = [], []

    def rolled() -> bool:
        pods = cluster.deployment_pods(NS, "roll")
        ready_counts.append(sum(map(ready, pods)))
        pod_counts.append(len(pods))
        status = cluster.get("deployments", NS, "roll")["status"]
        return status["observedGeneration"] == 2 and status.get("updatedReplicas") == status.get("replicas") == \
            status.get("readyReplicas") == 2 and all(p["metadata"]["labels"]["pod-template-hash"] == current
                                                     for p in pods)

    cluster.wait_for(rolled, 15, "the rollout", interval=0.02)
    assert min(ready_counts) >= 2 and max(pod_counts) <= 3  # maxUnavailable 0, maxSurge 1
    assert max(pod_counts) == 3  # one surge pod at a time
    pods = cluster.deployment_pods(NS, "roll")
    assert len(pods) == 2 and not old & {p["metadata"]["name"] for p in pods}
    assert all(p["metadata"]["annotations"] == {"rollout": "2"} for p in pods)
    conditions = {c["type"]: c for c in cluster.get("deployments", NS, "roll")["status"]["conditions"]}
    assert conditions["Progressing"]["message"] == f'ReplicaSet "roll-{current}" has successfully progressed.'


def test_recreate_deletes_the_old_pods_before_creating_new_ones(cluster, state):
    cluster.apps.create_namespaced_deployment(NS, deployment("recreate", server(state, free_port()), replicas=1,
                                                             strategy={"type": "Recreate"}))
    cluster.wait_for(lambda: cluster.get("deployments", NS, "recreate")["status"].get("readyReplicas") == 1, 10,
                     "a ready replica")
    [old] = cluster.deployment_pods(NS, "recreate")
    since = cluster.core.list_namespaced_pod(NS).metadata.resource_version
    cluster.apps.patch_namespaced_deployment("recreate", NS, {"spec": {"template": {"metadata": {
        "labels": {"app": "recreate", "version": "2"}}}}})
    [new] = cluster.wait_for(lambda: [p for p in cluster.deployment_pods(NS, "recreate") if ready(p)
                                      and p["metadata"]["labels"].get("version") == "2"], 10, "the new pod")
    events = [(e["type"], e["object"].metadata.name) for e in kubernetes.watch.Watch().stream(
        cluster.core.list_namespaced_pod, NS, label_selector="app=recreate", resource_version=since,
        timeout_seconds=1)]
    assert events.index(("DELETED", old["metadata"]["name"])) < events.index(("ADDED", new["metadata"]["name"]))


def test_scaling_through_the_scale_subresource_and_pods_replaced_and_deleted_with_it(cluster, state):
    cluster.apps.create_namespaced_deployment(NS, deployment("scaled", server(state, free_port()), replicas=1))
    [first] = cluster.wait_for(lambda: [p for p in cluster.deployment_pods(NS, "scaled") if ready(p)], 10,
                               "one ready pod")
    cluster.apps.patch_namespaced_deployment_scale("scaled", NS, {"spec": {"replicas": 3}})  # kubectl scale
    cluster.wait_for(lambda: cluster.get("deployments", NS, "scaled")["status"].get("readyReplicas") == 3, 10,
                     "three ready replicas")
    scale = cluster.apps.read_namespaced_deployment_scale("scaled", NS)
    assert (scale.spec.replicas, scale.status.replicas, scale.status.selector) == (3, 3, "app=scaled")

    cluster.apps.patch_namespaced_deployment_scale("scaled", NS, {"spec": {"replicas": 1}})
    cluster.wait_for(lambda: len(cluster.deployment_pods(NS, "scaled")) == 1, 10, "scaled down to one")
    assert cluster.deployment_pods(NS, "scaled")[0]["metadata"]["name"] == first["metadata"]["name"]  # newest first
    status = cluster.wait_for(lambda: (s := cluster.get("deployments", NS, "scaled")["status"])["replicas"] == 1
                              and s, 10, "the status to count one")
    assert status["readyReplicas"] == 1 and status["observedGeneration"] == 3

    cluster.core.delete_namespaced_pod(first["metadata"]["name"], NS, grace_period_seconds=0)  # a pod vanishes
    [replacement] = cluster.wait_for(lambda: [p for p in cluster.deployment_pods(NS, "scaled") if ready(p)], 10,
                                     "a replacement")
    assert replacement["metadata"]["name"] != first["metadata"]["name"]

    cluster.apps.delete_namespaced_deployment("scaled", NS)
    cluster.wait_for(lambda: not cluster.core.list_namespaced_pod(NS, label_selector="app=scaled").items, 10,
                     "the Deployment's pods to go with it")
    assert cluster.history("pods", NS, replacement["metadata"]["name"])[-2]["metadata"]["deletionTimestamp"]


def test_startup_probe_gates_the_others_and_a_liveness_failure_restarts_the_container(cluster, state):
    (state / "ready").touch()
    probes = {"startupProbe": {"exec": {"command": ["test", "-f", str(state / "started")]}, "periodSeconds": 1,
                               "failureThreshold": 30},
              "readinessProbe": READY_PROBE,
              "livenessProbe": {"httpGet": {"path": "/live", "port": "http"}, "periodSeconds": 1,
                                "initialDelaySeconds": 1, "failureThreshold": 1}}  # the restarted server listens first
    cluster.apps.create_namespaced_deployment(NS, deployment("probed", server(state, free_port(), **probes),
                                                             replicas=1))
    [pod] = cluster.wait_for(lambda: cluster.deployment_pods(NS, "probed"), 10, "the pod")
    name = pod["metadata"]["name"]
    cluster.wait_for(lambda: records(state, name), 10, "the server to listen")
    time.sleep(1.5)  # startup probes fail meanwhile
    status = cluster.get("pods", NS, name)["status"]
    assert not status["containerStatuses"][0]["started"] and not ready(cluster.get("pods", NS, name))
    assert not [line for line in records(state, name) if "GET" in line]  # no readiness or liveness probe yet

    (state / "started").touch()
    cluster.wait_for(lambda: ready(cluster.get("pods", NS, name)), 5, "started, then ready")
    assert cluster.get("pods", NS, name)["status"]["containerStatuses"][0]["started"]

    (state / f"{name}.sick").touch()
    restarted = cluster.wait_for(lambda: (s := cluster.get("pods", NS, name)["status"]["containerStatuses"][0])[
        "restartCount"] >= 1 and s, 10, "the liveness failure to restart the container")
    (state / f"{name}.sick").unlink()
    assert restarted["lastState"]["terminated"]["exitCode"] == 0  # the server's SIGTERM handler exits 0
    cluster.wait_for(lambda: ready(cluster.get("pods", NS, name)), 10, "ready again after the restart")
    assert cluster.get("pods", NS, name)["metadata"]["uid"] == pod["metadata"]["uid"]  # the same pod
    events = {(e["reason"], e["message"]) for e in cluster.list("events", NS) if e["involvedObject"]["name"] == name}
    assert ("Unhealthy", "Liveness probe failed: HTTP probe failed with statuscode: 503") in events
    assert ("Killing", "Container server failed liveness probe, will be restarted") in events


def test_pre_stop_runs_before_sigterm_within_the_grace_period(cluster, state):
    hook = "import sys, time; open(sys.argv[1], 'a').write(f'{time.monotonic():.3f} preStop\\n'); time.sleep(float(" \
           "sys.argv[2]))"
    for name, pause, grace in (("stops", 1, 5), ("overruns", 30, 1)):
        container = server(state, free_port(), lifecycle={"preStop": {"exec": {"command": [
            "python", "-c", hook, str(state / f"{name}.log"), str(pause)]}}})
        cluster.core.create_namespaced_pod(NS, {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                                                "spec": {"containers": [container],
                                                         "terminationGracePeriodSeconds": grace}})
    for name in ("stops", "overruns"):
        cluster.wait_for(lambda name=name: ready(cluster.get("pods", NS, name)) and records(state, name), 10,
                         f"{name} to serve")
    asked = time.monotonic()
    for name in ("stops", "overruns"):
        cluster.core.delete_namespaced_pod(name, NS)
    cluster.wait_for(lambda: any("preStop" in line for line in records(state, "stops")), 5, "the hook")
    terminating = cluster.get("pods", NS, "stops")
    assert terminating["metadata"]["deletionTimestamp"] and terminating["status"]["phase"] == "Running"
    for name in ("stops", "overruns"):
        cluster.wait_for(lambda name=name: cluster.get("pods", NS, name) is None, 10, f"{name} to go")
    times = {}
    for name in ("stops", "overruns"):
        lines = [line.split(" ", 1) for line in records(state, name)]
        assert [event for _, event in lines][-2:] == ["preStop", "SIGTERM"]
        times[name] = {event: float(at) for at, event in lines}
    assert times["stops"]["SIGTERM"] - times["stops"]["preStop"] >= 0.9  # after the hook's second
    assert 0.8 <= times["overruns"]["SIGTERM"] - asked <= 3  # the hook cut short when the grace period is over


def test_pod_disruption_budgets_and_horizontal_pod_autoscalers_are_served(cluster):
    budget = kubernetes.client.PolicyV1Api(cluster.api).create_namespaced_pod_disruption_budget(NS, {
        "metadata": {"name": "budget"}, "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app": "x"}}}})
    assert budget.spec.max_unavailable == 1
    scaler = kubernetes.client.AutoscalingV2Api(cluster.api).create_namespaced_horizontal_pod_autoscaler(NS, {
        "metadata": {"name": "scaler"}, "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "x"},
            "minReplicas": 1, "maxReplicas": 3, "metrics": [{"type": "Pods", "pods": {
                "metric": {"name": "pending"}, "target": {"type": "AverageValue", "averageValue": "4"}}}]}})
    assert scaler.spec.max_replicas == 3
    status, body = cluster.request("PATCH", f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets/budget/status",
                                   {"status": {"currentHealthy": 2}, "spec": {"maxUnavailable": 2}},
                                   "application/merge-patch+json")
    assert status == 200 and body["status"]["currentHealthy"] == 2 and body["spec"]["maxUnavailable"] == 1
    assert cluster.get("pdb", NS, "budget")["status"] == {"currentHealthy": 2}
    assert cluster.get("hpa", NS, "scaler")["spec"]["metrics"][0]["pods"]["metric"]["name"] == "pending"
    resources = {r["name"] for r in cluster.request("GET", "/apis/autoscaling/v2")[1]["resources"]}
    assert resources == {"horizontalpodautoscalers", "horizontalpodautoscalers/status"}


@pytest.mark.parametrize(("replicas", "surge", "unavailable", "most_pods", "fewest_ready"), [
    (2, 1, 0, 3, 2), (1, 1, 0, 2, 1), (4, "25%", "25%", 5, 3), (3, 0, 1, 3, 2), (5, "50%", 0, 8, 5),
    (3, 0, 0, 3, 2)])  # both 0: maxUnavailable 1
def test_a_rolling_update_plan_stays_within_max_surge_and_max_unavailable(replicas, surge, unavailable, most_pods,
                                                                          fewest_ready):
    """The controller's plan, step by step (each step's new pods become ready before the next): never more than
    replicas + maxSurge pods, never fewer ready than replicas - maxUnavailable, and in the end only new pods."""
    template = {"metadata": {"labels": {"app": "x"}}, "spec": {"containers": []}}
    deployment = {"metadata": {"name": "x", "namespace": NS, "uid": "u"}, "spec": {
        "replicas": replicas, "template": template,
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": surge, "maxUnavailable": unavailable}}}}
    serial = iter(range(1000))

    def pod(revision: str, up: bool) -> dict:
        number = next(serial)
        return {"metadata": {"name": f"x-{number:03d}", "uid": str(number), "labels": {HASH_LABEL: revision}},
                "spec": {"nodeName": "node"},
                "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True" if up else "False"}]}}

    pods = [pod("old", True) for _ in range(replicas)]
    for _ in range(4 * replicas + 2):
        todo = plan(deployment, pods, deletion_order=lambda p: (is_ready(p), p["metadata"]["name"]))
        if not todo.create and not todo.delete:
            break
        pods = [p for p in pods if p not in todo.delete] + [pod(template_hash(template), False)
                                                            for _ in range(todo.create)]
        assert len(pods) <= most_pods and sum(map(is_ready, pods)) >= fewest_ready
        pods = [{**p, "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}
                for p in pods]
    assert len(pods) == replicas and all(p["metadata"]["labels"][HASH_LABEL] == template_hash(template) for p in pods)
