"""A ParallelTrainingJob under Kueue and under a gang scheduler (operator/queueing.py, operator/gangs.py, and the rules
of operator/training.py that use them), without a cluster: table-driven cases (name, the job, its pods and Workload,
the expected plan), and the objects the operator builds checked against the upstream CRD schemas in
tests/upstream_crds/ (structural schema and CEL rules, as devcluster's API server applies them)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_training_reconcile import CHECKPOINT_MOUNT, NOW, ago, job, pod, running

from devcluster import schema
from tandem.manifest import parse
from tandem.operator import queueing
from tandem.operator.gangs import pod_group
from tandem.operator.observed import read_resource
from tandem.operator.training import Queueing, Settings, reconcile
from tandem.operator.training_objects import group_objects, worker_pod

UPSTREAM = Path(__file__).resolve().parents[1] / "upstream_crds"
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
    assert upstream_problems("kueue/kueue.x-k8s.io_workloads.yaml", created) == []


def test_a_pod_priority_class_names_kueues_priority_source():
    body = queued_job(priorityClassName="batch-high")
    assert queueing.priority_source(body, parse(body)) == ("scheduling.k8s.io", "PriorityClass", "batch-high")
    assert queueing.priority_source(job(), parse(job())) is None


def test_the_workload_patches_are_valid_against_kueues_schema():
    for patch in (queueing.released(EVICTED, NOW), queueing.finished(ADMITTED, True, "done", NOW),
                  queueing.pods_ready(ADMITTED, True, NOW)):
        merged = {**ADMITTED, "status": {**ADMITTED["status"], **patch["status"]}}
        merged["status"] = {k: v for k, v in merged["status"].items() if v is not None}
        assert upstream_problems("kueue/kueue.x-k8s.io_workloads.yaml", merged) == []


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


@pytest.mark.parametrize("scheduler, crd, member", [
    ("coscheduling", "scheduler-plugins/scheduling.x-k8s.io_podgroups.yaml",
     ("labels", "scheduling.x-k8s.io/pod-group")),
    ("volcano", "volcano/scheduling.volcano.sh_podgroups.yaml", ("annotations", "scheduling.k8s.io/group-name")),
])
def test_a_gangs_podgroup_and_pods_are_what_its_scheduler_expects(scheduler, crd, member):
    gang = {"scheduler": scheduler, **({"queue": "research"} if scheduler == "volcano" else
                                       {"scheduleTimeoutSeconds": 120})}
    body = job(workers=4, ranksPerPod=2, gang=gang, priorityClassName="high",
               resources={"requests": {"cpu": "500m", "memory": "1Gi"}})
    parsed = parse(body)
    group = pod_group(body, parsed, {"tandem.dev/job": "digits"})
    assert group["spec"]["minMember"] == 2
    assert group["spec"]["minResources"] == {"cpu": "1", "memory": "2147483648"}
    assert upstream_problems(crd, group) == []
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
def upstream_crd(path: str) -> dict[str, Any]:
    return yaml.load((UPSTREAM / path).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def upstream_problems(path: str, manifest: dict[str, Any]) -> list[str]:
    """What the upstream CRD's schema (the version `manifest` names) says of it, as an API server would."""
    crd = upstream_crd(path)
    version = manifest["apiVersion"].split("/")[1]
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return schema.problems(manifest, served["schema"]["openAPIV3Schema"])


def test_the_schema_check_can_fail():
    broken = {**ADMITTED, "spec": {**ADMITTED["spec"], "podSets": [{"name": "ranks", "count": "two"}]}}
    assert upstream_problems("kueue/kueue.x-k8s.io_workloads.yaml", broken)


def readme_section() -> str:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    return readme.split("### Queues and gangs", 1)[1].split("\n### ", 1)[0]


def test_the_readmes_queue_manifests_are_valid_kueue_objects():
    blocks = [yaml.safe_load_all(b.split("```", 1)[0]) for b in readme_section().split("```yaml\n")[1:]]
    platform = [d for d in blocks[0] if d]
    assert [d["kind"] for d in platform] == ["ResourceFlavor", "ClusterQueue", "LocalQueue", "WorkloadPriorityClass"]
    for document in platform:
        plural = document["kind"].lower() + ("es" if document["kind"].endswith("s") else "s")
        assert upstream_problems(f"kueue/kueue.x-k8s.io_{plural}.yaml", document) == [], document["kind"]


def test_the_readmes_job_labels_and_gang_make_a_valid_queued_job():
    blocks = readme_section().split("```yaml\n")[1:]
    labels, gang = (yaml.safe_load(b.split("```", 1)[0]) for b in blocks[1:3])
    body = job(**gang["spec"])
    body["metadata"]["labels"] = labels["metadata"]["labels"]
    parsed = parse(body)
    assert queueing.queue_name(body) == "team-a"
    assert queueing.priority_source(body, parsed) == ("kueue.x-k8s.io", "WorkloadPriorityClass", "urgent")
    assert upstream_problems("volcano/scheduling.volcano.sh_podgroups.yaml",
                             pod_group(body, parsed, {"tandem.dev/job": "digits"})) == []
