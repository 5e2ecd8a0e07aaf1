"""A ParallelTrainingJob under Kueue and under a gang scheduler (operator/queueing.py, operator/gangs.py, and the rules
of operator/training.py that use them), without a cluster: table-driven cases (name, the job, its pods and Workload,
the expected plan), and the objects the operator builds checked against the CRD schemas devcluster serves for Kueue
and the gang schedulers (devcluster/crds/, written after their APIs: structural schema and CEL rules, as devcluster's
API server applies them), which refuse what they must."""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_training_reconcile import CHECKPOINT_MOUNT, NOW, ago, job, pod, running

from devcluster import schema
from devcluster.catalog import kinds_of_crd
from devcluster.kueue import COSCHEDULING_CRDS, KUEUE_CRDS, VOLCANO_CRDS, one_queue
from tandem.manifest import parse
from tandem.operator import queueing
from tandem.operator.gangs import pod_group
from tandem.operator.observed import read_resource
from tandem.operator.training import Queueing, Settings, reconcile
from tandem.operator.training_objects import group_objects, worker_pod

KUEUE = Settings(worker_image="w:1", restart_backoff_seconds=10, kueue=True)
LATEST = f"{CHECKPOINT_MOUNT}/digits/step-00000100.pt"


def queued_job(status: dict | None = None, queue: str = "team-a", **spec: Any) -> dict[str, Any]:
    body = job(status, **spec)
    body["metadata"]["labels"] = {queueing.QUEUE_LABEL: queue}
    return body


def workload(*kinds: tuple[str, str, str], admitted_in: str | None = None, flavor: str = "cpu",
             pods: int = 2, version: str = "7") -> dict[str, Any]:
    """The job's Workload as Kueue left it: conditions (type, status, reason), an admission when `admitted_in`."""
    body = queued_job()
    built = queueing.workload(body, parse(body), worker_pod(body, parse(body), 0, group=0, resume_from=None,
                                                            default_image="w:1"), None, {"tandem.dev/job": "digits"})
    built["spec"]["podSets"][0]["count"] = pods
    built["metadata"]["resourceVersion"] = version
    status: dict[str, Any] = {"conditions": [{"type": kind, "status": value, "reason": reason,
                                              "message": f"{kind} {reason}", "lastTransitionTime": ago(5)}
                                             for kind, value, reason in kinds]}
    if admitted_in:
        status["admission"] = {"clusterQueue": admitted_in, "podSetAssignments": [
            {"name": queueing.POD_SET, "flavors": {"cpu": flavor}, "resourceUsage": {"cpu": "2"}, "count": pods}]}
    return {**built, "status": status}


PENDING = workload(("QuotaReserved", "False", "Pending"))
ADMITTED = workload(("QuotaReserved", "True", "QuotaReserved"), ("Admitted", "True", "Admitted"), admitted_in="cq")
EVICTED = workload(("QuotaReserved", "True", "QuotaReserved"), ("Admitted", "True", "Admitted"),
                   ("Evicted", "True", "Preempted"), ("Preempted", "True", "InClusterQueue"), admitted_in="cq")
RELEASED = workload(("QuotaReserved", "False", "Pending"), ("Admitted", "False", "NoReservation"),
                    ("Evicted", "True", "Preempted"), ("Requeued", "True", "Preempted"))
NODES_FAILED = workload(("QuotaReserved", "True", "QuotaReserved"), ("Admitted", "True", "Admitted"),
                        ("Evicted", "True", "NodeFailures"), admitted_in="cq")
DEACTIVATED = workload(("QuotaReserved", "True", "QuotaReserved"), ("Admitted", "True", "Admitted"),
                       ("Evicted", "True", "Deactivated"), admitted_in="cq")
RESERVED = workload(("QuotaReserved", "True", "QuotaReserved"), ("Admitted", "False", "UnsatisfiedChecks"),
                    admitted_in="cq")
