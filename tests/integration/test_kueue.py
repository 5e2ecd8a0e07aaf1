"""Queued training on the emulated cluster: `tandem operator --kueue` against devcluster's emulated Kueue admission
(devcluster/kueue.py: a ClusterQueue's quota, the queue order, preemption, the Workload's conditions; not Kueue
itself, which needs a real cluster) and Kueue's CRDs as devcluster serves them (devcluster/crds/, written after
Kueue's API), so that every Workload the operator writes is checked against Kueue's schema and rules. The ranks are
real gloo processes run by the test kubelet.

One ClusterQueue of 2 CPUs (a flavour whose node label the node has), and jobs of 2 ranks asking 1 CPU each: one job
fits at a time."""

from __future__ import annotations

import sys

import pytest
import torch
import yaml
from jobs import TESTS, final_weights, manifest, start_tandem_run
from operator_runs import GROUP, JOBS, NS, STARTUP, VERSION, claim, custom_job, events, start_operator
from operator_runs import job_pods as pods

from devcluster import Cluster
from devcluster.harness import CRDS
from devcluster.kueue import COSCHEDULING_CRDS, VOLCANO_CRDS, one_queue
from tandem.contract import checkpoint_name
from tandem.operator import queueing
from tandem.worker import checkpoint

FLAVOR_LABEL = {"tandem.dev/node-pool": "cpu"}
# The dropout MLP draws random numbers every step, so an inexact resume shows in the weights; 0.04 s a step keeps
# the job running long enough to be preempted mid-run (a checkpoint every 40 steps, about 1.6 s). The pause draws no
# random numbers: the uninterrupted run it is compared with goes without it.
DROPOUT = {"hidden": 32, "p": 0.3}
TRAINER = {"model": "userland:dropout_mlp", "modelArgs": {**DROPOUT, "step_seconds": 0.04},
           "evalData": None, "deterministic": True, "epochs": 100, "maxSteps": 160,
           "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}}
EVERY = 40


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with Cluster(tmp_path_factory.mktemp("kueue"), crds=[CRDS, COSCHEDULING_CRDS, VOLCANO_CRDS], kueue=True,
                 node_labels=FLAVOR_LABEL, extra_env={"PYTHONPATH": str(TESTS)}) as cluster:
        for document in one_queue(NS, cpus="2", flavor_labels=FLAVOR_LABEL):
            cluster.apply(document)
        start_operator(cluster, "--kueue", "--gang-scheduling")
        yield cluster


def queued(document: dict, priority: str) -> dict:
    document["metadata"]["labels"] = {queueing.QUEUE_LABEL: "team-a", queueing.PRIORITY_LABEL: priority}
    document["spec"]["resources"] = {"requests": {"cpu": "1"}}
    return document


def create(cluster: Cluster, document: dict) -> None:
    cluster.custom.create_namespaced_custom_object(GROUP, VERSION, NS, JOBS, document)


def status(cluster: Cluster, name: str) -> dict:
    return (cluster.get("ptj", NS, name) or {}).get("status") or {}


def wait_status(cluster: Cluster, name: str, predicate, what: str, timeout: float = STARTUP) -> dict:
    try:
        return cluster.wait_for(lambda: predicate(s := status(cluster, name)) and s, timeout, what)
    except TimeoutError:
        print(cluster.process_log("operator")[-4000:])
        raise AssertionError(f"{name}: {what}: {status(cluster, name)}") from None


def workload_of(cluster: Cluster, name: str) -> dict | None:
    return next((w for w in cluster.list("workloads", NS) if w["metadata"]["labels"].get("tandem.dev/job") == name),
                None)


def test_a_higher_priority_job_preempts_a_running_one_which_resumes_bit_identical(cluster, tmp_path):
    """Two jobs on a quota that fits one: the first runs, the second waits Queued with no pods. A third of higher
    priority preempts the first: its ranks checkpoint at the step they agree on and stop, its quota goes back, and
    the third runs. Admitted again, the first resumes from that checkpoint and ends with the weights of an
    uninterrupted run (`tandem run` of the same job, started once the first is preempted and run meanwhile);
    nothing counts as a failure."""
    first = yaml.safe_load(manifest(tmp_path, "first", trainer=TRAINER).read_text())
    first["spec"]["checkpoint"] = {"directory": "first", "persistentVolumeClaim": "first-checkpoints",
                                   "everySteps": EVERY}
    claim(cluster, "first-checkpoints")
    create(cluster, queued(first, "low"))
    running = wait_status(cluster, "first", lambda s: s.get("phase") == "Running" and s.get("progress", {}).get(
        "step", 0) > 0, "the first job to run")
    assert running["queue"]["admitted"] and running["queue"]["clusterQueue"] == "team"
    workload = workload_of(cluster, "first")
    assert workload["spec"]["priority"] == 10 and workload["spec"]["podSets"][0]["count"] == 2
    assert workload["metadata"]["ownerReferences"][0]["name"] == "first"
    assert all(p["spec"]["nodeSelector"] == FLAVOR_LABEL for p in pods(cluster, "first"))

    create(cluster, queued(custom_job("second", [sys.executable, "-c", "pass"]), "low"))
    waiting = wait_status(cluster, "second", lambda s: s.get("phase") == "Queued" and "insufficient unused quota" in
                          s.get("queue", {}).get("message", ""), "the second job to wait in the queue for quota")
    assert waiting["queue"]["reason"] == "Pending" and not waiting["queue"]["admitted"]
    assert not pods(cluster, "second")

    wait_status(cluster, "first", lambda s: s.get("checkpoint", {}).get("step"), "a first checkpoint")
    create(cluster, queued(custom_job("urgent", [sys.executable, "-c", "import time; time.sleep(2)"]), "high"))
    preempted = wait_status(cluster, "first", lambda s: s.get("phase") == "Queued" and not pods(cluster, "first"),
                            "the first job to be preempted and its ranks gone")
    stopped_at = preempted["checkpoint"]["step"]
    assert stopped_at == preempted["progress"]["step"] < TRAINER["maxSteps"], "a checkpoint at the agreed step"
    reference, reference_stderr = start_tandem_run(
        manifest(tmp_path, "reference", trainer={**TRAINER, "modelArgs": DROPOUT}))
    with reference:  # waited for, whatever happens meanwhile
        wait_status(cluster, "urgent", lambda s: s.get("phase") == "Succeeded", "the urgent job to run and finish")

        final = wait_status(cluster, "first", lambda s: s.get("phase") == "Succeeded",
                            "the first job to resume and end", timeout=240)
        assert final["restarts"] == 0, "a preemption is not a failure"
        assert final["queue"]["evictions"] == 1
        assert final["progress"]["step"] == TRAINER["maxSteps"]
        assert {"Requeued", "Admitted"} <= set(events(cluster, "first"))
        resumed_env = {e["name"]: e.get("value") for e in pods(cluster, "first")[0]["spec"]["containers"][0]["env"]}
        assert resumed_env["TANDEM_RESUME_FROM"].endswith(checkpoint_name(stopped_at))
        cluster.wait_for(lambda: any(c["type"] == "Finished" and c["status"] == "True" for c in (
            workload_of(cluster, "first").get("status") or {}).get("conditions", [])), 10,
            "the Workload marked Finished")
        wait_status(cluster, "second", lambda s: s.get("phase") == "Succeeded", "the second job, admitted last")

        reference.communicate(timeout=300)
        assert reference.returncode == 0, reference_stderr.read_text()
    on_cluster = checkpoint.load(checkpoint.latest(cluster.kubelet.claim_dir(NS, "first-checkpoints") / "first"))
    expected = final_weights(tmp_path, "reference")
    assert on_cluster["model"].keys() == expected.keys()
    differing = [key for key in expected if not torch.equal(expected[key], on_cluster["model"][key])]
    assert not differing, f"the preempted job's weights differ from an uninterrupted run's: {differing}"


def test_a_job_without_a_queue_label_is_untouched_by_kueue(cluster):
    create(cluster, custom_job("unqueued", [sys.executable, "-c", "pass"]))
    done = wait_status(cluster, "unqueued", lambda s: s.get("phase") == "Succeeded", "the job to run unqueued")
    assert "queue" not in done
    assert workload_of(cluster, "unqueued") is None


def test_a_gang_gets_its_podgroup_which_follows_a_resize(cluster):
    """spec.gang: the operator creates the Volcano PodGroup (Volcano's CRD schema checks it) before the pods,
    which carry Volcano's annotation and scheduler; no Volcano runs here, so they stay unscheduled, Pending. A resize
    replaces the group, and the PodGroup's minMember follows it (a patch of the existing one)."""
    create(cluster, custom_job("gang", gang={"scheduler": "volcano", "queue": "research"}))
    group = cluster.wait_for(lambda: cluster.get("podgroups.scheduling.volcano.sh", NS, "gang"), 30,
                             "the PodGroup")
    assert group["spec"] == {"minMember": 2, "queue": "research"}
    cluster.wait_for(lambda: len(pods(cluster, "gang")) == 2, 30, "the rank pods")
    for rank_pod in pods(cluster, "gang"):
        assert rank_pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "gang"
        assert rank_pod["spec"]["schedulerName"] == "volcano"
    pending = wait_status(cluster, "gang", lambda s: s.get("phase") == "Pending" and "pod" in s.get("message", ""),
                          "the gang to wait for its scheduler")
    assert not pending.get("queue")
    cluster.custom.patch_namespaced_custom_object(GROUP, VERSION, NS, JOBS, "gang", {"spec": {"workers": 4}})
    cluster.wait_for(lambda: cluster.get("podgroups.scheduling.volcano.sh", NS, "gang")["spec"]["minMember"] == 4,
                     30, "the PodGroup to follow the resize")
    cluster.wait_for(lambda: len(pods(cluster, "gang")) == 4, 30, "four rank pods")


def test_operator_log_has_no_errors(cluster):
    log = cluster.process_log("operator")
    assert "Traceback" not in log and "[ERROR]" not in log, log[-4000:]

