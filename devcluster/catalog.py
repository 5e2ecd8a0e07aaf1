"""What the emulator serves: the built-in resources an operator and kopf touch, and the CRDs applied to it.

Each served resource is a `Kind`: its group/version/plural, kind, scope, subresources and (for custom resources)
its schema, printer columns and scale paths, read from the CustomResourceDefinition as the API server reads it. The
catalogue is what discovery (discovery.py: `/api/v1`, `/apis/<group>/<version>`), server-side printing (tables.py)
and the OpenAPI documents (openapi.py) describe.

Not emulated: several versions of one group (only the CRD's storage version is served), conversion between
versions, and the aggregated APIs (metrics, custom.metrics).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import kmock

VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")


@dataclass(frozen=True)
class ScalePaths:
    """The scale subresource's mapping, as a CRD declares it (`.spec.workers`, ...)."""

    spec_replicas: str
    status_replicas: str
    label_selector: str | None = None


@dataclass(frozen=True)
class Kind:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    subresources: frozenset[str] = frozenset()
    short_names: tuple[str, ...] = ()
    singular: str = ""
    categories: tuple[str, ...] = ()
    scale: ScalePaths | None = None
    schema: Mapping[str, Any] | None = field(default=None, compare=False, hash=False)
    printer_columns: tuple[Mapping[str, Any], ...] = field(default=(), compare=False, hash=False)  # tables.py

    @property
    def resource(self) -> kmock.resource:
        return kmock.resource(self.group, self.version, self.plural)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def has_status(self) -> bool:
        """Whether writes to the object leave `status` alone (and `/status` writes change only it)."""
        return "status" in self.subresources

    @property
    def group_resource(self) -> str:
        """How the API server names the resource in messages: `pods`, `paralleltrainingjobs.tandem.dev`."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    def info(self) -> kmock.ResourceInfo:
        return kmock.ResourceInfo(
            namespaced=self.namespaced, kind=self.kind, singular=self.singular or self.kind.lower(), verbs=VERBS,
            shortnames=self.short_names, categories=self.categories, subresources=self.subresources)


_APPS_SCALE = ScalePaths(".spec.replicas", ".status.replicas")
_RBAC = "rbac.authorization.k8s.io"

BUILTINS: tuple[Kind, ...] = (
    Kind("", "v1", "namespaces", "Namespace", False, frozenset({"status", "finalize"}), ("ns",)),
    Kind("", "v1", "nodes", "Node", False, frozenset({"status"}), ("no",)),
    Kind("", "v1", "pods", "Pod", True, frozenset({"status", "binding", "eviction", "log"}), ("po",)),
    Kind("", "v1", "services", "Service", True, frozenset({"status"}), ("svc",)),
    Kind("", "v1", "endpoints", "Endpoints", True, frozenset(), ("ep",)),
    Kind("", "v1", "configmaps", "ConfigMap", True, frozenset(), ("cm",)),
    Kind("", "v1", "secrets", "Secret", True),
    Kind("", "v1", "serviceaccounts", "ServiceAccount", True, frozenset(), ("sa",)),
    Kind("", "v1", "events", "Event", True, frozenset(), ("ev",)),
    Kind("", "v1", "persistentvolumeclaims", "PersistentVolumeClaim", True, frozenset({"status"}), ("pvc",)),
    Kind("", "v1", "persistentvolumes", "PersistentVolume", False, frozenset({"status"}), ("pv",)),
    Kind("apps", "v1", "deployments", "Deployment", True, frozenset({"status", "scale"}), ("deploy",),
         scale=_APPS_SCALE),
    Kind("apps", "v1", "replicasets", "ReplicaSet", True, frozenset({"status", "scale"}), ("rs",), scale=_APPS_SCALE),
    Kind("apps", "v1", "statefulsets", "StatefulSet", True, frozenset({"status", "scale"}), ("sts",),
         scale=_APPS_SCALE),
    Kind("batch", "v1", "jobs", "Job", True, frozenset({"status"})),
    Kind("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", True, frozenset({"status"}), ("pdb",)),
    Kind("autoscaling", "v2", "horizontalpodautoscalers", "HorizontalPodAutoscaler", True, frozenset({"status"}),
         ("hpa",)),
    Kind(_RBAC, "v1", "roles", "Role", True),
    Kind(_RBAC, "v1", "rolebindings", "RoleBinding", True),
    Kind(_RBAC, "v1", "clusterroles", "ClusterRole", False),
    Kind(_RBAC, "v1", "clusterrolebindings", "ClusterRoleBinding", False),
    Kind("coordination.k8s.io", "v1", "leases", "Lease", True),
    Kind("events.k8s.io", "v1", "events", "Event", True, frozenset(), ("ev",)),
    Kind("scheduling.k8s.io", "v1", "priorityclasses", "PriorityClass", False, frozenset(), ("pc",)),
    Kind("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition", False,
         frozenset({"status"}), ("crd", "crds")),
)


def kinds_of_crd(crd: Mapping[str, Any]) -> list[Kind]:
    """The resources a CustomResourceDefinition serves (its storage version; scale and status as declared)."""
    spec = crd.get("spec", {})
    names = spec.get("names", {})
    kinds = []
    for version in spec.get("versions", []):
        if not version.get("served", True) or not version.get("storage", True):
            continue
        declared = version.get("subresources") or {}
        scale = declared.get("scale")
        kinds.append(Kind(
            group=spec["group"], version=version["name"], plural=names["plural"], kind=names["kind"],
            namespaced=spec.get("scope", "Namespaced") == "Namespaced",
            subresources=frozenset(declared), short_names=tuple(names.get("shortNames", ())),
            singular=names.get("singular", ""), categories=tuple(names.get("categories", ())),
            scale=ScalePaths(scale["specReplicasPath"], scale["statusReplicasPath"], scale.get("labelSelectorPath"))
            if scale else None,
            schema=(version.get("schema") or {}).get("openAPIV3Schema"),
            printer_columns=tuple(version.get("additionalPrinterColumns") or ()),
        ))
    return kinds


class Catalog:
    """The served kinds by (group, version, plural), and lookups by the names tests like to use."""

    def __init__(self, kinds: Iterable[Kind] = BUILTINS) -> None:
        self._kinds: dict[tuple[str, str, str], Kind] = {}
        for kind in kinds:
            self.add(kind)

    def add(self, kind: Kind) -> None:
        self._kinds[kind.group, kind.version, kind.plural] = kind

    def remove(self, kind: Kind) -> None:
        self._kinds.pop((kind.group, kind.version, kind.plural), None)

    def __iter__(self):
        return iter(list(self._kinds.values()))

    def find(self, group: str | None, version: str | None, plural: str | None) -> Kind | None:
        return self._kinds.get((group or "", version or "", plural or ""))

    def of(self, api_version: str, kind: str) -> Kind | None:
        """The resource of an object's apiVersion and kind (as in an ownerReference or a manifest)."""
        group, _, version = api_version.rpartition("/")
        return next((k for k in self._kinds.values() if (k.group, k.version, k.kind) == (group, version, kind)), None)

    def lookup(self, name: str | Kind) -> Kind:
        """A kind by any name a test may use: 'pods', 'v1/pods', 'pod', 'po', 'Pod', 'ptj',
        'paralleltrainingjobs.tandem.dev', 'tandem.dev/v1alpha1/paralleltrainingjobs'."""
        if isinstance(name, Kind):
            return name
        if name.count("/") >= 1:
            head, _, plural = name.rpartition("/")
            group, _, version = head.rpartition("/")
            found = self.find(group, version, plural)
            if found:
                return found
        plural, _, group = name.partition(".")
        matches = [k for k in self._kinds.values()
                   if (not group or k.group == group)
                   and plural.lower() in {k.plural, k.singular or k.kind.lower(), k.kind.lower(), *k.short_names}]
        core_first = sorted(matches, key=lambda k: (k.group not in ("", group), k.group))
        if not core_first:
            raise KeyError(f"no served resource is called {name!r}")
        return core_first[0]
