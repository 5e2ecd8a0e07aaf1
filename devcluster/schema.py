"""A custom resource's structural schema, applied as the API server applies it on every write: prune, default,
validate.

- pruning: fields the schema does not declare are dropped silently (unless `x-kubernetes-preserve-unknown-fields`
  or `additionalProperties` keep them), so a status field missing from the CRD vanishes here as on a cluster;
  `null` for a field that is not `nullable` is dropped too;
- defaulting: a missing field with a `default` gets it, where its parent object exists;
- validation: types, enums, bounds, patterns and `required` (OpenAPI 3.0, by openapi-schema-validator); a write
  that fails answers 422 Invalid with one line per problem, naming the field;
- CEL rules (`x-kubernetes-validations`, cel.py): evaluated on the pruned and defaulted object, each with `self`
  bound to the value where its rule sits; a broken rule answers `spec: Invalid value: "object": <message>`. As on a
  server, they are not evaluated when the OpenAPI validation found a type, `required`, enum or size error (one line
  says so instead), and transition rules (`oldSelf`) only on updates.

Writes that validate: create, update (PUT), patch, the status subresource (the whole object, as a server does) and
the scale subresource (the object with its new replicas), all through `Writer.admit`.

Not emulated: validation ratcheting of the OpenAPI part (a real server lets an update keep an invalid value it did
not change): every write validates the whole object against the OpenAPI schema. CEL rules are ratcheted (cel.py).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from openapi_schema_validator import OAS30Validator

from . import cel

_META = ("apiVersion", "kind", "metadata")
_validators: dict[int, tuple[Mapping[str, Any], OAS30Validator]] = {}
# The OpenAPI errors after which a server does not evaluate CEL rules (apiextensions' hasBlockingErr).
_BLOCKING = frozenset({"type", "required", "enum", "maxLength", "maxItems", "maxProperties"})


def prune_and_default(value: Any, schema: Mapping[str, Any] | None, *, root: bool = False) -> Any:
    if not schema:
        return value
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        additional = schema.get("additionalProperties")
        preserve = schema.get("x-kubernetes-preserve-unknown-fields", False)
        result = {}
        for key, item in value.items():
            if root and key in _META:
                result[key] = item
            elif key in properties:
                if item is not None or properties[key].get("nullable"):
                    result[key] = prune_and_default(item, properties[key])
            elif isinstance(additional, Mapping):
                result[key] = prune_and_default(item, additional)
            elif additional is True or preserve:
                result[key] = item
        for key, sub in properties.items():
            if key not in result and "default" in sub:
                result[key] = prune_and_default(copy.deepcopy(sub["default"]), sub)
        return result
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        return [prune_and_default(item, schema["items"]) for item in value]
    return value


def _validator(schema: Mapping[str, Any]) -> OAS30Validator:
    cached = _validators.get(id(schema))
    if cached is None or cached[0] is not schema:
        cached = _validators[id(schema)] = (schema, OAS30Validator(dict(schema)))
    return cached[1]


def problems(obj: Mapping[str, Any], schema: Mapping[str, Any] | None, old: Mapping[str, Any] | None = None
             ) -> list[str]:
    """One line per violation, `spec.workers: 0 is less than the minimum of 1`, then one per broken CEL rule
    (`spec: Invalid value: "object": <message>`); empty when valid. `old` is the stored object of an update."""
    if not schema:
        return []
    body = {key: value for key, value in obj.items() if key not in _META}
    lines, blocking = [], False
    for error in sorted(_validator(schema).iter_errors(body), key=lambda e: list(map(str, e.absolute_path))):
        path = ".".join(str(part) for part in error.absolute_path) or "<root>"
        lines.append(f"{path}: {error.message}")
        blocking = blocking or error.validator in _BLOCKING
    if cel.has_rules(schema):
        lines += [cel.BLOCKED] if blocking else cel.violations(obj, schema, old)
    return lines
