"""The Kubernetes objects a ParallelTrainingJob becomes, built from its spec as plain manifests (pure functions):

- one Pod per `ranksPerPod` ranks, created directly (the operator owns the gang: no Job or JobSet), named and
  hostnamed `<job>-worker-<index>` under a headless Service, so rank 0 (in pod 0) has a stable DNS name,
  MASTER_ADDR; a pod of one rank runs it (`tandem worker train`), a pod of several runs their launcher (`tandem
  worker launch`), with all their GPUs and a /dev/shm in memory for NCCL's shared-memory transport;
- the headless Service; a ConfigMap holding the job as JSON, mounted read-only where TANDEM_SPEC points, annotated
  with the hash of the group's spec and the group's size (a running group's drift is found from them, RunningGroup);
- for an elastic job (recovery regroup), one more pod, `<job>-coordinator` under the same Service: the group's TCP
  store and the planner of its regroups (`tandem worker coordinator`, CPU only), out of the ranks so that
  losing any rank, rank 0 included, is a regroup; the ranks' MASTER_ADDR is its DNS name;
- rank 0's ServiceAccount, Role (get and patch on this one job and its status, nothing else) and RoleBinding:
  rank 0 reports progress, metrics and checkpoints into the job's status itself (in an elastic job any rank may
  become rank 0, so every rank pod runs under them).

Every object is owned by the job (ownerReferences), so deleting the job deletes them all.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from tandem import contract
from tandem.api import GROUP, ParallelTrainingJob
from tandem.api.common import ResourceRequirements
from tandem.contract import RESUME_LATEST, WorkerContract
from tandem.crd import RESOURCES
from tandem.operator.gangs import gang_member, pod_group
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

JOB_PLURAL = RESOURCES["ParallelTrainingJob"].plural
"""The resource's name in API paths and RBAC rules: `paralleltrainingjobs`."""
JOB_LABEL = "tandem.dev/job"
RANK_LABEL = "tandem.dev/rank"
"""The pod's first rank (its only one, with ranksPerPod 1): `-l tandem.dev/rank=0` finds rank 0's pod."""
POD_INDEX_LABEL = "tandem.dev/pod-index"
"""The pod's index among the job's rank pods (Kubeflow's replica-index): its ranks are index x ranksPerPod on."""
GROUP_LABEL = "tandem.dev/group"
"""The restart generation: status.restarts when the group was created."""
ROLE_LABEL = "tandem.dev/role"
"""On an elastic job's coordinator pod only (COORDINATOR_ROLE): the job's pod that hosts no rank."""
COORDINATOR_ROLE = "coordinator"
MASTER_PORT = 29500
SPEC_FILE = "job.json"
CHECKPOINT_MOUNT = "/var/lib/tandem/checkpoints"
TERMINATION_LOG = "/dev/termination-log"
WORKER_COMMAND = ["tandem", "worker", "train"]
LAUNCH_COMMAND = ["tandem", "worker", "launch", "--termination-log", TERMINATION_LOG]
COORDINATOR_COMMAND = ["tandem", "worker", "coordinator"]
COORDINATOR_REQUESTS = {"cpu": "100m", "memory": "512Mi"}
"""The coordinator's own requests, whatever the ranks' resources: it serves a TCP store and plans regroups (torch
imported for the store is most of its memory) and needs no GPU."""
TERMINATION_GRACE_SECONDS = 60
"""A rank's time to write its checkpoint after SIGTERM (deletion, suspend, resize) before it is killed."""
WORKERS_ANNOTATION = "tandem.dev/workers"
RANKS_PER_POD_ANNOTATION = "tandem.dev/ranks-per-pod"
POLICY_FIELDS = {"workers", "ranksPerPod", "suspend", "backoffLimit", "activeDeadlineSeconds",
                 "ttlSecondsAfterFinished", "heartbeatTimeoutSeconds"}
"""Spec fields read live from the job; every other field is the group's, fixed while it runs."""


def pod_name(job: str, index: int) -> str:
    return child_name(job, f"worker-{index}")


def service_name(job: str) -> str:
    return child_name(job, "workers")


def rank0_account_name(job: str) -> str:
    return child_name(job, "rank0")


def coordinator_name(job: str) -> str:
    return child_name(job, "coordinator")


def master_address(job: str) -> str:
    """Rank 0's own DNS name: its hostname under the headless Service (resolved in the job's namespace)."""
    return f"{pod_name(job, 0)}.{service_name(job)}"


