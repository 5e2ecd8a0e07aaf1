"""`tandem operator` on the emulated cluster (devcluster/), for the tests that run it end to end (test_operator,
test_pool_operator, test_chaos): starting it as a real process, manifests of jobs and pools, their pods and Events,
and a client that keeps sending inference requests to a pool's servers."""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

from jobs import ROOT, TESTS

from devcluster import Cluster, Faults
from devcluster.network import free_port

NS = "default"
GROUP, VERSION = "tandem.dev", "v1alpha1"
JOBS, POOLS = "paralleltrainingjobs", "inferencepools"
SLEEP = ["python", "-c", "import time; time.sleep(600)"]
STARTUP = 60  # seconds a group of ranks may take to start and report, on a busy 2-core machine
READY = 90  # seconds for server pods to start (torch import, load, warm-up) on a busy 2-core machine
NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))
API_FAULTS = {
    "api-errors": Faults(write_fraction=0.1, latency=0.01, watch_end_after=5.0, seed=1),
    "hangs": Faults(hang_fraction=0.03, latency=0.03, seed=2),
    "watches": Faults(watch_end_after=2.0, watch_end_abruptly=True, gone_on_resume=0.5, seed=3),
}
"""The chaos suite's classes of API faults (test_chaos.py), for the operator's and its pods' requests."""
GPU = "nvidia.com/gpu"


def start_operator(cluster: Cluster, *extra: str) -> None:
    """`tandem operator` for namespace NS, as the API client named "operator" (devcluster's faults can single it
    out), its metrics on `cluster.metrics_port`."""
    cluster.metrics_port = free_port()
    cluster.spawn([sys.executable, "-m", "tandem.cli", "operator", "--namespace", NS, "--restart-backoff-seconds",
                   "0", "--worker-image", "tandem-worker:test", "--metrics-port", str(cluster.metrics_port), *extra],
                  name="operator", cwd=ROOT, client="operator")


@contextlib.contextmanager
def cluster_with_operator(directory: Path) -> Iterator[Cluster]:
    """The emulated cluster in `directory` with `tandem operator` running (start_operator), the tests' modules
    importable by its pods."""
    with Cluster(directory, extra_env={"PYTHONPATH": str(TESTS)}) as cluster:
        start_operator(cluster)
        yield cluster


def operator_metrics(cluster: Cluster) -> str:
    try:
        with NO_PROXY.open(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=5) as response:
            return response.read().decode()
    except OSError:
        return ""


def custom_job(name: str, command: list[str] = SLEEP, workers: int = 2, **spec) -> dict:
    """A job whose ranks run `command` (no torch): for tests where only the pods' lifecycle matters."""
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ParallelTrainingJob", "metadata": {"name": name},
            "spec": {"workers": workers, "trainingMode": "custom", "custom": {"command": command},
                     "trainer": {"model": "tandem.examples.digits:mlp", "data": "tandem.examples.digits:train_data"},
                     **spec}}


def pool_manifest(name: str, model: dict, replicas: int = 1, **spec) -> dict:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferencePool", "metadata": {"name": name},
            "spec": {"replicas": replicas, "workersPerReplica": 1, "model": model, "batchLimit": 8,
                     "port": 8000, **spec}}


def claim(cluster: Cluster, name: str) -> None:
    cluster.apply({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name},
                   "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}})


def paced_elastic_job(name: str, go: Path, *, directory: str, elastic: dict | None = None,
                      every_steps: int | None = 40, **trainer) -> dict:
    """An elastic job of two ranks whose model paces its steps until `go` exists (the test has seen what it waits
    for), checkpointing every `every_steps` steps in `directory`."""
    checkpoint = {"directory": directory, **({"everySteps": every_steps} if every_steps else {})}
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ParallelTrainingJob", "metadata": {"name": name},
            "spec": {"workers": 2, "elastic": {"minWorkers": 1, **(elastic or {})},
                     "trainer": {"model": "userland:paced_until",
                                 "modelArgs": {"until": str(go), "hidden": 64, "step_seconds": 0.1},
                                 "data": "tandem.examples.digits:train_data", "epochs": 10, "batchSizePerWorker": 16,
                                 **trainer},
                     "checkpoint": checkpoint}}


