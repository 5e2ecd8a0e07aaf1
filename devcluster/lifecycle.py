"""What happens around deletion, and the controllers a bare API server relies on (kube-controller-manager's part).

- `delete`: an object with finalizers gets a deletionTimestamp and stays until they are removed; a pod on a node gets
  a deletionTimestamp and deletionGracePeriodSeconds (its DeleteOptions', else its spec's
  terminationGracePeriodSeconds, else 30) and stays until the kubelet reports its process ended and deletes it with
  gracePeriodSeconds=0; an unscheduled or finished pod goes at once, as on a real cluster; a second delete may
  shorten the grace period, never lengthen it; preconditions (uid, resourceVersion) answer 409 when stale;
- `GarbageCollector`: when an owner is gone (its uid no longer exists), its dependents are deleted in the
  background, each by the rules above, so deletion cascades (pods through their graceful termination); a dependent
  created for an owner that does not exist is collected too; `propagationPolicy: Orphan` removes the
  ownerReference from the dependents instead. Deviation: `Foreground` is treated as `Background` (the owner goes
  first), and `blockOwnerDeletion` is not enforced;
- `NamespaceController`: deleting a namespace marks it Terminating, deletes everything in it, then removes it;
- `CrdController`: a CustomResourceDefinition's resources are served from its creation (status Established), and
  go, with their objects, when it is deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections.abc import Callable, Mapping
from typing import Any

import kmock

from .catalog import Kind, kinds_of_crd
from .store import Key
from .writes import Writer, api_error, blockers, not_found, timestamp


def delete(writer: Writer, kind: Kind, key: Key, options: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
    """Delete by the API server's rules. Returns the object (its final state if removed) and whether it is gone."""
    current = writer.store.live(key)
    if current is None:
        raise not_found(kind, key[2])
    meta = current["metadata"]
    preconditions = options.get("preconditions") or {}
    for field in ("uid", "resourceVersion"):
        if preconditions.get(field) and preconditions[field] != meta.get(field):
            raise api_error(409, "Conflict", f"Precondition failed: {field} in precondition: {preconditions[field]}, "
                            f"{field} in object meta: {meta.get(field)}", name=key[2], kind=kind.plural)
    grace = _grace_period(kind, current, options.get("gracePeriodSeconds"))
    if options.get("propagationPolicy") == "Orphan":
        writer.orphaned.add(meta["uid"])
    if grace == 0 and not blockers(current):
        return writer.remove(kind, key), True
    if meta.get("deletionTimestamp") and meta.get("deletionGracePeriodSeconds", 0) <= grace:
        return current, False
    stored = writer.mark_for_deletion(kind, key, grace)
    return stored, writer.store.live(key) is None


def _grace_period(kind: Kind, pod: dict[str, Any], requested: Any) -> int:
    if kind.plural != "pods" or kind.group:
        return 0
    spec, status = pod.get("spec", {}), pod.get("status", {})
    if not spec.get("nodeName") or status.get("phase") in ("Succeeded", "Failed"):
        return 0
    grace = int(requested) if requested is not None else spec.get("terminationGracePeriodSeconds", 30)
    return max(int(grace), 0)


class GarbageCollector:
    """Deletes objects whose owners are all gone; sweeps soon after every removal, in the background."""

    def __init__(self, writer: Writer, spawn: Callable[[Callable[[], None]], None]) -> None:
        self.writer, self.spawn = writer, spawn
        self.scheduled = False
        writer.listeners.append(self.on_commit)

    def on_commit(self, kind: Kind, type_: str, obj: dict[str, Any]) -> None:
        dangling = type_ == "ADDED" and any(not self.writer.store.uid_exists(ref.get("uid", ""))
                                            for ref in obj["metadata"].get("ownerReferences") or [])
        if (type_ == "DELETED" or dangling) and not self.scheduled:
            self.scheduled = True
            self.spawn(self.sweep)

    def sweep(self) -> None:
        self.scheduled = False
        store, orphaned = self.writer.store, self.writer.orphaned
        for key, obj in list(store.all_live()):
            refs = obj["metadata"].get("ownerReferences") or []
            if not refs or obj["metadata"].get("deletionTimestamp"):
                continue
            kind = self.writer.catalog.find(key[0].group, key[0].version, key[0].plural)
            kept = [ref for ref in refs if ref.get("uid") not in orphaned or store.uid_exists(ref["uid"])]
            if len(kept) < len(refs):
                updated = copy.deepcopy(obj)
                updated["metadata"]["ownerReferences"] = kept
                if not kept:
                    del updated["metadata"]["ownerReferences"]
                self.writer.update(kind, key, updated, system=True)
            elif not any(store.uid_exists(ref.get("uid", "")) for ref in refs):
                with contextlib.suppress(kmock.KubernetesError):  # gone meanwhile
                    delete(self.writer, kind, key, {"propagationPolicy": "Background"})


