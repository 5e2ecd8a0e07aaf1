"""InferencePools end to end: `tandem operator` as a real process (kopf) against the emulated API server; the
Deployments it creates are run by the harness's Deployment controller, and every server pod by the test kubelet as
a real `tandem serve` process (probes, preStop and rolling updates as devcluster/ emulates them). Clients are
`tritonclient.http` and plain HTTP against the pods' addresses. Mocked: nothing of Tandem's; Services have no
virtual IP here (clients call a pod), and where a test plays rank 0 (writing a job's checkpoint status) it says so.

A claim is a local directory here, and the kubelet rewrites mount paths in a server's arguments to it: a checkpoint
path a server reports over HTTP (and the operator copies into the pool's status) names that directory, where on a
cluster it names the mount. `on_cluster` maps it back before comparing.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import urllib.error
import urllib.request

import kubernetes_validate
import numpy as np
import pytest
import tritonclient.grpc as tritongrpc
import tritonclient.http as triton
import yaml
from jobs import ROOT, TESTS
from operator_runs import (
    GROUP,
    JOBS,
    NO_PROXY,
    NS,
    POOLS,
    READY,
    SLEEP,
    VERSION,
    Client,
    claim,
    events,
    infer,
    pool_manifest,
    server_pods,
    start_operator,
    status,
)
from serving import write_checkpoint
from tritonclient.utils import InferenceServerException

from devcluster import Cluster
from tandem.operator.pool_objects import MODEL_MOUNT
from tandem.worker import checkpoint


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with Cluster(tmp_path_factory.mktemp("cluster"), extra_env={"PYTHONPATH": str(TESTS)}) as cluster:
        start_operator(cluster)
        yield cluster


def create(cluster: Cluster, plural: str, document: dict) -> dict:
    return cluster.custom.create_namespaced_custom_object(GROUP, VERSION, NS, plural, document)


def condition(found: dict, kind: str) -> dict:
    return next((c for c in found.get("conditions") or [] if c["type"] == kind), {})


def wait_pool(cluster: Cluster, name: str, check, what: str, timeout: float = READY) -> dict:
    try:
        return cluster.wait_for(lambda: (s := status(cluster, POOLS, name)) and check(s) and s, timeout, what)
    except TimeoutError:
        print(cluster.process_log("operator")[-4000:])
        for pod in server_pods(cluster, name):
            print(pod["metadata"]["name"], pod.get("status"), cluster.logs(NS, pod["metadata"]["name"])[-3000:])
        raise AssertionError(f"{name}: not {what}: {status(cluster, POOLS, name)}") from None


def address(cluster: Cluster, pool: str) -> str:
    [pod] = [p for p in server_pods(cluster, pool) if p.get("status", {}).get("podIP")][:1]
    return f"{pod['status']['podIP']}:8000"


def on_cluster(cluster: Cluster, claim_name: str, path: str | None) -> str | None:
    """A path a server reports, as it reads on a cluster (see the module's docstring)."""
    local = os.path.realpath(cluster.kubelet.claim_dir(NS, claim_name))
    return None if path is None else path.replace(local, MODEL_MOUNT)


def served_checkpoint(cluster: Cluster, pool: str, claim_name: str) -> str | None:
    return on_cluster(cluster, claim_name, status(cluster, POOLS, pool).get("model", {}).get("checkpoint"))


def test_a_pool_follows_its_training_job_and_swaps_each_checkpoint_without_failing_a_request(cluster):
    """The contract end to end: the digits job trains on two gloo ranks in pods; once it has a checkpoint, a pool
    `fromTrainingJob {follow: true}` starts a real `tandem serve` on the job's claim, read-only; a client sends
    requests while the job writes newer checkpoints and succeeds; the pool's status ends on the job's last
    checkpoint, as the server reports it, and no request failed. Then tritonclient gets an answer."""
    document = yaml.safe_load((ROOT / "examples" / "digits-train.yaml").read_text())
    document["spec"]["checkpoint"].update({"persistentVolumeClaim": "digits-checkpoints", "everySteps": 20})
    claim(cluster, "digits-checkpoints")
    create(cluster, JOBS, document)
    pool = pool_manifest("digits", {"fromTrainingJob": {"name": "digits-train", "follow": True}})
    create(cluster, POOLS, pool)
    cluster.wait_for(lambda: status(cluster, JOBS, "digits-train").get("checkpoint", {}).get("latest"), READY,
                     "the job's first checkpoint")
    first = wait_pool(cluster, "digits", lambda s: s.get("phase") == "Ready" and s.get("model"), "Ready")
    assert first["model"]["source"] == "fromTrainingJob/digits-train"
    first_checkpoint = on_cluster(cluster, "digits-checkpoints", first["model"]["checkpoint"])
    assert first_checkpoint.startswith(f"{MODEL_MOUNT}/runs/digits-train/checkpoints/step-")
    serving = address(cluster, "digits")
    client = Client(lambda: [serving])
    client.start()
    try:
        cluster.wait_for(lambda: status(cluster, JOBS, "digits-train").get("phase") == "Succeeded", 180,
                         "the job to succeed")
        last = f"{MODEL_MOUNT}/runs/digits-train/checkpoints/step-00000230.pt"
        final = wait_pool(cluster, "digits", lambda s: served_checkpoint(cluster, "digits", "digits-checkpoints")
                          == last, "serving the job's last checkpoint", timeout=30)
    finally:
        client.stop.set()
        client.join(timeout=30)
    assert client.answered > 0 and client.failures == [], client.failures[:5]
    assert len(client.checkpoints) >= 2, "the server swapped at least once while the client sent requests"
    assert final["readyReplicas"] == 1 and final["endpoint"] == f"http://digits.{NS}.svc.cluster.local:8000/v2"
    assert condition(final, "Available")["status"] == "True"
    server = triton.InferenceServerClient(address(cluster, "digits"))
    inputs = triton.InferInput("input", [2, 64], "FP32")
    inputs.set_data_from_numpy(np.zeros((2, 64), dtype=np.float32))
    assert server.infer("digits", [inputs]).as_numpy("output").shape == (2, 10)
    metadata = server.get_model_metadata("digits")
    assert on_cluster(cluster, "digits-checkpoints", metadata["parameters"]["checkpoint"]) == last
    [pod] = server_pods(cluster, "digits")
    log = cluster.logs(NS, pod["metadata"]["name"])
    assert "step-00000230.pt" in log, "the server logs its swaps"


def test_a_pool_becomes_its_objects_scales_through_its_scale_subresource_and_deleting_it_removes_them(cluster):
    pool = pool_manifest("objects", {"callable": "tandem.examples.digits:mlp", "inputShape": [64], "name": "digits"},
                         replicas=2, autoscaling={"minReplicas": 1, "maxReplicas": 3, "targetQueueDepth": 8})
    create(cluster, POOLS, pool)
    ready = wait_pool(cluster, "objects", lambda s: s.get("phase") == "Ready", "Ready")
    assert ready["readySummary"] == "2/2" and ready["model"]["source"] == "callable"
    assert "checkpoint" not in ready["model"]
    event = cluster.wait_for(lambda: next((e for e in cluster.list("events", NS) if e["reason"] == "Ready"
                                           and e["involvedObject"]["name"] == "objects"), None), 10,
                             "the pool's Ready Event")
    assert event["source"]["component"] == event["reportingComponent"] == "tandem-operator", event
    created = {kind: cluster.get(kind, NS, name) for kind, name in [
        ("deployments", "objects-server"), ("services", "objects"), ("configmaps", "objects-spec"),
        ("poddisruptionbudgets", "objects-server"), ("horizontalpodautoscalers", "objects")]}
    for kind, found in created.items():
        assert found is not None, kind
        clean = {k: v for k, v in found.items() if k != "status"}
        clean["metadata"] = {k: found["metadata"][k] for k in ("name", "namespace", "labels", "ownerReferences")}
        kubernetes_validate.validate(clean, kubernetes_validate.latest_version(), strict=True)
        assert found["metadata"]["ownerReferences"][0]["kind"] == "InferencePool"
    template = created["deployments"]["spec"]["template"]["metadata"]["annotations"]["tandem.dev/spec-hash"]

    scale = {"spec": {"replicas": 1}}
    cluster.custom.patch_namespaced_custom_object_scale(GROUP, VERSION, NS, POOLS, "objects", scale)
    cluster.wait_for(lambda: cluster.get("deployments", NS, "objects-server")["spec"]["replicas"] == 1
                     and cluster.get("poddisruptionbudgets", NS, "objects-server") is None, 30,
                     "the Deployment to follow the scale and the budget to go")
    after = cluster.get("deployments", NS, "objects-server")
    assert after["spec"]["template"]["metadata"]["annotations"]["tandem.dev/spec-hash"] == template, \
        "scaling does not restart the servers"
    wait_pool(cluster, "objects", lambda s: s.get("replicas") == 1 and s.get("phase") == "Ready", "scaled to 1")

    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, NS, POOLS, "objects")
    cluster.wait_for(lambda: all(cluster.get(kind, NS, name) is None for kind, name in [
        ("deployments", "objects-server"), ("services", "objects"), ("configmaps", "objects-spec"),
        ("horizontalpodautoscalers", "objects")]) and not server_pods(cluster, "objects"), 60,
        "the pool's objects and pods to go")


