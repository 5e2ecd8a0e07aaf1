"""What the operator sends for a decision: `handlers._apply` and `pool_handlers._apply` carrying out a Plan, recorded
call by call in the order the calls are sent and answered. The reconcile tables (test_training_reconcile.py,
test_queueing.py) check the Plan; these check what becomes of it: the grace period rank pods are deleted with, the
order of creates and of the status patch, that concurrent calls have all settled before a failure ends the pass,
and what a 404 under a replace does to the loop.

`RecordingCluster` stands in for the operator's `Cluster` (operator/cluster.py): each call is answered after a
scripted number of turns of the event loop, or fails as scripted, so the interleaving of concurrent calls is
certain rather than a race. The same calls through the real `Cluster` and the `kubernetes` client against the
emulated API server are tests/integration/test_operator_calls.py."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException
from test_api_policy import loop_waits
from test_queueing import EVICTED, KUEUE, queued_job
from test_training_reconcile import NOW, SETTINGS, applied, job, pod, running

from tandem.operator import daemon, handlers, pool_handlers
from tandem.operator.api_policy import Unavailable
from tandem.operator.observed import read_resource
from tandem.operator.pools import PoolPlan
from tandem.operator.training import Plan, Queueing, Settings, reconcile

BOTH_RUNNING = [pod(0), pod(1)]


class RecordingCluster:
    """The calls `_apply` makes, as ("sent" | "answered" | "failed", verb, what, detail) in the order they happen;
    `what` is "Kind/name" ("status" for the job's or pool's status). `turns`: how many turns of the event loop the
    call on `what` takes to be answered (default 1); `fail`: the calls (by `what`) answered with an exception."""

    def __init__(self, turns: dict[str, int] | None = None, fail: dict[str, BaseException] | None = None) -> None:
        self.turns, self.fail = turns or {}, fail or {}
        self.log: list[tuple[str, str, str, Any]] = []

    async def _call(self, verb: str, what: str, detail: Any = None, answer: Any = None) -> Any:
        self.log.append(("sent", verb, what, detail))
        for _ in range(self.turns.get(what, 1)):
            await asyncio.sleep(0)
        if what in self.fail:
            self.log.append(("failed", verb, what, detail))
            raise self.fail[what]
        self.log.append(("answered", verb, what, detail))
        return answer

    async def create(self, manifest: dict[str, Any]) -> None:
        await self._call("create", f"{manifest['kind']}/{manifest['metadata']['name']}")

    async def put(self, manifest: dict[str, Any], existing: dict[str, Any] | None) -> dict[str, Any] | None:
        verb = "create" if existing is None else "replace"
        return await self._call(verb, f"{manifest['kind']}/{manifest['metadata']['name']}",
                                answer={**manifest, "metadata": {**manifest["metadata"], "uid": "new"}})

    async def delete(self, kind: str, name: str, namespace: str, grace_seconds: int | None = None) -> bool:
        return await self._call("delete", f"{kind}/{name}", grace_seconds, answer=True)

    async def patch_status(self, plural: str, name: str, namespace: str, status: dict[str, Any]) -> None:
        await self._call("patch", "status", status)

    async def patch_custom_status(self, group: str, version: str, plural: str, namespace: str, name: str,
                                  patch: dict[str, Any]) -> dict[str, Any]:
        return await self._call("patch", f"Workload/{name}", patch, answer=patch)

    async def delete_custom(self, plural: str, name: str, namespace: str, *_: Any) -> bool:
        return await self._call("delete", f"{plural}/{name}", answer=True)

    def index(self, event: str, verb: str, what: str) -> int:
        return next(i for i, entry in enumerate(self.log) if entry[:3] == (event, verb, what))

    def calls(self, event: str, verb: str, kind: str = "") -> list[tuple[str, Any]]:
        return [(what, detail) for e, v, what, detail in self.log
                if (e, v) == (event, verb) and what.startswith(kind)]


@pytest.fixture(autouse=True)
def no_events(monkeypatch):
    """`daemon.publish` posts the decision's Events through kopf, which needs a running operator: recorded here."""
    posted = []
    monkeypatch.setattr(daemon.kopf, "event", lambda body, **event: posted.append(event))
    return posted


def carry_out(plan: Plan, body: dict[str, Any], pods: list[dict[str, Any]], cluster: RecordingCluster) -> None:
    state = daemon.Reconciliation("paralleltrainingjobs", "ml", "digits")
    asyncio.run(handlers._apply(plan, body, pods, cluster, state, handlers.QueueReads()))


