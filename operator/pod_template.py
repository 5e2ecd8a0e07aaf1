"""What the pods of a ParallelTrainingJob and of an InferencePool have in common, built once (pure functions):

- the pod spec of one container from the API's shared PodSettings: the user's image, env, volumes, scheduling
  fields passed through, resources as quantities, a GPU limit, the operator's spec mounted read-only, and the same
  restricted security contexts for both kinds (non-root, no privilege escalation, no capabilities, seccomp);
- the names and metadata every child object carries: the app.kubernetes.io labels and an ownerReference to its job
  or pool, so deleting the owner deletes them all.

A kind's module adds only what is its own (a rank's contract and gang, a server's probes and drain).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from tandem.api import API_VERSION
from tandem.api.common import PodSettings

RUN_AS = 1000
"""The pods' user and group: the images' own (the Dockerfile's UID)."""
SPEC_MOUNT = "/etc/tandem"
"""Where a pod finds the job or pool it runs, the spec ConfigMap mounted read-only."""
MAX_NAME = 63
SPEC_HASH = "tandem.dev/spec-hash"
"""The annotation holding `spec_hash` of what a job's group or a pool's servers were started with: a change of the
owner's spec is found by comparing hashes, not by reading the running objects back."""


def spec_hash(spec: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def child_name(owner: str, suffix: str) -> str:
    """`<owner>-<suffix>`, shortened with a hash of the owner's name where it would pass 63 characters (a DNS label:
    pod hostnames and Service names must be one)."""
    name = f"{owner}-{suffix}"
    if len(name) <= MAX_NAME:
        return name
    digest = hashlib.sha256(owner.encode()).hexdigest()[:6]
    return f"{owner[:MAX_NAME - len(suffix) - len(digest) - 2].rstrip('-')}-{digest}-{suffix}"


def config_map_name(owner: str) -> str:
    """The ConfigMap holding the spec a job's or a pool's pods run."""
    return child_name(owner, "spec")


def spec_file_config_map(owner: dict[str, Any], kind: str, spec: dict[str, Any], *, file: str,
                         labels: dict[str, str], annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """The ConfigMap the owner's pods mount at SPEC_MOUNT: the resource (`kind`, its name and namespace, `spec`) as
    JSON in `file`, what its pods run."""
    metadata = owner["metadata"]
    document = {"apiVersion": API_VERSION, "kind": kind,
                "metadata": {"name": metadata["name"], "namespace": metadata.get("namespace")}, "spec": spec}
    config_map = {"apiVersion": "v1", "kind": "ConfigMap",
                  "metadata": object_metadata(owner, config_map_name(metadata["name"]), labels),
                  "data": {file: json.dumps(document, sort_keys=True)}}
    if annotations:
        config_map["metadata"]["annotations"] = annotations
    return config_map


def owner_reference(owner: dict[str, Any]) -> dict[str, Any]:
    metadata = owner["metadata"]
    return {"apiVersion": owner.get("apiVersion", API_VERSION), "kind": owner.get("kind", "ParallelTrainingJob"),
            "name": metadata["name"], "uid": metadata["uid"], "controller": True, "blockOwnerDeletion": True}


def object_metadata(owner: dict[str, Any], name: str, labels: dict[str, str]) -> dict[str, Any]:
    """A child's metadata in the owner's namespace. `labels`: the kind's own (its selector, a component), beside the
    app.kubernetes.io ones every child carries, so `kubectl get -l` finds a job's or a pool's objects either way."""
    metadata = owner["metadata"]
    return {"name": name, "namespace": metadata.get("namespace"),
            "labels": {**labels, "app.kubernetes.io/name": "tandem", "app.kubernetes.io/instance": metadata["name"],
                       "app.kubernetes.io/managed-by": "tandem-operator"},
            "ownerReferences": [owner_reference(owner)]}


def pod_spec(settings: PodSettings, *, container: dict[str, Any], pod: dict[str, Any], gpus: int, spec_config_map: str,
             default_image: str, env: Sequence[dict[str, Any]] = (), mounts: Sequence[dict[str, Any]] = (),
             volumes: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """A pod spec of one container. `container` and `pod`: the caller's own fields (name, command, ports, probes;
    restart policy, grace period, service account); `env`, `mounts`, `volumes`: the caller's own, put before the
    user's. `gpus`: the pod's nvidia.com/gpu limit (0: none), a parameter rather than read from the settings because
    each kind counts its pod's GPUs its own way; it replaces a limit the user's resources give."""
    resources = {kind: {key: str(quantity) for key, quantity in amounts.items()}  # quantities are strings
                 for kind, amounts in settings.resources.to_dict().items()}
    if gpus > 0:
        resources.setdefault("limits", {})["nvidia.com/gpu"] = str(gpus)
    spec_mount = {"name": "tandem-spec", "mountPath": SPEC_MOUNT, "readOnly": True}
    spec_volume = {"name": "tandem-spec", "configMap": {"name": spec_config_map}}
    built = {
        **container,
        "image": settings.image or default_image,
        "imagePullPolicy": settings.image_pull_policy,
        "env": [*env, *(e.to_dict() for e in settings.env)],
        "resources": resources,
        "volumeMounts": [spec_mount, *mounts, *(m.to_dict() for m in settings.volume_mounts)],
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {"allowPrivilegeEscalation": False, "runAsNonRoot": True,
                            "capabilities": {"drop": ["ALL"]}},
    }
    optional = {"nodeSelector": settings.node_selector, "tolerations": [t.to_dict() for t in settings.tolerations],
                "schedulerName": settings.scheduler_name, "priorityClassName": settings.priority_class_name}
    return {
        **pod,
        "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [built],
        "volumes": [spec_volume, *volumes, *(v.to_dict() for v in settings.volumes)],
        **{key: value for key, value in optional.items() if value},
    }