class NamespaceController:
    """Empties a Terminating namespace, then removes it."""

    def __init__(self, writer: Writer) -> None:
        self.writer = writer
        self.tasks: set[asyncio.Task] = set()
        writer.listeners.append(self.on_commit)

    def on_commit(self, kind: Kind, type_: str, obj: dict[str, Any]) -> None:
        if kind.plural == "namespaces" and not kind.group and type_ == "MODIFIED" \
                and obj["metadata"].get("deletionTimestamp"):
            name = obj["metadata"]["name"]
            if not any(task.get_name() == f"namespace {name}" for task in self.tasks):
                task = asyncio.get_running_loop().create_task(self.finalize(kind, name), name=f"namespace {name}")
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)

    async def finalize(self, kind: Kind, name: str) -> None:
        while True:
            contents = [(key, k) for k in self.writer.catalog if k.namespaced
                        for key in self.writer.store.keys(k.resource, name)]
            if not contents:
                break
            for key, content_kind in contents:
                if not (self.writer.store.live(key) or {}).get("metadata", {}).get("deletionTimestamp"):
                    delete(self.writer, content_kind, key, {})
            await asyncio.sleep(0.05)
        key = self.writer.key(kind, None, name)
        namespace = self.writer.store.live(key)
        if namespace is not None:
            emptied = copy.deepcopy(namespace)
            emptied.setdefault("spec", {})["finalizers"] = []
            self.writer.update(kind, key, emptied, system=True)


class CrdController:
    """Serves the resources of each CustomResourceDefinition (and stops serving them when it goes)."""

    def __init__(self, writer: Writer, on_change: Callable[[], None]) -> None:
        self.writer, self.on_change = writer, on_change
        writer.listeners.append(self.on_commit)

    def on_commit(self, kind: Kind, type_: str, obj: dict[str, Any]) -> None:
        if (kind.group, kind.plural) != ("apiextensions.k8s.io", "customresourcedefinitions"):
            return
        for old in [k for k in self.writer.catalog if f"{k.plural}.{k.group}" == obj["metadata"]["name"]]:
            self.writer.catalog.remove(old)
            if type_ == "DELETED":
                for key in self.writer.store.keys(old.resource):
                    self.writer.remove(old, key)
        if type_ != "DELETED":
            for new in kinds_of_crd(obj):
                self.writer.catalog.add(new)
            if not obj.get("status", {}).get("conditions"):
                self._establish(kind, obj)
        self.on_change()

    def _establish(self, kind: Kind, crd: dict[str, Any]) -> None:
        now = timestamp()
        status = {"acceptedNames": crd["spec"]["names"], "storedVersions": [
            v["name"] for v in crd["spec"]["versions"] if v.get("storage")], "conditions": [
            {"type": t, "status": "True", "reason": r, "message": m, "lastTransitionTime": now}
            for t, r, m in (("NamesAccepted", "NoConflicts", "no conflicts found"),
                            ("Established", "InitialNamesAccepted", "the initial names have been accepted"))]}
        key = self.writer.key(kind, None, crd["metadata"]["name"])
        self.writer.update(kind, key, {**crd, "status": status}, subresource="status", system=True)
