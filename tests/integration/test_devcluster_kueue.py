"""The emulated Kueue admission (devcluster/kueue.py, kueue_admission.py) on the emulated cluster, with hand-written
Workloads and the tests playing the job integration's part (the owner clearing a reservation, finishing a Workload);
no operator. Also: the CRDs of Kueue and the gang schedulers (devcluster/crds/, written after their APIs) install,
and the emulator validates objects against them (422 for what their OpenAPI schemas or CEL rules refuse),
cluster-scoped kinds included. Then the pure functions
(quantities, requests, flavor assignment, victims, one pass) table by table."""

from __future__ import annotations

import copy
import json
import time
import urllib.request

import pytest

from devcluster import Cluster, Faults
from devcluster.kueue import API, COSCHEDULING_CRDS, VOLCANO_CRDS
from devcluster.kueue_admission import World, assign_flavors, choose_victims, may_preempt, plan
from devcluster.kueue_objects import Queue, amount, pod_requests, quantity, queue_key
from devcluster.writes import timestamp

NS = "default"
MERGE = "application/merge-patch+json"
KUEUE = "kueue.x-k8s.io/v1beta2"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with Cluster(tmp_path_factory.mktemp("kueue"), crds=[COSCHEDULING_CRDS, VOLCANO_CRDS], kueue=True,
                 kubelet=False, deployments=False, namespaces=("default", "other")) as running:
        yield running
    assert not running.emulator.bugs, running.emulator.bugs


# -- helpers: the objects, and the owner's part -------------------------------------------------------------------
def flavor(cluster: Cluster, name: str, **labels: str) -> None:
    """A ResourceFlavor (cluster-scoped: the tests share it; created once)."""
    spec = {"nodeLabels": labels} if labels else {}
    code, body = cluster.request("POST", f"{API}/resourceflavors", {
        "apiVersion": KUEUE, "kind": "ResourceFlavor", "metadata": {"name": name}, "spec": spec})
    assert code == 201 or (code == 409 and cluster.get("resourceflavors", None, name)["spec"] == spec), body


def queue(cluster: Cluster, name: str, cpu: str = "2", *, flavors: tuple[tuple[str, str], ...] | None = None,
          policy: str | None = None, strategy: str | None = None, selector: dict | str | None = None,
          local_queue: bool = True, cluster_queue: bool = True, namespace: str = NS) -> None:
    """A ClusterQueue `name` covering cpu (one resource group: `flavors` as (flavor, quota), else `default` with
    `cpu`; `selector` its namespaceSelector, `{}` by default, "null" for none) and a LocalQueue `name` in
    `namespace` pointing to it."""
    if cluster_queue:
        spec: dict = {"namespaceSelector": {} if selector is None else selector, "resourceGroups": [{
            "coveredResources": ["cpu"],
            "flavors": [{"name": f, "resources": [{"name": "cpu", "nominalQuota": q}]}
                        for f, q in (flavors or (("default", cpu),))]}]}
        if policy:
            spec["preemption"] = {"withinClusterQueue": policy}
        if strategy:
            spec["queueingStrategy"] = strategy
        if selector == "null":
            del spec["namespaceSelector"]
        cluster.apply({"apiVersion": KUEUE, "kind": "ClusterQueue", "metadata": {"name": name}, "spec": spec})
    if local_queue:
        cluster.apply({"apiVersion": KUEUE, "kind": "LocalQueue", "metadata": {"name": name, "namespace": namespace},
                       "spec": {"clusterQueue": name}})


def workload(cluster: Cluster, name: str, queue_name: str, cpu: str = "1", *, count: int = 1,
             priority: int | None = None, memory: str | None = None, node_selector: dict | None = None,
             labels: dict | None = None, namespace: str = NS) -> dict:
    requests = {"cpu": cpu, **({"memory": memory} if memory else {})}
    pod = {"containers": [{"name": "rank", "image": "tandem", "resources": {"requests": requests}}]}
    if node_selector:
        pod["nodeSelector"] = node_selector
    spec: dict = {"queueName": queue_name, "podSets": [{"name": "main", "count": count, "template": {"spec": pod}}]}
    if priority is not None:
        spec["priority"] = priority
    meta = {"name": name, "namespace": namespace, **({"labels": labels} if labels else {})}
    return cluster.apply({"apiVersion": KUEUE, "kind": "Workload", "metadata": meta, "spec": spec})[0]


def get(cluster: Cluster, name: str, namespace: str = NS) -> dict:
    return cluster.get("workloads", namespace, name)


def condition(cluster: Cluster, name: str, type_: str, namespace: str = NS) -> dict | None:
    return next((c for c in (get(cluster, name, namespace).get("status") or {}).get("conditions") or []
                 if c["type"] == type_), None)


def admitted(cluster: Cluster, name: str, namespace: str = NS) -> bool:
    return (condition(cluster, name, "Admitted", namespace) or {}).get("status") == "True" and \
        (condition(cluster, name, "QuotaReserved", namespace) or {}).get("status") == "True"


def pending(cluster: Cluster, name: str, namespace: str = NS) -> dict | None:
    """The QuotaReserved=False condition, once written."""
    found = condition(cluster, name, "QuotaReserved", namespace)
    return found if found and found["status"] == "False" else None


