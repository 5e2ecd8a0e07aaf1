"""The Kubernetes objects a ParallelTrainingJob becomes, built from its spec as plain manifests (pure functions):

- one Pod per rank, created directly (the operator owns the gang: no Job or JobSet), named and hostnamed
  `<job>-worker-<rank>` under a headless Service, so rank 0 has a stable DNS name, MASTER_ADDR;
- the headless Service; a ConfigMap holding the job as JSON, mounted read-only where TANDEM_SPEC points;
- rank 0's ServiceAccount, Role (get and patch on this one job and its status, nothing else) and RoleBinding:
  rank 0 reports progress, metrics and checkpoints into the job's status itself.

Every object is owned by the job (ownerReferences), so deleting the job deletes them all.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import PurePosixPath
from typing import Any

from tandem.api import API_VERSION, GROUP, ParallelTrainingJob
from tandem.contract import RESUME_LATEST, WorkerContract

JOB_LABEL = "tandem.dev/job"
RANK_LABEL = "tandem.dev/rank"
GROUP_LABEL = "tandem.dev/group"
"""The restart generation: status.restarts when the group was created."""
MASTER_PORT = 29500
SPEC_MOUNT = "/etc/tandem"
SPEC_FILE = "job.json"
CHECKPOINT_MOUNT = "/var/lib/tandem/checkpoints"
WORKER_COMMAND = ["tandem", "worker", "train"]
TERMINATION_GRACE_SECONDS = 60
"""A rank's time to write its checkpoint after SIGTERM (deletion, suspend, resize) before it is killed."""
RUN_AS = 1000
MAX_NAME = 63


def child_name(job: str, suffix: str) -> str:
    """`<job>-<suffix>`, shortened with a hash of the job's name where it would pass 63 characters (a DNS label:
    pod hostnames and Service names must be one)."""
    name = f"{job}-{suffix}"
    if len(name) <= MAX_NAME:
        return name
    digest = hashlib.sha256(job.encode()).hexdigest()[:6]
    return f"{job[:MAX_NAME - len(suffix) - len(digest) - 2].rstrip('-')}-{digest}-{suffix}"


def pod_name(job: str, rank: int) -> str:
    return child_name(job, f"worker-{rank}")


def service_name(job: str) -> str:
    return child_name(job, "workers")


def config_map_name(job: str) -> str:
    return child_name(job, "spec")


def rank0_account_name(job: str) -> str:
    return child_name(job, "rank0")


def master_address(job: str) -> str:
    """Rank 0's own DNS name: its hostname under the headless Service (resolved in the job's namespace)."""
    return f"{pod_name(job, 0)}.{service_name(job)}"


def selector(job: str) -> dict[str, str]:
    """The labels every rank pod of `job` carries, and only they."""
    return {JOB_LABEL: job}


def selector_string(job: str) -> str:
    return ",".join(f"{key}={value}" for key, value in selector(job).items())


def checkpoint_directory(job: ParallelTrainingJob) -> str:
    """Where rank 0 writes checkpoints in the pods: spec.checkpoint.directory under the checkpoint volume's mount
    (an absolute directory stays as it is)."""
    return str(PurePosixPath(CHECKPOINT_MOUNT) / job.spec.checkpoint.directory)


def owner_reference(owner: dict[str, Any]) -> dict[str, Any]:
    metadata = owner["metadata"]
    return {"apiVersion": owner.get("apiVersion", API_VERSION), "kind": owner.get("kind", "ParallelTrainingJob"),
            "name": metadata["name"], "uid": metadata["uid"], "controller": True, "blockOwnerDeletion": True}


def _metadata(owner: dict[str, Any], name: str, **extra: Any) -> dict[str, Any]:
    job = owner["metadata"]["name"]
    return {"name": name, "namespace": owner["metadata"].get("namespace"),
            "labels": {**selector(job), "app.kubernetes.io/name": "tandem", "app.kubernetes.io/instance": job,
                       "app.kubernetes.io/managed-by": "tandem-operator"},
            "ownerReferences": [owner_reference(owner)], **extra}


