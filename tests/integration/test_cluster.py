"""The test cluster (tests/cluster): each emulator fix and each kubelet behaviour, shown with the real `kubernetes`
client (raw HTTP where the client cannot say it), and a minimal kopf operator running against it end to end."""

from __future__ import annotations

import json
import os
import re
import sys
import textwrap
import threading
import time
from pathlib import Path

import kubernetes
import pytest
from kubernetes.client import ApiException

from devcluster import Cluster
from devcluster import store as cluster_store

NS = "default"
GROUP, VERSION, PTJ = "tandem.dev", "v1alpha1", "paralleltrainingjobs"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with Cluster(tmp_path_factory.mktemp("cluster"), images=["python:*"]) as running:
        yield running
    assert not running.emulator.bugs, running.emulator.bugs


def job(name: str, workers: int = 2, **extra) -> dict:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ParallelTrainingJob", "metadata": {"name": name, **extra},
            "spec": {"workers": workers, "trainer": {"model": "tandem.examples.digits:mlp",
                                                     "data": "tandem.examples.digits:train_data",
                                                     "evalData": "tandem.examples.digits:eval_data", "epochs": 1}}}


def pod(name: str, code: str = "pass", *, args: tuple = (), image: str = "python:3.11", restart: str = "Never",
        env: dict | None = None, mounts: list | None = None, volumes: list | None = None, **spec) -> dict:
    container = {"name": "main", "image": image, "command": ["python", "-c", code, *args],
                 "env": [{"name": k, "value": v} if isinstance(v, str) else {"name": k, "valueFrom": v}
                         for k, v in (env or {}).items()],
                 "volumeMounts": mounts or [], "terminationMessagePolicy": "FallbackToLogsOnError"}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"restartPolicy": restart, "containers": [container], "volumes": volumes or [], **spec}}


def phase(cluster: Cluster, name: str, wanted: str, timeout: float = 15) -> dict:
    return cluster.wait_for(lambda: (p := cluster.get("pods", NS, name)) and p["status"].get("phase") == wanted and p,
                            timeout, f"pod {name} to be {wanted}")


def create_job(cluster: Cluster, name: str, **extra) -> dict:
    return cluster.custom.create_namespaced_custom_object(GROUP, VERSION, NS, PTJ, job(name, **extra))


# -- the emulator -------------------------------------------------------------------------------------------------
def test_uid_resource_version_and_generation(cluster):
    created = create_job(cluster, "meta")
    meta = created["metadata"]
    assert re.fullmatch(r"[0-9a-f-]{36}", meta["uid"]) and meta["generation"] == 1 and meta["creationTimestamp"]
    cm = cluster.core.create_namespaced_config_map(NS, {"metadata": {"name": "meta-between"}})
    assert int(cm.metadata.resource_version) > int(meta["resourceVersion"])  # one counter for the whole store

    labelled = cluster.custom.patch_namespaced_custom_object(GROUP, VERSION, NS, PTJ, "meta",
                                                             {"metadata": {"labels": {"a": "b"}}})
    assert labelled["metadata"]["generation"] == 1  # metadata is not spec
    assert int(labelled["metadata"]["resourceVersion"]) > int(cm.metadata.resource_version)
    scaled = cluster.custom.patch_namespaced_custom_object(GROUP, VERSION, NS, PTJ, "meta", {"spec": {"workers": 3}})
    assert scaled["metadata"]["generation"] == 2
    status = cluster.custom.patch_namespaced_custom_object_status(GROUP, VERSION, NS, PTJ, "meta",
                                                                  {"status": {"phase": "Running"}})
    assert status["metadata"]["generation"] == 2 and status["metadata"]["uid"] == meta["uid"]
    again = cluster.custom.patch_namespaced_custom_object(GROUP, VERSION, NS, PTJ, "meta", {"spec": {"workers": 3}})
    assert again["metadata"]["resourceVersion"] == status["metadata"]["resourceVersion"]  # a no-op is no change


def test_discovery_serves_the_builtins_and_the_crds_but_no_kopf_peering(cluster):
    groups = {g.name for g in kubernetes.client.ApisApi(cluster.api).get_api_versions().groups}
    assert {"apps", "rbac.authorization.k8s.io", "coordination.k8s.io", "events.k8s.io", "apiextensions.k8s.io",
            GROUP} <= groups and "kopf.dev" not in groups
    core = {r.name for r in cluster.core.get_api_resources().resources}
    assert {"pods", "pods/status", "pods/log", "services", "configmaps", "serviceaccounts", "events",
            "persistentvolumeclaims", "namespaces"} <= core
    status, tandem = cluster.request("GET", f"/apis/{GROUP}/{VERSION}")
    served = {r["name"]: r for r in tandem["resources"]}
    assert {"paralleltrainingjobs/status", "paralleltrainingjobs/scale", "inferencepools/scale"} <= set(served)
    assert served["paralleltrainingjobs"]["kind"] == "ParallelTrainingJob" and served["paralleltrainingjobs"][
        "namespaced"] and "ptj" in served["paralleltrainingjobs"]["shortNames"]
    assert cluster.request("GET", "/apis/kopf.dev/v1")[0] == 404