def coordinator_address(job: str) -> str:
    """The coordinator's own DNS name, as master_address is rank 0's."""
    return f"{coordinator_name(job)}.{service_name(job)}"


def group_master(job: ParallelTrainingJob) -> tuple[str, str]:
    """The pod hosting the group's store and its address, the ranks' MASTER_ADDR: an elastic job's (recovery
    regroup) coordinator, which no rank's loss takes down; otherwise rank 0's pod."""
    name = job.metadata.name
    if job.spec.regroups:
        return coordinator_name(name), coordinator_address(name)
    return pod_name(name, 0), master_address(name)


def is_coordinator(pod: dict[str, Any]) -> bool:
    return ((pod.get("metadata") or {}).get("labels") or {}).get(ROLE_LABEL) == COORDINATOR_ROLE


def selector(job: str) -> dict[str, str]:
    """The labels every pod of `job` carries (its rank pods, and an elastic job's coordinator), and only they."""
    return {JOB_LABEL: job}


def selector_string(job: str) -> str:
    return ",".join(f"{key}={value}" for key, value in selector(job).items())


def rank_selector_string(job: str) -> str:
    """The job's rank pods alone (status.selector, which the scale subresource reports: an autoscaler counts ranks,
    not an elastic job's coordinator). `notin`, not `!=`: kubectl reads a /scale selector with the set-based parser
    of LabelSelector, which has no `!=`."""
    return f"{selector_string(job)},{ROLE_LABEL} notin ({COORDINATOR_ROLE})"


def checkpoint_directory(job: ParallelTrainingJob) -> str:
    """Where rank 0 writes checkpoints in the pods: spec.checkpoint.directory under the checkpoint volume's mount
    (an absolute directory stays as it is)."""
    return str(PurePosixPath(CHECKPOINT_MOUNT) / job.spec.checkpoint.directory)