def test_changing_the_inference_mode_rolls_the_servers_without_failing_a_request(cluster):
    """A new inferenceMode rolls the Deployment: the new server is started and ready before the old one is deleted
    (maxUnavailable 0), and the old one keeps serving through its preStop pause while the endpoints drop it, then
    drains. A client that sends each request to the Service's ready endpoints (as kube-proxy would) sees no failure."""
    create(cluster, POOLS, pool_manifest("rolling", {"callable": "tandem.examples.digits:mlp", "inputShape": [64],
                                                     "name": "digits"}))
    wait_pool(cluster, "rolling", lambda s: s.get("phase") == "Ready", "Ready")
    [before] = server_pods(cluster, "rolling")
    client = Client(lambda: cluster.endpoints(NS, "rolling"))
    client.start()
    try:
        cluster.custom.patch_namespaced_custom_object(GROUP, VERSION, NS, POOLS, "rolling",
                                                      {"spec": {"inferenceMode": "sequential"}})
        cluster.wait_for(lambda: cluster.get("pods", NS, before["metadata"]["name"]) is None, READY,
                         "the old server to go")
        rolled = wait_pool(cluster, "rolling", lambda s: s.get("phase") == "Ready" and s.get("observedGeneration") == 2,
                           "Ready on the new spec")
    finally:
        client.stop.set()
        client.join(timeout=30)
    assert client.failures == [] and client.answered > 0, client.failures[:5]
    assert len(client.served_by) == 2, "requests went to the old server, then to the new one"
    [after] = server_pods(cluster, "rolling")
    config = json.loads(cluster.get("configmaps", NS, "rolling-spec")["data"]["pool.json"])
    assert config["spec"]["inferenceMode"] == "sequential" and rolled["readySummary"] == "1/1"
    assert after["metadata"]["name"] != before["metadata"]["name"]
    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, NS, POOLS, "rolling")


