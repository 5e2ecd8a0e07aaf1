"""The pod a rank and a server both run in (operator/pod_template.py), built once from the API's shared PodSettings:
table-driven cases (name, the settings on the wire, the pod's GPU count, what the pod must get), each checked on
the builder itself and on both kinds' pods, so a rank and a server can never drift apart in what they pass
through or in how locked down they run."""

from __future__ import annotations

from typing import Any

import pytest

from tandem.api.common import PodSettings
from tandem.manifest import parse
from tandem.operator.pod_template import RUN_AS, SPEC_MOUNT, pod_spec
from tandem.operator.pool_objects import server_deployment
from tandem.operator.training_objects import worker_pod

DEFAULT_IMAGE = "registry.example/tandem-worker:1"
POD_SECURITY = {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS,
                "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}
OPTIONAL = ("nodeSelector", "tolerations", "schedulerName", "priorityClassName")
EVERYTHING = {
    "image": "registry.example/mine:2", "imagePullPolicy": "Always",
    "env": [{"name": "MODE", "value": "fast"},
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
    "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}],
    "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True}],
    "nodeSelector": {"pool": "gpu"}, "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "schedulerName": "volcano", "priorityClassName": "high",
}

CASES = [
    ("defaults: the operator's image, no GPU, no optional field", {}, 0,
     {"image": DEFAULT_IMAGE, "imagePullPolicy": "IfNotPresent", "resources": {"limits": {}, "requests": {}}}),
    ("quantities become strings",
     {"resources": {"limits": {"cpu": 2, "memory": "4Gi"}, "requests": {"cpu": "500m"}}}, 0,
     {"image": DEFAULT_IMAGE, "imagePullPolicy": "IfNotPresent",
      "resources": {"limits": {"cpu": "2", "memory": "4Gi"}, "requests": {"cpu": "500m"}}}),
    ("the GPU count is the limit", {}, 2,
     {"image": DEFAULT_IMAGE, "imagePullPolicy": "IfNotPresent",
      "resources": {"limits": {"nvidia.com/gpu": "2"}, "requests": {}}}),
    ("the GPU count replaces the user's limit", {"resources": {"limits": {"nvidia.com/gpu": 8, "memory": "1Gi"}}}, 1,
     {"image": DEFAULT_IMAGE, "imagePullPolicy": "IfNotPresent",
      "resources": {"limits": {"nvidia.com/gpu": "1", "memory": "1Gi"}, "requests": {}}}),
    ("every passthrough field, when set", EVERYTHING, 0,
     {"image": "registry.example/mine:2", "imagePullPolicy": "Always", "resources": {"limits": {}, "requests": {}},
      **{key: EVERYTHING[key] for key in OPTIONAL}}),
]


def rank_pod(settings: dict[str, Any], gpus: int) -> dict[str, Any]:
    body = {"apiVersion": "tandem.dev/v1alpha1", "kind": "ParallelTrainingJob",
            "metadata": {"name": "digits", "namespace": "ml", "uid": "job-uid"},
            "spec": {"workers": 2, "gpusPerWorker": gpus, **settings,
                     "trainer": {"model": "tandem.examples.digits:mlp", "data": "tandem.examples.digits:train_data"}}}
    return worker_pod(body, parse(body), 1, group=0, resume_from=None, default_image=DEFAULT_IMAGE)["spec"]


def server_pod(settings: dict[str, Any], gpus: int) -> dict[str, Any]:
    body = {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferencePool",
            "metadata": {"name": "digits", "namespace": "ml", "uid": "pool-uid"},
            "spec": {"gpusPerReplica": gpus, **settings,
                     "model": {"callable": "tandem.examples.digits:mlp", "inputShape": [64]}}}
    deployment = server_deployment(body, parse(body), job=None, pinned_step=None, default_image=DEFAULT_IMAGE)
    return deployment["spec"]["template"]["spec"]


def builder_pod(settings: dict[str, Any], gpus: int) -> dict[str, Any]:
    return pod_spec(PodSettings.model_validate(settings), container={"name": "main", "command": ["run"]},
                    pod={"restartPolicy": "Always"}, gpus=gpus, spec_config_map="digits-spec",
                    default_image=DEFAULT_IMAGE, env=[{"name": "OWN", "value": "1"}],
                    mounts=[{"name": "own", "mountPath": "/own"}], volumes=[{"name": "own", "emptyDir": {}}])


@pytest.mark.parametrize("build", [builder_pod, rank_pod, server_pod], ids=["the builder", "a rank", "a server"])
@pytest.mark.parametrize(("name", "settings", "gpus", "expected"), CASES, ids=[case[0] for case in CASES])
def test_every_pod_gets_the_settings_the_same_way(build, name, settings, gpus, expected):
    pod = build(settings, gpus)
    [container] = pod["containers"]
    assert pod["securityContext"] == POD_SECURITY
    assert container["securityContext"] == CONTAINER_SECURITY
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    for key in ("image", "imagePullPolicy", "resources"):
        assert container[key] == expected[key], key
    assert {key: pod[key] for key in OPTIONAL if key in pod} == {key: expected[key] for key in OPTIONAL
                                                                  if key in expected}
    # the operator's spec mount first, the kind's own next, the user's env, mounts and volumes last
    assert container["volumeMounts"][0] == {"name": "tandem-spec", "mountPath": SPEC_MOUNT, "readOnly": True}
    assert pod["volumes"][0] == {"name": "tandem-spec", "configMap": {"name": "digits-spec"}}
    user = PodSettings.model_validate(settings)
    for got, given in ((container["env"], user.env), (container["volumeMounts"], user.volume_mounts),
                       (pod["volumes"], user.volumes)):
        assert got[len(got) - len(given):] == [item.to_dict() for item in given]


def test_the_builder_keeps_the_callers_own_fields():
    pod = builder_pod({}, 0)
    [container] = pod["containers"]
    assert (container["name"], container["command"], pod["restartPolicy"]) == ("main", ["run"], "Always")
    assert container["env"] == [{"name": "OWN", "value": "1"}]
    assert [mount["name"] for mount in container["volumeMounts"]] == ["tandem-spec", "own"]
    assert [volume["name"] for volume in pod["volumes"]] == ["tandem-spec", "own"]