def write_conditions(cluster: Cluster, name: str, *changes: dict, admission: bool = True) -> dict:
    """The owner's status write: conditions set (by type) and, with `admission=False`, status.admission removed;
    a merge patch with the resourceVersion read, as a controller would."""
    current = get(cluster, name)
    status = copy.deepcopy(current.get("status") or {})
    conditions = [c for c in status.get("conditions") or [] if c["type"] not in {ch["type"] for ch in changes}]
    for change in changes:
        old = next((c for c in status.get("conditions") or [] if c["type"] == change["type"]), None)
        since = old["lastTransitionTime"] if old and old["status"] == change["status"] else timestamp()
        conditions.append({"lastTransitionTime": since, "message": "", **change})
    patch = {"metadata": {"resourceVersion": current["metadata"]["resourceVersion"]},
             "status": {"conditions": conditions, **({} if admission else {"admission": None})}}
    code, body = cluster.request("PATCH", f"{API}/namespaces/{NS}/workloads/{name}/status", patch, MERGE)
    assert code == 200, body
    return body


def clear_reservation(cluster: Cluster, name: str) -> dict:
    """What the job integration does once its job stopped after an eviction (jobframework reconciler, step 6):
    Requeued (True after a preemption), QuotaReserved=False (Pending, the eviction's message), Admitted=False, and
    status.admission removed (UnsetQuotaReservationWithCondition)."""
    evicted = condition(cluster, name, "Evicted")
    return write_conditions(
        cluster, name,
        {"type": "Requeued", "status": "True" if evicted["reason"] == "Preempted" else "False",
         "reason": evicted["reason"], "message": evicted["message"]},
        {"type": "QuotaReserved", "status": "False", "reason": "Pending", "message": evicted["message"]},
        {"type": "Admitted", "status": "False", "reason": "NoReservation",
         "message": "The workload has no reservation"}, admission=False)


def events_of(cluster: Cluster, *names: str) -> list[tuple[str, str]]:
    wanted = {f"{NS}/{n}" for n in names}
    return [(event, key.split("/")[1]) for _, event, key in list(cluster.kueue.history) if key in wanted]


def admission_recorded(cluster: Cluster, name: str) -> bool:
    """Admitted as the API holds it and in the controller's history, which it writes once the API has answered its
    write: a moment after another reader can see the admission."""
    return admitted(cluster, name) and ("admitted", name) in events_of(cluster, name)


def settled(cluster: Cluster, *names: str, quiet: float = 0.4) -> None:
    """No more writes to these Workloads for `quiet` seconds: no write loop."""
    versions = None
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        now = [get(cluster, n)["metadata"]["resourceVersion"] for n in names]
        if now == versions:
            return
        versions = now
        time.sleep(quiet)
    raise AssertionError(f"{names} kept changing")


# -- Kueue's and the gang schedulers' CRDs in the emulator -------------------------------------------------------
def test_cluster_scoped_kinds_are_served_at_their_paths(cluster):
    """ClusterQueue, ResourceFlavor and WorkloadPriorityClass (scope: Cluster) answer create/get/list/watch at
    /apis/kueue.x-k8s.io/v1beta2/<plural>, with the CRD's defaults; a namespaced path for them is 404."""
    flavor(cluster, "scoped")
    queue(cluster, "scoped", local_queue=False)
    code, body = cluster.request("POST", f"{API}/workloadpriorityclasses", {
        "apiVersion": KUEUE, "kind": "WorkloadPriorityClass", "metadata": {"name": "urgent"}, "value": 1000})
    assert code == 201, body
    code, cq = cluster.request("GET", f"{API}/clusterqueues/scoped")
    assert code == 200 and "namespace" not in cq["metadata"]
    assert cq["spec"]["queueingStrategy"] == "BestEffortFIFO"  # defaulted by the schema
    assert cq["spec"]["preemption"]["withinClusterQueue"] == "Never"
    code, listing = cluster.request("GET", f"{API}/clusterqueues")
    assert code == 200 and "scoped" in [o["metadata"]["name"] for o in listing["items"]]
    assert cluster.request("GET", f"{API}/resourceflavors/scoped")[0] == 200
    assert cluster.request("GET", f"{API}/workloadpriorityclasses/urgent")[1]["value"] == 1000
    assert cluster.request("GET", f"{API}/namespaces/{NS}/clusterqueues/scoped")[0] == 404
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
            f"{cluster.url}{API}/clusterqueues?watch=true&timeoutSeconds=1", timeout=10) as stream:
        events = [json.loads(line) for line in stream if line.strip()]
    assert ("ADDED", "scoped") in [(e["type"], e["object"]["metadata"]["name"]) for e in events]