def test_generate_name_for_objects_and_both_event_apis(cluster):
    cm = cluster.core.create_namespaced_config_map(NS, {"metadata": {"generateName": "gen-"}})
    assert re.fullmatch(r"gen-[a-z0-9]{5}", cm.metadata.name)
    involved = {"kind": "ConfigMap", "namespace": NS, "name": cm.metadata.name, "uid": cm.metadata.uid}
    event = cluster.core.create_namespaced_event(NS, {"metadata": {"generateName": "ev-"}, "involvedObject": involved,
                                                      "reason": "Tested", "message": "core/v1", "type": "Normal"})
    assert event.metadata.name.startswith("ev-") and len(event.metadata.name) == 8
    new_api = kubernetes.client.EventsV1Api(cluster.api).create_namespaced_event(NS, {
        "metadata": {"generateName": "ev2-"}, "eventTime": "2026-01-01T00:00:00.000000Z", "regarding": involved,
        "reason": "Tested", "note": "events.k8s.io/v1", "type": "Normal", "action": "Test",
        "reportingController": "tests", "reportingInstance": "tests"})
    assert new_api.metadata.name.startswith("ev2-")
    listed = cluster.core.list_namespaced_event(NS, field_selector=f"involvedObject.name={cm.metadata.name}")
    assert [e.message for e in listed.items] == ["core/v1"]


def test_label_and_field_selectors_on_list_and_watch(cluster):
    for name, labels in [("sel-a", {"app": "x", "tier": "web"}), ("sel-b", {"app": "x", "env": "prod"}),
                         ("sel-c", {"app": "y", "env": "dev"})]:
        cluster.core.create_namespaced_config_map(NS, {"metadata": {"name": name, "labels": labels}})

    def names(**selectors):
        return sorted(i.metadata.name for i in cluster.core.list_namespaced_config_map(NS, **selectors).items
                      if i.metadata.name.startswith("sel-"))

    assert names(label_selector="app=x") == ["sel-a", "sel-b"]
    assert names(label_selector="app==x,tier") == ["sel-a"]
    assert names(label_selector="app!=x") == ["sel-c"]
    assert names(label_selector="env in (prod,dev),!tier") == ["sel-b", "sel-c"]
    assert names(label_selector="env notin (prod)") == ["sel-a", "sel-c"]
    assert names(field_selector="metadata.name=sel-b") == ["sel-b"]
    assert names(field_selector="metadata.namespace=default,metadata.name!=sel-a", label_selector="app") == [
        "sel-b", "sel-c"]
    assert cluster.request("GET", "/api/v1/configmaps?labelSelector=a%20in%20(")[0] == 400

    cluster.core.create_namespaced_pod(NS, pod("sel-done"))
    cluster.core.create_namespaced_pod(NS, pod("sel-waits", schedulerName="nobody"))  # never scheduled
    phase(cluster, "sel-done", "Succeeded")
    done = cluster.core.list_namespaced_pod(NS, field_selector="status.phase=Succeeded").items
    assert "sel-done" in {p.metadata.name for p in done} and "sel-waits" not in {p.metadata.name for p in done}
    unscheduled = cluster.core.list_namespaced_pod(NS, field_selector="spec.nodeName=").items
    assert "sel-waits" in {p.metadata.name for p in unscheduled}

    # a selector-filtered watch sees an object entering (ADDED) and leaving (DELETED) its selection
    version = cluster.core.list_namespaced_config_map(NS).metadata.resource_version
    cluster.core.patch_namespaced_config_map("sel-c", NS, {"metadata": {"labels": {"app": "x"}}})
    cluster.core.patch_namespaced_config_map("sel-a", NS, {"metadata": {"labels": {"app": "z"}}})
    seen = [(e["type"], e["object"].metadata.name) for e in kubernetes.watch.Watch().stream(
        cluster.core.list_namespaced_config_map, NS, label_selector="app=x", resource_version=version,
        timeout_seconds=1)]
    assert seen == [("ADDED", "sel-c"), ("DELETED", "sel-a")]


def test_a_watch_from_a_lists_resource_version_loses_nothing(cluster):
    for i in range(3):
        cluster.core.create_namespaced_config_map(NS, {"metadata": {"name": f"lw-{i}", "labels": {"lw": "1"}}})
    listed = cluster.core.list_namespaced_config_map(NS, label_selector="lw")
    # changes between the list and the watch: the watch from the list's resourceVersion must stream every one
    cluster.core.create_namespaced_config_map(NS, {"metadata": {"name": "lw-3", "labels": {"lw": "1"}}})
    cluster.core.patch_namespaced_config_map("lw-0", NS, {"data": {"k": "v"}})
    cluster.core.delete_namespaced_config_map("lw-1", NS)
    started = time.monotonic()
    events = [(e["type"], e["object"].metadata.name) for e in kubernetes.watch.Watch().stream(
        cluster.core.list_namespaced_config_map, NS, label_selector="lw",
        resource_version=listed.metadata.resource_version, timeout_seconds=1)]
    assert events == [("ADDED", "lw-3"), ("MODIFIED", "lw-0"), ("DELETED", "lw-1")]
    assert 0.9 < time.monotonic() - started < 5  # timeoutSeconds ends the stream
    # without a resourceVersion, a watch starts with the objects as they are
    initial = [(e["type"], e["object"].metadata.name) for e in kubernetes.watch.Watch().stream(
        cluster.core.list_namespaced_config_map, NS, label_selector="lw", timeout_seconds=1)]
    assert sorted(initial) == [("ADDED", "lw-0"), ("ADDED", "lw-2"), ("ADDED", "lw-3")]


