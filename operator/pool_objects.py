"""The Kubernetes objects an InferencePool becomes, built from its spec as plain manifests (pure functions):

- a Deployment of server pods, each running `tandem serve --watch-pool` on the pool's manifest (a ConfigMap, mounted
  read-only), listening on all the pod's interfaces; the pod template's spec hash leaves out the batching settings,
  which the running servers read from the pool themselves (worker/serve/pool_watch.py) without being replaced;
  probes that tell the truth (startup covers the model's load and warm-up, readiness is the server's own
  /v2/health/ready, liveness /v2/health/live); a preStop pause so endpoints drop the pod before its drain begins,
  and a grace period longer than pause and drain together; rolling updates that never go below the ready replicas
  (maxUnavailable 0);
- with `spec.auth`, the token's Secret mounted as a file (`--auth-token-file`): a rotated Secret reaches the running
  servers without a restart, and the operator itself never reads Secrets;
- the servers' ServiceAccount, a Role allowing exactly get and watch on this one pool (resourceNames), nothing else,
  and the binding: how the batching settings reach the servers, with no control endpoint on a port clients reach;
- a ClusterIP Service on the pool's HTTP and gRPC ports; a PodDisruptionBudget when there is more than one replica; with
  `spec.autoscaling`, a HorizontalPodAutoscaler on the pool's scale subresource, on pending requests per replica.

Every object is owned by the pool. A model from a ParallelTrainingJob is read from that job's checkpoint claim,
mounted read-only, at the directory the job's spec names: never from a path copied out of the job's status.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

from tandem.api import API_VERSION, GROUP, InferencePool, InferencePoolSpec, ParallelTrainingJob
from tandem.api.inference import LIVE_FIELDS
from tandem.contract import checkpoint_name
from tandem.crd import RESOURCES
from tandem.operator.pod_template import (
    SPEC_HASH,
    SPEC_MOUNT,
    child_name,
    config_map_name,
    object_metadata,
    pod_spec,
    spec_file_config_map,
    spec_hash,
)

POOL_PLURAL = RESOURCES["InferencePool"].plural
"""The resource's name in API paths: `inferencepools`."""
POOL_LABEL = "tandem.dev/pool"
SPEC_FILE = "pool.json"
MODEL_MOUNT = "/var/lib/tandem/models"
AUTH_MOUNT = "/var/run/secrets/tandem/auth"
AUTH_FILE = "token"
DRAIN_SECONDS = 25
"""`tandem serve --grace-period`: how long the queued and running requests may take after SIGTERM."""
PRE_STOP_SECONDS = 5
"""How long a stopping server keeps serving before its drain begins, while the endpoints drop it."""
STARTUP_SECONDS = 600
"""How long a server may take to load and warm up its model before the kubelet gives up on it."""


def deployment_name(pool: str) -> str:
    return child_name(pool, "server")


def model_name(pool: InferencePool) -> str:
    return pool.spec.model.name or pool.metadata.name


def endpoint(pool: InferencePool, namespace: str) -> str:
    """The Service's in-cluster URL of the Open Inference Protocol."""
    return f"http://{pool.metadata.name}.{namespace}.svc.cluster.local:{pool.spec.port}/v2"


def selector(pool: str) -> dict[str, str]:
    return {POOL_LABEL: pool}


def job_checkpoint_directory(job: ParallelTrainingJob) -> str:
    """Where a job's checkpoints are under the pool's mount of its claim: the job's own checkpoint.directory (its
    pods mount the claim's root; so does the pool, elsewhere)."""
    return str(PurePosixPath(MODEL_MOUNT) / job.spec.checkpoint.directory)


def labels(pool: str) -> dict[str, str]:
    """What every object of a pool is labelled with besides the app.kubernetes.io labels all children carry."""
    return {**selector(pool), "app.kubernetes.io/component": "inference"}


def served_spec(pool: InferencePool) -> dict[str, Any]:
    """What a server is started with: the pool's spec less how many servers there are (scaling them, by hand or by
    the autoscaler, must not restart the ones running)."""
    return {key: value for key, value in pool.spec.to_dict().items() if key not in ("replicas", "autoscaling")}


def server_account_name(pool: str) -> str:
    return child_name(pool, "server")


def rollout_spec(pool: InferencePool) -> dict[str, Any]:
    """What, changed, replaces the servers: the served spec, less the batching settings, which the running servers
    read from the pool themselves (pool_watch.py)."""
    live = {InferencePoolSpec.model_fields[name].alias for name in LIVE_FIELDS}
    return {key: value for key, value in served_spec(pool).items() if key not in live}


def spec_config_map(owner: dict[str, Any], pool: InferencePool) -> dict[str, Any]:
    return spec_file_config_map(owner, "InferencePool", served_spec(pool), file=SPEC_FILE,
                                labels=labels(pool.metadata.name))