def test_objects_kueues_schemas_refuse_answer_422(cluster):
    """The Workload's and ClusterQueue's schemas (OpenAPI and CEL rules, Kueue's) refuse what Kueue's refuse."""
    pod = {"spec": {"containers": [{"name": "c", "image": "x"}]}}
    for spec, expected in (
            ({"podSets": [{"name": "main", "count": 1}]}, "spec.podSets.0: 'template' is a required property"),
            ({"podSets": [{"name": "main", "count": 1, "minCount": 2, "template": pod}]},
             "minCount should be positive and less or equal to count"),
            ({"podSets": [{"name": "Main", "count": 1, "template": pod}]}, "spec.podSets.0.name"),
            ({"priorityClassRef": {"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass", "name": "urgent"},
              "podSets": [{"count": 1, "template": pod}]}, "priority should not be nil when priorityClassRef is set"),
    ):
        code, body = cluster.request("POST", f"{API}/namespaces/{NS}/workloads", {
            "apiVersion": KUEUE, "kind": "Workload", "metadata": {"name": "refused"}, "spec": spec})
        assert code == 422 and expected in body["message"], body
    code, body = cluster.request("POST", f"{API}/clusterqueues", {
        "apiVersion": KUEUE, "kind": "ClusterQueue", "metadata": {"name": "refused"}, "spec": {"resourceGroups": [{
            "coveredResources": ["cpu", "memory"],
            "flavors": [{"name": "default", "resources": [{"name": "cpu", "nominalQuota": "1"}]}]}]}})
    assert code == 422 and "flavors must have the same number of resources as the coveredResources" in body["message"]
    assert cluster.get("workloads", NS, "refused") is None


def test_kueues_transition_rules_hold_on_updates(cluster):
    """The CRDs' rules on `oldSelf` (evaluated by cel-python on updates): a LocalQueue's clusterQueue is immutable,
    a Workload's queueName and pod sets too while it holds a quota reservation (the pod sets: Kueue's webhook's
    check, a rule of devcluster's CRD)."""
    flavor(cluster, "default")
    queue(cluster, "rules")
    workload(cluster, "rules-one", "rules")
    cluster.wait_for(lambda: admitted(cluster, "rules-one"))
    code, body = cluster.request("PATCH", f"{API}/namespaces/{NS}/localqueues/rules",
                                 {"spec": {"clusterQueue": "other"}}, MERGE)
    assert code == 422 and 'spec.clusterQueue: Invalid value: "string": field is immutable' in body["message"]
    code, body = cluster.request("PATCH", f"{API}/namespaces/{NS}/workloads/rules-one",
                                 {"spec": {"queueName": "other"}}, MERGE)
    assert code == 422 and "queueName is immutable while workload quota reserved" in body["message"]
    pod_sets = get(cluster, "rules-one")["spec"]["podSets"]
    code, body = cluster.request("PATCH", f"{API}/namespaces/{NS}/workloads/rules-one",
                                 {"spec": {"podSets": [{**pod_sets[0], "count": 2}]}}, MERGE)
    assert code == 422 and 'spec.podSets: Invalid value: "object": field is immutable' in body["message"], body
    code, body = cluster.request("PATCH", f"{API}/namespaces/{NS}/workloads/rules-one/status", {"status": {
        "admission": {"clusterQueue": "rules", "podSetAssignments": []}}}, MERGE)
    assert code == 422 and "podSetAssignments must have the same number of podSets as the spec" in body["message"]


@pytest.mark.parametrize(("path", "api_version"), [
    ("/apis/scheduling.x-k8s.io/v1alpha1", "scheduling.x-k8s.io/v1alpha1"),
    ("/apis/scheduling.volcano.sh/v1beta1", "scheduling.volcano.sh/v1beta1"),
], ids=["scheduler-plugins", "volcano"])
def test_podgroups_are_validated_against_their_schedulers_schemas(cluster, path, api_version):
    group = {"apiVersion": api_version, "kind": "PodGroup", "metadata": {"name": "gang"},
             "spec": {"minMember": 4, "minResources": {"cpu": "4"}}}
    code, body = cluster.request("POST", f"{path}/namespaces/{NS}/podgroups", group)
    assert code == 201 and body["spec"]["minMember"] == 4, body
    code, body = cluster.request("POST", f"{path}/namespaces/{NS}/podgroups",
                                 {**group, "metadata": {"name": "wrong"}, "spec": {"minMember": "x"}})
    assert code == 422 and "spec.minMember: 'x' is not of type 'integer'" in body["message"], body
    code, body = cluster.request("POST", f"{path}/namespaces/{NS}/podgroups",
                                 {**group, "metadata": {"name": "negative"}, "spec": {"minMember": -1}})
    assert code == 422 and "spec.minMember" in body["message"], body