@dataclass
class Decision:
    name: str
    body: dict[str, Any]
    pods: list[dict[str, Any]]
    grace: int | None
    """The grace period every rank pod is deleted with: None is the pod's own (terminationGracePeriodSeconds:
    SIGTERM, and the ranks checkpoint); 0 is SIGKILL at once."""
    pods_before_status: bool
    """The ranks are stopped before the status is written (a suspension the spec records) rather than after it
    (the decision first: an operator stopped between the two finds it in the status)."""
    config_map: dict[str, Any] | None = None
    settings: Settings = SETTINGS
    queued: Queueing | None = None
    reason: str = ""
    """The reason of the phase condition the decision sets (that the case is the decision it names)."""


DECISIONS = [
    Decision("a suspension stops the ranks with their grace period, before the status",
             job(running(), suspend=True), BOTH_RUNNING, grace=None, pods_before_status=True, reason="Suspended"),
    Decision("a preemption by Kueue stops the ranks with their grace period, before the status",
             queued_job(running()), BOTH_RUNNING, grace=None, pods_before_status=True, settings=KUEUE,
             queued=Queueing(workload=EVICTED), reason="Preempted"),
    Decision("a resize (kubectl scale) stops the ranks with their grace period, after the status",
             job(running(), workers=3), BOTH_RUNNING, grace=None, pods_before_status=False,
             config_map=applied(job(running()), workers=2), reason="Resizing"),
    Decision("a failed rank's siblings are stopped with their grace period, after the status",
             job(running()), [pod(0), pod(1, "Failed", exit_code=1)], grace=None, pods_before_status=False,
             reason="Restarting"),
    Decision("past activeDeadlineSeconds the ranks are stopped with their grace period",
             job(running(started=120), activeDeadlineSeconds=100), BOTH_RUNNING, grace=None,
             pods_before_status=False, reason="DeadlineExceeded"),
    Decision("a group whose rank 0 went silent hangs: killed at once, after the status",
             job(running(heartbeat=400, running_for=500, started=600)), BOTH_RUNNING, grace=0,
             pods_before_status=False, reason="Restarting"),
]


@pytest.mark.parametrize("decision", DECISIONS, ids=[d.name for d in DECISIONS])
def test_rank_pods_are_deleted_with_the_grace_period_their_decision_calls_for(decision: Decision):
    plan = reconcile(read_resource(decision.body), decision.pods, decision.config_map, NOW, decision.settings,
                     decision.queued)
    phase = plan.status["phase"]
    assert next(c for c in plan.status["conditions"] if c["type"] == phase)["reason"] == decision.reason
    cluster = RecordingCluster()
    carry_out(plan, decision.body, decision.pods, cluster)
    live = [f"Pod/{p['metadata']['name']}" for p in decision.pods]  # a failed rank's pod too: it is the group's
    deleted = cluster.calls("sent", "delete", "Pod/")
    assert sorted(pod for pod, _ in deleted) == live
    assert {grace for _, grace in deleted} == {decision.grace}
    if decision.pods_before_status:
        assert max(cluster.index("answered", "delete", pod) for pod in live) < cluster.index("sent", "patch", "status")
    else:
        assert min(cluster.index("sent", "delete", pod) for pod in live) > cluster.index("answered", "patch", "status")


@pytest.mark.parametrize(("name", "body", "settings", "first"), [
    ("a plain job", job(), SETTINGS, ["Service", "ConfigMap", "ServiceAccount", "Role", "RoleBinding"]),
    ("a gang's job", job(gang={"scheduler": "coscheduling"}), Settings(worker_image="w:1", gang_scheduling=True),
     ["Service", "ConfigMap", "ServiceAccount", "Role", "RoleBinding", "PodGroup"]),
])
def test_a_new_groups_pods_are_created_only_once_everything_they_mount_and_run_as_is_answered(
        name, body, settings, first):
    """A pod created before its ServiceAccount, Role and ConfigMap exist is refused by a real API server (its
    ServiceAccount not found) or starts without its spec file: the other objects are created first, concurrently,
    each taking another number of turns (the ServiceAccount the most), and the first pod create is sent only after
    the last of them is answered. The status (the decision) is written before any of it."""
    plan = reconcile(read_resource(body), [], None, NOW, settings)
    assert [m["kind"] for m in plan.create] == [*first, "Pod", "Pod"]
    objects = [f"{m['kind']}/{m['metadata']['name']}" for m in plan.create]
    cluster = RecordingCluster(turns={what: 2 + (10 if what.startswith("ServiceAccount/") else index)
                                      for index, what in enumerate(objects)})
    carry_out(plan, body, [], cluster)
    assert sorted(what for what, _ in cluster.calls("answered", "create")) == sorted(objects)
    pods = [what for what in objects if what.startswith("Pod/")]
    others = [what for what in objects if not what.startswith("Pod/")]
    assert max(cluster.index("answered", "create", what) for what in others) < min(
        cluster.index("sent", "create", what) for what in pods)
    assert cluster.index("answered", "patch", "status") < min(cluster.index("sent", "create", w) for w in objects)