def worker_pod(owner: dict[str, Any], job: ParallelTrainingJob, index: int, *, group: int, resume_from: str | None,
               default_image: str, regroups_before: int = 0, world_size: int | None = None) -> dict[str, Any]:
    """Rank pod `index`, hosting ranks index x ranksPerPod on: one rank runs `tandem worker train` with the worker
    contract's environment; several run under `tandem worker launch`, given the pod's contract (GROUP_RANK in place
    of RANK and LOCAL_RANK), which starts each and writes a failed one's cause at the termination message path.
    `resume_from`: a checkpoint's path, RESUME_LATEST (the ranks look in the checkpoint directory), or None
    (afresh). `world_size`: the ranks the group starts with, where it starts with fewer than spec.workers (some lent:
    spec.elastic.lendTo)."""
    name = job.metadata.name
    spec = job.spec
    first_rank = index * spec.ranks_per_pod
    worker = WorkerContract(
        rank=first_rank, world_size=world_size or spec.workers, local_rank=0, local_world_size=spec.ranks_per_pod,
        master_addr=group_master(job)[1], master_port=MASTER_PORT, job=name,
        namespace=owner["metadata"].get("namespace"), spec_path=PurePosixPath(SPEC_MOUNT) / SPEC_FILE,
        checkpoint_dir=PurePosixPath(checkpoint_directory(job)),
        resume_from=PurePosixPath(resume_from) if resume_from and resume_from != RESUME_LATEST else None,
        resume_latest=resume_from == RESUME_LATEST, job_uid=owner["metadata"].get("uid"),
        regroups_before=regroups_before,
    )
    several = spec.ranks_per_pod > 1
    environ = worker.pod_environ() if several else worker.to_environ()
    mounts, volumes = _rank_volumes(job)
    container = {"name": "worker", "command": LAUNCH_COMMAND if several else WORKER_COMMAND,
                 "ports": [{"name": "rendezvous", "containerPort": MASTER_PORT, "protocol": "TCP"}],
                 "terminationMessagePath": TERMINATION_LOG}
    reports = index == 0 or spec.regroups  # an elastic job's rank 0 is its generation's lowest slot: any rank
    pod = {"hostname": pod_name(name, index), "subdomain": service_name(name), "restartPolicy": "Never",
           "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS, "automountServiceAccountToken": reports}
    if reports:
        pod["serviceAccountName"] = rank0_account_name(name)
    labels = {**selector(name), RANK_LABEL: str(first_rank), POD_INDEX_LABEL: str(index), GROUP_LABEL: str(group),
              "app.kubernetes.io/component": "worker"}
    return gang_member({
        "apiVersion": "v1", "kind": "Pod", "metadata": object_metadata(owner, pod_name(name, index), labels),
        "spec": pod_spec(spec, container=container, pod=pod, gpus=spec.ranks_per_pod * spec.gpus_per_worker,
                         spec_config_map=config_map_name(name), default_image=default_image,
                         env=[{"name": key, "value": value} for key, value in environ.items()],
                         mounts=mounts, volumes=volumes)}, job)


def coordinator_pod(owner: dict[str, Any], job: ParallelTrainingJob, *, group: int, default_image: str,
                    world_size: int | None = None) -> dict[str, Any]:
    """An elastic job's coordinator: the group's store on MASTER_PORT and the planner of its regroups, in the rank
    pods' image and under their Service, reading the spec file as they do. Its MASTER_ADDR is its own DNS name, the
    ranks' MASTER_ADDR (unused by it, but a cluster emulation that gives each group one port, as the test kubelet
    does, finds the group by it); WORLD_SIZE is the group's size at its start (generation 1's slots: `world_size`,
    spec.workers unless some are lent). No GPU, the user's resources (a rank's) and volumes left out, no API token
    (it reports nothing); outside the gang (its PodGroup counts the rank pods). It exits 0 once the training is
    over: the job's success."""
    name = job.metadata.name
    environ = {contract.WORLD_SIZE: str(world_size or job.spec.workers),
               contract.MASTER_ADDR: coordinator_address(name), contract.MASTER_PORT: str(MASTER_PORT),
               contract.JOB: name,
               contract.NAMESPACE: owner["metadata"].get("namespace"),
               contract.SPEC: str(PurePosixPath(SPEC_MOUNT) / SPEC_FILE)}
    settings = job.spec.model_copy(update={"resources": ResourceRequirements(requests=COORDINATOR_REQUESTS),
                                           "volumes": [], "volume_mounts": []})
    container = {"name": "coordinator", "command": COORDINATOR_COMMAND,
                 "ports": [{"name": "rendezvous", "containerPort": MASTER_PORT, "protocol": "TCP"}]}
    pod = {"hostname": coordinator_name(name), "subdomain": service_name(name), "restartPolicy": "Never",
           "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS, "automountServiceAccountToken": False}
    labels = {**selector(name), ROLE_LABEL: COORDINATOR_ROLE, GROUP_LABEL: str(group),
              "app.kubernetes.io/component": "coordinator"}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": object_metadata(owner, coordinator_name(name), labels),
            "spec": pod_spec(settings, container=container, pod=pod, gpus=0, spec_config_map=config_map_name(name),
                             default_image=default_image,
                             env=[{"name": key, "value": value} for key, value in environ.items()
                                  if value is not None])}


def _rank_volumes(job: ParallelTrainingJob) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A rank pod's own mounts and volumes (beside its spec): the checkpoint volume, and /dev/shm in memory, sized
    by spec.shmSize (NCCL's shared-memory transport and the data loaders need more than a container's 64 MiB)."""
    mounts = [{"name": "tandem-checkpoints", "mountPath": CHECKPOINT_MOUNT},
              {"name": "tandem-shm", "mountPath": "/dev/shm"}]
    volumes = [{"name": "tandem-checkpoints", **_checkpoint_volume(job)},
               {"name": "tandem-shm", "emptyDir": {"medium": "Memory", "sizeLimit": str(job.spec.shm_size)}}]
    return mounts, volumes


def _checkpoint_volume(job: ParallelTrainingJob) -> dict[str, Any]:
    claim = job.spec.checkpoint.persistent_volume_claim
    return {"persistentVolumeClaim": {"claimName": claim}} if claim else {"emptyDir": {}}


def headless_service(owner: dict[str, Any], job: ParallelTrainingJob) -> dict[str, Any]:
    """DNS for the ranks and an elastic job's coordinator (`<pod>.<service>`: it selects every pod of the job),
    published before they are ready: the master's name must resolve while the ranks wait for its port."""
    name = job.metadata.name
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": object_metadata(owner, service_name(name), selector(name)),
        "spec": {"clusterIP": "None", "selector": selector(name), "publishNotReadyAddresses": True,
                 "ports": [{"name": "rendezvous", "port": MASTER_PORT, "targetPort": MASTER_PORT, "protocol": "TCP"}]},
    }


