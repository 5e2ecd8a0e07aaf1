"""A server following its pool's batching settings in the Kubernetes API (`tandem serve --watch-pool`,
worker/serve/pool_watch.py), against the emulated API server (devcluster/, no kubelet): the server in process, the
pool patched through the API as `kubectl patch` would. No port takes a batching change (issue 35): the servers read
their pool themselves, and report a refusal in their readiness parameters, where the operator reads it."""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path

import pytest
from serving import make_pool, request, wait_until

from devcluster import Cluster
from tandem.worker.serve.processes import Group

GROUP, VERSION, POOLS, NS = "tandem.dev", "v1alpha1", "inferencepools", "default"
AT_MOST_4 = {"callable": "inference_models:at_most", "args": {"rows": 4}, "inputShape": [64]}


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    with Cluster(tmp_path, kubelet=False) as cluster:
        monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        yield cluster


def create_pool(cluster: Cluster, **spec) -> None:
    pool = make_pool(**spec)
    cluster.custom.create_namespaced_custom_object(GROUP, VERSION, NS, POOLS, {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "InferencePool", "metadata": {"name": "digits"},
        "spec": pool.spec.to_dict()})


def patch_pool(cluster: Cluster, **spec) -> None:
    cluster.custom.patch_namespaced_custom_object(GROUP, VERSION, NS, POOLS, "digits", {"spec": spec})


def batching(port: int) -> dict:
    return json.loads(request(port, "GET", "/v2/models/digits/batching")[2])


def parameters(port: int) -> dict:
    return json.loads(request(port, "GET", "/v2/models/digits/ready")[2])["parameters"]


def test_a_server_runs_its_pools_batching_settings_and_follows_their_changes(cluster, served):
    """The pool as the API holds it wins over the manifest the server started from (a server started before a
    change), and each patch reaches the running server within seconds; no port takes a change."""
    create_pool(cluster, batchLimit=4, queueLimit=20)
    server = served(make_pool(), watch_pool=True)  # its manifest: the defaults, batchLimit 32, queueLimit 64
    wait_until(lambda: batching(server.port)["batchLimit"] == 4, 30, "the pool's settings")
    assert batching(server.port)["queueLimit"] == 20
    patch_pool(cluster, batchLimit=16, maxQueueDelayMicroseconds=500, requestTimeoutMs=9000)
    wait_until(lambda: batching(server.port)["batchLimit"] == 16, 30, "the patched settings")
    assert batching(server.port) == {"batchLimit": 16, "queueLimit": 20, "maxQueueDelayMicroseconds": 500,
                                     "requestTimeoutMs": 9000}
    assert server.server.model.inference.batch_limit == 16
    patch_pool(cluster, replicas=3)  # not a batching setting: nothing to do
    assert request(server.port, "PUT", "/v2/models/digits/batching", b'{"batchLimit": 1}')[0] == 405
    patch_pool(cluster, queueLimit=7)
    wait_until(lambda: batching(server.port)["queueLimit"] == 7, 30, "the next change")
    assert batching(server.port)["batchLimit"] == 16


def test_settings_the_model_fails_at_are_reported_in_readiness_and_tried_again_later(cluster, served, caplog):
    """The server keeps its settings and says which it refused and why (`refused_*` parameters, open behind a
    token like all of readiness: the operator reads them); the same settings are tried again after a while, and
    settings it can run clear the refusal."""
    caplog.set_level(logging.WARNING, logger="tandem.serve")
    create_pool(cluster, model=AT_MOST_4, batchLimit=4)
    server = served(make_pool(model=AT_MOST_4, batchLimit=4), watch_pool=True)
    server.server.pool_watch.retry_seconds = 0.5
    patch_pool(cluster, batchLimit=8, queueLimit=30)
    wait_until(lambda: "refused_reason" in parameters(server.port), 30, "the refusal reported")
    found = parameters(server.port)
    assert found["refused_batch_limit"] == 8 and found["refused_queue_limit"] == 30
    assert "fails its warm-up at the new batch sizes: RuntimeError: this model takes at most 4 examples, not 8" \
        in found["refused_reason"]
    assert found["batch_limit"] == 4 and found["queue_limit"] == 64, "still running with its own"
    assert request(server.port, "GET", "/v2/health/ready")[0] == 200
    wait_until(lambda: sum("are refused" in r.getMessage() for r in caplog.records) >= 2, 30, "a second try")
    patch_pool(cluster, batchLimit=2)
    wait_until(lambda: batching(server.port)["batchLimit"] == 2, 30, "settings it can run")
    assert not any(key.startswith("refused_") for key in parameters(server.port))
    assert batching(server.port)["queueLimit"] == 30


def test_in_a_group_the_leader_watches_and_every_process_changes_and_reports_a_refusal(cluster, served):
    directory = Path(tempfile.mkdtemp(prefix="tandem-group-"))  # short: a Unix socket's path is at most 107 bytes
    try:
        create_pool(cluster, model=AT_MOST_4, batchLimit=4)
        leader, other = [served(make_pool(model=AT_MOST_4, batchLimit=4), group=Group(directory, index, 2),
                                watch_pool=True) for index in range(2)]
        assert leader.server.pool_watch is not None and other.server.pool_watch is None, "one watch per pod"
        patch_pool(cluster, batchLimit=3)
        for server in (leader, other):
            wait_until(lambda s=server: batching(s.port)["batchLimit"] == 3, 30, "the change in every process")
        patch_pool(cluster, batchLimit=8)
        for server in (leader, other):
            wait_until(lambda s=server: parameters(s.port).get("refused_batch_limit") == 8, 30,
                       "the refusal in every process's readiness")
            assert batching(server.port)["batchLimit"] == 3
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_without_credentials_a_server_serves_with_its_manifests_settings(served, monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    server = served(make_pool(batchLimit=6), watch_pool=True)
    wait_until(lambda: any("no Kubernetes credentials" in r.getMessage() for r in caplog.records), 30,
               "the error logged")
    assert batching(server.port)["batchLimit"] == 6
    assert request(server.port, "GET", "/v2/health/ready")[0] == 200
