"""The InferencePool's decisions (operator/pools.py) and objects (operator/pool_objects.py), without a cluster:
table-driven cases, one per rule; every object passes kubernetes-validate --strict."""

from __future__ import annotations

import copy
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import kubernetes_validate
import pytest

from tandem.api.inference import BatchingSettings
from tandem.operator.observed import read_resource
from tandem.operator.pool_objects import AUTH_MOUNT, MODEL_MOUNT, SPEC_HASH, server_deployment
from tandem.operator.pool_served import Served, refused_batching
from tandem.operator.pools import Sources, reconcile_pool, sources

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
IMAGE = "registry.example/tandem-worker:1"


def ago(seconds: float) -> str:
    return (NOW - timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")


def pool(status: dict | None = None, generation: int = 1, **spec: Any) -> dict[str, Any]:
    body = {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferencePool",
            "metadata": {"name": "digits", "namespace": "ml", "uid": "pool-uid", "generation": generation},
            "spec": {"replicas": 2, "model": {"fromTrainingJob": {"name": "train", "follow": True},
                                              "inputShape": [64]}, **spec}}
    if status is not None:
        body["status"] = status
    return body


def job(latest: str | None = "/var/lib/tandem/checkpoints/digits/step-00000200.pt", step: int = 200,
        claim: str | None = "train-checkpoints", directory: str = "digits") -> dict[str, Any]:
    checkpoint = {"directory": directory, **({"persistentVolumeClaim": claim} if claim else {})}
    body = {"apiVersion": "tandem.dev/v1alpha1", "kind": "ParallelTrainingJob",
            "metadata": {"name": "train", "namespace": "ml", "uid": "job-uid"},
            "spec": {"trainer": {"model": "tandem.examples.digits:mlp", "data": "tandem.examples.digits:train_data"},
                     "checkpoint": checkpoint}}
    if latest:
        body["status"] = {"checkpoint": {"latest": latest, "step": step}}
    return body


def deployment(body: dict[str, Any], ready: int, updated: int | None = None, *, pinned: int | None = None,
               job_body: dict | None = None) -> dict[str, Any]:
    from tandem.manifest import parse

    parsed = parse({k: body[k] for k in ("apiVersion", "kind", "metadata", "spec")})
    source = parse({k: (job_body or job())[k] for k in ("apiVersion", "kind", "metadata", "spec")})
    created = server_deployment(body, parsed, job=source, pinned_step=pinned, default_image=IMAGE)
    created["metadata"]["generation"] = 1
    created["status"] = {"observedGeneration": 1, "replicas": body["spec"]["replicas"], "readyReplicas": ready,
                         "updatedReplicas": body["spec"]["replicas"] if updated is None else updated}
    return created


def server_pod(name: str, phase: str = "Running", *, crashed: str | None = None) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": phase}
    if crashed is not None:
        status["containerStatuses"] = [{"name": "server", "restartCount": 2, "state": {"waiting": {
            "reason": "CrashLoopBackOff", "message": "back-off 20s restarting failed container"}},
            "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": crashed}}}]
    return {"metadata": {"name": name, "labels": {"tandem.dev/pool": "digits"}}, "status": status}


DEFAULT_BATCHING = BatchingSettings()


def served(pod: str, step: int, batching: BatchingSettings | None = DEFAULT_BATCHING, **settings: Any) -> Served:
    """A ready server's report; `settings` change its batching settings from the defaults."""
    if settings:
        batching = BatchingSettings(**settings)
    return Served(pod, f"{MODEL_MOUNT}/digits/step-{step:08d}.pt", "fromTrainingJob/train", ago(10), batching)


def everything(body: dict[str, Any], ready: int = 2, **kw: Any) -> dict[str, dict | None]:
    from tandem.manifest import parse
    from tandem.operator.pool_objects import disruption_budget, service, spec_config_map

    parsed = parse({k: body[k] for k in ("apiVersion", "kind", "metadata", "spec")})
    return {"Deployment": deployment(body, ready, **kw), "ConfigMap": spec_config_map(body, parsed),
            "Service": service(body, parsed), "PodDisruptionBudget": disruption_budget(body, parsed),
            "HorizontalPodAutoscaler": None}