# -- admission ------------------------------------------------------------------------------------------------------
def test_admission_in_priority_then_creation_order(cluster):
    """Queued while their ClusterQueue is missing (Inadmissible), then admitted by priority, then age, into cpu 2."""
    queue(cluster, "order", cluster_queue=False)
    workload(cluster, "order-old", "order")
    workload(cluster, "order-high", "order", priority=5)
    workload(cluster, "order-new", "order")
    for name in ("order-old", "order-high", "order-new"):
        found = cluster.wait_for(lambda n=name: pending(cluster, n), what=f"{name} pending")
        assert (found["reason"], found["message"]) == ("Inadmissible", "ClusterQueue order is terminating or missing")
    flavor(cluster, "default")
    queue(cluster, "order", local_queue=False)
    cluster.wait_for(lambda: admitted(cluster, "order-high") and admitted(cluster, "order-old"), what="two admitted")
    cluster.wait_for(lambda: "1 more needed" in (pending(cluster, "order-new") or {}).get("message", ""))
    assert events_of(cluster, "order-old", "order-high", "order-new") == [
        ("admitted", "order-high"), ("admitted", "order-old")]
    status = get(cluster, "order-high")["status"]
    assert status["admission"] == {"clusterQueue": "order", "podSetAssignments": [
        {"name": "main", "count": 1, "flavors": {"cpu": "default"}, "resourceUsage": {"cpu": "1"}}]}
    assert {(c["type"], c["status"], c["reason"], c["message"]) for c in status["conditions"]} == {
        ("QuotaReserved", "True", "QuotaReserved", "Quota reserved in ClusterQueue order"),
        ("Admitted", "True", "Admitted", "The workload is admitted")}
    waiting = pending(cluster, "order-new")
    assert (waiting["reason"], waiting["message"]) == (
        "Pending", "couldn't assign flavors to pod set main: insufficient unused quota for cpu in flavor default, "
                   "1 more needed")
    assert get(cluster, "order-new")["status"]["resourceRequests"] == [{"name": "main", "resources": {"cpu": "1"}}]
    settled(cluster, "order-old", "order-high", "order-new")


def test_a_workload_that_does_not_fit_stays_pending_without_blocking_smaller_ones(cluster):
    """BestEffortFIFO: a head that does not fit does not hold back a smaller one behind it; the reasons of the
    others that stay pending are Kueue's."""
    flavor(cluster, "default")
    queue(cluster, "fit", cpu="2")
    workload(cluster, "fit-first", "fit", cpu="1500m")
    cluster.wait_for(lambda: admitted(cluster, "fit-first"))
    workload(cluster, "fit-big", "fit", cpu="1", count=2)
    workload(cluster, "fit-huge", "fit", cpu="3")
    workload(cluster, "fit-memory", "fit", cpu="100m", memory="1Gi")
    workload(cluster, "fit-nowhere", "missing-queue")
    workload(cluster, "fit-small", "fit", cpu="500m")
    cluster.wait_for(lambda: admitted(cluster, "fit-small"), what="the small one admitted past the big one")
    expected = {
        "fit-big": ("Pending", "couldn't assign flavors to pod set main: insufficient unused quota for cpu in flavor "
                               "default, 2 more needed"),
        "fit-huge": ("Pending", "couldn't assign flavors to pod set main: insufficient quota for cpu in flavor "
                                "default, previously considered podsets requests (0) + current podset request (3) > "
                                "maximum capacity (2)"),
        "fit-memory": ("Pending", "couldn't assign flavors to pod set main: resource memory unavailable in "
                                  "ClusterQueue"),
        "fit-nowhere": ("Inadmissible", "LocalQueue missing-queue is terminating or missing"),
    }
    for name, reason in expected.items():
        found = cluster.wait_for(lambda n=name, r=reason: (pending(cluster, n) or {}).get("message") == r[1] and
                                 pending(cluster, n), what=f"{name}'s reason")
        assert found["reason"] == reason[0]
        assert condition(cluster, name, "Admitted") is None  # never admitted: no Admitted condition (v0.19)
    settled(cluster, *expected, "fit-first", "fit-small")


def test_strict_fifo_namespace_selectors_and_missing_flavors(cluster):
    """StrictFIFO: a head that does not fit holds back the rest (never looked at: no status). namespaceSelector:
    null admits no namespace, a selector admits the namespaces it matches (kubernetes.io/metadata.name included). A
    ClusterQueue naming a ResourceFlavor that does not exist is inactive."""
    flavor(cluster, "default")
    queue(cluster, "strict", cpu="1", strategy="StrictFIFO")
    workload(cluster, "strict-head", "strict", cpu="2")
    workload(cluster, "strict-next", "strict", cpu="100m")
    cluster.wait_for(lambda: pending(cluster, "strict-head"))
    time.sleep(0.5)
    assert not admitted(cluster, "strict-next") and condition(cluster, "strict-next", "QuotaReserved") is None
    queue(cluster, "closed", selector="null")
    workload(cluster, "closed-one", "closed")
    found = cluster.wait_for(lambda: pending(cluster, "closed-one"))
    assert (found["reason"], found["message"]) == ("Pending", "workload namespace doesn't match ClusterQueue selector")
    selector = {"matchLabels": {"kubernetes.io/metadata.name": "other"}}
    queue(cluster, "team", selector=selector, namespace="other")
    queue(cluster, "team", cluster_queue=False)
    workload(cluster, "team-here", "team")
    workload(cluster, "team-there", "team", namespace="other")
    cluster.wait_for(lambda: admitted(cluster, "team-there", "other"))
    assert cluster.wait_for(lambda: pending(cluster, "team-here"))["message"] == \
        "workload namespace doesn't match ClusterQueue selector"
    queue(cluster, "noflavor", flavors=(("absent", "2"),))
    workload(cluster, "noflavor-one", "noflavor")
    found = cluster.wait_for(lambda: pending(cluster, "noflavor-one"))
    assert (found["reason"], found["message"]) == ("Pending", "ClusterQueue noflavor is inactive")