def server_deployment(owner: dict[str, Any], pool: InferencePool, *, job: ParallelTrainingJob | None,
                      pinned_step: int | None, default_image: str) -> dict[str, Any]:
    """The server pods. With a model from `job`: its claim mounted read-only, and `--checkpoint` the job's checkpoint
    directory (followed) or, with `pinned_step`, the checkpoint of that step in it."""
    name, spec = pool.metadata.name, pool.spec
    command = ["tandem", "serve", f"{SPEC_MOUNT}/{SPEC_FILE}", "--host", "0.0.0.0", "--port", str(spec.port),
               "--grpc-port", str(spec.grpc_port), "--grace-period", str(DRAIN_SECONDS), "--watch-pool"]
    mounts: list[dict[str, Any]] = []
    volumes: list[dict[str, Any]] = []
    if spec.auth is not None:
        # A directory mount, not a subPath: the kubelet updates it in place when the Secret changes.
        command += ["--auth-token-file", f"{AUTH_MOUNT}/{AUTH_FILE}"]
        mounts.append({"name": "tandem-auth", "mountPath": AUTH_MOUNT, "readOnly": True})
        volumes.append({"name": "tandem-auth", "secret": {
            "secretName": spec.auth.secret_name, "items": [{"key": spec.auth.key, "path": AUTH_FILE}]}})
    if job is not None:
        directory = job_checkpoint_directory(job)
        command += ["--checkpoint", directory if pinned_step is None else f"{directory}/{checkpoint_name(pinned_step)}"]
        mounts.append({"name": "tandem-model", "mountPath": MODEL_MOUNT, "readOnly": True})
        volumes.append({"name": "tandem-model", "persistentVolumeClaim": {
            "claimName": job.spec.checkpoint.persistent_volume_claim, "readOnly": True}})
    probe = {"httpGet": {"path": "/v2/health/ready", "port": "http"}, "periodSeconds": 2, "timeoutSeconds": 2}
    container = {
        "name": "server",
        "command": command,
        "ports": [{"name": "http", "containerPort": spec.port, "protocol": "TCP"},
                  {"name": "grpc", "containerPort": spec.grpc_port, "protocol": "TCP"}],
        "startupProbe": {**probe, "failureThreshold": STARTUP_SECONDS // 2},
        "readinessProbe": {**probe, "failureThreshold": 1},
        "livenessProbe": {"httpGet": {"path": "/v2/health/live", "port": "http"}, "periodSeconds": 10,
                          "timeoutSeconds": 5, "failureThreshold": 3},
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRE_STOP_SECONDS)]}}},
    }
    pod = {
        "serviceAccountName": server_account_name(name),  # get and watch on this pool, nothing else (server_access)
        "automountServiceAccountToken": True,
        "terminationGracePeriodSeconds": PRE_STOP_SECONDS + DRAIN_SECONDS + 10,
    }
    served = {"spec": rollout_spec(pool), "command": command}
    template_metadata = {
        "labels": object_metadata(owner, name, labels(name))["labels"],
        "annotations": {SPEC_HASH: spec_hash(served), "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(spec.port), "prometheus.io/path": "/metrics"},
    }
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": object_metadata(owner, deployment_name(name), labels(name)),
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": selector(name)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {"metadata": template_metadata, "spec": pod_spec(
                spec, container=container, pod=pod, gpus=spec.gpus_per_replica, spec_config_map=config_map_name(name),
                default_image=default_image, mounts=mounts, volumes=volumes)},
        },
    }


def server_access(owner: dict[str, Any], pool: InferencePool) -> list[dict[str, Any]]:
    """The servers' ServiceAccount, a Role allowing exactly get and watch on this one pool, the binding: a server
    reads its pool's batching settings (a GET, then a watch with `fieldSelector=metadata.name=<pool>`, which the API
    server authorizes by resourceNames) and can change nothing, not even its pool's status."""
    name = pool.metadata.name
    account, namespace = server_account_name(name), owner["metadata"].get("namespace")
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": object_metadata(owner, account, labels(name)),
         "automountServiceAccountToken": True},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": object_metadata(owner, account, labels(name)),
         "rules": [{"apiGroups": [GROUP], "resources": [POOL_PLURAL], "resourceNames": [name],
                    "verbs": ["get", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": object_metadata(owner, account, labels(name)),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": account},
         "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": namespace}]},
    ]


def service(owner: dict[str, Any], pool: InferencePool) -> dict[str, Any]:
    name = pool.metadata.name
    return {"apiVersion": "v1", "kind": "Service", "metadata": object_metadata(owner, name, labels(name)),
            "spec": {"type": "ClusterIP", "selector": selector(name),
                     "ports": [{"name": "http", "port": pool.spec.port, "targetPort": "http", "protocol": "TCP"},
                               {"name": "grpc", "port": pool.spec.grpc_port, "targetPort": "grpc", "protocol": "TCP",
                                "appProtocol": "kubernetes.io/h2c"}]}}


def disruption_budget(owner: dict[str, Any], pool: InferencePool) -> dict[str, Any]:
    """At most one server down at a time for a voluntary disruption (a node drain)."""
    name = pool.metadata.name
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": object_metadata(owner, deployment_name(name), labels(name)),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(name)}}}


PENDING_METRIC = "tandem_inference_pending_requests"
"""The server's Prometheus gauge of requests queued or running; a metrics adapter serves it to the autoscaler."""


def autoscaler(owner: dict[str, Any], pool: InferencePool) -> dict[str, Any]:
    """An HPA on the pool's own scale subresource (so `spec.replicas` stays the truth), on pending requests per server
    pod. Needs a metrics adapter serving the custom metric (e.g. prometheus-adapter; see README)."""
    scaling, name = pool.spec.autoscaling, pool.metadata.name
    return {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
        "metadata": object_metadata(owner, name, labels(name)),
        "spec": {
            "scaleTargetRef": {"apiVersion": API_VERSION, "kind": "InferencePool", "name": name},
            "minReplicas": scaling.min_replicas, "maxReplicas": scaling.max_replicas,
            "metrics": [{"type": "Pods", "pods": {
                "metric": {"name": PENDING_METRIC},
                "target": {"type": "AverageValue", "averageValue": f"{scaling.target_queue_depth:g}"}}}],
        },
    }
