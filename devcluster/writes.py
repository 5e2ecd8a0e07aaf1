"""How the emulator writes objects: the API server's rules for create and update, each a small named step.

- `stamp_new`: uid, creationTimestamp, generation 1, `generateName` honoured (for Events too), system fields a
  client sent are ignored; apiVersion and kind set from the URL's resource;
- `initial_status`: for resources with the status subresource, a create's `status` is dropped (pods start
  `{phase: Pending}`, namespaces `{phase: Active}`);
- `keep_system_fields`: an update cannot change uid, name, namespace, creationTimestamp, deletionTimestamp;
- `isolate_status`: writes to the object never change `status`; writes to `/status` change only `status`;
- `check_finalizers`: no new finalizer on an object being deleted (422);
- `check_pod_update`: a pod's spec is immutable but for images, activeDeadlineSeconds and tolerations (422);
- custom resources are pruned, defaulted and validated against their CRD's schema, CEL rules included (schema.py,
  cel.py), on every write: create, update, patch, status and scale; a CRD whose rule does not compile is refused;
- names and labels are validated as a real API server does (422);
- `bump_generation`: generation + 1 when anything but metadata (and status) changed;
- a no-op update keeps its resourceVersion and sends no watch event, as a real API server does;
- `release_if_done`: an object with a deletionTimestamp, no finalizers and no grace period left is removed.
"""

from __future__ import annotations

import copy
import datetime
import random
import re
import uuid
from collections.abc import Callable
from typing import Any

import kmock

from . import cel, schema
from .catalog import Catalog, Kind
from .store import Key, Store

Listener = Callable[[Kind, str, dict[str, Any]], None]
_SYSTEM = ("uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "generation",
           "resourceVersion", "name", "namespace")
_LABEL = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_SUFFIX_CHARS = "bcdfghjklmnpqrstvwxz2456789"  # the API server's generateName alphabet


def api_error(status: int, reason: str, message: str, **details: Any) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=status, reason=reason, message=message, details=details or {"causes": []})


def not_found(kind: Kind, name: str) -> kmock.KubernetesError:
    return api_error(404, "NotFound", f'{kind.group_resource} "{name}" not found', name=name, kind=kind.plural)


def invalid(kind: Kind, name: str, problems: list[str]) -> kmock.KubernetesError:
    title = f"{kind.kind}.{kind.group}" if kind.group else kind.kind
    return api_error(422, "Invalid", f'{title} "{name}" is invalid: ' + "; ".join(problems), name=name,
                     kind=kind.kind, causes=[_cause(p) for p in problems])


def _cause(problem: str) -> dict[str, str]:
    """`spec.workers: 0 is less...` as a cause with its field, which kubectl prints as `* spec.workers: ...`."""
    field, sep, message = problem.partition(": ")
    if not sep or " " in field:
        return {"reason": "FieldValueInvalid", "message": problem}
    return {"reason": "FieldValueInvalid", "field": field, "message": message}


def blockers(obj: dict[str, Any]) -> list[str]:
    """What keeps a deleted object: its finalizers (and a namespace's spec.finalizers)."""
    found = list(obj["metadata"].get("finalizers") or [])
    if obj.get("kind") == "Namespace" and obj.get("apiVersion") == "v1":
        found += (obj.get("spec") or {}).get("finalizers") or []
    return found


def timestamp(offset_seconds: float = 0) -> str:
    moment = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=offset_seconds)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


