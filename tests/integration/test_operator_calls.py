"""What the operator sends for a decision, as the API server receives it: `handlers._apply` and `Cluster.put` through
the real `Cluster` (operator/cluster.py) and the `kubernetes` client against the emulated API server (no kubelet:
the rank pods are bound to a node by hand and stay as the test leaves them). Every request the server serves is
recorded in order. tests/unit/test_apply.py shows the same decisions call by call against a scripted cluster."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from devcluster import Cluster
from tandem.api import GROUP, VERSION
from tandem.manifest import parse
from tandem.operator import daemon, handlers
from tandem.operator.cluster import Cluster as OperatorCluster
from tandem.operator.observed import read_resource
from tandem.operator.training import Settings, reconcile
from tandem.operator.training_objects import JOB_PLURAL, TERMINATION_GRACE_SECONDS, worker_pod
from tandem.operator.training_plan import ETA_REMOVED

NS = "default"
SETTINGS = Settings(worker_image="registry.example/tandem-worker:1", restart_backoff_seconds=10)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with Cluster(tmp_path_factory.mktemp("calls"), kubelet=False, deployments=False) as running:
        yield running


@pytest.fixture
def served(cluster):
    """The requests the emulator serves from now on, in order, as (method, plural, name, answer): a hook whose
    predicate records every request and never accepts one, so it never fires and stays for the whole test."""
    log: list[tuple[str, str | None, str | None, Any]] = []
    hook = cluster.after(lambda request: log.append((request.method, request.plural, request.name,
                                                     request.result)) and False, lambda request: None)
    yield log
    hook.cancel()


@pytest.fixture(autouse=True)
def no_events(monkeypatch):
    """`daemon.publish` posts the decision's Events through kopf, which needs a running operator: dropped here."""
    monkeypatch.setattr(daemon.kopf, "event", lambda body, **event: None)


def new_job(cluster: Cluster, name: str, **spec: Any) -> dict[str, Any]:
    """A ParallelTrainingJob created in the API (its children's ownerReferences name its real uid)."""
    return cluster.custom.create_namespaced_custom_object(GROUP, VERSION, NS, JOB_PLURAL, {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "ParallelTrainingJob", "metadata": {"name": name},
        "spec": {"workers": 2, "trainer": {"model": "tandem.examples.digits:mlp",
                                           "data": "tandem.examples.digits:train_data"}, **spec}})


def carry_out(cluster: Cluster, body: dict[str, Any], pods: list[dict[str, Any]], now: datetime) -> None:
    plan = reconcile(read_resource(body), pods, None, now, SETTINGS)
    state = daemon.Reconciliation(JOB_PLURAL, NS, body["metadata"]["name"])
    asyncio.run(handlers._apply(plan, body, pods, OperatorCluster(cluster.api), state, handlers.QueueReads()))