UNAVAILABLE = Unavailable("create", "Role", "ml/digits-rank0", 503, "ServiceUnavailable", "etcd leader changed")


@dataclass
class Failure:
    name: str
    body: dict[str, Any]
    pods: list[dict[str, Any]]
    fail: str
    """The call that fails (by its object, Kind/name)."""
    slow: str
    """A call sent beside it that takes many turns: it must be answered before the pass ends."""
    not_sent: str = ""
    """No call on an object whose Kind/name starts so may be sent once the failure is known."""
    config_map: dict[str, Any] | None = None


FAILURES = [
    Failure("a group's object fails: the others are answered and no pod is created", job(), [],
            fail="Role/digits-rank0", slow="ServiceAccount/digits-rank0", not_sent="Pod/"),
    Failure("a pod create fails: the other rank's create is answered", job(), [],
            fail="Pod/digits-worker-0", slow="Pod/digits-worker-1"),
    Failure("a pod delete fails: the other rank's delete is answered", job(running(), workers=3), BOTH_RUNNING,
            fail="Pod/digits-worker-0", slow="Pod/digits-worker-1", config_map=applied(job(running()), workers=2)),
]


@pytest.mark.parametrize("failure", FAILURES, ids=[f.name for f in FAILURES])
def test_a_failed_call_ends_the_pass_only_once_the_calls_sent_beside_it_are_settled(failure: Failure):
    """Concurrent calls overlap their retries; when one fails, the pass raises only after the others are answered
    (none is left running unobserved, to race the next pass's identical call), and sends nothing that depended on
    the failed one."""
    plan = reconcile(read_resource(failure.body), failure.pods, failure.config_map, NOW, SETTINGS)
    objects = [f"{m['kind']}/{m['metadata']['name']}" for m in plan.create] + [f"Pod/{p}" for p in plan.delete_pods]
    assert failure.fail in objects and failure.slow in objects, objects
    cluster = RecordingCluster(turns={failure.slow: 20}, fail={failure.fail: UNAVAILABLE})
    with pytest.raises(Unavailable):
        carry_out(plan, failure.body, failure.pods, cluster)
    sent = [what for event, _, what, _ in cluster.log if event == "sent"]
    settled = [what for event, _, what, _ in cluster.log if event != "sent"]
    assert sorted(sent) == sorted(settled), "a call was still in flight when the pass ended"
    assert failure.slow in settled
    assert not failure.not_sent or not [what for what in sent if what.startswith(failure.not_sent)]


def test_a_404_under_a_replace_marks_the_child_gone_decides_again_at_once_and_then_creates_it(monkeypatch):
    """pool_handlers._apply in the daemon's loop: kopf's index holds the pool's Deployment, which was deleted while a
    watch was down; replacing it is answered 404. The loop's state after it: the Deployment is gone (left out of
    every later pass though the index keeps it), no refusal is recorded (no APIRequestRefused condition), the pass is
    decided again after STALE_SECONDS (not a backoff, nor kopf's 60 s), and the next pass creates it anew."""
    ghost = {"kind": "Deployment", "metadata": {"name": "p-server", "uid": "d1", "resourceVersion": "5"}}
    manifest = {"kind": "Deployment", "metadata": {"name": "p-server", "namespace": "default"}}
    body = {"metadata": {"name": "p", "namespace": "default"}, "status": {}}
    state = daemon.Reconciliation("inferencepools", "default", "p")

    class Vanished(RecordingCluster):
        async def put(self, manifest, existing):
            self.fail = {"Deployment/p-server": ApiException(status=404, reason="Not Found")} if existing else {}
            return await super().put(manifest, existing)

    cluster, passes = Vanished(), []

    async def one_pass():
        indexed = state.present([ghost])  # kopf's index keeps the ghost for good
        passes.append(indexed)
        await pool_handlers._apply(PoolPlan(apply=[manifest]), body, {"Deployment": next(iter(indexed), None)},
                                   cluster, pool_handlers.RecentlyPut(), state)
        return None

    waits, _ = loop_waits(monkeypatch, [one_pass, one_pass], state)
    assert passes == [[ghost], []]
    assert state.gone == {"d1"} and state.refusal is None
    assert waits == [daemon.STALE_SECONDS, None]
    assert [(event, verb, what) for event, verb, what, _ in cluster.log if event != "sent"] == [
        ("failed", "replace", "Deployment/p-server"), ("answered", "create", "Deployment/p-server")]