def test_a_watch_from_a_forgotten_resource_version_is_gone(cluster, monkeypatch):
    monkeypatch.setattr(cluster_store, "LOG_LIMIT", 3)  # events kept per resource; leases are new here
    leases = kubernetes.client.CoordinationV1Api(cluster.api)
    first = leases.create_namespaced_lease(NS, {"metadata": {"name": "lease-0"}})
    for i in range(1, 6):
        leases.create_namespaced_lease(NS, {"metadata": {"name": f"lease-{i}"}})
    with pytest.raises(ApiException) as error:
        list(kubernetes.watch.Watch().stream(leases.list_namespaced_lease, NS, timeout_seconds=1,
                                             resource_version=first.metadata.resource_version))
    assert error.value.status == 410  # the watcher must list again
    recent = leases.list_namespaced_lease(NS).items[-2].metadata.resource_version  # still kept: fine
    assert [e["object"].metadata.name for e in kubernetes.watch.Watch().stream(
        leases.list_namespaced_lease, NS, resource_version=recent, timeout_seconds=1)] == ["lease-5"]


def test_put_with_a_stale_resource_version_is_a_conflict(cluster):
    cluster.core.create_namespaced_config_map(NS, {"metadata": {"name": "put"}, "data": {"k": "1"}})
    first = cluster.core.read_namespaced_config_map("put", NS)
    first.data = {"k": "2"}
    second = cluster.core.replace_namespaced_config_map("put", NS, first)
    assert second.data == {"k": "2"} and second.metadata.resource_version != first.metadata.resource_version
    first.data = {"k": "3"}  # still carries the old resourceVersion
    with pytest.raises(ApiException) as error:
        cluster.core.replace_namespaced_config_map("put", NS, first)
    assert error.value.status == 409 and "the object has been modified" in json.loads(error.value.body)["message"]
    with pytest.raises(ApiException) as error:  # a merge-patch naming a resourceVersion is a precondition too
        cluster.core.patch_namespaced_config_map("put", NS, {"metadata": {"resourceVersion": "1"}, "data": {"k": "4"}})
    assert error.value.status == 409


def test_json_patch_test_ops(cluster):
    cluster.core.create_namespaced_config_map(NS, {"metadata": {"name": "jp"}, "data": {"k": "v"}})
    version = cluster.core.read_namespaced_config_map("jp", NS).metadata.resource_version
    patched = cluster.core.patch_namespaced_config_map("jp", NS, [
        {"op": "test", "path": "/metadata/resourceVersion", "value": version},
        {"op": "add", "path": "/data/k2", "value": "w"}])
    assert patched.data == {"k": "v", "k2": "w"}
    with pytest.raises(ApiException) as error:  # kopf's finalizer patches rely on exactly this
        cluster.core.patch_namespaced_config_map("jp", NS, [
            {"op": "test", "path": "/metadata/resourceVersion", "value": version},
            {"op": "remove", "path": "/data/k"}])
    assert error.value.status == 422
    assert cluster.core.read_namespaced_config_map("jp", NS).data == {"k": "v", "k2": "w"}


def test_status_subresource_isolation_both_ways(cluster):
    created = cluster.custom.create_namespaced_custom_object(GROUP, VERSION, NS, PTJ,
                                                             {**job("iso"), "status": {"phase": "Failed"}})
    assert "status" not in created  # a create's status is dropped
    cluster.custom.patch_namespaced_custom_object_status(GROUP, VERSION, NS, PTJ, "iso",
                                                         {"status": {"phase": "Running"}})
    on_object = cluster.custom.patch_namespaced_custom_object(GROUP, VERSION, NS, PTJ, "iso", {
        "spec": {"workers": 3}, "status": {"phase": "Succeeded"}})
    assert on_object["spec"]["workers"] == 3 and on_object["status"]["phase"] == "Running"
    on_status = cluster.custom.patch_namespaced_custom_object_status(GROUP, VERSION, NS, PTJ, "iso", {
        "spec": {"workers": 5}, "status": {"phase": "Succeeded"}})
    assert on_status["spec"]["workers"] == 3 and on_status["status"]["phase"] == "Succeeded"
    whole = cluster.custom.get_namespaced_custom_object(GROUP, VERSION, NS, PTJ, "iso")
    whole["spec"]["workers"], whole["status"]["phase"] = 7, "Failed"
    replaced = cluster.custom.replace_namespaced_custom_object_status(GROUP, VERSION, NS, PTJ, "iso", whole)
    assert replaced["spec"]["workers"] == 3 and replaced["status"]["phase"] == "Failed"
    # so for pods: a write to the pod keeps the kubelet's status
    cluster.core.create_namespaced_pod(NS, pod("iso-pod", schedulerName="nobody"))
    kept = cluster.core.patch_namespaced_pod("iso-pod", NS, {"metadata": {"labels": {"x": "y"}},
                                                             "status": {"phase": "Succeeded"}})
    assert kept.status.phase == "Pending" and kept.metadata.labels == {"x": "y"}
    # the schema applies as on a cluster: unknown fields pruned, defaults filled, invalid values refused
    assert "kopf" not in replaced["status"] and replaced["status"]["restarts"] == 0
    with pytest.raises(ApiException) as error:
        create_job(cluster, "bad", workers=0)
    assert error.value.status == 422 and "spec.workers" in json.loads(error.value.body)["message"]