def batch_sizes(host: str) -> dict[str, float]:
    """A server's batch-size histogram (cumulative buckets by bound) and batching gauges, from its /metrics."""
    with NO_PROXY.open(f"http://{host}/metrics", timeout=30) as response:
        metrics = response.read().decode()
    found = {bound: float(count) for bound, count in re.findall(
        r'tandem_inference_batch_size_bucket{le="([^"]+)",model="digits"} (\S+)', metrics)}
    for gauge in ("batch_limit", "max_queue_delay_seconds"):
        found[gauge] = float(re.search(rf'tandem_inference_{gauge}{{model="digits"}} (\S+)', metrics).group(1))
    return found


def test_a_batching_change_reaches_the_running_servers_under_load_without_a_new_pod_or_a_failed_request(cluster):
    """batchLimit and maxQueueDelayMicroseconds patched while eight clients keep two servers busy, each of two
    processes (processesPerReplica): each server reads the new settings from its pool (a watch with its own
    ServiceAccount; the operator sends nothing), and its processes all take them; the Deployment is not changed, no
    pod is replaced or restarted, every request succeeds, the servers batch by the new limit (their /metrics, summed
    over a pod's processes) and the pool's status shows what they run."""
    create(cluster, POOLS, pool_manifest("live", {"callable": "tandem.examples.digits:mlp", "inputShape": [64],
                                                  "name": "digits"}, replicas=2, processesPerReplica=2))
    ready = wait_pool(cluster, "live", lambda s: s.get("phase") == "Ready" and s.get("batching"), "Ready")
    assert ready["batching"] == {"batchLimit": 8, "queueLimit": 64, "maxQueueDelayMicroseconds": 0,
                                 "requestTimeoutMs": 30000}
    pods = {p["metadata"]["name"]: p["metadata"]["uid"] for p in server_pods(cluster, "live")}
    deployment = cluster.get("deployments", NS, "live-server")
    clients = [Client(lambda: cluster.endpoints(NS, "live")) for _ in range(8)]
    for client in clients:
        client.start()
    try:
        cluster.wait_for(lambda: sum(c.answered for c in clients) >= 40, READY, "answers before the change")
        cluster.custom.patch_namespaced_custom_object(GROUP, VERSION, NS, POOLS, "live", {"spec": {
            "batchLimit": 3, "maxQueueDelayMicroseconds": 20000}})
        hosts = cluster.endpoints(NS, "live")
        cluster.wait_for(lambda: all(batch_sizes(h)["batch_limit"] == 3 for h in hosts), 30,
                         "the servers to run the new batch limit")
        before = {host: batch_sizes(host) for host in hosts}
        answered = sum(c.answered for c in clients)
        cluster.wait_for(lambda: sum(c.answered for c in clients) >= answered + 200, READY,
                         "answers after the change")
        after = {host: batch_sizes(host) for host in hosts}
        changed = wait_pool(cluster, "live", lambda s: s.get("batching", {}).get("batchLimit") == 3
                            and s.get("observedGeneration") == 2, "showing the new batching")
    finally:
        for client in clients:
            client.stop.set()
        for client in clients:
            client.join(timeout=30)
    assert [f for c in clients for f in c.failures] == [] and all(c.answered for c in clients)
    assert changed["batching"] == {"batchLimit": 3, "queueLimit": 64, "maxQueueDelayMicroseconds": 20000,
                                   "requestTimeoutMs": 30000}
    assert condition(changed, "BatchingDiffers").get("status") in (None, "False")
    now = cluster.get("deployments", NS, "live-server")
    assert now["metadata"]["generation"] == deployment["metadata"]["generation"]
    assert now["spec"]["template"] == deployment["spec"]["template"]
    assert {p["metadata"]["name"]: p["metadata"]["uid"] for p in server_pods(cluster, "live")} == pods
    assert all(c.get("restartCount", 0) == 0 for p in server_pods(cluster, "live")
               for c in p["status"].get("containerStatuses") or [])
    config = json.loads(cluster.get("configmaps", NS, "live-spec")["data"]["pool.json"])
    assert config["spec"]["batchLimit"] == 3, "a server started later starts with the new settings"
    new = {host: {bound: after[host][bound] - before[host].get(bound, 0) for bound in after[host]} for host in hosts}
    for host, delta in new.items():
        assert after[host]["max_queue_delay_seconds"] == 0.02
        assert delta["+Inf"] - delta["3.0"] <= 1, f"{host}: batches over the new limit after the change: {delta}"
    assert sum(delta["3.0"] - delta["2.0"] for delta in new.values()) > 0, f"no batch of the new limit, 3: {new}"
    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, NS, POOLS, "live")