CHECKS_PENDING = {**RESERVED, "status": {**RESERVED["status"], "admissionChecks": [
    {"name": "provisioning", "state": "Pending", "message": "", "lastTransitionTime": ago(1)}]}}
ON_GPUS = queueing.Placement(node_selector={"cloud.example/pool": "gpu-a"},
                             tolerations=[{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}])


@dataclass
class Case:
    name: str
    body: dict[str, Any]
    queued: Queueing | None = None
    pods: list[dict[str, Any]] = field(default_factory=list)
    settings: Settings = KUEUE
    phase: str = "Queued"
    reason: str = ""
    created: list[str] = field(default_factory=list)
    """The kinds created, in order."""
    deleted: list[str] = field(default_factory=list)
    workload_patch: dict[str, Any] | None = None
    """Fields the Workload's status patch must hold (None: no patch)."""
    delete_workload: bool = False
    queue: dict[str, Any] | None = None
    """Fields status.queue must hold (a job without the queue label has none)."""
    resumes: bool = False
    """The pods created start from the latest checkpoint."""


CASES = [
    Case("a job without the queue label is untouched by Kueue", job(), phase="Pending",
         created=["Service", "ConfigMap", "ServiceAccount", "Role", "RoleBinding", "Pod", "Pod"]),
    Case("a queued job creates its Workload and no pod", queued_job(), Queueing(), reason="Queued",
         created=["Workload"], queue={"name": "team-a", "admitted": False}),
    Case("without --kueue a queued job waits and says how to enable it", queued_job(), Queueing(),
         settings=Settings(worker_image="w:1"), reason="KueueDisabled", queue={"reason": "KueueDisabled"}),
    Case("a priority class that does not exist holds the Workload back", queued_job(),
         Queueing(priority_problem="the WorkloadPriorityClass high ... does not exist"),
         reason="PriorityClassNotFound", queue={"reason": "PriorityClassNotFound", "admitted": False}),
    Case("a pending Workload keeps the job Queued with Kueue's reason", queued_job(), Queueing(workload=PENDING),
         reason="Pending", queue={"admitted": False, "reason": "Pending", "message": "QuotaReserved Pending"}),
    Case("an admitted Workload starts the group on the admission's flavour", queued_job({"phase": "Queued"}),
         Queueing(workload=ADMITTED, placement=ON_GPUS), phase="Pending", reason="Admitted",
         created=["Service", "ConfigMap", "ServiceAccount", "Role", "RoleBinding", "Pod", "Pod"],
         queue={"admitted": True, "clusterQueue": "cq", "reason": "Admitted"},
         workload_patch={"PodsReady": "False"}),
    Case("quota reserved while admission checks (provisioning) are pending starts no rank",
         queued_job({"phase": "Queued"}), Queueing(workload=CHECKS_PENDING, placement=ON_GPUS),
         reason="UnsatisfiedChecks", queue={"admitted": False, "clusterQueue": "cq", "message": (
             "QuotaReserved QuotaReserved; waiting for admission checks: provisioning (Pending)")}),
    Case("an admitted job's group runs and reports PodsReady", queued_job(running(phase="Running")),
         Queueing(workload=ADMITTED), [pod(0), pod(1)], phase="Running", workload_patch={"PodsReady": "True"},
         queue={"admitted": True}),
    Case("an evicted group is stopped as a suspension stops it (SIGTERM: the ranks checkpoint)",
         queued_job(running()), Queueing(workload=EVICTED), [pod(0), pod(1)], reason="Preempted",
         deleted=["digits-worker-0", "digits-worker-1"], queue={"admitted": False, "reason": "Preempted"}),
    Case("once its ranks are gone, an evicted Workload's quota is given back", queued_job(running(phase="Queued")),
         Queueing(workload=EVICTED), reason="Preempted",
         workload_patch={"QuotaReserved": "False", "Requeued": "True", "Admitted": "False", "admission": None},
         queue={"evictions": 1}),
    Case("a Workload evicted for node failures is requeued, as after a preemption, once its ranks are gone",
         queued_job(running(phase="Queued")), Queueing(workload=NODES_FAILED), reason="NodeFailures",
         workload_patch={"QuotaReserved": "False", "Requeued": "True", "Admitted": "False", "admission": None},
         queue={"evictions": 1}),
    Case("a deactivated Workload gives its quota back without being requeued", queued_job(running(phase="Queued")),
         Queueing(workload=DEACTIVATED), reason="Deactivated",
         workload_patch={"QuotaReserved": "False", "Requeued": "False", "admission": None}),
    Case("given back, it waits for admission again", queued_job(running(phase="Queued")),
         Queueing(workload=RELEASED), reason="Preempted", queue={"evictions": 0, "admitted": False}),
    Case("admitted again, it resumes from the latest checkpoint", queued_job(running(phase="Queued")),
         Queueing(workload=ADMITTED), phase="Pending", reason="Admitted", created=[
             "Service", "ConfigMap", "ServiceAccount", "Role", "RoleBinding", "Pod", "Pod"],
         workload_patch={"PodsReady": "False"}, resumes=True),
    Case("a resize of an admitted group queues it again with a new Workload", queued_job(running(), workers=4),
         Queueing(workload=ADMITTED), [pod(0), pod(1)], reason="PodSetChanged",
         deleted=["digits-worker-0", "digits-worker-1"]),
    Case("once the resized group's ranks are gone, its old Workload is deleted",
         queued_job(running(phase="Queued"), workers=4), Queueing(workload=ADMITTED), reason="PodSetChanged",
         delete_workload=True),
    Case("a queued job whose pods' resources alone change gets a new Workload (its quota counts them)",
         queued_job(running(phase="Queued"), resources={"requests": {"cpu": "2", "memory": "4Gi"}}),
         Queueing(workload=PENDING), reason="PodSetChanged", delete_workload=True),
    Case("a Workload whose pod sets were emptied by hand is replaced, not trusted",
         queued_job(running(phase="Queued")), Queueing(workload={**PENDING, "spec": {"queueName": "team-a"}}),
         reason="PodSetChanged", delete_workload=True),
    Case("a finished job marks its Workload Finished", queued_job(running(phase="Succeeded")),
         Queueing(workload=ADMITTED), [pod(0, "Succeeded", exit_code=0), pod(1, "Succeeded", exit_code=0)],
         phase="Succeeded", workload_patch={"Finished": "True"}),
    Case("a suspended queued job leaves its queue once its ranks are gone", queued_job(running(phase="Suspended"),
                                                                                       suspend=True),
         Queueing(workload=ADMITTED), phase="Suspended", delete_workload=True),
    Case("spec.gang without --gang-scheduling holds the job and says how to enable it",
         job(gang={"scheduler": "volcano"}), settings=Settings(worker_image="w:1"), phase="Pending",
         reason="GangSchedulingDisabled"),
    Case("spec.gang creates the PodGroup with the group", job(gang={"scheduler": "coscheduling"}),
         settings=Settings(worker_image="w:1", gang_scheduling=True), phase="Pending",
         created=["Service", "ConfigMap", "ServiceAccount", "Role", "RoleBinding", "PodGroup", "Pod", "Pod"]),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_reconcile_under_a_queue(case: Case):
    plan = reconcile(read_resource(case.body), case.pods, None, NOW, case.settings, case.queued)
    assert plan.status.get("phase") == case.phase, plan.status.get("message")
    if case.reason:
        phase_condition = next(c for c in plan.status["conditions"] if c["type"] == case.phase)
        assert phase_condition["reason"] == case.reason, phase_condition
    assert [o["kind"] for o in plan.create] == case.created
    assert plan.delete_pods == case.deleted
    if case.deleted:
        assert plan.stop_first and not plan.kill_at_once
    assert (plan.delete_workload == ADMITTED["metadata"]["name"]) == case.delete_workload
    if case.workload_patch is None:
        assert plan.workload_status is None
    else:
        patch = plan.workload_status
        assert patch["metadata"]["resourceVersion"] == "7"  # decided on that version: 409 if Kueue wrote since
        states = {c["type"]: c["status"] for c in patch["status"]["conditions"]}
        for key, value in case.workload_patch.items():
            assert (patch["status"][key] if key == "admission" else states[key]) == value, key
    if queueing.queue_name(case.body) is None:
        assert "queue" not in plan.status
    if case.queue is not None:
        assert case.queue.items() <= plan.status["queue"].items()
    for pod_manifest in (o for o in plan.create if o["kind"] == "Pod"):
        if case.queued and case.queued.placement.node_selector:
            assert pod_manifest["spec"]["nodeSelector"] == ON_GPUS.node_selector
            assert pod_manifest["spec"]["tolerations"] == ON_GPUS.tolerations
        if case.resumes:
            env = {e["name"]: e.get("value") for e in pod_manifest["spec"]["containers"][0]["env"]}
            assert env.get("TANDEM_RESUME_FROM") == LATEST


def test_a_created_workload_has_the_groups_pod_set_and_priority():
    body = queued_job(workers=4, ranksPerPod=2, gpusPerWorker=1,
                      resources={"requests": {"cpu": "4", "memory": "8Gi"}})
    body["metadata"]["labels"][queueing.PRIORITY_LABEL] = "high"
    priority = queueing.Priority(*queueing.priority_source(body, parse(body)), 1000)
    plan = reconcile(read_resource(body), [], None, NOW, KUEUE, Queueing(priority=priority))
    (created,) = plan.create
    assert created["metadata"]["ownerReferences"][0]["controller"] is True
    assert created["spec"]["queueName"] == "team-a"
    assert created["spec"]["priorityClassRef"] == {"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass",
                                                   "name": "high"}
    assert created["spec"]["priority"] == 1000
    (pod_set,) = created["spec"]["podSets"]
    assert pod_set["count"] == 2
    assert pod_set["template"]["spec"]["containers"][0]["resources"] == {
        "requests": {"cpu": "4", "memory": "8Gi"}, "limits": {"nvidia.com/gpu": "2"}}
    assert schema_problems(created) == []


def test_a_pod_priority_class_names_kueues_priority_source():
    body = queued_job(priorityClassName="batch-high")
    assert queueing.priority_source(body, parse(body)) == ("scheduling.k8s.io", "PriorityClass", "batch-high")
    assert queueing.priority_source(job(), parse(job())) is None


def test_the_workload_patches_are_valid_against_kueues_schema():
    """Each status patch, merged into the Workload it was decided on, is valid, transition rules included."""
    for source, patch in ((EVICTED, queueing.released(EVICTED, NOW)),
                          (ADMITTED, queueing.finished(ADMITTED, True, "done", NOW)),
                          (ADMITTED, queueing.pods_ready(ADMITTED, True, NOW))):
        merged = {**source, "status": {**source["status"], **patch["status"]}}
        merged["status"] = {k: v for k, v in merged["status"].items() if v is not None}
        assert schema_problems(merged, old=source) == []


def test_the_workloads_name_follows_kueues_and_fits_a_label():
    body = queued_job()
    body["metadata"]["name"] = "a" * 60
    name = queueing.workload_name(body)
    assert len(name) <= 63 and name.startswith("paralleltrainingjob-aaa")
    assert queueing.workload_name(queued_job()) != queueing.workload_name({**queued_job(), "metadata": {
        "name": "digits", "uid": "uid-2"}})


def test_admission_reads_kueues_conditions():
    assert queueing.admission_of(ADMITTED).admitted and queueing.admission_of(ADMITTED).flavors == ("cpu",)
    evicted = queueing.admission_of(EVICTED)
    assert (evicted.admitted, evicted.evicted, evicted.holds_quota, evicted.reason) == (False, True, True, "Preempted")
    assert evicted.message == "Preempted InClusterQueue"  # the Preempted condition's detail
    released = queueing.admission_of(RELEASED)
    assert (released.admitted, released.holds_quota) == (False, False)


def test_placement_merges_flavours_and_admission_check_updates():
    admitted = {**ADMITTED, "status": {**ADMITTED["status"], "admissionChecks": [{
        "name": "prov", "state": "Ready", "message": "", "lastTransitionTime": ago(1), "podSetUpdates": [
            {"name": queueing.POD_SET, "labels": {"provisioned": "yes"}, "nodeSelector": {"zone": "a"}}]}]}}
    where = queueing.placement(queueing.admission_of(admitted), {"cpu": {"nodeLabels": {"pool": "cpu"}, "tolerations": [
        {"key": "spot", "operator": "Exists"}]}})
    assert where.node_selector == {"pool": "cpu", "zone": "a"}
    assert where.tolerations == [{"key": "spot", "operator": "Exists"}]
    body = queued_job(nodeSelector={"disk": "ssd"})
    placed = queueing.placed(worker_pod(body, parse(body), 0, group=0, resume_from=None, default_image="w"), where)
    assert placed["spec"]["nodeSelector"] == {"disk": "ssd", "pool": "cpu", "zone": "a"}
    assert placed["metadata"]["labels"]["provisioned"] == "yes"


GANG_RESOURCES = {"cpu": "1", "memory": "2147483648", "nvidia.com/gpu": "4"}
"""Two pods of two ranks with a GPU each: every pod's requests (two GPUs a pod), times the pods."""


@pytest.mark.parametrize("scheduler, member, spec", [
    ("coscheduling", ("labels", "scheduling.x-k8s.io/pod-group"),
     {"minMember": 2, "minResources": GANG_RESOURCES, "scheduleTimeoutSeconds": 120}),
    ("volcano", ("annotations", "scheduling.k8s.io/group-name"),
     {"minMember": 2, "minResources": GANG_RESOURCES, "queue": "research", "priorityClassName": "high"}),
])
def test_a_gangs_podgroup_and_pods_are_what_its_scheduler_expects(scheduler, member, spec):
    gang = {"scheduler": scheduler, **({"queue": "research"} if scheduler == "volcano" else
                                       {"scheduleTimeoutSeconds": 120})}
    body = job(workers=4, ranksPerPod=2, gpusPerWorker=1, gang=gang, priorityClassName="high",
               resources={"requests": {"cpu": "500m", "memory": "1Gi"}})
    parsed = parse(body)
    group = pod_group(body, parsed, {"tandem.dev/job": "digits"})
    assert group["spec"] == spec
    assert schema_problems(group) == []
    assert group in group_objects(body, parsed)
    rank_pod = worker_pod(body, parsed, 1, group=0, resume_from=None, default_image="w")
    assert rank_pod["metadata"][member[0]][member[1]] == "digits"
    assert rank_pod["spec"]["schedulerName"] == queueing_scheduler(scheduler)
    named = parse(job(gang=gang, schedulerName="my-scheduler"))
    assert worker_pod(body, named, 0, group=0, resume_from=None, default_image="w")["spec"]["schedulerName"] == \
        "my-scheduler"


def queueing_scheduler(scheduler: str) -> str:
    return {"coscheduling": "scheduler-plugins-scheduler", "volcano": "volcano"}[scheduler]


def test_a_job_without_gang_or_queue_has_neither():
    body = job()
    assert all(o["kind"] != "PodGroup" for o in group_objects(body, parse(body)))
    rank_pod = worker_pod(body, parse(body), 0, group=0, resume_from=None, default_image="w")
    assert "schedulerName" not in rank_pod["spec"] and "annotations" not in rank_pod["metadata"]


def test_gang_options_of_the_other_scheduler_are_refused_naming_the_fix():
    from tandem.manifest import ManifestError
    with pytest.raises(ManifestError, match="gang.queue is a Volcano queue"):
        parse(job(gang={"scheduler": "coscheduling", "queue": "q"}))
    with pytest.raises(ManifestError, match="gang.scheduleTimeoutSeconds is scheduler-plugins'"):
        parse(job(gang={"scheduler": "volcano", "scheduleTimeoutSeconds": 5}))


@functools.cache
def served_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind): the schema devcluster serves for each kind of Kueue's and the gang schedulers' (the CRDs'
    storage versions, devcluster/crds/)."""
    return {(f"{kind.group}/{kind.version}", kind.kind): kind.schema
            for path in (KUEUE_CRDS, COSCHEDULING_CRDS, VOLCANO_CRDS)
            for crd in yaml.safe_load_all(path.read_text()) if crd for kind in kinds_of_crd(crd)}


def schema_problems(manifest: dict[str, Any], old: dict[str, Any] | None = None) -> list[str]:
    """What the CRD of the manifest's kind says of it, as devcluster's API server would: OpenAPI schema and CEL rules
    (`old`: the stored object of an update, for the transition rules)."""
    return schema.problems(manifest, served_schemas()[manifest["apiVersion"], manifest["kind"]], old)


DELETE = object()


def changed(body: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A copy of `body` with the value at the dotted `path` (list indexes as numbers) replaced, or removed (DELETE)."""
    result = copy.deepcopy(body)
    *parents, last = [int(part) if part.isdigit() else part for part in path.split(".")]
    node = result
    for part in parents:
        node = node[part]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    return result