def test_flavors_in_order_with_their_node_labels(cluster):
    """A resource group's flavors are tried in order; the assigned flavor's nodeLabels are what the owner reads
    (through the ResourceFlavor) to place its pods; a nodeSelector a flavor contradicts skips it."""
    flavor(cluster, "spot", pool="spot")
    flavor(cluster, "ondemand", pool="ondemand")
    queue(cluster, "flavors", flavors=(("spot", "1"), ("ondemand", "4")))
    workload(cluster, "fl-1", "flavors")
    cluster.wait_for(lambda: admitted(cluster, "fl-1"))
    workload(cluster, "fl-2", "flavors")
    workload(cluster, "fl-pinned", "flavors", node_selector={"pool": "ondemand", "zone": "a"})
    workload(cluster, "fl-gpu", "flavors", node_selector={"pool": "gpu"})
    cluster.wait_for(lambda: admitted(cluster, "fl-2") and admitted(cluster, "fl-pinned"))

    def assigned(name: str) -> str:
        return get(cluster, name)["status"]["admission"]["podSetAssignments"][0]["flavors"]["cpu"]

    assert [assigned(n) for n in ("fl-1", "fl-2", "fl-pinned")] == ["spot", "ondemand", "ondemand"]
    labels = [cluster.request("GET", f"{API}/resourceflavors/{assigned(n)}")[1]["spec"]["nodeLabels"]
              for n in ("fl-1", "fl-2")]
    assert labels == [{"pool": "spot"}, {"pool": "ondemand"}]
    found = cluster.wait_for(lambda: pending(cluster, "fl-gpu"))
    assert found["message"] == ("couldn't assign flavors to pod set main: flavor ondemand doesn't match node "
                                "affinity, flavor spot doesn't match node affinity")


# -- preemption, eviction, release ------------------------------------------------------------------------------------
def test_preemption_waits_for_the_owner_to_release_the_victims_quota(cluster):
    flavor(cluster, "default")
    queue(cluster, "preempt", cpu="3", policy="LowerPriority")
    workload(cluster, "pre-low1", "preempt")
    cluster.wait_for(lambda: admitted(cluster, "pre-low1"))
    workload(cluster, "pre-low2", "preempt")
    cluster.wait_for(lambda: admitted(cluster, "pre-low2"))
    high = workload(cluster, "pre-high", "preempt", cpu="2", priority=10, labels={"kueue.x-k8s.io/job-uid": "j-1"})
    cluster.wait_for(lambda: (condition(cluster, "pre-low2", "Evicted") or {}).get("status") == "True")
    message = (f"Preempted to accommodate a workload (UID: {high['metadata']['uid']}, JobUID: j-1) due to "
               f"prioritization in the ClusterQueue; preemptor path: /preempt; preemptee path: /preempt")
    evicted, preempted = condition(cluster, "pre-low2", "Evicted"), condition(cluster, "pre-low2", "Preempted")
    assert (evicted["reason"], evicted["message"]) == ("Preempted", message)
    assert (preempted["status"], preempted["reason"], preempted["message"]) == ("True", "InClusterQueue", message)
    assert get(cluster, "pre-low2")["status"]["schedulingStats"]["evictions"] == [
        {"reason": "Preempted", "underlyingCause": "", "count": 1}]
    assert admitted(cluster, "pre-low2")  # it keeps its quota until its owner clears the reservation
    found = cluster.wait_for(lambda: pending(cluster, "pre-high"))
    assert found["message"] == ("couldn't assign flavors to pod set main: insufficient unused quota for cpu in flavor "
                                "default, 1 more needed. Pending the preemption of 1 workload(s)")
    # while it waits, nothing behind it is admitted into the cpu still free, and no victim is evicted twice
    workload(cluster, "pre-small", "preempt")
    settled(cluster, "pre-low1", "pre-low2", "pre-high", "pre-small")
    assert not admitted(cluster, "pre-small") and not admitted(cluster, "pre-high")
    assert condition(cluster, "pre-low1", "Evicted") is None
    clear_reservation(cluster, "pre-low2")
    cluster.wait_for(lambda: admission_recorded(cluster, "pre-high"), what="the preemptor admitted")
    assert events_of(cluster, "pre-low1", "pre-low2", "pre-high", "pre-small") == [
        ("admitted", "pre-low1"), ("admitted", "pre-low2"), ("preempted", "pre-low2"), ("released", "pre-low2"),
        ("admitted", "pre-high")]
    # the victim is requeued, and pending behind the preemptor; finishing it (the owner) releases the quota
    cluster.wait_for(lambda: "insufficient unused quota" in (pending(cluster, "pre-low2") or {}).get("message", ""))
    write_conditions(cluster, "pre-high", {"type": "Finished", "status": "True", "reason": "Succeeded",
                                           "message": "Job finished successfully"})
    cluster.wait_for(lambda: admitted(cluster, "pre-low2") and admitted(cluster, "pre-small"))
    readmitted = get(cluster, "pre-low2")["status"]
    assert [(c["type"], c["status"], c["reason"], c["message"]) for c in readmitted["conditions"]
            if c["type"] in ("Evicted", "Preempted")] == [
        ("Preempted", "False", "QuotaReserved", f"Previously: {message}"),
        ("Evicted", "False", "QuotaReserved", f"Previously: {message}")]
    finished = get(cluster, "pre-high")["status"]
    assert finished["admission"]["clusterQueue"] == "preempt" and condition(cluster, "pre-high", "Admitted")["status"] \
        == "True"  # Finished releases the quota and changes nothing else