def test_batching_a_server_refuses_is_a_condition_with_its_answer_and_the_server_keeps_serving(cluster):
    """A batchLimit the model fails at (its warm-up at the new batch size raises): the server refuses it and keeps
    its settings, the pool says so in BatchingDiffers with the server's own answer, and no pod is replaced."""
    model = {"callable": "inference_models:at_most", "args": {"rows": 8}, "inputShape": [64], "name": "digits"}
    create(cluster, POOLS, pool_manifest("refusing", model))
    wait_pool(cluster, "refusing", lambda s: s.get("phase") == "Ready" and s.get("batching"), "Ready")
    [before] = server_pods(cluster, "refusing")
    cluster.custom.patch_namespaced_custom_object(GROUP, VERSION, NS, POOLS, "refusing", {"spec": {"batchLimit": 16}})
    refused = wait_pool(cluster, "refusing", lambda s: condition(s, "BatchingDiffers").get("reason") == "Refused",
                        "saying the server refused the batching")
    message = condition(refused, "BatchingDiffers")["message"]
    assert "fails its warm-up at the new batch sizes: RuntimeError: this model takes at most 8 examples, not 16" \
        in message, message
    assert refused["batching"]["batchLimit"] == 8 and refused["phase"] == "Ready"
    [after] = server_pods(cluster, "refusing")
    assert after["metadata"]["uid"] == before["metadata"]["uid"]
    assert infer(address(cluster, "refusing"), [0.5] * 64)
    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, NS, POOLS, "refusing")