def running_group(cluster: Cluster, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The job's two rank pods, bound to a node (so that a deletion waits for their grace period, as a kubelet's
    pods do)."""
    pods = []
    for index in range(2):
        manifest = worker_pod(body, parse(body), index, group=0, resume_from=None, default_image="w:1")
        manifest["spec"]["nodeName"] = "node-1"
        pods.append(cluster.api.sanitize_for_serialization(cluster.core.create_namespaced_pod(NS, manifest)))
    return pods


def test_a_new_groups_pods_reach_the_api_server_after_every_object_they_need(cluster, served):
    body = new_job(cluster, "fresh")
    served.clear()
    carry_out(cluster, body, [], datetime.now(UTC))
    kinds = [plural for method, plural, *_ in served if method == "POST"]
    assert sorted(kinds) == sorted(["services", "configmaps", "serviceaccounts", "roles", "rolebindings", "pods",
                                    "pods"]), kinds
    assert kinds.index("pods") == len(kinds) - 2, f"a pod created before what it mounts and runs as: {kinds}"
    status = next(i for i, (method, plural, *_) in enumerate(served) if method == "PATCH" and plural == JOB_PLURAL)
    assert status < next(i for i, (method, *_) in enumerate(served) if method == "POST")


@pytest.mark.parametrize(("name", "status", "spec", "grace"), [
    ("suspended", {"phase": "Running"}, {"suspend": True}, TERMINATION_GRACE_SECONDS),
    ("hung", {"phase": "Running", "startTime": "2026-01-01T00:00:00Z", "progress": {
        "lastHeartbeat": "2026-01-01T00:00:00Z"}}, {"heartbeatTimeoutSeconds": 60}, 0),
], ids=["a suspension: the pods' own grace period", "a hung group: at once"])
def test_rank_pods_are_deleted_with_the_grace_period_the_decision_calls_for(cluster, served, name, status, spec,
                                                                           grace):
    """A suspension's ranks get SIGTERM and TERMINATION_GRACE_SECONDS to write their checkpoint: the pods stay
    terminating with that grace period; a group whose rank 0 is silent cannot checkpoint and is removed at once."""
    body = new_job(cluster, name, **spec)
    pods = running_group(cluster, body)
    served.clear()
    now = datetime.now(UTC)
    if "lastHeartbeat" in status.get("progress", {}):
        status["conditions"] = [{"type": "Running", "status": "True", "reason": "Running", "message": "",
                                 "lastTransitionTime": (now - timedelta(seconds=600)).strftime("%Y-%m-%dT%H:%M:%SZ")}]
    carry_out(cluster, {**body, "status": status}, pods, now)
    deleted = [(plural, name) for method, plural, name, _ in served if method == "DELETE"]
    assert deleted and all(plural == "pods" for plural, _ in deleted)
    assert sorted(name for _, name in deleted) == sorted(p["metadata"]["name"] for p in pods)
    for pod in pods:
        left = cluster.get("pods", NS, pod["metadata"]["name"])
        if grace == 0:
            assert left is None
        else:
            assert left["metadata"]["deletionGracePeriodSeconds"] == grace


def test_a_replace_of_an_object_deleted_meanwhile_raises_the_404_to_the_loop(cluster, served):
    """`Cluster.put` answered 404 on a replace: not a refusal (no condition), not a transient failure (no backoff),
    not a create that found the object (None): the ApiException goes to the daemon's loop, which decides again on a
    newer view (tests/unit/test_apply.py: the child is marked gone and created anew)."""
    manifest = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "vanished", "namespace": NS},
                "spec": {"ports": [{"port": 8000}], "selector": {"app": "vanished"}}}
    seen = cluster.api.sanitize_for_serialization(cluster.core.create_namespaced_service(NS, manifest))
    cluster.request("DELETE", f"/api/v1/namespaces/{NS}/services/vanished")
    with pytest.raises(ApiException) as raised:
        asyncio.run(OperatorCluster(cluster.api).put(manifest, seen))
    assert raised.value.status == 404  # an ApiException: neither Refused, Stale nor Unavailable (ApiFailures)
    assert [method for method, *_ in served] == ["POST", "DELETE"], "a 404 is no served request: none other came"


def test_a_status_key_the_operator_drops_is_deleted_and_rank_0s_part_of_a_shared_field_kept(cluster, served):
    """A merge patch keeps what it does not name: `publish` sends a null for each key the operator's new value no
    longer has, at any depth, so the object read back holds what was decided; in the fields rank 0 writes too it
    sends only its own keys: rank 0's `recoveries.regroups` stays, and so does its `progress` when the operator
    removes the ETA from it. A status already written is not sent again (the nulls it holds are not in the
    object)."""
    body = new_job(cluster, "dropped")
    state = daemon.Reconciliation(JOB_PLURAL, NS, "dropped")
    api = OperatorCluster(cluster.api)
    pool = {"name": "digits", "workers": 1, "baseReplicas": 1, "workersPerReplica": 1}
    lent = {"workers": 1, "to": ["digits"], "since": "2026-01-01T00:00:00Z",
            "pools": [{**pool, "unplacedSince": "2026-01-01T00:00:05Z"}],
            "unplaceable": [{"name": "other", "placement": "gpu=a100", "since": "2026-01-01T00:00:00Z"}]}
    asyncio.run(daemon.publish(api, state, body, {"lent": lent, "recoveries": {"restarts": 0}}, []))
    cluster.custom.patch_namespaced_custom_object_status(GROUP, VERSION, NS, JOB_PLURAL, "dropped", {
        "status": {"recoveries": {"regroups": 2}, "progress": {"step": 5, "etaSeconds": 9}}})  # rank 0's part
    body = cluster.get(JOB_PLURAL, NS, "dropped")
    served.clear()
    ended = {"lent": {"workers": 0, "to": [], "since": None, "pools": [pool]},  # unplaceable dropped, since null
             "recoveries": {"restarts": 1}}
    asyncio.run(daemon.publish(api, state, body, {**ended, **ETA_REMOVED}, []))
    assert [(method, plural) for method, plural, *_ in served] == [("PATCH", JOB_PLURAL)]
    status = cluster.get(JOB_PLURAL, NS, "dropped")["status"]
    assert status["lent"] == {"workers": 0, "to": [], "pools": [pool]}
    assert status["recoveries"] == {"restarts": 1, "regroups": 2}
    assert status["progress"]["step"] == 5 and "etaSeconds" not in status["progress"]
    served.clear()  # the same decision again, on the body as the daemon reads it (its last writes laid over)
    asyncio.run(daemon.publish(api, state, state.observed(cluster.get(JOB_PLURAL, NS, "dropped")), ended, []))
    assert served == [], "a status already written is not patched again"