def test_a_deleted_workload_releases_its_quota(cluster):
    flavor(cluster, "default")
    queue(cluster, "delete", cpu="1")
    workload(cluster, "del-a", "delete")
    cluster.wait_for(lambda: admitted(cluster, "del-a"))
    workload(cluster, "del-b", "delete")
    cluster.wait_for(lambda: pending(cluster, "del-b"))
    assert cluster.request("DELETE", f"{API}/namespaces/{NS}/workloads/del-a")[0] == 200
    cluster.wait_for(lambda: admitted(cluster, "del-b"))


def test_deactivation_evicts_and_releases_and_reactivation_requeues(cluster):
    flavor(cluster, "default")
    queue(cluster, "active", cpu="1")
    workload(cluster, "act-a", "active")
    cluster.wait_for(lambda: admitted(cluster, "act-a"))
    workload(cluster, "act-b", "active")
    cluster.wait_for(lambda: pending(cluster, "act-b"))
    code, _ = cluster.request("PATCH", f"{API}/namespaces/{NS}/workloads/act-a", {"spec": {"active": False}}, MERGE)
    assert code == 200
    evicted = cluster.wait_for(lambda: condition(cluster, "act-a", "Evicted"))
    assert (evicted["status"], evicted["reason"], evicted["message"]) == (
        "True", "Deactivated", "The workload is deactivated")
    cluster.wait_for(lambda: admitted(cluster, "act-b"), what="the quota of an inactive Workload to stop counting")
    clear_reservation(cluster, "act-a")  # Requeued=False (Deactivated): held out of the queue
    code, _ = cluster.request("PATCH", f"{API}/namespaces/{NS}/workloads/act-a", {"spec": {"active": True}}, MERGE)
    requeued = cluster.wait_for(lambda: (condition(cluster, "act-a", "Requeued") or {}).get("status") == "True"
                                and condition(cluster, "act-a", "Requeued"))
    assert (requeued["reason"], requeued["message"]) == ("Reactivated", "The workload was reactivated")
    cluster.wait_for(lambda: "1 more needed" in (pending(cluster, "act-a") or {}).get("message", ""))
    assert [e for e, _ in events_of(cluster, "act-a")] == ["admitted", "released", "deactivated"]


# -- the pure functions -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("resource", "text", "value", "back"), [
    ("cpu", "500m", 500, "500m"), ("cpu", "2", 2000, "2"), ("cpu", 2, 2000, "2"), ("cpu", "1500m", 1500, "1500m"),
    ("cpu", "0.1", 100, "100m"), ("cpu", "2000", 2_000_000, "2k"), ("memory", "1Gi", 2 ** 30, "1Gi"),
    ("memory", "1536Mi", 1536 * 2 ** 20, "1536Mi"), ("memory", "1G", 10 ** 9, "1G"), ("memory", "100", 100, "100"),
    ("nvidia.com/gpu", "4", 4, "4"), ("pods", 1000, 1000, "1k"), ("memory", "1.5", 2, "2"),
])
def test_quantities_as_kueue_counts_and_writes_them(resource, text, value, back):
    assert amount(resource, text) == value
    assert quantity(resource, value) == back


@pytest.mark.parametrize(("spec", "expected"), [
    ({"containers": [{"resources": {"requests": {"cpu": "1"}}}, {"resources": {"limits": {"cpu": "500m"}}}]},
     {"cpu": 1500}),
    ({"containers": [{"resources": {"requests": {"cpu": "1"}, "limits": {"cpu": "2", "memory": "1Gi"}}}]},
     {"cpu": 1000, "memory": 2 ** 30}),
    ({"containers": [{"resources": {"requests": {"cpu": "1"}}}],
      "initContainers": [{"resources": {"requests": {"cpu": "3"}}}, {"resources": {"requests": {"cpu": "2"}}}]},
     {"cpu": 3000}),
    ({"containers": [{"resources": {"requests": {"cpu": "1"}}}],
      "initContainers": [{"restartPolicy": "Always", "resources": {"requests": {"cpu": "1"}}},
                         {"resources": {"requests": {"cpu": "2"}}}], "overhead": {"cpu": "100m"}},
     {"cpu": 3100}),
    ({"containers": [{}]}, {}),
], ids=["limits-for-missing-requests", "limit-not-request", "init-max", "sidecar-and-overhead", "nothing"])
def test_pod_requests(spec, expected):
    assert pod_requests(spec) == expected


def _cq(*flavors: tuple[str, str], policy: str = "Never", covered: tuple[str, ...] = ("cpu",)) -> Queue:
    return Queue.of({"metadata": {"name": "q"}, "spec": {"preemption": {"withinClusterQueue": policy},
                                                         "resourceGroups": [{"coveredResources": list(covered),
                                                                             "flavors": [{"name": f, "resources": [
                                                                                 {"name": r, "nominalQuota": q}
                                                                                 for r in covered]}
                                                                                 for f, q in flavors]}]}})