def test_a_missing_job_or_checkpoint_is_a_condition_and_the_pool_recovers_pinned_to_the_latest(cluster, tmp_path):
    """The job appears after the pool, then its first checkpoint: the test plays rank 0 (copies a digits checkpoint
    onto the claim and writes the job's status.checkpoint), since only that matters to the pool. The pool does
    not follow: it pins the checkpoint latest when it starts, and a newer one moves nothing."""
    create(cluster, POOLS, pool_manifest("late", {"fromTrainingJob": {"name": "later", "follow": False}}))
    missing = wait_pool(cluster, "late", lambda s: condition(s, "ModelSourceMissing").get("status") == "True",
                        "waiting for its job", timeout=20)
    assert "does not exist" in condition(missing, "ModelSourceMissing")["message"] and missing["phase"] == "Pending"
    claim(cluster, "later-data")
    create(cluster, JOBS, {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ParallelTrainingJob",
                           "metadata": {"name": "later"},
                           "spec": {"workers": 1, "trainingMode": "custom", "custom": {"command": SLEEP},
                                    "trainer": {"model": "tandem.examples.digits:mlp",
                                                "data": "tandem.examples.digits:train_data"},
                                    "checkpoint": {"directory": "ckpt", "persistentVolumeClaim": "later-data"}}})
    waiting = wait_pool(cluster, "late", lambda s: "no checkpoint yet" in
                        condition(s, "ModelSourceMissing").get("message", ""), "waiting for a checkpoint", timeout=20)
    assert not server_pods(cluster, "late") and waiting["phase"] == "Pending"

    source = cluster.kubelet.claim_dir(NS, "digits-checkpoints") / "runs/digits-train/checkpoints"
    target = cluster.kubelet.claim_dir(NS, "later-data") / "ckpt"
    target.mkdir(parents=True)
    shutil.copy(source / "step-00000200.pt", target / "step-00000200.pt")
    write_checkpoint_status(cluster, "later", 200)
    ready = wait_pool(cluster, "late", lambda s: s.get("phase") == "Ready" and s.get("model"), "Ready")
    assert condition(ready, "ModelSourceMissing")["status"] == "False"
    assert served_checkpoint(cluster, "late", "later-data") == f"{MODEL_MOUNT}/ckpt/step-00000200.pt"
    deployment = cluster.get("deployments", NS, "late-server")
    shutil.copy(source / "step-00000230.pt", target / "step-00000230.pt")
    write_checkpoint_status(cluster, "later", 230)
    cluster.wait_for(lambda: status(cluster, JOBS, "later").get("checkpoint", {}).get("step") == 230, 10, "rank 0")
    assert cluster.get("deployments", NS, "late-server")["spec"] == deployment["spec"], "pinned: nothing moves"
    assert served_checkpoint(cluster, "late", "later-data") == f"{MODEL_MOUNT}/ckpt/step-00000200.pt"


def write_checkpoint_status(cluster: Cluster, job: str, step: int) -> None:
    cluster.custom.patch_namespaced_custom_object_status(GROUP, VERSION, NS, JOBS, job, {"status": {"checkpoint": {
        "latest": f"/var/lib/tandem/checkpoints/ckpt/step-{step:08d}.pt", "step": step}}})