def kinds(plan) -> list[str]:
    return [o["kind"] for o in plan.apply]


STEADY = pool({"observedGeneration": 1, "phase": "Ready"})
TWO_SERVING = [served("digits-server-a", 200), served("digits-server-b", 200)]

# (name, pool, children, pods, served, job, expected)
CASES = [
    ("new pool from a job with a checkpoint: everything is created", pool(), {}, [], [], job(),
     {"apply": ["ConfigMap", "Service", "Deployment", "PodDisruptionBudget"], "phase": "Pending"}),
    ("job missing: a condition, no server, the pool waits", pool(), {}, [], [], None,
     {"apply": [], "phase": "Pending", "condition": ("ModelSourceMissing", "True", "does not exist")}),
    ("job without a checkpoint yet: waits", pool(), {}, [], [], job(latest=None),
     {"apply": [], "condition": ("ModelSourceMissing", "True", "has written no checkpoint yet")}),
    ("job on an emptyDir: cannot be shared", pool(), {}, [], [], job(claim=None),
     {"apply": [], "condition": ("ModelSourceMissing", "True", "emptyDir")}),
    ("the job's checkpoint appears: the pool recovers", pool({"conditions": [{
        "type": "ModelSourceMissing", "status": "True", "reason": "x", "message": "", "lastTransitionTime": ago(9)}]}),
     {}, [], [], job(), {"apply": ["ConfigMap", "Service", "Deployment", "PodDisruptionBudget"],
                         "condition": ("ModelSourceMissing", "False", "")}),
    ("servers up, none ready: Loading", STEADY, "all-0", [server_pod("a"), server_pod("b")], [], job(),
     {"apply": [], "phase": "Loading", "condition": ("Available", "False", "0/2")}),
    ("all ready: Ready, with the model the servers report", STEADY, "all-2", [], TWO_SERVING, job(),
     {"apply": [], "phase": "Ready", "condition": ("Available", "True", "2/2"),
      "model": {"source": "fromTrainingJob/train", "checkpoint": f"{MODEL_MOUNT}/digits/step-00000200.pt",
                "checkpointFile": "step-00000200.pt", "gateMetric": None}}),
    ("gated and ready: the gate's metric of the served checkpoint, to four figures",
     pool({"observedGeneration": 1, "phase": "Ready"}, model={"fromTrainingJob": {
         "name": "train", "follow": True, "promote": {"metric": "accuracy"}}, "inputShape": [64]}), "all-2", [],
     [replace(s, metrics={"accuracy": 0.9722222, "evalLoss": 0.1}) for s in TWO_SERVING], job(),
     {"phase": "Ready", "model": {"gateMetric": "accuracy=0.9722", "metrics": {"accuracy": 0.9722222,
                                                                               "evalLoss": 0.1}}}),
    ("a Ready pool loses one of two: Degraded, a Warning", STEADY, "all-1", [], TWO_SERVING[:1], job(),
     {"phase": "Degraded", "event": ("Warning", "Degraded")}),
    ("a starting pool has one of two ready: Degraded, Normal", pool({"observedGeneration": 1, "phase": "Loading"}),
     "all-1", [], TWO_SERVING[:1], job(), {"phase": "Degraded", "event": ("Normal", "Degraded")}),
    ("a rollout has one of two ready: Degraded, Normal", pool({"observedGeneration": 1, "phase": "Ready"},
                                                              generation=2, image="tandem:2"),
     "all-1", [], TWO_SERVING[:1], job(), {"phase": "Degraded", "event": ("Normal", "Degraded")}),
    ("replicas mid-swap serve different checkpoints: a condition says so", STEADY, "all-2", [],
     [served("digits-server-a", 200), served("digits-server-b", 180)], job(),
     {"phase": "Ready", "condition": ("CheckpointsDiffer", "True", "digits-server-b: /var/lib/tandem/models/digits/"
                                                                   "step-00000180.pt")}),
    ("a server cannot load the model: Failed with the server's own error", STEADY, "all-0",
     [server_pod("a", crashed="ModelLoadError: /var/lib/tandem/models/digits: no checkpoint")], [], job(),
     {"phase": "Failed", "condition": ("ModelLoadFailed", "True", "ModelLoadError: /var/lib/tandem/models/digits")}),
    ("scaled to three: the Deployment follows", pool({"observedGeneration": 1}, generation=2, replicas=3), "all-2",
     [], TWO_SERVING, job(), {"apply": ["Deployment"], "replicas": 3, "rolls": False}),
    ("scaled to one: the budget goes", pool({"observedGeneration": 1}, generation=2, replicas=1), "all-1", [],
     TWO_SERVING[:1], job(), {"apply": ["Deployment"], "delete": [("PodDisruptionBudget", "digits-server")]}),
    ("batching changed: no roll, nothing sent (the servers read the pool), a condition says so until they run it",
     pool({"observedGeneration": 1}, generation=2, batchLimit=8), "all-2", [], TWO_SERVING, job(),
     {"apply": ["ConfigMap"], "batching": {"batchLimit": 32}, "requeue": 1.0,
      "condition": ("BatchingDiffers", "True", "digits-server-b: batchLimit 32, queueLimit 64")}),
    ("the servers run the new batching: the status shows it", pool({
        "observedGeneration": 2, "conditions": [{"type": "BatchingDiffers", "status": "True", "reason": "Changing",
                                                 "message": "", "lastTransitionTime": ago(3)}]},
        generation=2, batchLimit=8), "all-2", [],
     [served("digits-server-a", 200, batchLimit=8), served("digits-server-b", 200, batchLimit=8)], job(),
     {"requeue": 5.0, "batching": {"batchLimit": 8, "queueLimit": 64},
      "condition": ("BatchingDiffers", "False", "")}),
    ("a server that does not report its batching is not counted", pool({"observedGeneration": 1},
                                                                       generation=2, batchLimit=8),
     "all-2", [], [served("digits-server-a", 200, None)], job(), {"batching": None}),
    ("autoscaling asked: an HPA on the pool's scale subresource", pool({"observedGeneration": 1}, generation=2,
                                                                        autoscaling={"maxReplicas": 4}),
     "all-2", [], TWO_SERVING, job(), {"apply": ["HorizontalPodAutoscaler"]}),
    ("autoscaling dropped: the HPA goes", pool({"observedGeneration": 1}, generation=2), {
        **everything(STEADY), "HorizontalPodAutoscaler": {"kind": "HorizontalPodAutoscaler", "spec": {}}}, [],
     TWO_SERVING, job(), {"apply": [], "delete": [("HorizontalPodAutoscaler", "digits")]}),
    ("nothing changed: nothing is written", STEADY, "all-2", [], TWO_SERVING, job(), {"apply": [], "delete": []}),
    ("scaled to zero: Pending, said so", pool({"observedGeneration": 1}, generation=2, replicas=0), "all-0", [], [],
     job(), {"phase": "Pending", "message": "scaled to zero"}),
]