QUEUE_OBJECTS = {d["kind"]: d for d in one_queue("ml", cpus="2", flavor_labels={"pool": "cpu"})}


def gang_pod_group(scheduler: str) -> dict[str, Any]:
    body = job(workers=4, ranksPerPod=2, gpusPerWorker=1, priorityClassName="high", gang={"scheduler": scheduler},
               resources={"requests": {"cpu": "500m", "memory": "1Gi"}})
    return pod_group(body, parse(body), {})


COSCHEDULING_GROUP, VOLCANO_GROUP = gang_pod_group("coscheduling"), gang_pod_group("volcano")
PRIORITY_REF = {"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass", "name": "high"}
REFUSED = [
    # (what is wrong, the valid object, the path changed, its value, a line the schema must answer, the stored object)
    ("a pod set's count of the wrong type", ADMITTED, "spec.podSets.0.count", "two",
     "spec.podSets.0.count: 'two' is not of type 'integer'", None),
    ("a pod set without its template", ADMITTED, "spec.podSets.0.template", DELETE,
     "spec.podSets.0: 'template' is a required property", None),
    ("a pod set name that is not a DNS label", ADMITTED, "spec.podSets.0.name", "Ranks",
     "spec.podSets.0.name: 'Ranks' does not match", None),
    ("more pod sets than Kueue takes", ADMITTED, "spec.podSets",
     [{**ADMITTED["spec"]["podSets"][0], "name": f"ranks-{i}"} for i in range(19)], "] is too long", None),
    ("a pod template without containers", ADMITTED, "spec.podSets.0.template.spec.containers", DELETE,
     "spec.podSets.0.template.spec: 'containers' is a required property", None),
    ("a request that is not a quantity", ADMITTED, "spec.podSets.0.template.spec.containers.0.resources",
     {"requests": {"cpu": "two"}}, "spec.podSets.0.template.spec.containers.0.resources.requests.cpu: 'two' does not "
     "match", None),
    ("a priority class reference of a kind Kueue does not know", ADMITTED, "spec.priorityClassRef",
     {**PRIORITY_REF, "kind": "Priority"}, "spec.priorityClassRef.kind: 'Priority' is not one of", None),
    ("a priority class reference without the priority", ADMITTED, "spec.priorityClassRef", PRIORITY_REF,
     'spec: Invalid value: "object": priority should not be nil when priorityClassRef is set', None),
    ("a WorkloadPriorityClass in the group of PriorityClasses", ADMITTED, "spec.priorityClassRef",
     {**PRIORITY_REF, "group": "scheduling.k8s.io"},
     'spec.priorityClassRef: Invalid value: "object": only the PriorityClass kind is allowed for the '
     "scheduling.k8s.io group", None),
    ("a minCount above the count", ADMITTED, "spec.podSets.0.minCount", 5,
     'spec.podSets[0]: Invalid value: "object": minCount should be positive and less or equal to count', None),
    ("a condition status other than True, False or Unknown", ADMITTED, "status.conditions.0.status", "Yes",
     "status.conditions.0.status: 'Yes' is not one of ['True', 'False', 'Unknown']", None),
    ("a condition without its reason", ADMITTED, "status.conditions.0.reason", DELETE,
     "status.conditions.0: 'reason' is a required property", None),
    ("an admission of fewer pod sets than the spec has", ADMITTED, "status.admission.podSetAssignments", [],
     '<nil>: Invalid value: "object": podSetAssignments must have the same number of podSets as the spec', None),
    ("an admission check state Kueue does not know", ADMITTED, "status.admissionChecks",
     [{"name": "prov", "state": "Done", "message": "", "lastTransitionTime": ago(1)}],
     "status.admissionChecks.0.state: 'Done' is not one of", None),
    ("an admission check's toleration with seconds but not NoExecute", ADMITTED, "status.admissionChecks",
     [{"name": "prov", "state": "Ready", "message": "", "lastTransitionTime": ago(1), "podSetUpdates": [
         {"name": queueing.POD_SET,
          "tolerations": [{"key": "spot", "effect": "NoSchedule", "tolerationSeconds": 5}]}]}],
     'status.admissionChecks[0].podSetUpdates[0].tolerations: Invalid value: "array": effect must be \'NoExecute\' '
     "when 'tolerationSeconds' is set", None),
    ("a pod set changed while quota is reserved (Kueue's webhook)", ADMITTED, "spec.podSets.0.count", 3,
     'spec.podSets: Invalid value: "object": field is immutable', ADMITTED),
    ("the queue changed while quota is reserved", ADMITTED, "spec.queueName", "team-b",
     '<nil>: Invalid value: "object": queueName is immutable while workload quota reserved', ADMITTED),
    ("a queueing strategy Kueue does not know", QUEUE_OBJECTS["ClusterQueue"], "spec.queueingStrategy", "FIFO",
     "spec.queueingStrategy: 'FIFO' is not one of ['StrictFIFO', 'BestEffortFIFO']", None),
    ("a preemption policy Kueue does not know", QUEUE_OBJECTS["ClusterQueue"], "spec.preemption.withinClusterQueue",
     "Always", "spec.preemption.withinClusterQueue: 'Always' is not one of", None),
    ("a covered resource a flavor gives no quota for", QUEUE_OBJECTS["ClusterQueue"],
     "spec.resourceGroups.0.coveredResources", ["cpu", "memory"],
     "flavors must have the same number of resources as the coveredResources", None),
    ("a resource without its nominal quota", QUEUE_OBJECTS["ClusterQueue"],
     "spec.resourceGroups.0.flavors.0.resources.0.nominalQuota", DELETE,
     "spec.resourceGroups.0.flavors.0.resources.0: 'nominalQuota' is a required property", None),
    ("a LocalQueue moved to another ClusterQueue", QUEUE_OBJECTS["LocalQueue"], "spec.clusterQueue", "other",
     'spec.clusterQueue: Invalid value: "string": field is immutable', QUEUE_OBJECTS["LocalQueue"]),
    ("a flavor's toleration with operator Exists and a value", QUEUE_OBJECTS["ResourceFlavor"], "spec.tolerations",
     [{"key": "gpu", "operator": "Exists", "value": "yes"}], "a value must be empty when 'operator' is 'Exists'",
     None),
    ("a flavor of more than 8 node labels", QUEUE_OBJECTS["ResourceFlavor"], "spec.nodeLabels",
     {f"label-{i}": "x" for i in range(9)}, "has too many properties", None),
    ("a WorkloadPriorityClass without its value", QUEUE_OBJECTS["WorkloadPriorityClass"], "value", DELETE,
     "<root>: 'value' is a required property", None),
    ("a WorkloadPriorityClass value of the wrong type", QUEUE_OBJECTS["WorkloadPriorityClass"], "value", "high",
     "value: 'high' is not of type 'integer'", None),
    ("a coscheduling PodGroup of no member", COSCHEDULING_GROUP, "spec.minMember", 0,
     "spec.minMember: 0 is less than the minimum of 1", None),
    ("a coscheduling PodGroup whose resources are not quantities", COSCHEDULING_GROUP, "spec.minResources",
     {"cpu": "lots"}, "spec.minResources.cpu: 'lots' does not match", None),
    ("a Volcano PodGroup in a queue that is not a DNS name", VOLCANO_GROUP, "spec.queue", "Research",
     "spec.queue: 'Research' does not match", None),
    ("a Volcano PodGroup phase Volcano does not know", VOLCANO_GROUP, "status", {"phase": "Done"},
     "status.phase: 'Done' is not one of", None),
]