def test_scale_subresource_maps_to_workers(cluster):
    create_job(cluster, "scaled", workers=2)
    cluster.custom.patch_namespaced_custom_object_status(GROUP, VERSION, NS, PTJ, "scaled", {"status": {
        "workers": {"total": 2, "ready": 2}, "selector": "tandem.dev/job=scaled"}})
    scale = cluster.custom.get_namespaced_custom_object_scale(GROUP, VERSION, NS, PTJ, "scaled")
    assert scale["kind"] == "Scale" and scale["spec"] == {"replicas": 2}
    assert scale["status"] == {"replicas": 2, "selector": "tandem.dev/job=scaled"}
    cluster.custom.patch_namespaced_custom_object_scale(GROUP, VERSION, NS, PTJ, "scaled", {"spec": {"replicas": 4}})
    after = cluster.get("ptj", NS, "scaled")
    assert after["spec"]["workers"] == 4 and after["metadata"]["generation"] == 2
    scale = cluster.custom.get_namespaced_custom_object_scale(GROUP, VERSION, NS, PTJ, "scaled")
    scale["spec"]["replicas"] = 3
    assert cluster.custom.replace_namespaced_custom_object_scale(GROUP, VERSION, NS, PTJ, "scaled", scale)[
        "spec"] == {"replicas": 3}
    assert cluster.get("ptj", NS, "scaled")["spec"]["workers"] == 3


def test_finalizers_hold_deletion_until_removed(cluster):
    cluster.core.create_namespaced_config_map(NS, {"metadata": {"name": "held", "finalizers": ["tests/hold"]}})
    cluster.core.delete_namespaced_config_map("held", NS)
    held = cluster.core.read_namespaced_config_map("held", NS)
    assert held.metadata.deletion_timestamp and held.metadata.finalizers == ["tests/hold"]
    with pytest.raises(ApiException) as error:  # no new finalizer on an object being deleted
        cluster.core.patch_namespaced_config_map("held", NS, {"metadata": {"finalizers": ["tests/hold", "more"]}})
    assert error.value.status == 422
    cluster.core.patch_namespaced_config_map("held", NS, {"metadata": {"finalizers": None}})
    assert cluster.get("configmaps", NS, "held") is None
    assert cluster.history("configmaps", NS, "held")[-1] is None


def test_deleting_an_owner_cascades_to_its_dependents(cluster):
    owner = create_job(cluster, "cascade")
    ref = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ParallelTrainingJob", "name": "cascade",
           "uid": owner["metadata"]["uid"], "controller": True}
    cm = cluster.core.create_namespaced_config_map(NS, {"metadata": {"name": "cascade-spec", "ownerReferences": [ref]}})
    cm_ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "cascade-spec", "uid": cm.metadata.uid}
    rank = pod("cascade-rank", "import time; print('up', flush=True); time.sleep(60)")
    rank["metadata"]["ownerReferences"] = [ref]
    cluster.core.create_namespaced_pod(NS, rank)
    cluster.core.create_namespaced_config_map(NS, {"metadata": {"name": "cascade-grandchild",
                                                                "ownerReferences": [cm_ref]}})
    phase(cluster, "cascade-rank", "Running")
    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, NS, PTJ, "cascade")
    for name in ("cascade-spec", "cascade-grandchild"):  # two levels down
        cluster.wait_for(lambda name=name: cluster.get("configmaps", NS, name) is None, 5, f"{name} collected")
    cluster.wait_for(lambda: cluster.get("pods", NS, "cascade-rank") is None, 10, "the owned pod to go")
    assert cluster.history("pods", NS, "cascade-rank")[-2]["metadata"]["deletionTimestamp"]  # it terminated first

    orphan_owner = cluster.core.create_namespaced_config_map(NS, {"metadata": {"name": "orphaner"}})
    cluster.core.create_namespaced_config_map(NS, {"metadata": {"name": "orphan", "ownerReferences": [
        {"apiVersion": "v1", "kind": "ConfigMap", "name": "orphaner", "uid": orphan_owner.metadata.uid}]}})
    cluster.core.delete_namespaced_config_map("orphaner", NS, propagation_policy="Orphan")
    cluster.wait_for(lambda: "ownerReferences" not in cluster.get("configmaps", NS, "orphan")["metadata"], 5,
                     "the ownerReference to be removed")


def test_namespaced_paths_and_namespace_deletion(cluster):
    cluster.core.create_namespace({"metadata": {"name": "scratch"}})
    assert "scratch" in {n.metadata.name for n in cluster.core.list_namespace().items}  # GET /api/v1/namespaces
    cluster.core.create_namespaced_config_map("scratch", {"metadata": {"name": "inside"}})
    with pytest.raises(ApiException) as error:
        cluster.core.create_namespaced_config_map("nowhere", {"metadata": {"name": "x"}})
    assert error.value.status == 404
    cluster.core.delete_namespace("scratch")
    cluster.wait_for(lambda: cluster.get("namespaces", None, "scratch") is None, 5, "the namespace to go")
    assert cluster.get("configmaps", "scratch", "inside") is None


# -- the kubelet --------------------------------------------------------------------------------------------------
def test_a_pod_runs_and_succeeds(cluster):
    cluster.core.create_namespaced_pod(NS, pod("hi", "print('hi')"))
    done = phase(cluster, "hi", "Succeeded")
    state = done["status"]["containerStatuses"][0]["state"]["terminated"]
    assert state["exitCode"] == 0 and state["reason"] == "Completed"
    assert cluster.logs(NS, "hi") == "hi\n"
    assert cluster.core.read_namespaced_pod_log("hi", NS) == "hi\n"  # kubectl logs
    running = [v for v in cluster.history("pods", NS, "hi") if v and v["status"].get("phase") == "Running"]
    assert running and "running" in running[0]["status"]["containerStatuses"][0]["state"]
    assert {c["type"]: c["status"] for c in running[0]["status"]["conditions"]}["Ready"] == "True"