def test_a_gated_pool_reports_its_promotions_and_skips_and_a_patch_pins_it_back(cluster, tmp_path):
    """The operator's side of gated promotion: the test plays rank 0 (it writes digits checkpoints onto the claim
    with the metrics a job's evaluation records, as tests/serving.py writes checkpoints). A worse candidate is skipped
    (status.lastSkipped with its metric and why, a PromotionSkipped Event), a better one promoted (status.model
    with its metrics, a Promoted Event); then one patch of fromTrainingJob.checkpoint rolls the servers back to the
    first checkpoint while a client's requests keep succeeding."""
    claim(cluster, "gated-data")
    create(cluster, JOBS, {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ParallelTrainingJob",
                           "metadata": {"name": "gated-train"},
                           "spec": {"workers": 1, "trainingMode": "custom", "custom": {"command": SLEEP},
                                    "trainer": {"model": "tandem.examples.digits:mlp",
                                                "data": "tandem.examples.digits:train_data"},
                                    "checkpoint": {"directory": "ckpt", "persistentVolumeClaim": "gated-data"}}})
    target = cluster.kubelet.claim_dir(NS, "gated-data") / "ckpt"

    def write(step: int, accuracy: float) -> str:
        state = checkpoint.load(write_checkpoint(tmp_path, seed=step, step=step))
        state["manifest"]["metrics"] = {"accuracy": accuracy, "evalLoss": 1.0 - accuracy}
        checkpoint.save(target, {k: v for k, v in state.items() if k != "format"}, step=step, keep_last=10)
        cluster.custom.patch_namespaced_custom_object_status(GROUP, VERSION, NS, JOBS, "gated-train", {"status": {
            "checkpoint": {"latest": f"/var/lib/tandem/checkpoints/ckpt/step-{step:08d}.pt", "step": step}}})
        return f"{MODEL_MOUNT}/ckpt/step-{step:08d}.pt"

    first = write(100, 0.9)
    create(cluster, POOLS, pool_manifest("gated", {"name": "digits", "fromTrainingJob": {
        "name": "gated-train", "promote": {"metric": "accuracy", "mode": "max", "minDelta": 0.01}}}))
    ready = wait_pool(cluster, "gated", lambda s: s.get("phase") == "Ready" and s.get("model"), "Ready")
    assert on_cluster(cluster, "gated-data", ready["model"]["checkpoint"]) == first
    assert ready["model"]["metrics"] == {"accuracy": 0.9, "evalLoss": pytest.approx(0.1)}
    client = Client(lambda: cluster.endpoints(NS, "gated"))
    client.start()
    try:
        worse = write(200, 0.5)
        skipped = wait_pool(cluster, "gated", lambda s: on_cluster(cluster, "gated-data", (s.get(
            "lastSkipped") or {}).get("checkpoint")) == worse, "reporting the skipped candidate", timeout=30)
        assert skipped["lastSkipped"]["metric"] == 0.5
        assert skipped["lastSkipped"]["reason"] == "accuracy 0.5 is not above the served 0.9 by more than 0.01"
        assert served_checkpoint(cluster, "gated", "gated-data") == first
        better = write(300, 0.95)
        promoted = wait_pool(cluster, "gated", lambda s: served_checkpoint(cluster, "gated", "gated-data") == better,
                             "serving the better checkpoint", timeout=30)
        assert promoted["model"]["metrics"]["accuracy"] == 0.95
        cluster.wait_for(lambda: {"PromotionSkipped", "Promoted"} <= set(events(cluster, "gated")), 10,
                         "the pool's promotion Events")
        reasons = events(cluster, "gated")
        assert reasons.index("PromotionSkipped") < reasons.index("Promoted"), reasons
        cluster.custom.patch_namespaced_custom_object(GROUP, VERSION, NS, POOLS, "gated", {"spec": {"model": {
            "fromTrainingJob": {"promote": None, "checkpoint": "step-00000100.pt"}}}})
        wait_pool(cluster, "gated", lambda s: s.get("observedGeneration") == 2 and s.get("phase") == "Ready"
                  and served_checkpoint(cluster, "gated", "gated-data") == first, "rolled back to the pinned one")
    finally:
        client.stop.set()
        client.join(timeout=30)
    assert client.answered > 0 and client.failures == [], client.failures[:5]
    command = cluster.get("deployments", NS, "gated-server")["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--checkpoint") + 1] == first
    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, NS, POOLS, "gated")