def worker_pod(owner: dict[str, Any], job: ParallelTrainingJob, rank: int, *, group: int, resume_from: str | None,
             default_image: str) -> dict[str, Any]:
    """The pod of one rank, running `tandem worker train` with the worker contract's environment. `resume_from`: a
    checkpoint's path, RESUME_LATEST (the ranks look in the checkpoint directory), or None (afresh)."""
    name = job.metadata.name
    spec = job.spec
    contract = WorkerContract(
        rank=rank, world_size=spec.workers, local_rank=0, local_world_size=1,
        master_addr=master_address(name), master_port=MASTER_PORT, job=name,
        namespace=owner["metadata"].get("namespace"), spec_path=PurePosixPath(SPEC_MOUNT) / SPEC_FILE,
        checkpoint_dir=PurePosixPath(checkpoint_directory(job)),
        resume_from=PurePosixPath(resume_from) if resume_from and resume_from != RESUME_LATEST else None,
        resume_latest=resume_from == RESUME_LATEST,
    )
    contract_env = [{"name": key, "value": value} for key, value in contract.to_environ().items()]
    resources = {kind: {name: str(quantity) for name, quantity in amounts.items()}  # quantities are strings
                 for kind, amounts in spec.resources.to_dict().items()}
    if spec.gpus_per_worker > 0:
        resources.setdefault("limits", {})["nvidia.com/gpu"] = str(spec.gpus_per_worker)
    mounts = [{"name": "tandem-spec", "mountPath": SPEC_MOUNT, "readOnly": True},
              {"name": "tandem-checkpoints", "mountPath": CHECKPOINT_MOUNT}]
    volumes = [{"name": "tandem-spec", "configMap": {"name": config_map_name(name)}},
               {"name": "tandem-checkpoints", **_checkpoint_volume(job)}]
    if spec.gpus_per_worker > 0:  # NCCL and the data loader need more shared memory than a container's 64 MiB
        mounts.append({"name": "tandem-shm", "mountPath": "/dev/shm"})
        volumes.append({"name": "tandem-shm", "emptyDir": {"medium": "Memory"}})
    container = {
        "name": "worker",
        "image": spec.image or default_image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": WORKER_COMMAND,
        "env": [*contract_env, *(e.to_dict() for e in spec.env)],
        "ports": [{"name": "rendezvous", "containerPort": MASTER_PORT, "protocol": "TCP"}],
        "resources": resources,
        "volumeMounts": [*mounts, *(m.to_dict() for m in spec.volume_mounts)],
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {"allowPrivilegeEscalation": False, "runAsNonRoot": True,
                            "capabilities": {"drop": ["ALL"]}},
    }
    pod_spec = {
        "hostname": pod_name(name, rank),
        "subdomain": service_name(name),
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
        "automountServiceAccountToken": rank == 0,
        "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": [*volumes, *(v.to_dict() for v in spec.volumes)],
    }
    if rank == 0:
        pod_spec["serviceAccountName"] = rank0_account_name(name)
    optional = {"nodeSelector": spec.node_selector, "tolerations": [t.to_dict() for t in spec.tolerations],
                "schedulerName": spec.scheduler_name, "priorityClassName": spec.priority_class_name}
    pod_spec.update({key: value for key, value in optional.items() if value})
    metadata = _metadata(owner, pod_name(name, rank))
    metadata["labels"].update({RANK_LABEL: str(rank), GROUP_LABEL: str(group),
                               "app.kubernetes.io/component": "worker"})
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}


def _checkpoint_volume(job: ParallelTrainingJob) -> dict[str, Any]:
    claim = job.spec.checkpoint.persistent_volume_claim
    return {"persistentVolumeClaim": {"claimName": claim}} if claim else {"emptyDir": {}}


def headless_service(owner: dict[str, Any], job: ParallelTrainingJob) -> dict[str, Any]:
    """DNS for the ranks (`<pod>.<service>`), published before they are ready: rank 0's name must resolve
    while the others wait for its port."""
    name = job.metadata.name
    return {
        "apiVersion": "v1", "kind": "Service", "metadata": _metadata(owner, service_name(name)),
        "spec": {"clusterIP": "None", "selector": selector(name), "publishNotReadyAddresses": True,
                 "ports": [{"name": "rendezvous", "port": MASTER_PORT, "targetPort": MASTER_PORT, "protocol": "TCP"}]},
    }


def spec_config_map(owner: dict[str, Any], job: ParallelTrainingJob) -> dict[str, Any]:
    """The job the ranks run, as JSON at TANDEM_SPEC: what a group was started with (a refused change of a
    running job does not reach it)."""
    document = {"apiVersion": API_VERSION, "kind": "ParallelTrainingJob",
                "metadata": {"name": job.metadata.name, "namespace": owner["metadata"].get("namespace")},
                "spec": job.spec.to_dict()}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _metadata(owner, config_map_name(job.metadata.name)),
            "data": {SPEC_FILE: json.dumps(document, sort_keys=True)}}


def applied_job(config_map: dict[str, Any] | None) -> ParallelTrainingJob | None:
    """The job a group runs, read back from its ConfigMap."""
    if config_map is None or SPEC_FILE not in (config_map.get("data") or {}):
        return None
    return ParallelTrainingJob.model_validate_json(config_map["data"][SPEC_FILE])


def rank0_access(owner: dict[str, Any], job: ParallelTrainingJob) -> list[dict[str, Any]]:
    """Rank 0's ServiceAccount, a Role allowing exactly get and patch on this job and its status, the binding."""
    name = rank0_account_name(job.metadata.name)
    namespace = owner["metadata"].get("namespace")
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _metadata(owner, name),
         "automountServiceAccountToken": True},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _metadata(owner, name),
         "rules": [{"apiGroups": [GROUP], "resources": ["paralleltrainingjobs", "paralleltrainingjobs/status"],
                    "resourceNames": [job.metadata.name], "verbs": ["get", "patch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": _metadata(owner, name),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]},
    ]


def group_objects(owner: dict[str, Any], job: ParallelTrainingJob) -> list[dict[str, Any]]:
    """Everything but the pods, created with the first group and kept for the job's life."""
    return [headless_service(owner, job), spec_config_map(owner, job), *rank0_access(owner, job)]