def test_a_failing_pod_reports_its_last_log_lines(cluster):
    code = "import sys\nfor i in range(200): print(f'line {i}')\nsys.exit(3)"
    cluster.core.create_namespaced_pod(NS, pod("fails", code))
    failed = phase(cluster, "fails", "Failed")
    state = failed["status"]["containerStatuses"][0]["state"]["terminated"]
    assert state["exitCode"] == 3 and state["reason"] == "Error"
    lines = state["message"].splitlines()
    assert lines[-1] == "line 199" and len(lines) == 80  # the kubelet's 80 lines (within 2048 bytes)


@pytest.mark.parametrize(("path", "written", "expected"), [
    (None, "why", "why"),
    ("/tmp/custom/why", "custom why", "custom why"),
    (None, "", "last words"),
    (None, "x" * 5000, "x" * 4096),
], ids=["default-path", "own-path", "empty-falls-back-to-the-log", "cut-at-4096-bytes"])
def test_a_container_writes_its_termination_message_at_its_path(cluster, request, path, written, expected):
    """What the container writes at its terminationMessagePath (given to it as an argument) is the message;
    FallbackToLogsOnError takes the log's tail only when it wrote nothing."""
    code = "import sys\nprint('last words')\nopen(sys.argv[1], 'w').write(sys.argv[2])\nsys.exit(4)"
    name = f"says-why-{request.node.callspec.id}"
    manifest = pod(name, code, args=(path or "/dev/termination-log", written))
    if path:
        manifest["spec"]["containers"][0]["terminationMessagePath"] = path
    cluster.core.create_namespaced_pod(NS, manifest)
    state = phase(cluster, name, "Failed")["status"]["containerStatuses"][0]["state"]["terminated"]
    assert state["exitCode"] == 4 and state["message"].strip() == expected