@pytest.mark.parametrize(("name", "body", "children", "pods", "reports", "source", "expected"), CASES,
                         ids=[c[0] for c in CASES])
def test_reconcile_pool(name, body, children, pods, reports, source, expected):
    if isinstance(children, str):  # "all-N": every object as the pool's spec at generation 1 gave it, N ready
        steady = copy.deepcopy(body)
        steady["spec"] = copy.deepcopy(STEADY["spec"])
        children = everything(steady, ready=int(children.split("-")[1]))
    plan = reconcile_pool(read_resource(body), children, pods, reports, source, NOW, IMAGE)
    status = plan.status
    if "apply" in expected:
        assert kinds(plan) == expected["apply"]
    if "delete" in expected:
        assert plan.delete == expected["delete"]
    if "phase" in expected:
        assert status["phase"] == expected["phase"], status["message"]
    if "condition" in expected:
        kind, value, text = expected["condition"]
        [found] = [c for c in status["conditions"] if c["type"] == kind]
        assert found["status"] == value and text in found["message"], found
    if "model" in expected:
        assert {k: status["model"].get(k) for k in expected["model"]} == expected["model"]
    if "replicas" in expected:
        [created] = [o for o in plan.apply if o["kind"] == "Deployment"]
        assert created["spec"]["replicas"] == expected["replicas"]
        assert status["replicas"] == children["Deployment"]["status"]["replicas"], "the servers there are, not wanted"
    if "rolls" in expected:
        [created] = [o for o in plan.apply if o["kind"] == "Deployment"]
        template = created["spec"]["template"]["metadata"]["annotations"][SPEC_HASH]
        assert (template != children["Deployment"]["spec"]["template"]["metadata"]["annotations"][SPEC_HASH]) \
            == expected["rolls"]
    if "event" in expected:
        assert [(kind, reason) for kind, reason, _ in plan.events] == [expected["event"]]
    if "message" in expected:
        assert expected["message"] in status["message"]
    if "requeue" in expected:
        assert plan.requeue_after == expected["requeue"]
    if "batching" in expected:
        wanted = expected["batching"]
        assert (status.get("batching") if wanted is None else
                {k: status["batching"][k] for k in wanted}) == wanted