def spec_config_map(owner: dict[str, Any], job: ParallelTrainingJob) -> dict[str, Any]:
    """The job the ranks run, as JSON at TANDEM_SPEC: what a group was started with (a refused change of a
    running job does not reach it), annotated with what RunningGroup reads."""
    return spec_file_config_map(owner, "ParallelTrainingJob", job.spec.to_dict(), file=SPEC_FILE,
                                labels=selector(job.metadata.name), annotations={
                                    SPEC_HASH: group_spec_hash(job), WORKERS_ANNOTATION: str(job.spec.workers),
                                    RANKS_PER_POD_ANNOTATION: str(job.spec.ranks_per_pod)})


def group_spec(job: ParallelTrainingJob) -> dict[str, Any]:
    """The spec a group is fixed to: every field but POLICY_FIELDS, less those at their defaults (so that an operator
    whose API adds a field with a default finds no change in the groups an older one started)."""
    spec = job.spec.model_dump(mode="json", by_alias=True, exclude_defaults=True)
    return {key: value for key, value in spec.items() if key not in POLICY_FIELDS}


def group_spec_hash(job: ParallelTrainingJob) -> str:
    return spec_hash(group_spec(job))


def changed_fields(running: ParallelTrainingJob, job: ParallelTrainingJob) -> list[str]:
    """The group's fields `job` sets otherwise than the `running` group."""
    was, now = group_spec(running), group_spec(job)
    return sorted(key for key in now if now[key] != was.get(key)) + sorted(set(was) - set(now))


@dataclass(frozen=True)
class RunningGroup:
    """What a group runs, as its spec ConfigMap says."""

    spec_hash: str
    """`group_spec_hash` of the job it was started with."""
    workers: int
    ranks_per_pod: int

    def runs(self, job: ParallelTrainingJob) -> bool:
        """Whether the group runs `job`'s spec (its size aside): their hashes agree."""
        return self.spec_hash == group_spec_hash(job)


def running_group(config_map: dict[str, Any] | None) -> RunningGroup | None:
    """The group the spec ConfigMap was written for, from its annotations. A ConfigMap without them (an operator
    before spec hashes wrote it, or someone edited them) is read back whole instead, as that operator did on every
    pass, until the next group replaces it: an upgraded operator finds the drift the older one would have, and
    restarts no group for the missing annotations."""
    if config_map is None or SPEC_FILE not in (config_map.get("data") or {}):
        return None
    annotations = (config_map.get("metadata") or {}).get("annotations") or {}
    try:
        return RunningGroup(annotations[SPEC_HASH], int(annotations[WORKERS_ANNOTATION]),
                            int(annotations[RANKS_PER_POD_ANNOTATION]))
    except (KeyError, ValueError):
        job = applied_job(config_map)
        return None if job is None else RunningGroup(group_spec_hash(job), job.spec.workers, job.spec.ranks_per_pod)


def applied_job(config_map: dict[str, Any] | None) -> ParallelTrainingJob | None:
    """The job a group runs, read back from its ConfigMap (only where its spec must be known whole: the group is
    rebuilt, or the fields that changed are named)."""
    if config_map is None or SPEC_FILE not in (config_map.get("data") or {}):
        return None
    return ParallelTrainingJob.model_validate_json(config_map["data"][SPEC_FILE])


def rank0_access(owner: dict[str, Any], job: ParallelTrainingJob) -> list[dict[str, Any]]:
    """Rank 0's ServiceAccount (an elastic job's ranks all run under it), a Role allowing exactly get and patch on
    this job and its status, the binding."""
    name, labels = rank0_account_name(job.metadata.name), selector(job.metadata.name)
    namespace = owner["metadata"].get("namespace")
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": object_metadata(owner, name, labels),
         "automountServiceAccountToken": True},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": object_metadata(owner, name, labels),
         "rules": [{"apiGroups": [GROUP], "resources": [JOB_PLURAL, f"{JOB_PLURAL}/status"],
                    "resourceNames": [job.metadata.name], "verbs": ["get", "patch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": object_metadata(owner, name, labels),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]},
    ]


def group_objects(owner: dict[str, Any], job: ParallelTrainingJob) -> list[dict[str, Any]]:
    """Everything but the pods, created with the first group and kept for the job's life (the ConfigMap and a
    PodGroup, which follow the group's spec and size, replaced with each group)."""
    gang = [pod_group(owner, job, selector(job.metadata.name))] if job.spec.gang is not None else []
    return [headless_service(owner, job), spec_config_map(owner, job), *rank0_access(owner, job), *gang]