def test_deleting_a_running_pod_sends_sigterm_and_waits_for_the_process(cluster):
    code = textwrap.dedent("""
        import signal, sys, time
        def stop(*_):
            print('got SIGTERM', flush=True); time.sleep(1); sys.exit(0)
        signal.signal(signal.SIGTERM, stop)
        print('ready', flush=True)
        time.sleep(60)
    """)
    cluster.core.create_namespaced_pod(NS, pod("long", code))
    cluster.wait_for(lambda: "ready" in cluster.logs(NS, "long"), 10, "the process to start")
    pid = cluster.kubelet.pid(NS, "long")
    cluster.core.delete_namespaced_pod("long", NS)
    terminating = cluster.core.read_namespaced_pod("long", NS)  # still there: its process still runs
    assert terminating.metadata.deletion_timestamp and terminating.metadata.deletion_grace_period_seconds == 30
    cluster.wait_for(lambda: "got SIGTERM" in cluster.logs(NS, "long"), 5, "SIGTERM")
    assert cluster.get("pods", NS, "long") is not None
    cluster.wait_for(lambda: cluster.get("pods", NS, "long") is None, 10, "the pod to go")
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)

    stubborn = pod("stubborn", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                               "print('ready', flush=True); time.sleep(60)", terminationGracePeriodSeconds=1)
    cluster.core.create_namespaced_pod(NS, stubborn)
    cluster.wait_for(lambda: "ready" in cluster.logs(NS, "stubborn"), 10, "the process to start")
    cluster.core.delete_namespaced_pod("stubborn", NS)
    cluster.wait_for(lambda: cluster.get("pods", NS, "stubborn") is None, 10, "SIGKILL after the grace period")
    last = [v for v in cluster.history("pods", NS, "stubborn") if v][-1]
    assert last["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 137

    cluster.core.create_namespaced_pod(NS, pod("forced", "import time; print('ready', flush=True); time.sleep(60)"))
    cluster.wait_for(lambda: "ready" in cluster.logs(NS, "forced"), 10, "the process to start")
    forced_pid = cluster.kubelet.pid(NS, "forced")
    cluster.core.delete_namespaced_pod("forced", NS, grace_period_seconds=0)
    assert cluster.get("pods", NS, "forced") is None  # gone at once
    cluster.wait_for(lambda: not _alive(forced_pid), 5, "the process to be killed")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_configmap_and_claim_volumes_at_rewritten_paths(cluster):
    cluster.core.create_namespaced_config_map(NS, {"metadata": {"name": "vol-cm"},
                                                   "data": {"a.txt": "from a ConfigMap"}})
    cluster.core.create_namespaced_persistent_volume_claim(NS, {"metadata": {"name": "data"}, "spec": {
        "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}})
    code = ("import os, sys, kubernetes; print(open(sys.argv[1]).read()); print(os.getcwd());"
            "open(os.path.join(os.environ['OUT'], 'out.txt'), 'w').write(os.environ['OUT']);"
            "kubernetes.config.load_kube_config(); kubernetes.client.CoreV1Api().patch_namespaced_config_map("
            "'vol-cm', 'default', {'data': {'reported': os.environ['OUT'] + '/out.txt'}})")
    spec = pod("volumes", code, args=("/etc/cfg/a.txt",), env={"OUT": "/data/run"},
               mounts=[{"name": "cfg", "mountPath": "/etc/cfg", "readOnly": True},
                       {"name": "claim", "mountPath": "/data"},
                       {"name": "claim", "mountPath": "/work", "subPath": "w"}],
               volumes=[{"name": "cfg", "configMap": {"name": "vol-cm"}},
                        {"name": "claim", "persistentVolumeClaim": {"claimName": "data"}}])
    spec["spec"]["containers"][0]["workingDir"] = "/work"
    claim = cluster.kubelet.claim_dir(NS, "data")
    (claim / "run").mkdir(parents=True)
    cluster.core.create_namespaced_pod(NS, spec)
    phase(cluster, "volumes", "Succeeded")
    printed = cluster.logs(NS, "volumes").splitlines()
    assert printed == ["from a ConfigMap", str(claim / "w")]
    assert (claim / "run" / "out.txt").read_text() == str(claim / "run")
    assert cluster.core.read_namespaced_persistent_volume_claim_status("data", NS).status.phase == "Bound"
    # a path the process reports through the API reads as the pod's own path, as on a cluster
    assert cluster.get("configmaps", NS, "vol-cm")["data"]["reported"] == "/data/run/out.txt"


def test_field_refs_resolve_in_the_environment(cluster):
    refs = {name: {"fieldRef": {"fieldPath": path}} for name, path in [
        ("POD_NAME", "metadata.name"), ("POD_NAMESPACE", "metadata.namespace"), ("POD_UID", "metadata.uid"),
        ("POD_IP", "status.podIP"), ("NODE", "spec.nodeName"), ("TEAM", "metadata.labels['team']")]}
    spec = pod("refs", "import json, os; print(json.dumps({k: os.environ.get(k) for k in os.environ}))",
               env={**refs, "GREETING": "hello $(POD_NAME)"})
    spec["metadata"]["labels"] = {"team": "ml"}
    cluster.core.create_namespaced_pod(NS, spec)
    done = phase(cluster, "refs", "Succeeded")
    env = json.loads(cluster.logs(NS, "refs"))
    assert env["POD_NAME"] == "refs" and env["POD_NAMESPACE"] == NS and env["TEAM"] == "ml"
    assert env["POD_UID"] == done["metadata"]["uid"] and env["POD_IP"] == done["status"]["podIP"]
    assert re.fullmatch(r"127\.\d+\.\d+\.\d+", env["POD_IP"]) and env["NODE"] == done["spec"]["nodeName"]
    assert env["GREETING"] == "hello refs" and env["CUDA_VISIBLE_DEVICES"] == ""
    kubeconfig = json.loads(Path(env["KUBECONFIG"]).read_text())  # the cluster's, with the pod's own token
    assert kubeconfig["clusters"][0]["cluster"]["server"] == cluster.url and "KUBERNETES_SERVICE_HOST" not in env


def test_config_map_and_secret_refs_and_the_kubernetes_client_in_a_pod(cluster):
    cluster.core.create_namespaced_config_map(NS, {"metadata": {"name": "refs-cm"}, "data": {"mode": "fast"}})
    cluster.core.create_namespaced_secret(NS, {"metadata": {"name": "refs-secret"}, "data": {"token": "czNjcjN0"}})
    code = ("import kubernetes, os; kubernetes.config.load_kube_config(); "
            "me = kubernetes.client.CoreV1Api().read_namespaced_pod(os.environ['ME'], 'default'); "
            "print(os.environ['MODE'], os.environ['TOKEN'], 'MISSING' in os.environ, me.status.pod_ip)")
    cluster.core.create_namespaced_pod(NS, pod("refs-client", code, env={
        "ME": {"fieldRef": {"fieldPath": "metadata.name"}},
        "MODE": {"configMapKeyRef": {"name": "refs-cm", "key": "mode"}},
        "TOKEN": {"secretKeyRef": {"name": "refs-secret", "key": "token"}},
        "MISSING": {"configMapKeyRef": {"name": "no-such-cm", "key": "k", "optional": True}}}))
    done = phase(cluster, "refs-client", "Succeeded", timeout=30)
    assert cluster.logs(NS, "refs-client").split() == ["fast", "s3cr3t", "False", done["status"]["podIP"]]

    cluster.core.create_namespaced_pod(NS, pod("refs-missing", env={
        "MODE": {"configMapKeyRef": {"name": "refs-cm-later", "key": "mode"}}}))
    waiting = cluster.wait_for(lambda: cluster.get("pods", NS, "refs-missing")["status"]["containerStatuses"][0][
        "state"]["waiting"]["reason"] == "CreateContainerConfigError", 5, "CreateContainerConfigError")
    assert waiting
    cluster.core.create_namespaced_config_map(NS, {"metadata": {"name": "refs-cm-later"}, "data": {"mode": "x"}})
    phase(cluster, "refs-missing", "Succeeded")


def test_restart_policy_on_failure_restarts_the_container(cluster):
    cluster.kubelet.restart_backoff = 0.1
    code = ("import os, sys; marker = '/scratch/tried'; first = not os.path.exists(marker); "
            "open(marker, 'w').close(); print('first' if first else 'second'); sys.exit(1 if first else 0)")
    cluster.core.create_namespaced_pod(NS, pod("restarts", code, restart="OnFailure",
                                               mounts=[{"name": "scratch", "mountPath": "/scratch"}],
                                               volumes=[{"name": "scratch", "emptyDir": {}}]))
    done = phase(cluster, "restarts", "Succeeded")
    status = done["status"]["containerStatuses"][0]
    assert status["restartCount"] == 1 and status["lastState"]["terminated"]["exitCode"] == 1
    assert cluster.logs(NS, "restarts") == "second\n"
    assert cluster.kubelet.log_path(NS, "restarts", previous=True).read_text() == "first\n"
    assert cluster.core.read_namespaced_pod_log("restarts", NS, previous=True) == "first\n"

    cluster.core.create_namespaced_pod(NS, pod("crashes", "import time; print('up', flush=True); time.sleep(60)"))
    cluster.wait_for(lambda: cluster.logs(NS, "crashes"), 10, "the process to start")
    cluster.kubelet.kill(NS, "crashes")  # as an OOM kill or a crash would
    crashed = phase(cluster, "crashes", "Failed")["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (crashed["exitCode"], crashed["reason"], crashed["message"]) == (137, "Error", "up\n")


def test_pod_dns_names_and_a_shared_master_port(cluster):
    show = ("import json, os, time; "
            "print(json.dumps({k: os.environ[k] for k in ('MASTER_ADDR', 'MASTER_PORT')}), flush=True)")
    env = {"MASTER_ADDR": "a.s", "MASTER_PORT": "29500"}
    cluster.core.create_namespaced_pod(NS, pod("a", show + "; time.sleep(30)", env=env, hostname="a", subdomain="s"))
    cluster.wait_for(lambda: cluster.logs(NS, "a"), 10, "a to print")
    cluster.core.create_namespaced_pod(NS, pod("b", show, env={**env, "MASTER_ADDR": "a.s.default.svc.cluster.local"}))
    phase(cluster, "b", "Succeeded")
    a_ip = cluster.get("pods", NS, "a")["status"]["podIP"]
    seen_by_a, seen_by_b = json.loads(cluster.logs(NS, "a")), json.loads(cluster.logs(NS, "b"))
    assert seen_by_a["MASTER_ADDR"] == seen_by_b["MASTER_ADDR"] == a_ip
    assert seen_by_a["MASTER_PORT"] == seen_by_b["MASTER_PORT"]
    cluster.core.delete_namespaced_pod("a", NS, grace_period_seconds=1)


def test_two_gloo_ranks_train_through_the_kubelet(cluster):
    """What the operator's e2e test relies on: real ranks (`tandem worker train`) in pods, the spec from a ConfigMap
    volume, checkpoints on a claim, rank 0's DNS name as MASTER_ADDR, rank 0 reporting through the API."""
    spec = job("gloo")
    spec["spec"]["trainer"] = {**spec["spec"]["trainer"], "maxSteps": 8, "epochs": None}
    spec["spec"]["checkpoint"] = {"directory": "runs/gloo", "everySteps": 4}
    stored = cluster.custom.create_namespaced_custom_object(GROUP, VERSION, NS, PTJ, spec)
    cluster.apply({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "gloo-workers"},
                   "spec": {"clusterIP": "None", "selector": {"tandem.dev/job": "gloo"}}})
    cluster.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "gloo-spec"},
                   "data": {"job.json": json.dumps(stored)}})
    cluster.apply({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "gloo-ckpt"},
                   "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}})
    for rank in range(2):
        rank_pod = pod(f"gloo-worker-{rank}", image="python:3.11", hostname=f"gloo-worker-{rank}",
                       subdomain="gloo-workers", env={
                           "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "gloo-worker-0.gloo-workers",
                           "MASTER_PORT": "29500", "TANDEM_JOB": "gloo", "TANDEM_NAMESPACE": NS,
                           "TANDEM_SPEC": "/etc/tandem/job.json", "TANDEM_RESUME_FROM": "",
                           "TANDEM_CHECKPOINT_DIR": "/var/lib/tandem/checkpoints/runs/gloo"},
                       mounts=[{"name": "spec", "mountPath": "/etc/tandem", "readOnly": True},
                               {"name": "ckpt", "mountPath": "/var/lib/tandem/checkpoints"}],
                       volumes=[{"name": "spec", "configMap": {"name": "gloo-spec"}},
                                {"name": "ckpt", "persistentVolumeClaim": {"claimName": "gloo-ckpt"}}])
        rank_pod["spec"]["containers"][0]["command"] = ["tandem", "worker", "train"]
        rank_pod["metadata"]["labels"] = {"tandem.dev/job": "gloo"}
        cluster.core.create_namespaced_pod(NS, rank_pod)
    for rank in range(2):
        phase(cluster, f"gloo-worker-{rank}", "Succeeded", timeout=60)
    status = cluster.get("ptj", NS, "gloo")["status"]
    assert status["progress"]["step"] == 8 and "accuracy" in status["metrics"]
    assert status["checkpoint"]["latest"] == "/var/lib/tandem/checkpoints/runs/gloo/step-00000008.pt"
    assert (cluster.kubelet.claim_dir(NS, "gloo-ckpt") / "runs/gloo/step-00000008.pt").is_file()


def test_unschedulable_and_image_pull_failures_stay_pending_with_reasons(cluster):
    gpu = pod("wants-gpu")
    gpu["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "1"}}
    cluster.core.create_namespaced_pod(NS, gpu)
    condition = cluster.wait_for(lambda: next((c for c in cluster.get("pods", NS, "wants-gpu")["status"]["conditions"]
                                               if c["type"] == "PodScheduled"), None), 5, "the scheduler's verdict")
    assert (condition["status"], condition["reason"]) == ("False", "Unschedulable")
    assert condition["message"] == "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."

    cluster.core.create_namespaced_pod(NS, pod("bad-image", image="registry.example.com/nope:1"))

    def waiting():
        return cluster.get("pods", NS, "bad-image")["status"]["containerStatuses"][0]["state"]["waiting"]

    assert cluster.wait_for(lambda: waiting()["reason"] == "ErrImagePull" and waiting(), 5, "ErrImagePull")
    backoff = cluster.wait_for(lambda: waiting()["reason"] == "ImagePullBackOff" and waiting(), 5, "ImagePullBackOff")
    assert "registry.example.com/nope:1" in backoff["message"]
    for name in ("wants-gpu", "bad-image"):
        assert cluster.get("pods", NS, name)["status"]["phase"] == "Pending"
        cluster.core.delete_namespaced_pod(name, NS)
        cluster.wait_for(lambda name=name: cluster.get("pods", NS, name) is None, 5, f"{name} to go")


def test_gpus_are_whole_devices_assigned_to_pods_and_freed_when_they_end(tmp_path):
    with Cluster(tmp_path, crds=None, capacity={"nvidia.com/gpu": 2}) as gpus:
        for name in ("gpu-a", "gpu-b", "gpu-c"):
            spec = pod(name, "import os, time; print(os.environ['CUDA_VISIBLE_DEVICES'], flush=True); time.sleep(30)")
            spec["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "1"}}
            gpus.core.create_namespaced_pod(NS, spec)
        gpus.wait_for(lambda: gpus.logs(NS, "gpu-a") and gpus.logs(NS, "gpu-b"), 10, "two pods on two GPUs")
        assert sorted([gpus.logs(NS, "gpu-a"), gpus.logs(NS, "gpu-b")]) == ["0\n", "1\n"]
        third = gpus.wait_for(lambda: gpus.get("pods", NS, "gpu-c")["status"]["conditions"][0], 5, "a verdict")
        assert third["message"] == "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."
        freed = gpus.logs(NS, "gpu-a")
        gpus.core.delete_namespaced_pod("gpu-a", NS, grace_period_seconds=0)
        gpus.wait_for(lambda: gpus.logs(NS, "gpu-c"), 10, "the third pod to get the freed GPU")
        assert gpus.logs(NS, "gpu-c") == freed


def test_shutdown_leaves_no_thread_and_no_process(tmp_path):
    threads = set(threading.enumerate())
    with Cluster(tmp_path, crds=None) as short:
        short.core.create_namespaced_pod(NS, pod("sleeper", "import time; print('up', flush=True); time.sleep(60)"))
        short.wait_for(lambda: short.logs(NS, "sleeper"), 10, "the pod to start")
        pid = short.kubelet.pid(NS, "sleeper")
    assert not _alive(pid)
    assert set(threading.enumerate()) == threads


# -- a real kopf operator on the emulator -------------------------------------------------------------------------
OPERATOR = '''
import kopf, kubernetes

@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_):
    # a CRD's structural schema prunes kopf's status.<handler> results and status.kopf, on a cluster as here
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="test.tandem.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="test.tandem.dev")

@kopf.on.create("tandem.dev", "v1alpha1", "paralleltrainingjobs")
def created(body, name, namespace, patch, logger, **_):
    child = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{name}-spec"}, "data": {"job": name}}
    kopf.adopt(child, owner=body)
    kubernetes.config.load_kube_config()
    kubernetes.client.CoreV1Api().create_namespaced_config_map(namespace, child)
    patch.status["phase"] = "Running"
    patch.status["message"] = "seen by the test operator"
    kopf.info(body, reason="Created", message="a child ConfigMap")  # an Event named by generateName

@kopf.on.delete("tandem.dev", "v1alpha1", "paralleltrainingjobs")
def deleted(name, logger, **_):
    logger.info(f"deleting {name}")
'''


def test_a_kopf_operator_runs_end_to_end(cluster, tmp_path):
    (tmp_path / "operator.py").write_text(OPERATOR)
    try:
        _run_the_operator(cluster, tmp_path)
    finally:
        print(cluster.process_log("kopf"))  # shown when the test fails


def _run_the_operator(cluster, tmp_path):
    # no --standalone: the emulator serves no kopf.dev peering resources, and kopf must run without them
    cluster.core.create_namespace({"metadata": {"name": "ops"}})  # the operator's namespace: other tests' jobs aside
    cluster.spawn([sys.executable, "-m", "kopf", "run", "--namespace", "ops", "--verbose",
                   str(tmp_path / "operator.py")], name="kopf")
    cluster.custom.create_namespaced_custom_object(GROUP, VERSION, "ops", PTJ, job("kopf-job"))
    running = cluster.wait_for(lambda: (j := cluster.get("ptj", "ops", "kopf-job"))["status"]["phase"] == "Running"
                               and j, 20, "the operator to set the phase")
    assert running["status"]["message"] == "seen by the test operator"
    assert running["metadata"]["finalizers"] == ["kopf.zalando.org/KopfFinalizerMarker"]
    child = cluster.get("configmaps", "ops", "kopf-job-spec")
    assert child["metadata"]["ownerReferences"][0]["uid"] == running["metadata"]["uid"]
    event = cluster.wait_for(lambda: next((e for e in cluster.list("events", "ops")
                                           if e["involvedObject"]["name"] == "kopf-job"), None), 5, "kopf's event")
    assert event["reason"] == "Created" and event["metadata"]["name"].startswith("kopf-event-")

    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, "ops", PTJ, "kopf-job")
    cluster.wait_for(lambda: cluster.get("ptj", "ops", "kopf-job") is None, 10, "kopf to remove its finalizer")
    cluster.wait_for(lambda: cluster.get("configmaps", "ops", "kopf-job-spec") is None, 5, "the child to be collected")
    log = cluster.process_log("kopf")
    assert "JSON-patching the resource with: [{'op': 'test'" in log and "Removing the finalizer" in log
    assert "deleting kopf-job" in log
    problems = [line for line in log.splitlines() if re.search(r"\[(ERROR|WARNING)|Traceback", line)]
    assert not problems, "\n".join(problems)
    assert cluster.stop_process("kopf") == 0
