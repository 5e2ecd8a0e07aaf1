"""Discovery as the API server serves it, from the catalogue (catalog.py): `/api`, `/api/v1`, `/apis`,
`/apis/GROUP`, `/apis/GROUP/VERSION`, the documents kubectl and the `kubernetes` client read to map a name
(`ptj`, `pods`, `tip`) to a resource.

As on a server: the core group's version list is `/v1` (kmock's own serving named it `/v1`, so kubectl found no
`pods`); a subresource (`pods/status`, `paralleltrainingjobs/scale`) has no short names and no categories (with them
kubectl warns that `ptj` "could also match lower priority resource paralleltrainingjobs/status") and its own verbs
and kind (`scale` is autoscaling/v1 Scale, `eviction` policy/v1 Eviction, `binding` Binding, `log` get only).

The groups of `/apis` come in a server's order, which decides what a name two groups share means to kubectl (its
RESTMapper takes the first group that has it): the built-in groups first, by the priorities kube-apiserver gives them
(cmd/kube-apiserver/app/aggregator.go: apps 17800, ..., coordination.k8s.io 16500), then every CRD's group at the
priority 1000 its APIService gets (crdregistration), ties in the order of the APIServices' names, `VERSION.GROUP`
(kube-aggregator's ByGroupPriorityMinimum). So with the Gateway API Inference Extension's CRD beside Tandem's,
`inferencepools` means `inferencepools.inference.networking.k8s.io` (`v1.inference...` sorts before
`v1alpha1.tandem.dev`), as on a cluster; aggregated discovery breaks such ties by the group's name, which orders those
two the same way.

Not emulated: aggregated discovery (apidiscovery.k8s.io/v2): kubectl asks for it first and, answered with the plain
documents, falls back to reading each group version, as it does against a server older than 1.26.
"""

from __future__ import annotations

from typing import Any

from .catalog import VERBS, Catalog, Kind

# A subresource's verbs, kind and group/version where they are not its resource's (as a 1.3x server lists them).
_SUBRESOURCES: dict[str, dict[str, Any]] = {
    "status": {"verbs": ["get", "patch", "update"]},
    "scale": {"verbs": ["get", "patch", "update"], "group": "autoscaling", "version": "v1", "kind": "Scale"},
    "log": {"verbs": ["get"]},
    "binding": {"verbs": ["create"], "kind": "Binding"},
    "eviction": {"verbs": ["create"], "group": "policy", "version": "v1", "kind": "Eviction"},
    "finalize": {"verbs": ["update"]},
}


def document(catalog: Catalog, path: str) -> dict[str, Any] | None:
    """The discovery document at `path`, or None where `path` is no discovery path (or an unknown group)."""
    parts = [part for part in path.split("/") if part]
    if parts == ["api"]:
        return {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": [
            {"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}]}
    if parts == ["api", "v1"]:
        return resource_list(catalog, "", "v1")
    if parts == ["apis"]:
        return {"kind": "APIGroupList", "apiVersion": "v1",
                "groups": [group for name in _groups(catalog) if (group := api_group(catalog, name))]}
    if len(parts) == 2 and parts[0] == "apis":
        found = api_group(catalog, parts[1])
        return None if found is None else {"kind": "APIGroup", "apiVersion": "v1", **found}
    if len(parts) == 3 and parts[0] == "apis":
        return resource_list(catalog, parts[1], parts[2])
    return None


# kube-apiserver's group priorities (aggregator.go's apiVersionPriorities) of the built-in groups served here and a
# few more; any other group is a CRD's: its APIService has GroupPriorityMinimum 1000.
_BUILTIN_PRIORITY = {
    "apiregistration.k8s.io": 18000, "apps": 17800, "events.k8s.io": 17750, "authentication.k8s.io": 17700,
    "authorization.k8s.io": 17600, "autoscaling": 17500, "batch": 17400, "certificates.k8s.io": 17300,
    "networking.k8s.io": 17200, "policy": 17100, "rbac.authorization.k8s.io": 17000, "storage.k8s.io": 16800,
    "apiextensions.k8s.io": 16700, "admissionregistration.k8s.io": 16700, "scheduling.k8s.io": 16600,
    "coordination.k8s.io": 16500, "node.k8s.io": 16300, "discovery.k8s.io": 16200,
    "flowcontrol.apiserver.k8s.io": 16100,
}
_CRD_PRIORITY = 1000


def _groups(catalog: Catalog) -> list[str]:
    """The named groups in the order `/apis` lists them: by priority, highest first, then by APIService name."""
    first: dict[str, tuple[int, str]] = {}
    for kind in catalog:
        if kind.group:
            key = (-_BUILTIN_PRIORITY.get(kind.group, _CRD_PRIORITY), f"{kind.version}.{kind.group}")
            first[kind.group] = min(first.get(kind.group, key), key)
    return sorted(first, key=first.__getitem__)


def api_group(catalog: Catalog, group: str) -> dict[str, Any] | None:
    versions = sorted({kind.version for kind in catalog if kind.group == group})
    if not group or not versions:
        return None
    entries = [{"groupVersion": f"{group}/{version}", "version": version} for version in versions]
    return {"name": group, "versions": entries, "preferredVersion": entries[0]}


def resource_list(catalog: Catalog, group: str, version: str) -> dict[str, Any] | None:
    kinds = [kind for kind in catalog if (kind.group, kind.version) == (group, version)]
    if not kinds:
        return None
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": f"{group}/{version}" if group else version,
            "resources": [entry for kind in kinds for entry in resources_of(kind)]}


def resources_of(kind: Kind) -> list[dict[str, Any]]:
    """The APIResource entries of one kind: itself, then each of its subresources."""
    entries = [{"name": kind.plural, "singularName": kind.singular or kind.kind.lower(), "namespaced": kind.namespaced,
                "kind": kind.kind, "verbs": list(VERBS), "shortNames": list(kind.short_names),
                "categories": list(kind.categories)}]
    for sub in sorted(kind.subresources):
        known = _SUBRESOURCES.get(sub, {"verbs": ["get"]})
        entry = {"name": f"{kind.plural}/{sub}", "singularName": "", "namespaced": kind.namespaced,
                 "kind": known.get("kind", kind.kind), "verbs": known["verbs"]}
        if "group" in known:
            entry.update(group=known["group"], version=known["version"])
        entries.append(entry)
    return entries