def test_a_model_that_cannot_load_fails_the_pool_with_the_servers_own_error(cluster):
    create(cluster, POOLS, pool_manifest("broken", {"checkpoint": "/nowhere/step-00000001.pt", "inputShape": [64]}))
    failed = wait_pool(cluster, "broken", lambda s: s.get("phase") == "Failed", "Failed")
    assert "/nowhere/step-00000001.pt" in condition(failed, "ModelLoadFailed")["message"]
    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, NS, POOLS, "broken")


def test_a_pool_with_a_token_answers_only_with_it_over_http_and_grpc_and_the_operator_still_sees_it_serve(cluster):
    """The token from a Secret the kubelet mounts (the operator reads none): the server pod's probes pass without
    it, the operator still learns what each server serves (status.model), and clients need it on both ports."""
    token = "pool-s3cret"
    cluster.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "guarded-token"},
                   "data": {"bearer": base64.b64encode(token.encode()).decode()}})
    create(cluster, POOLS, pool_manifest("guarded", {"callable": "tandem.examples.digits:mlp", "inputShape": [64],
                                                     "name": "digits"},
                                         auth={"secretName": "guarded-token", "key": "bearer"}))
    ready = wait_pool(cluster, "guarded", lambda s: s.get("phase") == "Ready" and s.get("model"), "Ready")
    assert ready["model"]["source"] == "callable", "the operator reads what is served behind the token"
    [pod] = server_pods(cluster, "guarded")
    host = pod["status"]["podIP"]
    x = np.zeros((2, 64), dtype=np.float32)
    http = triton.InferenceServerClient(f"{host}:8000")
    tensor = triton.InferInput("input", [2, 64], "FP32")
    tensor.set_data_from_numpy(x)
    with pytest.raises(InferenceServerException) as refused:
        http.infer("digits", [tensor])
    assert refused.value.status() == "401"
    assert http.infer("digits", [tensor], headers={"Authorization": f"Bearer {token}"}).as_numpy("output").shape \
        == (2, 10)
    grpc = tritongrpc.InferenceServerClient(f"{host}:8001")
    assert grpc.is_server_ready()
    tensor = tritongrpc.InferInput("input", [2, 64], "FP32")
    tensor.set_data_from_numpy(x)
    with pytest.raises(InferenceServerException) as refused:
        grpc.infer("digits", [tensor])
    assert refused.value.status() == "StatusCode.UNAUTHENTICATED"
    assert grpc.infer("digits", [tensor], headers={"authorization": f"Bearer {token}"}).as_numpy("output").shape \
        == (2, 10)
    grpc.close()
    # A batching change reaches a pool behind a token without a roll too: the server reads it from its pool, and
    # no port takes one, not even from the token's holders.
    change = urllib.request.Request(f"http://{host}:8000/v2/models/digits/batching", method="PUT",
                                    data=b'{"batchLimit": 1}', headers={"Authorization": f"Bearer {token}"})
    with pytest.raises(urllib.error.HTTPError) as put:
        NO_PROXY.open(change, timeout=30)
    assert put.value.code == 405
    cluster.custom.patch_namespaced_custom_object(GROUP, VERSION, NS, POOLS, "guarded", {"spec": {"batchLimit": 5}})
    changed = wait_pool(cluster, "guarded", lambda s: s.get("batching", {}).get("batchLimit") == 5
                        and s.get("observedGeneration") == 2, "showing the new batching")
    assert condition(changed, "BatchingDiffers").get("status") in (None, "False")
    [after] = server_pods(cluster, "guarded")
    assert after["metadata"]["uid"] == pod["metadata"]["uid"], "no new pod"
    assert after["spec"]["serviceAccountName"] == "guarded-server"
    role = cluster.get("roles", NS, "guarded-server")
    assert role["rules"] == [{"apiGroups": [GROUP], "resources": [POOLS], "resourceNames": ["guarded"],
                              "verbs": ["get", "watch"]}]
    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, NS, POOLS, "guarded")


def test_operator_log_has_no_errors(cluster):
    log = cluster.process_log("operator")
    problems = [line for line in log.splitlines() if "Traceback" in line or "[ERROR" in line]
    assert not problems, "\n".join(problems)