def _wl(name: str, *podsets: tuple[int, str], priority: int = 0, created: str = "2026-01-01T00:00:00Z",
        status: dict | None = None) -> dict:
    return {"metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}", "creationTimestamp": created,
                         "generation": 1},
            "spec": {"queueName": "q", "priority": priority, "podSets": [
                {"name": f"ps{i}", "count": count, "template": {"spec": {"containers": [
                    {"resources": {"requests": {"cpu": cpu}}}]}}} for i, (count, cpu) in enumerate(podsets)]},
            "status": status or {}}


FLAVORS = {"a": {"spec": {}}, "b": {"spec": {}}}


@pytest.mark.parametrize(("queue_", "podsets", "used", "reclaimable", "mode", "chosen", "message"), [
    (_cq(("a", "2")), [(2, "1")], {}, {}, "Fit", [{"cpu": "a"}], ""),
    (_cq(("a", "1"), ("b", "4")), [(2, "1")], {}, {}, "Fit", [{"cpu": "b"}], ""),
    (_cq(("a", "2"), ("b", "2")), [(1, "2"), (1, "2")], {}, {}, "Fit", [{"cpu": "a"}, {"cpu": "b"}], ""),
    (_cq(("a", "2")), [(1, "1"), (1, "2")], {}, {}, "NoFit", [{"cpu": "a"}],
     "couldn't assign flavors to pod set ps1: insufficient quota for cpu in flavor a, previously considered podsets "
     "requests (1) + current podset request (2) > maximum capacity (2)"),
    (_cq(("a", "2")), [(1, "1")], {("a", "cpu"): 1500}, {}, "NoFit", [],
     "couldn't assign flavors to pod set ps0: insufficient unused quota for cpu in flavor a, 500m more needed"),
    (_cq(("a", "2"), ("b", "2")), [(1, "1")], {("a", "cpu"): 1500, ("b", "cpu"): 2000}, {("b", "cpu"): 2000},
     "Preempt", [{"cpu": "b"}],
     "couldn't assign flavors to pod set ps0: insufficient unused quota for cpu in flavor a, 500m more needed, "
     "insufficient unused quota for cpu in flavor b, 1 more needed"),
], ids=["fits", "next-flavor", "pod-sets-split", "exceeds-nominal", "waits", "preempt-in-second-flavor"])
def test_assign_flavors(queue_, podsets, used, reclaimable, mode, chosen, message):
    assignment = assign_flavors(_wl("w", *podsets), queue_, FLAVORS, used, reclaimable)
    assert assignment.mode == mode
    assert [ps.get("flavors") for ps in assignment.podsets] == chosen
    assert assignment.message == message


def _holding(name: str, cpu: str, priority: int = 0, since: str = "2026-01-01T00:00:00Z", evicted: bool = False):
    conditions = [{"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved", "message": "",
                   "lastTransitionTime": since}]
    if evicted:
        conditions.append({"type": "Evicted", "status": "True", "reason": "Preempted", "message": "",
                           "lastTransitionTime": since})
    return _wl(name, (1, cpu), priority=priority, status={"conditions": conditions, "admission": {
        "clusterQueue": "q", "podSetAssignments": [{"name": "ps0", "count": 1, "flavors": {"cpu": "a"},
                                                    "resourceUsage": {"cpu": cpu}}]}})


@pytest.mark.parametrize(("candidates", "need", "victims"), [
    ([_holding("old", "1", since="2026-01-01T00:00:01Z"), _holding("new", "1", since="2026-01-01T00:00:02Z")], 1000,
     ["new"]),
    ([_holding("p1", "1", priority=1), _holding("p0", "1", priority=0)], 1000, ["p0"]),
    ([_holding("small", "500m", since="2026-01-01T00:00:02Z"), _holding("big", "1500m", since="2026-01-01T00:00:01Z")],
     1000, ["big"]),  # removing the newest alone is not enough: it is added back once the older one made room
    ([_holding("done", "1", evicted=True), _holding("other", "1", since="2026-01-01T00:00:09Z")], 1000, ["done"]),
    ([_holding("one", "1"), _holding("two", "1")], 3000, None),
], ids=["most-recent", "lowest-priority", "fewest", "evicted-first", "not-enough"])
def test_choose_victims(candidates, need, victims):
    used = {("a", "cpu"): 2000}
    chosen = choose_victims(_cq(("a", "2")), {("a", "cpu"): need}, used, candidates, {})
    assert (None if chosen is None else sorted(c["metadata"]["name"] for c in chosen)) == victims