# (what changes in the pool's spec, whether the servers are replaced)
ROLLS = [
    ({"batchLimit": 8}, False),
    ({"queueLimit": 5}, False),
    ({"maxQueueDelayMicroseconds": 2000}, False),
    ({"requestTimeoutMs": 500}, False),
    ({"batchLimit": 4, "queueLimit": 8, "maxQueueDelayMicroseconds": 100, "requestTimeoutMs": 900}, False),
    ({"replicas": 3}, False),
    ({"inferenceMode": "sequential"}, True),
    ({"workersPerReplica": 2}, True),
    ({"processesPerReplica": 2}, True),
    ({"port": 9000}, True),
    ({"image": "registry.example/other:2"}, True),
    ({"resources": {"limits": {"cpu": "2"}}}, True),
    ({"env": [{"name": "OMP_NUM_THREADS", "value": "1"}]}, True),
    ({"modelRepository": {"load": True}}, True),
    ({"model": {"fromTrainingJob": {"name": "train"}, "inputShape": [64], "version": "2"}}, True),
    ({"grpcPort": 9001}, True),
]


@pytest.mark.parametrize(("change", "rolls"), ROLLS, ids=[",".join(c) for c, _ in ROLLS])
def test_which_pool_changes_replace_the_servers_and_which_reach_them_live(change, rolls):
    body = pool({"observedGeneration": 1}, generation=2, **change)
    children = everything(copy.deepcopy(STEADY))
    plan = reconcile_pool(read_resource(body), children, [], TWO_SERVING, job(), NOW, IMAGE)
    deployments = [o for o in plan.apply if o["kind"] == "Deployment"]
    template = deployments[0]["spec"]["template"]["metadata"]["annotations"][SPEC_HASH] if deployments else None
    before = children["Deployment"]["spec"]["template"]["metadata"]["annotations"][SPEC_HASH]
    assert (template is not None and template != before) == rolls
    assert ("ConfigMap" in [o["kind"] for o in plan.apply]) == (change.keys() != {"replicas"}), \
        "a server started later reads every setting but the replicas from the ConfigMap"