@pytest.mark.parametrize(("valid", "path", "value", "expected", "old"), [case[1:] for case in REFUSED],
                         ids=[case[0] for case in REFUSED])
def test_the_schema_check_can_fail(valid, path, value, expected, old):
    """Each schema refuses a wrong type, a missing required field, a value outside an enum or a bound, and a broken
    CEL rule, with the API server's line; the object it was changed from is valid."""
    assert schema_problems(valid, old=old) == []
    problems = schema_problems(changed(valid, path, value), old=old)
    assert any(expected in line for line in problems), problems


def test_a_pod_set_may_change_while_no_quota_is_reserved():
    """The webhook's immutability (as a transition rule) holds only while the stored Workload holds quota."""
    assert schema_problems(changed(PENDING, "spec.podSets.0.count", 3), old=PENDING) == []
    assert schema_problems(changed(RELEASED, "spec.queueName", "team-b"), old=RELEASED) == []


def readme_section() -> str:
    """The README's "Queues and gangs", in full in docs/operator.md (the README links to it)."""
    docs = (Path(__file__).resolve().parents[2] / "docs" / "operator.md").read_text()
    return docs.split("\n## Queues and gangs", 1)[1].split("\n## ", 1)[0]


def test_the_readmes_queue_manifests_are_valid_kueue_objects():
    blocks = [yaml.safe_load_all(b.split("```", 1)[0]) for b in readme_section().split("```yaml\n")[1:]]
    platform = [d for d in blocks[0] if d]
    assert [d["kind"] for d in platform] == ["ResourceFlavor", "ClusterQueue", "LocalQueue", "WorkloadPriorityClass"]
    for document in platform:
        assert schema_problems(document) == [], document["kind"]


def test_the_readmes_job_labels_and_gang_make_a_valid_queued_job():
    blocks = readme_section().split("```yaml\n")[1:]
    labels, gang = (yaml.safe_load(b.split("```", 1)[0]) for b in blocks[1:3])
    body = job(**gang["spec"])
    body["metadata"]["labels"] = labels["metadata"]["labels"]
    parsed = parse(body)
    assert queueing.queue_name(body) == "team-a"
    assert queueing.priority_source(body, parsed) == ("kueue.x-k8s.io", "WorkloadPriorityClass", "urgent")
    assert schema_problems(pod_group(body, parsed, {"tandem.dev/job": "digits"})) == []