def lending_job(name: str, go: Path, selector: dict, window: int, *, epochs: int = 40, step_seconds: float = 0.1,
                **elastic) -> dict:
    """paced_elastic_job lending its workers (spec.elastic.lendTo) to the pools `selector` selects, taking them back
    after `window` seconds of a pool's demand below its loan; each rank pod asks for one GPU. Its 45 steps an epoch
    take `step_seconds` each until `go` exists."""
    document = paced_elastic_job(name, go, directory=name, every_steps=None, epochs=epochs,
                                 elastic={"lendTo": {"poolSelector": {"matchLabels": selector},
                                                     "stabilizationWindowSeconds": window}, **elastic})
    document["spec"]["trainer"]["modelArgs"]["step_seconds"] = step_seconds
    document["spec"]["gpusPerWorker"] = 1
    return document


def gpu_pool(name: str, labels: dict) -> dict:
    """A pool serving digits' MLP, one GPU a replica."""
    document = pool_manifest(name, {"callable": "tandem.examples.digits:mlp", "inputShape": [64], "name": "digits"},
                             gpusPerReplica=1)
    document["metadata"]["labels"] = labels
    return document


def scale(cluster: Cluster, plural: str, name: str, replicas: int) -> None:
    """What `kubectl scale` (or an autoscaler) asks: a PATCH of the scale subresource, by the test's own client."""
    cluster.request("PATCH", f"/apis/{GROUP}/{VERSION}/namespaces/{NS}/{plural}/{name}/scale",
                    {"spec": {"replicas": replicas}}, "application/merge-patch+json")


def status(cluster: Cluster, plural: str, name: str) -> dict:
    """The status of the tandem.dev resource `plural`/`name` (empty while it has none, or is gone)."""
    return (cluster.get(f"{GROUP}/{VERSION}/{plural}", NS, name) or {}).get("status") or {}


def job_pods(cluster: Cluster, name: str) -> list[dict]:
    return sorted((p for p in cluster.list("pods", NS) if p["metadata"].get("labels", {}).get("tandem.dev/job")
                   == name), key=lambda p: p["metadata"]["name"])


def server_pods(cluster: Cluster, pool: str) -> list[dict]:
    return [p for p in cluster.list("pods", NS) if p["metadata"].get("labels", {}).get("tandem.dev/pool") == pool
            and not p["metadata"].get("deletionTimestamp")]


def ready_hosts(cluster: Cluster, pool: str) -> list[str]:
    """The pool's ready servers, as its Service's endpoints would list them."""
    return [f"{p['status']['podIP']}:8000" for p in server_pods(cluster, pool)
            if any(c["type"] == "Ready" and c["status"] == "True" for c in p.get("status", {}).get("conditions", []))]


def events(cluster: Cluster, name: str) -> list[str]:
    """The reasons of the Events about `name`, oldest first."""
    return [e["reason"] for e in sorted(cluster.list("events", NS), key=lambda e: e["metadata"]["resourceVersion"]
                                        and int(e["metadata"]["resourceVersion"]))
            if e["involvedObject"]["name"] == name]


def infer(host: str, values: list[float]) -> list[float]:
    body = json.dumps({"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": values}]})
    request = urllib.request.Request(f"http://{host}/v2/models/digits/infer", body.encode(),
                                     {"Content-Type": "application/json"})
    with NO_PROXY.open(request, timeout=30) as response:
        return json.loads(response.read())["outputs"][0]["data"]


class Client(threading.Thread):
    """Sends inference requests one after another until stopped; counts answers, keeps every failure, and notes
    each checkpoint the server says it serves between them."""

    def __init__(self, hosts: Callable[[], list[str]]) -> None:
        """`hosts`: where to send the next request (as a Service would: its ready endpoints)."""
        super().__init__(daemon=True)
        self.hosts, self.stop, self.answered, self.failures = hosts, threading.Event(), 0, []
        self.checkpoints: list[str] = []
        self.served_by: set[str] = set()

    def run(self) -> None:
        while not self.stop.is_set():
            hosts = self.hosts()
            if not hosts:
                self.failures.append("no ready endpoint")
                continue
            host = hosts[self.answered % len(hosts)]
            try:
                infer(host, [0.5] * 64)
                self.answered += 1
                self.served_by.add(host)
                with NO_PROXY.open(f"http://{host}/v2/models/digits", timeout=30) as response:
                    checkpoint = json.loads(response.read())["parameters"]["checkpoint"]
                if checkpoint not in self.checkpoints:
                    self.checkpoints.append(checkpoint)
            except (OSError, urllib.error.HTTPError) as error:
                self.failures.append(repr(error))