def test_a_pool_with_a_token_takes_a_batching_change_without_a_roll_too():
    """Its servers read the pool themselves: the operator, which holds no token, sends them nothing."""
    auth = {"secretName": "digits-token"}
    steady = pool({"observedGeneration": 1, "phase": "Ready"}, auth=auth)
    children = everything(copy.deepcopy(steady))
    plan = reconcile_pool(read_resource(pool({"observedGeneration": 1}, generation=2, auth=auth, batchLimit=8)),
                          children, [], TWO_SERVING, job(), NOW, IMAGE)
    assert kinds(plan) == ["ConfigMap"], "no Deployment: the servers are not replaced"
    [differs] = [c for c in plan.status["conditions"] if c["type"] == "BatchingDiffers"]
    assert differs["reason"] == "Changing" and "which they are taking from it" in differs["message"]


def test_the_servers_read_their_pool_with_an_account_that_may_get_and_watch_that_pool_only():
    """The servers' ServiceAccount, its Role (get and watch on this one InferencePool, nothing else) and binding are
    created with the Deployment (kept where they exist), and the server pods run as that account with its token."""
    plan = reconcile_pool(read_resource(pool()), {}, [], [], job(), NOW, IMAGE)
    assert [o["kind"] for o in plan.create] == ["ServiceAccount", "Role", "RoleBinding"]
    _, role, binding = plan.create
    assert {o["metadata"]["name"] for o in plan.create} == {"digits-server"}
    assert all(o["metadata"]["ownerReferences"][0]["uid"] == "pool-uid" for o in plan.create)
    assert role["rules"] == [{"apiGroups": ["tandem.dev"], "resources": ["inferencepools"],
                              "resourceNames": ["digits"], "verbs": ["get", "watch"]}]
    assert binding["roleRef"]["name"] == "digits-server"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "digits-server", "namespace": "ml"}]
    [deployment] = [o for o in plan.apply if o["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "digits-server" and pod["automountServiceAccountToken"] is True
    assert "--watch-pool" in pod["containers"][0]["command"]
    for manifest in plan.create:
        kubernetes_validate.validate(manifest, kubernetes_validate.latest_version(), strict=True)
    steady = reconcile_pool(read_resource(STEADY), everything(copy.deepcopy(STEADY)), [], TWO_SERVING, job(), NOW,
                            IMAGE)
    assert steady.create == [], "created with the Deployment only, not on every pass"


NEW_BATCHING = BatchingSettings(batchLimit=64)
REFUSED = "the model fails its warm-up at the new batch sizes: RuntimeError: out of memory"


def refusing(settings: BatchingSettings) -> dict[str, Any]:
    """A server's readiness parameters after refusing `settings` (worker/serve/served_model.py's shape)."""
    return {**{f"refused_{name}": value for name, value in settings.model_dump().items()}, "refused_reason": REFUSED}


# (the pool's settings digits-server-a last refused, from its readiness parameters; the condition's reason)
REFUSALS = [(None, "Changing"), (NEW_BATCHING, "Refused"), (BatchingSettings(batchLimit=48), "Changing")]


@pytest.mark.parametrize(("refused", "reason"), REFUSALS, ids=["none", "these-settings", "other-settings"])
def test_a_server_that_refused_the_pools_batching_says_so_and_the_condition_names_it(refused, reason):
    body = pool({"observedGeneration": 1}, generation=2, batchLimit=64)
    parameters = {} if refused is None else refusing(refused)
    report = replace(TWO_SERVING[0], refused=refused_batching(parameters))
    plan = reconcile_pool(read_resource(body), everything(copy.deepcopy(STEADY)), [], [report], job(), NOW, IMAGE)
    [differs] = [c for c in plan.status["conditions"] if c["type"] == "BatchingDiffers"]
    assert differs["status"] == "True" and differs["reason"] == reason
    assert ("Refused (tried again after 30 s" in differs["message"]) == (reason == "Refused")
    if reason == "Refused":
        assert f"digits-server-a: {REFUSED}" in differs["message"]
        assert plan.requeue_after == 5.0, "nothing changes until the server tries again"


def test_a_refusal_is_read_from_the_readiness_parameters_only_whole():
    assert refused_batching(refusing(NEW_BATCHING)) == (NEW_BATCHING, REFUSED)
    assert refused_batching({}) is None
    assert refused_batching({k: v for k, v in refusing(NEW_BATCHING).items() if k != "refused_queue_limit"}) is None
    assert refused_batching({**refusing(NEW_BATCHING), "refused_batch_limit": 0}) is None


def test_following_points_the_servers_at_the_jobs_directory_from_its_spec_and_mounts_its_claim_read_only():
    [created] = [o for o in reconcile_pool(read_resource(pool()), {}, [], [], job(directory="runs/digits"), NOW,
                                           IMAGE).apply if o["kind"] == "Deployment"]
    pod = created["spec"]["template"]["spec"]
    [server] = pod["containers"]
    assert server["command"] == ["tandem", "serve", "/etc/tandem/pool.json", "--host", "0.0.0.0", "--port", "8000",
                                 "--grpc-port", "8001", "--grace-period", "25", "--watch-pool",
                                 "--checkpoint", f"{MODEL_MOUNT}/runs/digits"]
    assert {"name": "tandem-model", "persistentVolumeClaim": {"claimName": "train-checkpoints", "readOnly": True}} \
        in pod["volumes"]
    assert {"name": "tandem-model", "mountPath": MODEL_MOUNT, "readOnly": True} in server["volumeMounts"]


def test_not_following_pins_the_latest_checkpoint_and_keeps_it_until_the_pool_changes():
    fixed = pool(model={"fromTrainingJob": {"name": "train", "follow": False}, "inputShape": [64]})
    [created] = [o for o in reconcile_pool(read_resource(fixed), {}, [], [], job(step=200), NOW, IMAGE).apply
                 if o["kind"] == "Deployment"]
    assert created["spec"]["template"]["spec"]["containers"][0]["command"][-1] == \
        f"{MODEL_MOUNT}/digits/step-00000200.pt"
    steady = copy.deepcopy(fixed)
    steady["status"] = {"observedGeneration": 1}
    children = {"Deployment": {**created, "status": {"readyReplicas": 2, "updatedReplicas": 2}}}
    later = reconcile_pool(read_resource(steady), children, [], [], job(step=400, latest="/x/step-00000400.pt"), NOW,
                           IMAGE)
    assert "Deployment" not in kinds(later), "a newer checkpoint of the job alone moves nothing"
    changed = copy.deepcopy(steady)
    changed["metadata"]["generation"] = 2
    changed["spec"]["batchLimit"] = 16
    moved = reconcile_pool(read_resource(changed), children, [], [], job(step=400, latest="/x/step-00000400.pt"), NOW,
                           IMAGE)
    [rolled] = [o for o in moved.apply if o["kind"] == "Deployment"]
    assert rolled["spec"]["template"]["spec"]["containers"][0]["command"][-1] == \
        f"{MODEL_MOUNT}/digits/step-00000400.pt"


def test_the_server_pods_probe_the_truth_drain_gracefully_and_never_roll_below_their_replicas():
    [created] = [o for o in reconcile_pool(read_resource(pool(gpusPerReplica=1)), {}, [], [], job(), NOW, IMAGE).apply
                 if o["kind"] == "Deployment"]
    spec = created["spec"]
    assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
    pod = spec["template"]["spec"]
    [server] = pod["containers"]
    assert server["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert server["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert server["startupProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert server["startupProbe"]["periodSeconds"] * server["startupProbe"]["failureThreshold"] >= 600
    assert server["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    assert pod["terminationGracePeriodSeconds"] > 5 + 25, "longer than the preStop pause and the drain together"
    assert server["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert pod["securityContext"]["runAsNonRoot"] and not server["securityContext"]["allowPrivilegeEscalation"]
    assert pod["serviceAccountName"] == "digits-server", "its own account, which may read its pool and nothing else"
    annotations = spec["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
    assert SPEC_HASH in annotations


def test_the_status_names_the_endpoint_and_selects_exactly_the_server_pods():
    status = reconcile_pool(read_resource(pool()), {}, [], [], job(), NOW, IMAGE).status
    assert status["endpoint"] == "http://digits.ml.svc.cluster.local:8000/v2"
    assert status["selector"] == "tandem.dev/pool=digits"
    assert status["readySummary"] == "0/2"


def test_an_invalid_pool_gets_a_condition_and_nothing_else():
    bad = pool(batchLimit=0)
    plan = reconcile_pool(read_resource(bad), {}, [], [], job(), NOW, IMAGE)
    assert plan.apply == [] and plan.delete == []
    [invalid] = plan.status["conditions"]
    assert invalid["type"] == "InvalidSpec" and "spec.batchLimit" in invalid["message"]


@pytest.mark.parametrize("created", reconcile_pool(
    read_resource(pool(autoscaling={"maxReplicas": 4}, schedulerName="volcano", gpusPerReplica=1)), {}, [], [], job(),
    NOW, IMAGE).apply, ids=lambda o: o["kind"])
def test_every_object_is_valid_kubernetes_under_strict_validation(created):
    kubernetes_validate.validate(created, kubernetes_validate.latest_version(), strict=True)


def test_the_specs_pod_settings_pass_through_to_the_server_pods():
    settings = {
        "image": "registry.example/custom:2", "imagePullPolicy": "Always",
        "resources": {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"memory": "8Gi"}},
        "env": [{"name": "OMP_NUM_THREADS", "value": "2"}], "nodeSelector": {"pool": "inference"},
        "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "volumes": [{"name": "cache", "emptyDir": {}}], "volumeMounts": [{"name": "cache", "mountPath": "/cache"}],
        "schedulerName": "volcano", "priorityClassName": "serving",
    }
    [created] = [o for o in reconcile_pool(read_resource(pool(**settings)), {}, [], [], job(), NOW, IMAGE).apply
                 if o["kind"] == "Deployment"]
    pod = created["spec"]["template"]["spec"]
    [server] = pod["containers"]
    assert (server["image"], server["imagePullPolicy"]) == ("registry.example/custom:2", "Always")
    assert server["resources"] == {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"memory": "8Gi"}}
    assert server["env"] == settings["env"]
    assert {"name": "cache", "mountPath": "/cache", "readOnly": False} in server["volumeMounts"]
    assert pod["nodeSelector"] == {"pool": "inference"} and pod["tolerations"] == settings["tolerations"]
    assert {"name": "cache", "emptyDir": {}} in pod["volumes"]
    assert (pod["schedulerName"], pod["priorityClassName"]) == ("volcano", "serving")
    assert "nvidia.com/gpu" not in server["resources"]["limits"], "no GPU asked, none in the limits"
    kubernetes_validate.validate(created, kubernetes_validate.latest_version(), strict=True)


@pytest.mark.parametrize(("name", "body", "expected"), [
    ("from a job", pool(), Sources("train", "digits", 8000)),
    ("a callable, named, on another port", pool(model={"callable": "tandem.examples.digits:mlp", "name": "mnist",
                                                       "inputShape": [64]}, port=9000), Sources(None, "mnist", 9000)),
    ("invalid: nothing to read", pool(batchLimit=0), None),
], ids=lambda v: v if isinstance(v, str) else "")
def test_what_a_pools_decision_reads_besides_its_objects(name, body, expected):
    assert sources(read_resource(body)) == expected


def test_a_deployment_just_created_is_loading_not_rolling_so_the_status_is_written_once():
    created = reconcile_pool(read_resource(pool()), {}, [], [], job(), NOW, IMAGE)
    children = {o["kind"]: {**o, "metadata": {**o["metadata"], "generation": 1}} for o in created.apply}
    later = reconcile_pool(read_resource(pool(created.status)), children, [], [], job(), NOW, IMAGE)
    progressing = [c for c in later.status["conditions"] if c["type"] == "Progressing"]
    assert progressing[0]["reason"] == "Loading" and later.apply == []
    assert later.status == created.status, "nothing new to write"


def test_objects_a_pool_daemon_created_stand_in_for_the_index_until_it_shows_them(monkeypatch):
    from tandem.operator import pool_handlers

    clock = [100.0]
    monkeypatch.setattr(pool_handlers.time, "monotonic", lambda: clock[0])
    put = pool_handlers.RecentlyPut()
    created = {"kind": "Deployment", "metadata": {"name": "digits-server", "resourceVersion": "7"}}
    put.add(created)
    assert put.over({"Deployment": None, "Service": None}) == {"Deployment": created, "Service": None}
    indexed = {**created, "status": {"readyReplicas": 1}}
    assert put.over({"Deployment": indexed}) == {"Deployment": indexed}, "the index wins once it has the object"
    assert put.over({"Deployment": None}) == {"Deployment": None}, "then gone from the index means deleted"
    put.add(created)
    clock[0] += pool_handlers.INDEX_LAG_SECONDS
    assert put.over({"Deployment": None}) == {"Deployment": None}, "an index that never shows it: deleted meanwhile"


def test_the_servers_listen_for_http_and_grpc_and_the_service_exposes_both():
    plan = reconcile_pool(read_resource(pool(port=9000, grpcPort=9001)), {}, [], [], job(), NOW, IMAGE)
    created = {o["kind"]: o for o in plan.apply}
    [server] = created["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert server["ports"] == [{"name": "http", "containerPort": 9000, "protocol": "TCP"},
                               {"name": "grpc", "containerPort": 9001, "protocol": "TCP"}]
    assert server["command"][server["command"].index("--grpc-port") + 1] == "9001"
    assert created["Service"]["spec"]["ports"] == [
        {"name": "http", "port": 9000, "targetPort": "http", "protocol": "TCP"},
        {"name": "grpc", "port": 9001, "targetPort": "grpc", "protocol": "TCP", "appProtocol": "kubernetes.io/h2c"}]
    assert "--auth-token-file" not in server["command"], "no auth asked, no token"


def test_a_pool_with_auth_mounts_its_secrets_key_as_a_file_and_passes_it_to_the_servers():
    """A directory mount (not subPath), so a rotated Secret reaches the running servers; the operator reads no
    Secret itself."""
    body = pool(auth={"secretName": "digits-token", "key": "bearer"})
    created = {o["kind"]: o for o in reconcile_pool(read_resource(body), {}, [], [], job(), NOW, IMAGE).apply}
    pod = created["Deployment"]["spec"]["template"]["spec"]
    [server] = pod["containers"]
    assert server["command"][server["command"].index("--auth-token-file") + 1] == f"{AUTH_MOUNT}/token"
    assert {"name": "tandem-auth", "secret": {"secretName": "digits-token",
                                              "items": [{"key": "bearer", "path": "token"}]}} in pod["volumes"]
    assert {"name": "tandem-auth", "mountPath": AUTH_MOUNT, "readOnly": True} in server["volumeMounts"]
    assert not any("subPath" in mount for mount in server["volumeMounts"])
    for found in created.values():
        kubernetes_validate.validate(found, kubernetes_validate.latest_version(), strict=True)


@pytest.mark.parametrize(("spec", "field"), [
    ({"port": 8001}, "port and grpcPort must differ"),
    ({"grpcPort": 0}, "spec.grpcPort"),
    ({"auth": {"key": "token"}}, "spec.auth.secretName"),
    ({"auth": {"secretName": "t", "metrics": "closed"}}, "spec.auth.metrics"),
], ids=lambda v: str(v))
def test_a_bad_grpc_port_or_auth_is_an_invalid_spec_naming_the_field(spec, field):
    plan = reconcile_pool(read_resource(pool(**spec)), {}, [], [], job(), NOW, IMAGE)
    assert plan.apply == []
    [invalid] = plan.status["conditions"]
    assert invalid["type"] == "InvalidSpec" and field in invalid["message"], invalid["message"]
