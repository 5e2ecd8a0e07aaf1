"""The ParallelTrainingJob's decisions (operator/training.py) and objects (operator/training_objects.py), without a
cluster: table-driven cases (name, the observed job and pods, the expected plan), one per transition, in the shape
of Kubeflow SDK's backend tests. Every object the operator would create passes kubernetes-validate --strict."""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta
from typing import Any

import kubernetes_validate
import pytest

from tandem.operator import training
from tandem.operator.lending import Borrower
from tandem.operator.observed import read_resource
from tandem.operator.training import Settings, reconcile
from tandem.operator.training_objects import (
    CHECKPOINT_MOUNT,
    GROUP_LABEL,
    JOB_LABEL,
    POD_INDEX_LABEL,
    RANK_LABEL,
    ROLE_LABEL,
    applied_job,
    changed_fields,
    child_name,
    coordinator_pod,
    running_group,
    spec_config_map,
    worker_pod,
)

NOW = datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC)
SETTINGS = Settings(worker_image="registry.example/tandem-worker:1", restart_backoff_seconds=10)


def ago(seconds: float) -> str:
    return (NOW - timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")


def job(status: dict | None = None, **spec: Any) -> dict[str, Any]:
    body = {
        "apiVersion": "tandem.dev/v1alpha1", "kind": "ParallelTrainingJob",
        "metadata": {"name": "digits", "namespace": "ml", "uid": "uid-1", "generation": 1},
        "spec": {"workers": 2, "trainer": {"model": "tandem.examples.digits:mlp",
                                            "data": "tandem.examples.digits:train_data"},
                 "checkpoint": {"directory": "digits", "persistentVolumeClaim": "checkpoints"}, **spec},
    }
    if status is not None:
        body["status"] = status
    return body


def conditions(**kinds: tuple[str, str, float]) -> list[dict[str, str]]:
    """Conditions from kind=(status, reason, seconds ago)."""
    return [{"type": kind, "status": value, "reason": reason, "message": "", "lastTransitionTime": ago(seconds)}
            for kind, (value, reason, seconds) in kinds.items()]


def running(restarts: int = 0, heartbeat: float | None = 2, started: float = 60, running_for: float = 50,
            **extra: Any) -> dict[str, Any]:
    status = {"phase": "Running", "restarts": restarts, "startTime": ago(started),
              "conditions": conditions(Running=("True", "Running", running_for)),
              "checkpoint": {"latest": f"{CHECKPOINT_MOUNT}/digits/step-00000100.pt"}, **extra}
    if heartbeat is not None:
        status["progress"] = {"lastHeartbeat": ago(heartbeat)}
    return status


def restarting(seconds: float, restarts: int = 0, reason: str = "Restarting") -> dict[str, Any]:
    """A job torn down `seconds` ago after a failure (or for a resize), waiting to start its next group."""
    return running(restarts=restarts, phase="Restarting", conditions=conditions(Restarting=("True", reason, seconds)))


def pod(index: int, phase: str = "Running", *, exit_code: int | None = None, message: str = "", reason: str = "",
        terminating: bool = False, waiting: tuple[str, str] | None = None, unschedulable: str | None = None,
        finished: float = 1, ranks_per_pod: int = 1, labelled: bool = True) -> dict[str, Any]:
    """Rank pod `index` (its ranks index x ranks_per_pod on); `labelled` False: as an operator from before
    ranksPerPod labelled it (no pod index)."""
    status: dict[str, Any] = {"phase": phase, "conditions": [{"type": "Ready",
                                                             "status": "True" if phase == "Running" else "False"}]}
    if exit_code is not None:
        status["containerStatuses"] = [{"name": "worker", "state": {"terminated": {
            "exitCode": exit_code, "reason": reason or ("Completed" if exit_code == 0 else "Error"), "message": message,
            "finishedAt": ago(finished)}}}]
    if waiting is not None:
        status["containerStatuses"] = [{"name": "worker", "state": {"waiting": {"reason": waiting[0],
                                                                                "message": waiting[1]}}}]
    if unschedulable is not None:
        status["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                 "message": unschedulable}]
    labels = {JOB_LABEL: "digits", RANK_LABEL: str(index * ranks_per_pod), GROUP_LABEL: "0"}
    if labelled:
        labels[POD_INDEX_LABEL] = str(index)
    metadata: dict[str, Any] = {"name": f"digits-worker-{index}", "namespace": "ml", "labels": labels}
    if terminating:
        metadata["deletionTimestamp"] = ago(1)
    return {"metadata": metadata, "status": status}


def coordinator(phase: str = "Running", **state: Any) -> dict[str, Any]:
    """An elastic job's coordinator pod, in `phase` (`state`: as for `pod`)."""
    made = pod(0, phase, **state)
    made["metadata"].update(name="digits-coordinator", labels={JOB_LABEL: "digits", ROLE_LABEL: "coordinator",
                                                               GROUP_LABEL: "0"})
    return made


def node_lost(rank: int) -> dict[str, Any]:
    """A rank pod on a node that stopped answering (on_a_lost_node)."""
    return on_a_lost_node(pod(rank, "Failed"))


def on_a_lost_node(lost: dict[str, Any]) -> dict[str, Any]:
    """A Failed pod as the node lifecycle controller and PodGC leave it on a node that stopped answering: the reason
    NodeLost, its container never seen to exit."""
    lost["status"].update(reason="NodeLost", message=f"Node n1 which was running pod {lost['metadata']['name']} is "
                                                     "unresponsive")
    lost["status"]["conditions"].append({"type": "DisruptionTarget", "status": "True", "reason": "DeletionByPodGC"})
    return lost


def applied(body: dict[str, Any], **spec: Any) -> dict[str, Any]:
    """The spec ConfigMap of the group now running (as it was created, with `spec` changed)."""
    was = copy.deepcopy(body)
    was["spec"].update(spec)
    return spec_config_map(was, parsed(was))


def kinds(plan) -> list[str]:
    return [f"{o['kind']}/{o['metadata']['name']}" for o in plan.create]


GROUP = ["Service/digits-workers", "ConfigMap/digits-spec", "ServiceAccount/digits-rank0", "Role/digits-rank0",
         "RoleBinding/digits-rank0", "Pod/digits-worker-0", "Pod/digits-worker-1"]
ELASTIC_GROUP = [*GROUP[:5], "Pod/digits-coordinator", *GROUP[5:]]
BOTH_RUNNING = [pod(0), pod(1)]
COORDINATED = [coordinator(), pod(0), pod(1)]
"""An elastic job's group running: its coordinator and both ranks."""

# (name, job, pods, config map changes or None (none yet) or {} (as the job), expected)
CASES = [
    ("new job: a group is created; the ranks resume from the claim's latest checkpoint, if any", job(), [], None,
     {"phase": "Pending", "create": GROUP, "event": "Created", "resume": "latest"}),
    ("new job with checkpoint.resume false: afresh", job(checkpoint={"directory": "digits", "resume": False,
                                                                       "persistentVolumeClaim": "checkpoints"}),
     [], None, {"phase": "Pending", "create": GROUP, "resume": ""}),
    ("new job on an emptyDir: afresh", job(checkpoint={"directory": "digits"}), [], None,
     {"phase": "Pending", "create": GROUP, "resume": ""}),
    ("restart on an emptyDir: afresh, not from a checkpoint that went with the old pods",
     job(restarting(11, restarts=1), checkpoint={"directory": "digits"}), [], {},
     {"phase": "Pending", "create": GROUP, "group": "1", "resume": ""}),
    ("restart before any checkpoint, resume false: afresh", job(
        {**restarting(11, restarts=1), "checkpoint": {}},
        checkpoint={"directory": "digits", "resume": False, "persistentVolumeClaim": "checkpoints"}), [], {},
     {"phase": "Pending", "create": GROUP, "group": "1", "resume": ""}),
    ("pods scheduled but not running: pending with the kubelet's reason", job(running()), [pod(0, "Pending"), pod(1)],
     {}, {"phase": "Pending", "message": "rank 0 (pod digits-worker-0): ContainerCreating"}),
    ("unschedulable: the scheduler's message", job({"phase": "Pending"}),
     [pod(0, "Pending", unschedulable="0/3 nodes are available: 3 Insufficient nvidia.com/gpu."), pod(1, "Pending")],
     {}, {"phase": "Pending", "message": "rank 0 (pod digits-worker-0): Unschedulable: 0/3 nodes are available: "
                                         "3 Insufficient nvidia.com/gpu."}),
    ("image pull: the image named", job({"phase": "Pending"}),
     [pod(0, "Pending", waiting=("ImagePullBackOff", 'Back-off pulling image "nope:1"')), pod(1, "Pending")],
     {}, {"phase": "Pending", "message": 'rank 0 (pod digits-worker-0): ImagePullBackOff: Back-off pulling image '
                                         '"nope:1"'}),
    ("every rank running: Running", job({"phase": "Pending", "startTime": ago(5)}), BOTH_RUNNING, {},
     {"phase": "Running", "ready": 2, "event": "Running"}),
    ("every rank exited 0: Succeeded", job(running()), [pod(0, "Succeeded", exit_code=0),
                                                       pod(1, "Succeeded", exit_code=0)], {},
     {"phase": "Succeeded", "event": "Succeeded", "completed": True}),
    ("rank 0 done, rank 1 still running: Running", job(running()), [pod(0, "Succeeded", exit_code=0), pod(1)], {},
     {"phase": "Running"}),
    ("a rank fails: the group is torn down for a restart", job(running()),
     [pod(0), pod(1, "Failed", exit_code=1, message="RuntimeError: boom")], {},
     {"phase": "Restarting", "restarts": 1, "delete": ["digits-worker-0", "digits-worker-1"], "event": "Restarting",
      "message": "rank 1 (pod digits-worker-1) exited with code 1: Error RuntimeError: boom; restart 1 of 3"}),
    ("a rank killed for memory with a long log: the reason is kept, and the log's end", job(running()),
     [pod(0), pod(1, "Failed", exit_code=137, reason="OOMKilled", message="x" * 5000 + " last line")], {},
     {"phase": "Restarting", "message": "exited with code 137: OOMKilled " + "x" * 590 + " last line"}),
    ("two ranks failed: the first to end is the cause", job(running()),
     [pod(0, "Failed", exit_code=1, message="Connection closed by peer", finished=1),
      pod(1, "Failed", exit_code=1, message="RuntimeError: boom", finished=2)], {},
     {"phase": "Restarting", "message": "rank 1 (pod digits-worker-1) exited with code 1: Error RuntimeError: boom"}),
    ("two ranks failed within one second: the one that lost its peer is not the cause", job(running()),
     [pod(0, "Failed", exit_code=1, message="RuntimeError: Read error: Connection reset by peer", finished=1),
      pod(1, "Failed", exit_code=137, message="", finished=1)], {},
     {"phase": "Restarting", "message": "rank 1 (pod digits-worker-1) exited with code 137"}),
    ("a rank that lost its peer a second ago, the peer still running: the peer's own failure is waited for",
     job(running()), [pod(0, "Failed", exit_code=1, message="Connection closed by peer", finished=1), pod(1)], {},
     {"phase": "Running", "restarts": 0, "delete": [], "requeue": 1.0}),
    ("a rank that lost its peer 3 s ago, the peer still running: restart all the same", job(running()),
     [pod(0, "Failed", exit_code=1, message="Connection closed by peer", finished=3), pod(1)], {},
     {"phase": "Restarting", "restarts": 1, "message": "rank 0 (pod digits-worker-0) exited with code 1"}),
    ("a rank's node lost: the group is torn down for a restart, the node named", job(running()),
     [pod(0), node_lost(1)], {},
     {"phase": "Restarting", "restarts": 1, "message": "rank 1 (pod digits-worker-1) failed: NodeLost Node n1 which "
                                                       "was running pod digits-worker-1 is unresponsive; restart 1"}),
    ("a rank pod deleted (evicted): restart", job(running()), [pod(0), pod(1, terminating=True)], {},
     {"phase": "Restarting", "restarts": 1, "delete": ["digits-worker-0"],
      "message": "rank 1's pod digits-worker-1 was deleted or evicted"}),
    ("a rank pod gone: restart", job(running()), [pod(0)], {},
     {"phase": "Restarting", "restarts": 1, "message": "rank 1's pod digits-worker-1 is gone"}),
    ("rank 0 silent past the heartbeat timeout: restart", job(running(heartbeat=400, running_for=500,
                                                                                   started=600)), BOTH_RUNNING, {},
     {"phase": "Restarting", "restarts": 1, "message": "rank 0 sent no heartbeat for more than 300 s",
      "kill_at_once": True}),
    ("a custom command reports no heartbeat: not a failure", job(running(heartbeat=None, running_for=900, started=950),
                                                                  trainingMode="custom", custom={"command": ["x"]}),
     BOTH_RUNNING, {}, {"phase": "Running", "delete": []}),
    ("backoffLimit spent: Failed", job(running(restarts=3)), [pod(0), pod(1, "Failed", exit_code=2)], {},
     {"phase": "Failed", "restarts": 3, "delete": ["digits-worker-0"], "event": "BackoffLimitExceeded",
      "completed": True, "message": "backoffLimit is 3"}),
    ("restarting: old pods still terminating, wait", job(restarting(30, restarts=1)), [pod(0, terminating=True)], {},
     {"phase": "Restarting", "create": [], "requeue": 1.0}),
    ("restarting: backoff not over, wait", job(restarting(5, restarts=2)), [], {},
     {"phase": "Restarting", "create": [], "requeue": 15.0}),
    ("restarting: pods gone and backoff over, a new group resumes from the checkpoint",
     job(restarting(11, restarts=1)), [], {},
     {"phase": "Pending", "create": GROUP, "group": "1", "event": "Restarted",
      "resume": f"{CHECKPOINT_MOUNT}/digits/step-00000100.pt"}),
    ("workers changed while running: resize from the checkpoint", job(running(), workers=3), BOTH_RUNNING,
     {"workers": 2}, {"phase": "Restarting", "restarts": 0, "delete": ["digits-worker-0", "digits-worker-1"],
                      "message": "resizing from 2 to 3 ranks"}),
    ("resizing, pods gone: the new size starts at once", job(restarting(0, reason="Resizing"), workers=3), [],
     {"workers": 2},
     {"phase": "Pending", "create": [*GROUP, "Pod/digits-worker-2"], "restarts": 0}),
    ("trainer changed while running: refused, keeps running", job(running(), image="other:2"), BOTH_RUNNING,
     {"image": "tandem-worker:1"}, {"phase": "Running", "condition": ("SpecChangeRefused", "True"), "delete": [],
                                    "condition_message": "spec.image cannot change while the ranks run"}),
    ("suspend: pods deleted (before the status is written), Suspended", job(running(), suspend=True), BOTH_RUNNING,
     {}, {"phase": "Suspended", "delete": ["digits-worker-0", "digits-worker-1"], "event": "Suspended",
          "stop_first": True}),
    ("unsuspended: a group resumes", job(running(phase="Suspended")), [], {},
     {"phase": "Pending", "create": GROUP, "event": "Resumed"}),
    ("past activeDeadlineSeconds: Failed, pods deleted", job(running(started=120), activeDeadlineSeconds=100),
     BOTH_RUNNING, {}, {"phase": "Failed", "event": "DeadlineExceeded", "delete": ["digits-worker-0",
                                                                                 "digits-worker-1"]}),
    ("finished with a rank still running: it is deleted, finished pods stay",
     job(running(phase="Failed", completionTime=ago(5))), [pod(0), pod(1, "Failed", exit_code=1)], {},
     {"phase": "Failed", "delete": ["digits-worker-0"]}),
    ("ttlSecondsAfterFinished not yet", job(running(phase="Succeeded", completionTime=ago(5)),
                                           ttlSecondsAfterFinished=60), [], {},
     {"phase": "Succeeded", "delete_job": False, "requeue": 55.0}),
    ("ttlSecondsAfterFinished passed: the job is deleted", job(running(phase="Succeeded", completionTime=ago(61)),
                                                               ttlSecondsAfterFinished=60), [], {},
     {"delete_job": True}),
    ("invalid spec: a condition naming the field, nothing else", job(workers=0), BOTH_RUNNING, None,
     {"create": [], "delete": [], "condition": ("InvalidSpec", "True"),
      "condition_message": "spec.workers: Input should be greater than or equal to 1", "event": "InvalidSpec"}),
    ("interrupted creation (operator restarted): the missing rank is created", job({"phase": "Pending"}), [pod(0)],
     {}, {"phase": "Pending", "create": ["Pod/digits-worker-1"]}),
    ("pods an operator before ranksPerPod created (no pod index): followed by their rank", job(running()),
     [pod(0, labelled=False), pod(1, labelled=False)], {}, {"phase": "Running", "ready": 2, "create": []}),
    # ranksPerPod: workers / ranksPerPod pods, each with its ranks' launcher
    ("4 ranks, 2 per pod: a group of 2 pods", job(workers=4, ranksPerPod=2), [], None,
     {"phase": "Pending", "create": GROUP, "resume": "latest"}),
    ("2 pods of 2 ranks running: 4 ranks ready", job({"phase": "Pending", "startTime": ago(5)}, workers=4,
                                                     ranksPerPod=2), [pod(0, ranks_per_pod=2), pod(1, ranks_per_pod=2)],
     {}, {"phase": "Running", "ready": 4, "ranks": 4, "pods": 2, "message": "4 ranks running in 2 pods"}),
    ("a pod of 2 ranks pending: both ranks named", job({"phase": "Pending"}, workers=4, ranksPerPod=2),
     [pod(0, "Pending", ranks_per_pod=2), pod(1, ranks_per_pod=2)], {},
     {"phase": "Pending", "message": "ranks 0-1 (pod digits-worker-0): ContainerCreating"}),
    ("a local rank fails: its launcher's words name the rank and the local rank", job(running(), workers=4,
                                                                                       ranksPerPod=2),
     [pod(0, ranks_per_pod=2), pod(1, "Failed", exit_code=7, ranks_per_pod=2,
                                   message="rank 3 (local rank 1) exited with code 7\nTraceback\nValueError: boom")],
     {}, {"phase": "Restarting", "restarts": 1, "delete": ["digits-worker-0", "digits-worker-1"],
          "message": "rank 3 (pod digits-worker-1, local rank 1) exited with code 7: Error Traceback\n"
                     "ValueError: boom; restart 1 of 3"}),
    ("a pod of 2 ranks killed for memory: both ranks named", job(running(), workers=4, ranksPerPod=2),
     [pod(0, ranks_per_pod=2), pod(1, "Failed", exit_code=137, reason="OOMKilled", ranks_per_pod=2)], {},
     {"phase": "Restarting", "message": "ranks 2-3 (pod digits-worker-1) exited with code 137: OOMKilled"}),
    ("a pod of 2 ranks gone: restart", job(running(), workers=4, ranksPerPod=2), [pod(0, ranks_per_pod=2)], {},
     {"phase": "Restarting", "restarts": 1, "message": "ranks 2-3's pod digits-worker-1 is gone"}),
    ("ranksPerPod changed while running: regrouped from the checkpoint", job(running(), workers=4, ranksPerPod=2),
     [pod(index) for index in range(4)], {"ranksPerPod": 1},
     {"phase": "Restarting", "restarts": 0, "delete": [f"digits-worker-{index}" for index in range(4)],
      "message": "regrouping the 4 ranks from 1 to 2 per pod"}),
    ("elastic: rank 1 killed: its pod alone is deleted, still Running, no restart", job(running(), elastic={}),
     [coordinator(), pod(0), pod(1, "Failed", exit_code=137, reason="Error")], {},
     {"phase": "Running", "restarts": 0, "delete": ["digits-worker-1"], "create": [], "event": "ReplacingRank",
      "message": "rank 1 being replaced; the other ranks train on", "requeue": 1.0}),
    ("elastic: a replacement already under way: the pass that repeats its decision posts no second Event",
     job(running(message="rank 1 being replaced; the other ranks train on (spec.elastic)"), elastic={}),
     [coordinator(), pod(0), pod(1, "Failed", exit_code=137, reason="Error")], {},
     {"phase": "Running", "delete": ["digits-worker-1"], "events": []}),
    ("elastic: the lost rank's pod gone: its replacement created with the same slot", job(running(), elastic={}),
     [coordinator(), pod(0)], {}, {"phase": "Running", "restarts": 0, "delete": [],
                                   "create": ["Pod/digits-worker-1"]}),
    ("elastic: the replacement pending: still Running, READY says 1/2", job(running(), elastic={}),
     [coordinator(), pod(0), pod(1, "Pending")], {},
     {"phase": "Running", "ready": 1, "restarts": 0, "create": [],
      "message": "rank 1's replacement (pod digits-worker-1) is"}),
    ("elastic: a rank pod evicted (terminating): waited for, then replaced", job(running(), elastic={}),
     [coordinator(), pod(0), pod(1, terminating=True)], {},
     {"phase": "Running", "restarts": 0, "delete": [], "create": []}),
    ("elastic: rank 1 on a lost node: replaced alone", job(running(), elastic={}),
     [coordinator(), pod(0), node_lost(1)], {},
     {"phase": "Running", "restarts": 0, "delete": ["digits-worker-1"], "event": "ReplacingRank"}),
    # rank 0 is a rank like any other: the group's store and planner are the coordinator's
    ("elastic: rank 0 killed: its pod alone is deleted, no restart", job(running(), elastic={}),
     [coordinator(), pod(0, "Failed", exit_code=137), pod(1)], {},
     {"phase": "Running", "restarts": 0, "delete": ["digits-worker-0"], "create": [], "event": "ReplacingRank",
      "message": "rank 0 being replaced; the other ranks train on"}),
    ("elastic: rank 0's pod gone: its replacement created", job(running(), elastic={}), [coordinator(), pod(1)], {},
     {"phase": "Running", "restarts": 0, "delete": [], "create": ["Pod/digits-worker-0"]}),
    ("elastic: rank 0's pod evicted: waited for, then replaced", job(running(), elastic={}),
     [coordinator(), pod(0, terminating=True), pod(1)], {},
     {"phase": "Running", "restarts": 0, "delete": [], "create": []}),
    ("elastic: rank 0's replacement pending: still Running", job(running(), elastic={}),
     [coordinator(), pod(0, "Pending"), pod(1)], {},
     {"phase": "Running", "ready": 1, "message": "rank 0's replacement (pod digits-worker-0) is"}),
    ("elastic: the coordinator failed: a whole-group restart, counted, named", job(running(), elastic={}),
     [coordinator("Failed", exit_code=1, message="the group was lost 3 times at step 40"), pod(0), pod(1)], {},
     {"phase": "Restarting", "restarts": 1, "event": "Restarting", "recovery": "restart",
      "delete": ["digits-worker-0", "digits-worker-1", "digits-coordinator"],
      "message": "the group's coordinator (pod digits-coordinator) exited with code 1: Error the group was lost 3 "
                 "times at step 40; restart 1 of 3"}),
    ("elastic: the coordinator failed with the ranks that lost it: the coordinator is the cause",
     job(running(), elastic={}), [coordinator("Failed", exit_code=137, finished=2),
                                  pod(0, "Failed", exit_code=75, message="the job's coordinator (its store) is gone"),
                                  pod(1)], {},
     {"phase": "Restarting", "restarts": 1, "delete": ["digits-worker-0", "digits-worker-1", "digits-coordinator"],
      "message": "the group's coordinator (pod digits-coordinator) exited with code 137", "recovery": "restart"}),
    ("elastic: the coordinator's node lost: a whole-group restart", job(running(), elastic={}),
     [on_a_lost_node(coordinator("Failed")), pod(0), pod(1)], {},
     {"phase": "Restarting", "restarts": 1, "recovery": "restart",
      "message": "the group's coordinator (pod digits-coordinator) failed: NodeLost"}),
    ("elastic: the coordinator deleted: a whole-group restart", job(running(), elastic={}),
     [coordinator(terminating=True), pod(0), pod(1)], {},
     {"phase": "Restarting", "restarts": 1, "delete": ["digits-worker-0", "digits-worker-1"],
      "message": "the group's coordinator's pod digits-coordinator was deleted or evicted", "recovery": "restart"}),
    ("elastic: the coordinator deleted, exited 0 on its SIGTERM: a restart, not a success",
     job(running(), elastic={}), [coordinator("Succeeded", exit_code=0, terminating=True), pod(0), pod(1)], {},
     {"phase": "Restarting", "restarts": 1, "recovery": "restart",
      "message": "the group's coordinator's pod digits-coordinator was deleted"}),
    ("elastic: the coordinator gone once the group ran: a whole-group restart (its store went with it)",
     job(running(), elastic={}), BOTH_RUNNING, {},
     {"phase": "Restarting", "restarts": 1, "create": [], "delete": ["digits-worker-0", "digits-worker-1"],
      "message": "the group's coordinator's pod digits-coordinator is gone", "recovery": "restart"}),
    ("elastic: the coordinator missing while the group is created (operator restarted): created",
     job({"phase": "Pending", "startTime": ago(5)}, elastic={}), [pod(0, "Pending"), pod(1, "Pending")], {},
     {"phase": "Pending", "restarts": 0, "create": ["Pod/digits-coordinator"], "delete": []}),
    ("elastic: the coordinator pending, every rank running: Pending, the coordinator named",
     job({"phase": "Pending", "startTime": ago(5)}, elastic={}),
     [coordinator("Pending", unschedulable="0/3 nodes are available: 3 Insufficient cpu."), pod(0), pod(1)], {},
     {"phase": "Pending", "message": "the group's coordinator (pod digits-coordinator): Unschedulable: 0/3 nodes"}),
    ("elastic: the coordinator and every rank running: Running", job({"phase": "Pending", "startTime": ago(5)},
                                                                     elastic={}), COORDINATED, {},
     {"phase": "Running", "ready": 2, "event": "Running"}),
    ("elastic: the coordinator exited 0, a replacement still waiting to join: Succeeded, the replacement deleted "
     "next", job(running(), elastic={}), [coordinator("Succeeded", exit_code=0), pod(0, "Succeeded", exit_code=0),
                                          pod(1)], {},
     {"phase": "Succeeded", "completed": True, "event": "Succeeded", "message": "the group's coordinator exited 0"}),
    ("elastic: the coordinator exited 0, a replacement failed to join it: Succeeded all the same",
     job(running(), elastic={}), [coordinator("Succeeded", exit_code=0), pod(0, "Succeeded", exit_code=0),
                                  pod(1, "Failed", exit_code=75)], {},
     {"phase": "Succeeded", "restarts": 0, "completed": True}),
    ("elastic: rank 0 exited 0, the coordinator still running: not over yet", job(running(), elastic={}),
     [coordinator(), pod(0, "Succeeded", exit_code=0), pod(1)], {}, {"phase": "Running", "delete": []}),
    ("elastic: a rank exited with the group-restart code (the coordinator's fallback): the whole group restarts",
     job(running(), elastic={}), [coordinator(), pod(0), pod(1, "Failed", exit_code=75, message="RegroupFailed")],
     {}, {"phase": "Restarting", "restarts": 1, "delete": ["digits-worker-0", "digits-worker-1", "digits-coordinator"],
          "message": "rank 1 (pod digits-worker-1) exited with code 75", "recovery": "restart"}),
    ("elastic: a rank's permanent failure fails the job, not a replacement that would meet it too",
     job(running(), elastic={}), [coordinator(), pod(0, "Failed", exit_code=78,
                                                     message="InvalidModelOrData: the data has no array y"), pod(1)],
     {}, {"phase": "Failed", "restarts": 0, "event": "InvalidModelOrData", "completed": True,
          "delete": ["digits-worker-1", "digits-coordinator"]}),
    ("elastic: a new job: the coordinator is created with the ranks", job(elastic={}), [], None,
     {"phase": "Pending", "create": ELASTIC_GROUP, "event": "Created"}),
    ("elastic: restarting: a coordinator still terminating is waited for", job(restarting(30, restarts=1),
                                                                                elastic={}),
     [coordinator(terminating=True)], {}, {"phase": "Restarting", "create": [], "requeue": 1.0}),
    ("elastic: restarting, every pod gone: a new group with a new coordinator", job(restarting(11, restarts=1),
                                                                                    elastic={}), [], {},
     {"phase": "Pending", "create": ELASTIC_GROUP, "group": "1", "event": "Restarted"}),
    ("elastic: suspended: the coordinator stopped with the ranks", job(running(), suspend=True, elastic={}),
     COORDINATED, {}, {"phase": "Suspended", "stop_first": True, "event": "Suspended",
                       "delete": ["digits-worker-0", "digits-worker-1", "digits-coordinator"]}),
    ("elastic: finished: a coordinator still running is deleted", job(running(phase="Succeeded",
                                                                              completionTime=ago(5)), elastic={}),
     [coordinator(), pod(0, "Succeeded", exit_code=0), pod(1, "Succeeded", exit_code=0)], {},
     {"phase": "Succeeded", "delete": ["digits-coordinator"]}),
    ("elastic, recovery restart: a lost rank restarts the group as without elastic, no coordinator",
     job(running(), elastic={"recovery": "restart"}), [pod(0), pod(1, "Failed", exit_code=1)], {},
     {"phase": "Restarting", "restarts": 1, "delete": ["digits-worker-0", "digits-worker-1"], "recovery": "restart"}),
    ("elastic: kubectl scale up: the new rank's pod created, nothing restarts",
     job(running(), workers=3, elastic={"maxWorkers": 3}), COORDINATED, {"workers": 2},
     {"phase": "Running", "restarts": 0, "delete": [], "create": ["Pod/digits-worker-2"], "event": "ScalingUp"}),
    ("elastic: kubectl scale down: the excess rank's pod deleted (it leaves), nothing restarts",
     job(running(), workers=1, elastic={}), COORDINATED, {"workers": 2},
     {"phase": "Running", "restarts": 0, "delete": ["digits-worker-1"], "create": [], "event": "ScalingDown"}),
    ("elastic: the restarted group running: the restart's seconds measured", job(
        {**running(), "phase": "Pending", "lastRecovery": {"kind": "restart", "workers": 2, "stoppedAtStep": 130,
                                                           "resumedAtStep": 100, "time": ago(12)}}, elastic={}),
     COORDINATED, {}, {"phase": "Running", "recovery_seconds": 12.0}),
    ("workers not a multiple of ranksPerPod: a condition with the fix, nothing else", job(running(), workers=3,
                                                                                          ranksPerPod=2),
     BOTH_RUNNING, None, {"create": [], "delete": [], "condition": ("InvalidSpec", "True"),
                          "condition_message": "workers (3) must be a multiple of ranksPerPod (2)"}),
]


@pytest.mark.parametrize(("name", "body", "pods", "changes", "expected"), CASES, ids=[c[0] for c in CASES])
def test_reconcile(name, body, pods, changes, expected):
    config_map = None if changes is None else applied(body, **changes)
    plan = reconcile(read_resource(body), pods, config_map, NOW, SETTINGS)
    status = plan.status
    if "phase" in expected:
        assert status["phase"] == expected["phase"], status.get("message")
    if "create" in expected:
        assert kinds(plan) == expected["create"]
    if "delete" in expected:
        assert plan.delete_pods == expected["delete"]
    if "restarts" in expected:
        assert status["restarts"] == expected["restarts"]
    if "ready" in expected:
        ranks, pods = expected.get("ranks", 2), expected.get("pods", 2)
        assert status["workers"] == {"ready": expected["ready"], "total": ranks,
                                     "summary": f"{expected['ready']}/{ranks}", "pods": pods,
                                     "readyPods": expected["ready"] * pods // ranks}
    if "message" in expected:
        assert expected["message"] in status["message"], status["message"]
    if "event" in expected:
        assert [reason for _, reason, _ in plan.events] == [expected["event"]]
    if "events" in expected:
        assert [reason for _, reason, _ in plan.events] == expected["events"]
    if "completed" in expected:
        assert status.get("completionTime") == NOW.strftime("%Y-%m-%dT%H:%M:%SZ")
    assert plan.kill_at_once is expected.get("kill_at_once", False)
    assert plan.stop_first is expected.get("stop_first", False), "only a suspension stops the pods first"
    if "delete_job" in expected:
        assert plan.delete_job is expected["delete_job"]
    if "requeue" in expected:
        assert plan.requeue_after == pytest.approx(expected["requeue"])
    if "recovery" in expected:  # the operator's lastRecovery, sent beside its recoveries.restarts
        assert (status["lastRecovery"]["kind"], status["recoveries"]) == (expected["recovery"],
                                                                          {"restarts": status["restarts"]})
    elif "recovery_seconds" in expected:
        assert status["lastRecovery"]["seconds"] == expected["recovery_seconds"]
    else:
        assert "lastRecovery" not in status, "rank 0's regroups are its own to report"
    if "condition" in expected:
        kind, value = expected["condition"]
        [found] = [c for c in status["conditions"] if c["type"] == kind]
        assert found["status"] == value
        assert expected.get("condition_message", "") in found["message"]
    for created in plan.create:
        if created["kind"] == "Pod":
            env = {e["name"]: e.get("value") for e in created["spec"]["containers"][0]["env"]}
            if created["metadata"]["name"] != "digits-coordinator":  # which checkpoint is the ranks' business
                assert env["TANDEM_RESUME_FROM"] == expected.get("resume", env["TANDEM_RESUME_FROM"])
            assert created["metadata"]["labels"][GROUP_LABEL] == expected.get("group", "0")


def from_before_spec_hashes(config_map: dict[str, Any]) -> dict[str, Any]:
    """The spec ConfigMap as an operator before spec hashes wrote it: no annotations."""
    legacy = copy.deepcopy(config_map)
    del legacy["metadata"]["annotations"]
    return legacy


def with_annotation(config_map: dict[str, Any], key: str, value: str) -> dict[str, Any]:
    edited = copy.deepcopy(config_map)
    edited["metadata"]["annotations"][key] = value
    return edited


def parsed(body: dict[str, Any]):
    return read_resource(body).model


# (name, the running group's ConfigMap, the job now, expected: whether the group runs the job's spec, the group's
# size (workers, ranksPerPod), the fields named as changed)
DRIFT = [
    ("the same spec", applied(job()), job(), (True, (2, 1), [])),
    ("the image changed", applied(job(), image="tandem-worker:1"), job(image="other:2"), (False, (2, 1), ["image"])),
    ("the trainer and the shm size changed", applied(job()), job(shmSize="2Gi", trainer={
        "model": "tandem.examples.digits:cnn", "data": "tandem.examples.digits:train_data"}),
     (False, (2, 1), ["shmSize", "trainer"])),
    ("a field set where it was left out", applied(job()), job(schedulerName="volcano"),
     (False, (2, 1), ["schedulerName"])),
    ("a field removed", applied(job(), schedulerName="volcano"), job(), (False, (2, 1), ["schedulerName"])),
    ("policy fields read live changed: the group's spec is the same", applied(job()),
     job(backoffLimit=7, suspend=True, heartbeatTimeoutSeconds=60, activeDeadlineSeconds=3600,
         ttlSecondsAfterFinished=10), (True, (2, 1), [])),
    ("workers and ranksPerPod changed: the size, not the spec", applied(job()), job(workers=4, ranksPerPod=2),
     (True, (2, 1), [])),
    ("a field set to its default where it was left out: no change", applied(job()),
     job(shmSize="1Gi", trainingMode="allReduce", gpusPerWorker=0), (True, (2, 1), [])),
    ("an older operator's ConfigMap (no annotations), the same spec: read back, no change",
     from_before_spec_hashes(applied(job(workers=4))), job(workers=4), (True, (4, 1), [])),
    ("an older operator's ConfigMap, the image changed", from_before_spec_hashes(applied(job(), image="a:1")),
     job(image="b:2"), (False, (2, 1), ["image"])),
    ("an older operator's ConfigMap, resized: its size read back", from_before_spec_hashes(applied(job())),
     job(workers=3), (True, (2, 1), [])),
    ("an annotation edited into nonsense: read back", with_annotation(applied(job()), "tandem.dev/workers", "two"),
     job(), (True, (2, 1), [])),
    ("a hash that is not the spec's: a change", with_annotation(applied(job()), "tandem.dev/spec-hash", "0" * 16),
     job(), (False, (2, 1), [])),
]


@pytest.mark.parametrize(("name", "config_map", "body", "expected"), DRIFT, ids=[c[0] for c in DRIFT])
def test_a_running_groups_drift_is_found_by_the_hash_of_its_spec(name, config_map, body, expected):
    runs, size, changed = expected
    group = running_group(config_map)
    assert group.runs(parsed(body)) is runs
    assert (group.workers, group.ranks_per_pod) == size
    assert changed_fields(applied_job(config_map), parsed(body)) == changed


def test_no_spec_config_map_or_one_without_the_spec_is_no_running_group():
    emptied = copy.deepcopy(applied(job()))
    emptied["data"] = {}
    assert running_group(None) is None and running_group(emptied) is None


def test_a_pass_over_an_unchanged_running_group_does_not_read_its_config_map_back(monkeypatch):
    def read_back(config_map):
        raise AssertionError("the ConfigMap was read back although the hashes agree")

    monkeypatch.setattr(training, "applied_job", read_back)
    plan = reconcile(read_resource(job(running(), backoffLimit=5)), BOTH_RUNNING, applied(job()), NOW, SETTINGS)
    assert plan.status["phase"] == "Running" and plan.delete_pods == []


# (name, the job now, the older operator's group (its spec changes), expected phase, pods deleted, refused fields)
UPGRADES = [
    ("unchanged: runs on", job(running()), {}, "Running", [], None),
    ("a policy field changed: runs on", job(running(), backoffLimit=9), {}, "Running", [], None),
    ("the image changed: refused, runs on", job(running(), image="b:2"), {"image": "a:1"}, "Running", [],
     "spec.image cannot change"),
    ("workers changed: resized, as before the upgrade", job(running(), workers=3), {"workers": 2}, "Restarting",
     ["digits-worker-0", "digits-worker-1"], None),
]


@pytest.mark.parametrize(("name", "body", "changes", "phase", "deleted", "refused"), UPGRADES,
                         ids=[c[0] for c in UPGRADES])
def test_a_group_an_older_operator_started_is_decided_as_that_operator_did(name, body, changes, phase, deleted,
                                                                           refused):
    plan = reconcile(read_resource(body), BOTH_RUNNING, from_before_spec_hashes(applied(body, **changes)), NOW,
                     SETTINGS)
    assert plan.status["phase"] == phase and plan.delete_pods == deleted and plan.status["restarts"] == 0
    found = {c["type"]: c for c in plan.status["conditions"]}.get("SpecChangeRefused")
    assert (found is not None and found["status"] == "True" and refused in found["message"]) if refused else \
        found is None


def with_eta(status: dict[str, Any]) -> dict[str, Any]:
    """`status` with rank 0's ETA, as it wrote it while the group ran."""
    return {**status, "progress": {**status.get("progress", {}), "etaSeconds": 125.0, "etaText": "2m5s"}}


# (name, job, pods, whether the operator removes rank 0's ETA)
ETA_CASES = [
    ("running: rank 0's ETA stays", job(with_eta(running())), BOTH_RUNNING, False),
    ("succeeded: removed", job(with_eta(running())), [pod(0, "Succeeded", exit_code=0),
                                                      pod(1, "Succeeded", exit_code=0)], True),
    ("a rank failed, restarting: removed (rank 0 may be gone)", job(with_eta(running())),
     [pod(0), pod(1, "Failed", exit_code=1)], True),
    ("suspended: removed", job(with_eta(running()), suspend=True), BOTH_RUNNING, True),
    ("past the deadline, failed: removed", job(with_eta(running(started=120)), activeDeadlineSeconds=100),
     BOTH_RUNNING, True),
    ("failed earlier and rank 0 wrote its ETA since: removed again", job(with_eta(running(phase="Failed",
                                                                                          completionTime=ago(5)))),
     [], True),
    ("succeeded, the ETA already removed: nothing to remove", job(running(phase="Succeeded", completionTime=ago(5))),
     [], False),
]


@pytest.mark.parametrize(("name", "body", "pods", "removed"), ETA_CASES, ids=[c[0] for c in ETA_CASES])
def test_the_operator_removes_rank_0s_eta_once_the_job_is_not_running(name, body, pods, removed):
    status = reconcile(read_resource(body), pods, applied(body), NOW, SETTINGS).status
    assert status.get("progress") == ({"etaSeconds": None, "etaText": None} if removed else None)


def test_the_status_names_the_master_and_selects_exactly_the_rank_pods():
    status = reconcile(read_resource(job(running())), BOTH_RUNNING, applied(job()), NOW, SETTINGS).status
    assert status["master"] == {"pod": "digits-worker-0", "address": "digits-worker-0.digits-workers", "port": 29500}
    assert status["selector"] == "tandem.dev/job=digits,tandem.dev/role notin (coordinator)"
    assert status["observedGeneration"] == 1


def test_conditions_keep_their_transition_time_until_their_status_changes():
    body = job({"phase": "Pending", "conditions": conditions(Pending=("True", "Created", 30))})
    first = reconcile(read_resource(body), [pod(0, "Pending"), pod(1, "Pending")], applied(body), NOW, SETTINGS).status
    [pending] = [c for c in first["conditions"] if c["type"] == "Pending"]
    assert pending["lastTransitionTime"] == ago(30)
    body["status"] = first
    second = reconcile(read_resource(body), BOTH_RUNNING, applied(body), NOW, SETTINGS).status
    by_type = {c["type"]: c for c in second["conditions"]}
    assert by_type["Running"]["status"] == "True" and by_type["Running"]["lastTransitionTime"] == ago(0)
    assert by_type["Pending"]["status"] == "False"


def test_without_a_claim_checkpoints_are_on_an_empty_dir_and_a_condition_says_they_will_not_survive():
    body = job(checkpoint={"directory": "digits"})
    plan = reconcile(read_resource(body), [], None, NOW, SETTINGS)
    [durable] = [c for c in plan.status["conditions"] if c["type"] == "CheckpointsDurable"]
    assert durable["status"] == "False" and "do not survive a restart" in durable["message"]
    [pod0] = [o for o in plan.create if o["metadata"]["name"] == "digits-worker-0"]
    assert {"name": "tandem-checkpoints", "emptyDir": {}} in pod0["spec"]["volumes"]


PASSED_THROUGH = {"gpusPerWorker": 1, "image": "me/train:2", "priorityClassName": "high",
                  "nodeSelector": {"gpu": "h100"}, "tolerations": [{"key": "gpu", "operator": "Exists"}],
                  "env": [{"name": "HF_HOME", "value": "/cache"}],
                  "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}],
                  "volumeMounts": [{"name": "data", "mountPath": "/data"}]}
"""Settings a rank pod takes from the spec (the coordinator's pod some of them)."""


def rank0_pod(**spec: Any) -> dict[str, Any]:
    body = job(**spec)
    return worker_pod(body, parsed(body), 0, group=2, resume_from="/var/lib/tandem/checkpoints/digits/step-00000100.pt",
                      default_image="tandem-worker:1")


def test_a_rank_pod_carries_the_worker_contract_and_the_passthrough_settings():
    created = rank0_pod(**PASSED_THROUGH, schedulerName="volcano",
                        resources={"requests": {"cpu": "4", "memory": "16Gi"}})
    spec = created["spec"]
    [container] = spec["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert container["command"] == ["tandem", "worker", "train"] and container["image"] == "me/train:2"
    assert env == {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                   "MASTER_ADDR": "digits-worker-0.digits-workers", "MASTER_PORT": "29500", "TANDEM_JOB": "digits",
                   "TANDEM_NAMESPACE": "ml", "TANDEM_SPEC": "/etc/tandem/job.json",
                   "TANDEM_CHECKPOINT_DIR": "/var/lib/tandem/checkpoints/digits",
                   "TANDEM_RESUME_FROM": "/var/lib/tandem/checkpoints/digits/step-00000100.pt", "HF_HOME": "/cache",
                   "TANDEM_JOB_UID": "uid-1"}
    assert container["resources"] == {"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"nvidia.com/gpu": "1"}}
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["restartPolicy"] == "Never"
    assert (spec["hostname"], spec["subdomain"]) == ("digits-worker-0", "digits-workers")
    assert (spec["schedulerName"], spec["priorityClassName"]) == ("volcano", "high")
    assert spec["nodeSelector"] == {"gpu": "h100"} and spec["serviceAccountName"] == "digits-rank0"
    assert {"name": "tandem-shm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}} in spec["volumes"]
    assert {"name": "data", "mountPath": "/data", "readOnly": False} in container["volumeMounts"]
    assert created["metadata"]["labels"][RANK_LABEL] == "0" and created["metadata"]["labels"][GROUP_LABEL] == "2"
    assert created["metadata"]["ownerReferences"][0]["uid"] == "uid-1"


def test_a_pod_of_several_ranks_runs_their_launcher_with_all_their_gpus():
    body = job(workers=8, ranksPerPod=4, gpusPerWorker=1, shmSize="8Gi")
    created = worker_pod(body, parsed(body), 1, group=0, resume_from=None, default_image="tandem-worker:1")
    spec = created["spec"]
    [container] = spec["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert container["command"] == ["tandem", "worker", "launch", "--termination-log", "/dev/termination-log"]
    assert container["terminationMessagePath"] == "/dev/termination-log"
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "4"}
    assert {key: env[key] for key in ("GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")} == {
        "GROUP_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "digits-worker-0.digits-workers"}
    assert "RANK" not in env and "LOCAL_RANK" not in env, "the launcher gives each rank its own"
    assert {"name": "tandem-shm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}} in spec["volumes"]
    assert {"name": "tandem-shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert spec["hostname"] == "digits-worker-1" and "serviceAccountName" not in spec
    assert created["metadata"]["labels"][RANK_LABEL] == "4" and created["metadata"]["labels"][POD_INDEX_LABEL] == "1"
    kubernetes_validate.validate(created, kubernetes_validate.latest_version(), strict=True)


def test_cpu_ranks_get_no_gpu_limit_and_other_ranks_no_service_account_token():
    plan = reconcile(read_resource(job()), [], None, NOW, SETTINGS)
    [pod1] = [o for o in plan.create if o["metadata"]["name"] == "digits-worker-1"]
    assert "nvidia.com/gpu" not in pod1["spec"]["containers"][0]["resources"].get("limits", {})
    assert pod1["spec"]["automountServiceAccountToken"] is False and "serviceAccountName" not in pod1["spec"]


def elastic_coordinator(**spec: Any) -> dict[str, Any]:
    body = job(elastic={}, **spec)
    return coordinator_pod(body, parsed(body), group=1, default_image="tandem-worker:1")


def test_an_elastic_jobs_coordinator_serves_the_store_on_cpu_under_the_ranks_service_as_they_run():
    """The coordinator's pod: the ranks' image, non-root as they are, the spec file mounted, their Service for DNS,
    the store's port; no GPU and none of the ranks' resources or volumes (a rank's), no API token."""
    created = elastic_coordinator(**PASSED_THROUGH, resources={"requests": {"cpu": "4", "memory": "16Gi"},
                                                               "limits": {"nvidia.com/gpu": "1"}})
    spec = created["spec"]
    [container] = spec["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert container["command"] == ["tandem", "worker", "coordinator"]
    assert container["image"] == "me/train:2"
    assert env == {"WORLD_SIZE": "2", "MASTER_ADDR": "digits-coordinator.digits-workers", "MASTER_PORT": "29500",
                   "TANDEM_JOB": "digits", "TANDEM_NAMESPACE": "ml", "TANDEM_SPEC": "/etc/tandem/job.json",
                   "HF_HOME": "/cache"}
    assert container["resources"] == {"requests": {"cpu": "100m", "memory": "512Mi"}, "limits": {}}
    assert container["ports"] == [{"name": "rendezvous", "containerPort": 29500, "protocol": "TCP"}]
    assert container["securityContext"] == {"allowPrivilegeEscalation": False, "runAsNonRoot": True,
                                            "capabilities": {"drop": ["ALL"]}}
    assert spec["securityContext"] == rank0_pod()["spec"]["securityContext"]
    assert (spec["hostname"], spec["subdomain"]) == ("digits-coordinator", "digits-workers")
    assert spec["restartPolicy"] == "Never" and spec["automountServiceAccountToken"] is False
    assert "serviceAccountName" not in spec
    assert spec["volumes"] == [{"name": "tandem-spec", "configMap": {"name": "digits-spec"}}]
    assert container["volumeMounts"] == [{"name": "tandem-spec", "mountPath": "/etc/tandem", "readOnly": True}]
    assert (spec["nodeSelector"], spec["priorityClassName"]) == ({"gpu": "h100"}, "high")
    labels = created["metadata"]["labels"]
    assert (labels[JOB_LABEL], labels[ROLE_LABEL], labels[GROUP_LABEL]) == ("digits", "coordinator", "1")
    assert RANK_LABEL not in labels and POD_INDEX_LABEL not in labels, "no rank pod's labels: it hosts no rank"
    assert created["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    kubernetes_validate.validate(created, kubernetes_validate.latest_version(), strict=True)


def test_an_elastic_jobs_ranks_find_the_coordinator_and_may_each_report_as_rank_0():
    """Every rank pod of an elastic job: MASTER_ADDR the coordinator's name, and rank 0's ServiceAccount with its
    token (any rank becomes rank 0 once the lower slots are lost); status.master names the coordinator."""
    plan = reconcile(read_resource(job(elastic={})), [], None, NOW, SETTINGS)
    ranks = [o for o in plan.create if o["kind"] == "Pod" and o["metadata"]["name"] != "digits-coordinator"]
    assert len(ranks) == 2
    for created in ranks:
        env = {e["name"]: e.get("value") for e in created["spec"]["containers"][0]["env"]}
        assert env["MASTER_ADDR"] == "digits-coordinator.digits-workers"
        assert created["spec"]["serviceAccountName"] == "digits-rank0"
        assert created["spec"]["automountServiceAccountToken"] is True
    status = reconcile(read_resource(job(running(), elastic={})), COORDINATED, applied(job(elastic={})), NOW,
                       SETTINGS).status
    assert status["master"] == {"pod": "digits-coordinator", "address": "digits-coordinator.digits-workers",
                                "port": 29500}
    assert status["selector"] == "tandem.dev/job=digits,tandem.dev/role notin (coordinator)"


def test_an_elastic_job_recovering_by_restart_has_no_coordinator():
    plan = reconcile(read_resource(job(elastic={"recovery": "restart"})), [], None, NOW, SETTINGS)
    assert kinds(plan) == GROUP
    [pod1] = [o for o in plan.create if o["metadata"]["name"] == "digits-worker-1"]
    assert "serviceAccountName" not in pod1["spec"]


@pytest.mark.parametrize("created", reconcile(read_resource(job(elastic={}, gpusPerWorker=1)), [], None, NOW,
                                              SETTINGS).create, ids=lambda o: f"{o['kind']}/{o['metadata']['name']}")
def test_every_object_of_an_elastic_job_is_valid_kubernetes_under_strict_validation(created):
    kubernetes_validate.validate(created, kubernetes_validate.latest_version(), strict=True)


def test_rank_zero_may_get_and_patch_its_own_job_and_status_and_nothing_else():
    plan = reconcile(read_resource(job()), [], None, NOW, SETTINGS)
    [role] = [o for o in plan.create if o["kind"] == "Role"]
    assert role["rules"] == [{"apiGroups": ["tandem.dev"],
                              "resources": ["paralleltrainingjobs", "paralleltrainingjobs/status"],
                              "resourceNames": ["digits"], "verbs": ["get", "patch"]}]
    [binding] = [o for o in plan.create if o["kind"] == "RoleBinding"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "digits-rank0", "namespace": "ml"}]


def test_the_spec_config_map_round_trips_the_job_the_ranks_run():
    plan = reconcile(read_resource(job()), [], None, NOW, SETTINGS)
    [config_map] = [o for o in plan.create if o["kind"] == "ConfigMap"]
    assert applied_job(config_map).spec.workers == 2


@pytest.mark.parametrize("created", reconcile(read_resource(job(gpusPerWorker=1, schedulerName="volcano")), [], None,
                                              NOW, SETTINGS).create, ids=lambda o: o["kind"])
def test_every_object_is_valid_kubernetes_under_strict_validation(created):
    kubernetes_validate.validate(created, kubernetes_validate.latest_version(), strict=True)


def test_long_job_names_still_give_dns_label_names():
    name = "a" * 60
    assert len(child_name(name, "worker-12")) == 63 and child_name(name, "worker-12").endswith("-worker-12")
    assert child_name(name, "worker-12") != child_name("a" * 61, "worker-12")


REGROUP = {"kind": "regroup", "lost": [1], "added": [], "workers": 1, "stoppedAtStep": 40, "resumedAtStep": 40,
           "seconds": 0.7}


@pytest.mark.parametrize(("name", "status", "seen", "expected"), [
    ("no look yet: nothing told", {"recoveries": {"regroups": 1}, "lastRecovery": REGROUP}, None, []),
    ("a regroup since the last look", {"recoveries": {"regroups": 1}, "lastRecovery": REGROUP}, 0,
     ["lost rank(s) 1: 1 rank(s) train on from step 40 in 0.70 s, nothing restarted (spec.elastic)"]),
    ("two since the last look", {"recoveries": {"regroups": 3}, "lastRecovery": {**REGROUP, "lost": [],
                                                                                   "added": [1], "workers": 2}}, 1,
     ["2 regroups since the last look; the latest: added rank(s) 1: 2 rank(s) train on from step 40"]),
    ("none since", {"recoveries": {"regroups": 1}, "lastRecovery": REGROUP}, 1, []),
    ("the latest recovery a restart (the operator's Event told it)",
     {"recoveries": {"regroups": 2}, "lastRecovery": {**REGROUP, "kind": "restart"}}, 1, []),
])
def test_each_regroup_rank_0_reports_gets_an_event(name, status, seen, expected):
    events = training.regroup_events(status, seen)
    assert [(kind, reason) for kind, reason, _ in events] == [("Normal", "Regrouped")] * len(expected)
    for (_, _, message), start in zip(events, expected, strict=True):
        assert message.startswith(start), message


LENDING = {"minWorkers": 1, "lendTo": {"poolSelector": {"matchLabels": {"tier": "online"}},
                                       "stabilizationWindowSeconds": 60}}
"""spec.elastic of a job that lends to the pools labelled tier=online."""
ONE_LENT = {"workers": 1, "to": ["online"], "since": ago(30), "pools": [
    {"name": "online", "workers": 1, "baseReplicas": 1, "workersPerReplica": 1.0}], "unplaceable": []}


def lending(status: dict[str, Any], borrowers: list[Borrower], pods: list[dict[str, Any]], **labels: str):
    body = job(status, workers=3, elastic=LENDING)
    body["metadata"]["labels"] = labels
    return reconcile(read_resource(body), pods, None, NOW, SETTINGS, borrowers=borrowers)


def test_a_job_at_its_size_lends_its_highest_rank_to_a_pool_short_of_what_the_ranks_hold():
    plan = lending(running(), [Borrower("online", 2, 2, 1, 1.0)], [coordinator(), pod(0), pod(1), pod(2)])
    assert plan.delete_pods == ["digits-worker-2"] and plan.create == []
    assert plan.status["lent"] == {**ONE_LENT, "since": ago(0)}
    assert [reason for _, reason, _ in plan.events] == ["Lent"], "its Event, no ScalingDown"
    assert plan.status["phase"] == "Running" and plan.status["workers"]["total"] == 3


def test_a_loan_keeps_the_group_smaller_and_says_so_until_it_is_taken_back():
    kept = lending(running(lent=ONE_LENT), [Borrower("online", 2, 2, 0, 0.0)], [coordinator(), pod(0), pod(1)])
    assert (kept.create, kept.delete_pods, kept.events) == ([], [], [])
    assert kept.status["lent"] == ONE_LENT and kept.status["phase"] == "Running"
    assert kept.status["message"] == "2 of 3 ranks running; 1 lent to InferencePool online (spec.elastic.lendTo)"
    almost = {**ONE_LENT, "pools": [{**ONE_LENT["pools"][0], "surplusSince": ago(58)}]}
    waiting = lending(running(lent=almost), [Borrower("online", 1, 1, 0, 0.0)], [coordinator(), pod(0), pod(1)])
    assert waiting.status["lent"] == almost and waiting.requeue_after == 2, "it looks again when the window runs out"
    surplus = {**ONE_LENT, "pools": [{**ONE_LENT["pools"][0], "surplusSince": ago(61)}]}
    back = lending(running(lent=surplus), [Borrower("online", 1, 1, 0, 0.0)], [coordinator(), pod(0), pod(1)])
    assert [o["metadata"]["name"] for o in back.create] == ["digits-worker-2"]
    assert back.status["lent"] is None
    assert [reason for _, reason, _ in back.events] == ["TookBack"], "its Event, no ScalingUp"


def test_a_group_started_again_under_a_loan_starts_with_the_ranks_not_lent():
    plan = lending({**restarting(30, restarts=1), "lent": ONE_LENT}, [Borrower("online", 2, 2, 0, 0.0)], [])
    created = {o["metadata"]["name"]: {e["name"]: e.get("value") for e in o["spec"]["containers"][0]["env"]}
               for o in plan.create if o["kind"] == "Pod"}
    assert sorted(created) == ["digits-coordinator", "digits-worker-0", "digits-worker-1"]
    assert {env["WORLD_SIZE"] for env in created.values()} == {"2"}, "generation 1 of 2 slots"


def test_under_kueue_a_job_lends_nothing_and_a_condition_says_why():
    plan = lending(running(), [Borrower("online", 2, 2, 1, 1.0)], [coordinator(), pod(0), pod(1), pod(2)],
                   **{"kueue.x-k8s.io/queue-name": "team"})
    assert plan.status["lent"] is None and "Lent" not in [reason for _, reason, _ in plan.events]
    refused = next(c for c in plan.status["conditions"] if c["type"] == "LendingRefused")
    assert (refused["status"], refused["reason"]) == ("True", "KueueManaged")
    assert "cannot shrink an admitted Workload" in refused["message"]


def test_a_finished_job_lends_nothing():
    plan = lending(running(phase="Succeeded", lent=ONE_LENT), [Borrower("online", 2, 2, 0, 0.0)], [])
    assert plan.status["lent"] is None and plan.events == []


def test_a_job_whose_lend_to_was_removed_takes_its_workers_back():
    body = job({**running(), "lent": ONE_LENT}, workers=3, elastic={"minWorkers": 1})
    plan = reconcile(read_resource(body), [coordinator(), pod(0), pod(1)], None, NOW, SETTINGS, borrowers=[])
    assert plan.status["lent"] is None and [reason for _, reason, _ in plan.events] == ["TookBack"]
    assert [o["metadata"]["name"] for o in plan.create] == ["digits-worker-2"]
    without_elastic = reconcile(read_resource(job({**running(), "lent": ONE_LENT}, workers=3)), [pod(0), pod(1)],
                                None, NOW, SETTINGS, borrowers=[])
    assert without_elastic.status["lent"] is None and without_elastic.events[0][1] == "TookBack"