class Writer:
    def __init__(self, catalog: Catalog, store: Store) -> None:
        self.catalog, self.store = catalog, store
        self.listeners: list[Listener] = []  # called after each commit: the CRD controller, GC, namespaces
        self.orphaned: set[str] = set()  # uids deleted with propagationPolicy Orphan

    def key(self, kind: Kind, namespace: str | None, name: str) -> Key:
        return kind.resource, namespace if kind.namespaced else None, name

    def commit(self, kind: Kind, key: Key, type_: str, obj: dict[str, Any], old: dict[str, Any] | None) -> dict:
        stored = self.store.commit(key, type_, obj, old)
        for listener in self.listeners:
            listener(kind, type_, stored)
        return stored

    # -- create ---------------------------------------------------------------------------------------------------
    def create(self, kind: Kind, namespace: str | None, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict) or not isinstance(body.get("metadata", {}), dict):
            raise api_error(400, "BadRequest", "the body of a create must be a JSON object with metadata")
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        namespace = self._namespace_for_create(kind, namespace, meta.get("namespace"))
        meta["name"] = self._name_for_create(kind, namespace, meta)
        key = self.key(kind, namespace, meta["name"])
        if self.store.live(key) is not None:
            raise api_error(409, "AlreadyExists", f'{kind.group_resource} "{meta["name"]}" already exists',
                            name=meta["name"], kind=kind.plural)
        self.stamp_new(kind, obj, namespace)
        self.initial_status(kind, obj)
        obj = self.admit(kind, obj, None)
        return self.commit(kind, key, "ADDED", obj, None)

    def _namespace_for_create(self, kind: Kind, from_path: str | None, from_body: str | None) -> str | None:
        if not kind.namespaced:
            return None
        if from_path and from_body and from_path != from_body:
            raise api_error(400, "BadRequest", "the namespace of the provided object does not match the namespace "
                                               "sent on the request")
        namespace = from_path or from_body
        if not namespace:
            raise api_error(400, "BadRequest", "a namespaced object needs a namespace")
        ns = self.store.live(self.key(self.catalog.find("", "v1", "namespaces"), None, namespace))
        if ns is None:
            raise api_error(404, "NotFound", f'namespaces "{namespace}" not found', name=namespace, kind="namespaces")
        if ns["metadata"].get("deletionTimestamp"):
            raise api_error(403, "Forbidden", f"unable to create new content in namespace {namespace} because it is "
                                              f"being terminated")
        return namespace

    def _name_for_create(self, kind: Kind, namespace: str | None, meta: dict[str, Any]) -> str:
        if meta.get("name"):
            return meta["name"]
        if not meta.get("generateName"):
            raise invalid(kind, "", ["metadata.name: Required value: name or generateName is required"])
        for _ in range(16):
            name = meta["generateName"] + "".join(random.choices(_SUFFIX_CHARS, k=5))
            if self.store.live(self.key(kind, namespace, name)) is None:
                return name
        raise api_error(409, "AlreadyExists", "generateName kept colliding")

    def stamp_new(self, kind: Kind, obj: dict[str, Any], namespace: str | None) -> None:
        meta = obj["metadata"]
        for field in ("uid", "resourceVersion", "creationTimestamp", "deletionTimestamp",
                      "deletionGracePeriodSeconds", "generation", "selfLink", "managedFields"):
            meta.pop(field, None)
        obj["apiVersion"], obj["kind"] = kind.api_version, kind.kind
        if namespace is not None:
            meta["namespace"] = namespace
        else:
            meta.pop("namespace", None)
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=timestamp(), generation=1)

    def initial_status(self, kind: Kind, obj: dict[str, Any]) -> None:
        if kind.has_status:
            obj.pop("status", None)
        if kind.kind == "Pod" and not kind.group:
            obj["status"] = {"phase": "Pending"}
        elif kind.kind == "Namespace" and not kind.group:
            obj["status"] = {"phase": "Active"}
            obj.setdefault("spec", {})["finalizers"] = ["kubernetes"]  # the namespace controller's

    # -- update ---------------------------------------------------------------------------------------------------
    def update(self, kind: Kind, key: Key, desired: Any, *, subresource: str | None = None,
               expect_version: str | None = None, system: bool = False) -> dict[str, Any]:
        """Replace the object with `desired` (a PUT body, or the current object with a patch applied), by the API
        server's rules. `system` writes (binding, deletion marks) skip the checks a client's writes get."""
        current = self.store.live(key)
        if current is None:
            raise not_found(kind, key[2])
        if not isinstance(desired, dict) or not isinstance(desired.get("metadata", {}), dict):
            raise api_error(400, "BadRequest", "the object must be a JSON object with metadata")
        if expect_version and expect_version != current["metadata"]["resourceVersion"]:
            raise api_error(409, "Conflict", f'Operation cannot be fulfilled on {kind.group_resource} "{key[2]}": the '
                            f"object has been modified; please apply your changes to the latest version and try again",
                            name=key[2], kind=kind.plural)
        given_name = desired.get("metadata", {}).get("name")
        if given_name and given_name != key[2]:
            raise api_error(400, "BadRequest", f"the name of the object ({given_name}) does not match the name on "
                                               f"the URL ({key[2]})")
        new = self.isolate_status(kind, current, copy.deepcopy(desired), subresource)
        new["apiVersion"], new["kind"] = kind.api_version, kind.kind
        self.keep_system_fields(current, new)
        if not system:
            self.check_finalizers(kind, current, new)
            self.check_pod_update(kind, current, new)
        new = self.admit(kind, new, current)
        self.bump_generation(kind, current, new)
        if new == current:
            return current
        stored = self.commit(kind, key, "MODIFIED", new, current)
        return self.release_if_done(kind, key) or stored

    def isolate_status(self, kind: Kind, current: dict, new: dict, subresource: str | None) -> dict[str, Any]:
        if subresource == "status":
            result = copy.deepcopy(current)
            if "status" in new:
                result["status"] = new["status"]
            else:
                result.pop("status", None)
            return result
        if kind.has_status:
            new.pop("status", None)
            if "status" in current:
                new["status"] = copy.deepcopy(current["status"])
        return new

    def keep_system_fields(self, current: dict[str, Any], new: dict[str, Any]) -> None:
        meta = new.setdefault("metadata", {})
        for field in _SYSTEM:
            if field in current["metadata"]:
                meta[field] = current["metadata"][field]
            else:
                meta.pop(field, None)

    def check_finalizers(self, kind: Kind, current: dict[str, Any], new: dict[str, Any]) -> None:
        if not current["metadata"].get("deletionTimestamp"):
            return
        added = set(new["metadata"].get("finalizers") or []) - set(current["metadata"].get("finalizers") or [])
        if added:
            raise invalid(kind, current["metadata"]["name"], [
                f"metadata.finalizers: Forbidden: no new finalizers can be added if the object is being deleted, "
                f"found new finalizers {sorted(added)}"])

    def check_pod_update(self, kind: Kind, current: dict[str, Any], new: dict[str, Any]) -> None:
        if kind.kind != "Pod" or kind.group:
            return

        def mutable_parts_cleared(spec: dict[str, Any]) -> dict[str, Any]:
            spec = copy.deepcopy(spec or {})
            for field in ("activeDeadlineSeconds", "tolerations"):
                spec.pop(field, None)
            for container in spec.get("containers", []) + spec.get("initContainers", []):
                container.pop("image", None)
            return spec

        if mutable_parts_cleared(current.get("spec")) != mutable_parts_cleared(new.get("spec")):
            raise invalid(kind, current["metadata"]["name"], [
                "spec: Forbidden: pod updates may not change fields other than `spec.containers[*].image`, "
                "`spec.initContainers[*].image`, `spec.activeDeadlineSeconds`, `spec.tolerations`"])

    def bump_generation(self, kind: Kind, current: dict[str, Any], new: dict[str, Any]) -> None:
        ignored = {"metadata", "apiVersion", "kind"} | ({"status"} if kind.has_status else set())
        if {k: v for k, v in current.items() if k not in ignored} != {k: v for k, v in new.items() if k not in ignored}:
            new["metadata"]["generation"] = current["metadata"].get("generation", 0) + 1

    def release_if_done(self, kind: Kind, key: Key) -> dict[str, Any] | None:
        """Remove an object whose deletion waits for nothing more; returns its final state if removed."""
        obj = self.store.live(key)
        if obj and obj["metadata"].get("deletionTimestamp") and not blockers(obj) \
                and not obj["metadata"].get("deletionGracePeriodSeconds"):
            return self.remove(kind, key)
        return None

    def mark_for_deletion(self, kind: Kind, key: Key, grace: int) -> dict[str, Any]:
        """Set deletionTimestamp (now + grace) and deletionGracePeriodSeconds; remove at once if nothing blocks."""
        current = self.store.live(key)
        marked = copy.deepcopy(current)
        marked["metadata"].update(deletionTimestamp=timestamp(grace), deletionGracePeriodSeconds=grace)
        if kind.kind == "Namespace" and not kind.group:
            marked["status"] = {**marked.get("status", {}), "phase": "Terminating"}
        stored = self.commit(kind, key, "MODIFIED", marked, current)
        return self.release_if_done(kind, key) or stored

    def remove(self, kind: Kind, key: Key) -> dict[str, Any]:
        current = self.store.live(key)
        return self.commit(kind, key, "DELETED", copy.deepcopy(current), current)

    # -- admission: what every written object must satisfy -----------------------------------------------------------
    def admit(self, kind: Kind, obj: dict[str, Any], old: dict[str, Any] | None) -> dict[str, Any]:
        """The object as stored (pruned, defaulted), or 422 naming every problem; `old` is the stored object of an
        update (CEL transition rules and ratcheting read it), None on create."""
        name = obj["metadata"]["name"]
        problems = self._name_problems(kind, name) + self._label_problems(obj["metadata"].get("labels"))
        if kind.schema:
            obj = schema.prune_and_default(obj, kind.schema, root=True)
            problems += schema.problems(obj, kind.schema, old)
        if (kind.group, kind.plural) == ("apiextensions.k8s.io", "customresourcedefinitions"):
            problems += cel.crd_problems(obj)
        if problems:
            raise invalid(kind, name, problems)
        return obj

    def _name_problems(self, kind: Kind, name: Any) -> list[str]:
        if kind.group == "rbac.authorization.k8s.io":
            ok = isinstance(name, str) and name and "/" not in name and "%" not in name
        elif kind.plural in ("namespaces", "services"):
            ok = isinstance(name, str) and len(name) <= 63 and _DNS_LABEL.fullmatch(name)
        else:
            ok = isinstance(name, str) and len(name) <= 253 and _SUBDOMAIN.fullmatch(name)
        return [] if ok else [f"metadata.name: Invalid value: {name!r}: a lowercase RFC 1123 name must consist of "
                              f"lower case alphanumeric characters, '-' or '.'"]

    def _label_problems(self, labels: Any) -> list[str]:
        problems = []
        for key, value in (labels or {}).items():
            prefix, _, name = key.rpartition("/")
            if not (len(name) <= 63 and name and _LABEL.fullmatch(name)) or \
                    (prefix and not (len(prefix) <= 253 and _SUBDOMAIN.fullmatch(prefix))):
                problems.append(f"metadata.labels: Invalid value: {key!r}: name part must consist of alphanumeric "
                                f"characters, '-', '_' or '.'")
            if not isinstance(value, str) or len(value) > 63 or not _LABEL.fullmatch(value):
                problems.append(f"metadata.labels: Invalid value: {value!r}: a valid label value must be 63 "
                                f"characters or less and consist of alphanumeric characters, '-', '_' or '.'")
        return problems
