"""The subresources beside `status`: scale (custom resources and apps), a pod's binding, eviction and log.

- scale: GET answers an `autoscaling/v1` Scale built from the object through the CRD's specReplicasPath,
  statusReplicasPath and labelSelectorPath (apps: `.spec.replicas`, `.status.replicas`, `.spec.selector`);
  PUT/PATCH of a Scale sets the object's spec replicas (a spec change: generation + 1);
- binding (`POST pods/NAME/binding`): the scheduler's write, sets spec.nodeName and condition PodScheduled=True;
  409 when the pod is bound already;
- eviction (`POST pods/NAME/eviction`): deletes the pod gracefully. Deviation: PodDisruptionBudgets are not
  consulted;
- log (`GET pods/NAME/log`): the kubelet's log file of the pod's container (`tailLines`, `previous`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

from . import lifecycle, patches
from .catalog import Kind
from .selectors import format_match_labels
from .store import Key
from .writes import Writer, api_error, not_found, timestamp

LogReader = Callable[[str, str, "str | None", bool], "bytes | None"]


def get_path(obj: Mapping[str, Any], path: str) -> Any:
    value: Any = obj
    for part in path.strip(".").split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


def set_path(obj: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.strip(".").split(".")
    for part in parents:
        obj = obj.setdefault(part, {})
    obj[last] = value


def scale_of(kind: Kind, obj: Mapping[str, Any]) -> dict[str, Any]:
    paths = kind.scale
    meta = obj["metadata"]
    if paths.label_selector:
        selector = get_path(obj, paths.label_selector)
    else:
        selector = format_match_labels(get_path(obj, ".spec.selector"))
    status = {"replicas": get_path(obj, paths.status_replicas) or 0}
    if selector:
        status["selector"] = selector
    return {
        "apiVersion": "autoscaling/v1", "kind": "Scale",
        "metadata": {key: meta[key] for key in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
                     if key in meta},
        "spec": {"replicas": get_path(obj, paths.spec_replicas)},
        "status": status,
    }


def write_scale(writer: Writer, kind: Kind, key: Key, method: str, body: Any, content_type: str | None
                ) -> dict[str, Any]:
    current = writer.store.live(key)
    if current is None:
        raise not_found(kind, key[2])
    scale = scale_of(kind, current)
    if method == "PUT":
        desired = body
    else:
        try:
            desired = patches.apply(scale, body, content_type)
        except patches.PatchError as error:
            raise api_error(error.status, error.reason, error.message) from None
    replicas = (desired.get("spec") or {}).get("replicas") if isinstance(desired, dict) else None
    if not isinstance(replicas, int) or replicas < 0:
        raise api_error(422, "Invalid", f'Scale.autoscaling "{key[2]}" is invalid: spec.replicas: Invalid value: '
                                        f"{replicas!r}: must be greater than or equal to 0")
    updated = copy.deepcopy(current)
    set_path(updated, kind.scale.spec_replicas, replicas)
    expect = (desired.get("metadata") or {}).get("resourceVersion")
    if expect == scale["metadata"].get("resourceVersion"):
        expect = None  # a patch of the Scale keeps its version: no precondition
    stored = writer.update(kind, key, updated, expect_version=expect)
    return scale_of(kind, stored)


def bind(writer: Writer, kind: Kind, key: Key, body: Any) -> dict[str, Any]:
    pod = writer.store.live(key)
    if pod is None:
        raise not_found(kind, key[2])
    node = ((body or {}).get("target") or {}).get("name")
    if not node:
        raise api_error(400, "BadRequest", "a Binding needs target.name")
    if pod.get("spec", {}).get("nodeName"):
        raise api_error(409, "Conflict", f'Operation cannot be fulfilled on pods/binding "{key[2]}": pod {key[2]} is '
                                         f"already assigned to node \"{pod['spec']['nodeName']}\"")
    bound = copy.deepcopy(pod)
    bound["spec"]["nodeName"] = node
    conditions = [c for c in bound.get("status", {}).get("conditions", []) if c.get("type") != "PodScheduled"]
    conditions.insert(0, {"type": "PodScheduled", "status": "True", "lastProbeTime": None,
                          "lastTransitionTime": timestamp()})
    bound.setdefault("status", {})["conditions"] = conditions
    writer.update(kind, key, bound, system=True)
    writer.update(kind, key, bound, subresource="status", system=True)
    return success(key[2], "pods")


def evict(writer: Writer, kind: Kind, key: Key, body: Any) -> dict[str, Any]:
    options = (body or {}).get("deleteOptions") or {}
    lifecycle.delete(writer, kind, key, options)
    return success(key[2], "pods")


def read_log(reader: LogReader | None, namespace: str, name: str, params: Mapping[str, str]) -> bytes:
    container = params.get("container")
    data = reader(namespace, name, container, params.get("previous") == "true") if reader else None
    if data is None:
        raise api_error(400, "BadRequest", f'container "{container or "0"}" in pod "{name}" is waiting to start: '
                                           f"ContainerCreating")
    if params.get("tailLines"):
        lines = data.splitlines(keepends=True)
        data = b"".join(lines[-int(params["tailLines"]):]) if int(params["tailLines"]) else b""
    return data


def success(name: str, plural: str, uid: str | None = None) -> dict[str, Any]:
    details = {"name": name, "kind": plural, **({"uid": uid} if uid else {})}
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "details": details}
