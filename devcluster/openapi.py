"""The OpenAPI v3 documents kubectl reads before `apply`, `create` and `replace`, and the field validation they
announce.

kubectl validates a manifest on the server when the server says it can: it reads `/openapi/v3` (one entry per group
version), then the group version's document (`/openapi/v3/apis/tandem.dev/v1alpha1`), and looks for the resource's
PATCH operation (by its `x-kubernetes-group-version-kind`) taking the `fieldValidation` query parameter. Found, it
sends `fieldValidation=Strict` and leaves the errors to the server: a field the CRD's schema does not declare is a
400 `strict decoding error: unknown field "spec.foo"` (`unknown_fields` here, checked by the emulator on create,
update and patch of a custom resource), a wrong type or value the schema's 422 Invalid (schema.py).

Each document has the served kinds' paths (with GET, PUT, PATCH, DELETE, POST) and, for custom resources, the CRD's
`openAPIV3Schema` as the kind's component schema (`dev.tandem.v1alpha1.ParallelTrainingJob`). The PATCH operations
accept JSON and merge patches, never strategic merge (kubectl then builds a merge patch for a custom resource, and
for a built-in kind the patch its own types describe).

Not emulated: `/openapi/v2` (kubectl only falls back to it where the v3 documents are missing), the built-in kinds'
schemas (their component is an open object, so `kubectl explain pod` says nothing useful and no unknown field of a
built-in object is refused), `Warn` field validation's warnings (a `Warn` or `Ignore` write prunes silently, as
every write without the parameter does).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from .catalog import Catalog, Kind

_PATCH_TYPES = ("application/json-patch+json", "application/merge-patch+json", "application/apply-patch+yaml")
_META = ("apiVersion", "kind", "metadata")


def document(catalog: Catalog, path: str) -> dict[str, Any] | None:
    """The document at `path` (`/openapi/v3`, `/openapi/v3/apis/GROUP/VERSION`, `/openapi/v3/api/v1`) or None."""
    if path.rstrip("/") == "/openapi/v3":
        return {"paths": {gv_path: {"serverRelativeURL": f"/openapi/v3/{gv_path}?hash={_hash(spec)}"}
                          for gv_path, spec in ((p, group_version(catalog, p)) for p in _group_versions(catalog))
                          if spec is not None}}
    prefix = "/openapi/v3/"
    return group_version(catalog, path[len(prefix):].strip("/")) if path.startswith(prefix) else None


def _group_versions(catalog: Catalog) -> list[str]:
    return sorted({f"apis/{kind.group}/{kind.version}" if kind.group else f"api/{kind.version}" for kind in catalog})


def _hash(spec: Mapping[str, Any]) -> str:
    return hashlib.sha512(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:64].upper()


def group_version(catalog: Catalog, gv_path: str) -> dict[str, Any] | None:
    parts = gv_path.split("/")
    if parts[:1] == ["api"] and len(parts) == 2:
        group, version = "", parts[1]
    elif parts[:1] == ["apis"] and len(parts) == 3:
        group, version = parts[1], parts[2]
    else:
        return None
    kinds = [kind for kind in catalog if (kind.group, kind.version) == (group, version)]
    if not kinds:
        return None
    paths, schemas = {}, {}
    for kind in kinds:
        name = component_name(kind)
        schemas[name] = component_schema(kind)
        ref = {"$ref": f"#/components/schemas/{name}"}
        root = f"/apis/{group}/{version}" if group else f"/api/{version}"
        collection = f"{root}/namespaces/{{namespace}}/{kind.plural}" if kind.namespaced else f"{root}/{kind.plural}"
        paths[collection] = {"get": _operation(kind, "list", ref), "post": _operation(kind, "post", ref)}
        paths[f"{collection}/{{name}}"] = {verb: _operation(kind, verb, ref)
                                           for verb in ("get", "put", "patch", "delete")}
    return {"openapi": "3.0.0", "info": {"title": "Kubernetes", "version": "v1.32.0 (emulated)"},
            "paths": paths, "components": {"schemas": schemas}}


def component_name(kind: Kind) -> str:
    """`dev.tandem.v1alpha1.ParallelTrainingJob`, `io.k8s.api.core.v1.Pod` (the names a server gives them)."""
    if kind.schema is None:
        return f"io.k8s.api.{kind.group.split('.')[0] or 'core'}.{kind.version}.{kind.kind}"
    return ".".join([*reversed(kind.group.split(".")), kind.version, kind.kind])


def component_schema(kind: Kind) -> dict[str, Any]:
    gvk = [{"group": kind.group, "version": kind.version, "kind": kind.kind}]
    if kind.schema is None:
        return {"type": "object", "x-kubernetes-preserve-unknown-fields": True, "x-kubernetes-group-version-kind": gvk}
    schema = dict(kind.schema)
    properties = dict(schema.get("properties") or {})
    properties.setdefault("apiVersion", {"type": "string"})
    properties.setdefault("kind", {"type": "string"})
    properties.setdefault("metadata", {"type": "object"})
    return {**schema, "properties": properties, "x-kubernetes-group-version-kind": gvk}


def _operation(kind: Kind, verb: str, ref: Mapping[str, Any]) -> dict[str, Any]:
    parameters = [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}] \
        if verb in ("get", "put", "patch", "delete") else []
    if kind.namespaced:
        parameters.append({"name": "namespace", "in": "path", "required": True, "schema": {"type": "string"}})
    if verb in ("post", "put", "patch"):
        parameters += [{"name": "fieldValidation", "in": "query", "schema": {"type": "string"}},
                       {"name": "fieldManager", "in": "query", "schema": {"type": "string"}},
                       {"name": "dryRun", "in": "query", "schema": {"type": "string"}}]
    operation: dict[str, Any] = {
        "operationId": f"{verb}{kind.kind}", "parameters": parameters,
        "responses": {"200": {"description": "OK", "content": {"application/json": {"schema": dict(ref)}}}},
        "x-kubernetes-action": {"post": "post", "put": "put", "patch": "patch", "delete": "delete",
                                "list": "list"}.get(verb, "get"),
        "x-kubernetes-group-version-kind": {"group": kind.group, "version": kind.version, "kind": kind.kind}}
    if verb == "patch":
        operation["requestBody"] = {"content": {t: {"schema": {"type": "object"}} for t in _PATCH_TYPES}}
    elif verb in ("post", "put"):
        operation["requestBody"] = {"content": {"application/json": {"schema": dict(ref)}}}
    return operation


def unknown_fields(value: Any, schema: Mapping[str, Any] | None, path: str = "", *, root: bool = True) -> list[str]:
    """The fields of `value` its schema does not declare (those pruning would drop), as `spec.foo`: what a strict
    write refuses."""
    if not schema:
        return []
    found: list[str] = []
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        additional = schema.get("additionalProperties")
        if schema.get("x-kubernetes-preserve-unknown-fields") or additional is True:
            return []
        for key, item in value.items():
            where = f"{path}.{key}" if path else key
            if root and key in _META:
                continue
            if key in properties:
                found += unknown_fields(item, properties[key], where, root=False)
            elif isinstance(additional, Mapping):
                found += unknown_fields(item, additional, where, root=False)
            else:
                found.append(where)
    elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for index, item in enumerate(value):
            found += unknown_fields(item, schema["items"], f"{path}[{index}]", root=False)
    return found