def test_queue_order_and_a_pass_that_is_a_fixed_point():
    """Priority first, then age, same-second ties by first sight; the pass applied to its own result changes
    nothing (no write loop)."""
    a = _wl("a", (1, "1"), created="2026-01-01T00:00:05Z")
    b = _wl("b", (1, "1"), priority=3, created="2026-01-01T00:00:09Z")
    c = _wl("c", (1, "1"), created="2026-01-01T00:00:05Z")
    seen = {"uid-a": 2, "uid-b": 3, "uid-c": 1}
    assert [w["metadata"]["name"] for w in sorted([a, b, c], key=lambda w: queue_key(w, seen))] == ["b", "c", "a"]
    world = World(workloads={w["metadata"]["uid"]: w for w in (a, b, c)},
                  cluster_queues={"q": {"metadata": {"name": "q"}, "spec": {
                      "namespaceSelector": {}, "resourceGroups": [{"coveredResources": ["cpu"], "flavors": [
                          {"name": "a", "resources": [{"name": "cpu", "nominalQuota": "2"}]}]}]}}},
                  local_queues={(NS, "q"): {"metadata": {"name": "q"}, "spec": {"clusterQueue": "q"}}},
                  flavors={"a": {"metadata": {"name": "a"}, "spec": {}}},
                  namespaces={NS: {"metadata": {"name": NS}}}, seen=seen)
    decisions = plan(world, "2026-01-01T00:01:00Z")
    assert {d.workload["metadata"]["name"]: d.event for d in decisions} == {"b": "admitted", "c": "admitted", "a": None}
    for decision in decisions:
        world.workloads[decision.workload["metadata"]["uid"]]["status"] = decision.status
    assert plan(world, "2026-01-01T00:02:00Z") == []


def test_the_controller_recovers_from_failed_writes(cluster):
    """Its writes answered 500, 503, 429 or 409 (nothing written) half of the time: it decides again and ends where
    it would have."""
    flavor(cluster, "default")
    queue(cluster, "faulty", cpu="2", policy="LowerPriority")
    with cluster.faulty(Faults(clients={"kueue"}, write_fraction=0.5, write_codes=(500, 503, 429, 409), seed=7)):
        for index in range(3):
            workload(cluster, f"faulty-{index}", "faulty")
        cluster.wait_for(lambda: admitted(cluster, "faulty-0") and admitted(cluster, "faulty-1")
                         and pending(cluster, "faulty-2"), timeout=20)
        workload(cluster, "faulty-high", "faulty", priority=3)
        cluster.wait_for(lambda: (condition(cluster, "faulty-1", "Evicted") or {}).get("status") == "True",
                         timeout=20)
        clear_reservation(cluster, "faulty-1")
        cluster.wait_for(lambda: admission_recorded(cluster, "faulty-high"), timeout=20)
    assert any(key[0] == "kueue" for key in cluster.emulator.injected)
    assert [e for e, _ in events_of(cluster, "faulty-0", "faulty-1", "faulty-2", "faulty-high")] == [
        "admitted", "admitted", "preempted", "released", "admitted"]


@pytest.mark.parametrize(("policy", "preemptor", "candidate", "allowed"), [
    ("Never", (5, 1), (0, 2), False),
    ("LowerPriority", (5, 1), (0, 2), True),
    ("LowerPriority", (0, 1), (0, 2), False),
    ("LowerOrNewerEqualPriority", (0, 1), (0, 2), True),  # equal priority, the candidate later in the queue
    ("LowerOrNewerEqualPriority", (0, 2), (0, 1), False),
    ("LowerOrNewerEqualPriority", (0, 1), (1, 2), False),
    ("LowerOrNewerEqualPriority", (1, 2), (0, 1), True),
])
def test_may_preempt(policy, preemptor, candidate, allowed):
    """(priority, creation second) of each."""
    first = _wl("preemptor", (1, "1"), priority=preemptor[0], created=f"2026-01-01T00:00:0{preemptor[1]}Z")
    second = _wl("candidate", (1, "1"), priority=candidate[0], created=f"2026-01-01T00:00:0{candidate[1]}Z")
    assert may_preempt(policy, first, second, {}) is allowed


def test_granular_reasons_of_unadmitted_workloads_observability():
    """granular_reasons: the reasons Kueue writes with UnadmittedWorkloadsObservability on (main's default)."""
    fits, huge, lost = _wl("fits", (1, "2")), _wl("huge", (1, "3")), _wl("lost", (1, "1"))
    lost["spec"]["queueName"] = "nowhere"
    world = World(workloads={w["metadata"]["uid"]: w for w in (fits, huge, lost)},
                  cluster_queues={"q": {"metadata": {"name": "q"}, "spec": {
                      "namespaceSelector": {}, "resourceGroups": [{"coveredResources": ["cpu"], "flavors": [
                          {"name": "a", "resources": [{"name": "cpu", "nominalQuota": "2"}]}]}]}}},
                  local_queues={(NS, "q"): {"metadata": {"name": "q"}, "spec": {"clusterQueue": "q"}}},
                  flavors={"a": {"metadata": {"name": "a"}, "spec": {}}}, namespaces={NS: {"metadata": {"name": NS}}})
    statuses = {d.workload["metadata"]["name"]: d.status for d in plan(world, "2026-01-01T00:01:00Z", granular=True)}
    reasons = {name: [(c["type"], c["status"], c["reason"]) for c in status["conditions"]]
               for name, status in statuses.items()}
    assert reasons == {
        "fits": [("QuotaReserved", "True", "QuotaReserved"), ("Admitted", "True", "Admitted")],
        "huge": [("QuotaReserved", "False", "ExceedsMaxQuota"), ("Admitted", "False", "NoReservation")],
        "lost": [("QuotaReserved", "False", "Misconfigured"), ("Admitted", "False", "NoReservation")]}
