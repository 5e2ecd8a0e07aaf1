"""Server-side printing: a GET, LIST or watch that accepts `application/json;as=Table;v=v1;g=meta.k8s.io` (kubectl
get sends it, then v1beta1, then plain `application/json`) is answered with a meta.k8s.io Table, as the API server
answers it; kubectl then prints its columns as they come.

- custom resources: NAME, then the CRD's `additionalPrinterColumns` (only `Age` where it declares none), evaluated as
  the apiextensions server does: the JSONPath's first result; none is a null cell (kubectl prints it blank); a
  `string` column prints the value (maps and lists as JSON), `integer` and `number` give JSON numbers (a float in an
  integer column is truncated; kubectl prints numbers as Go's %v: full precision), `boolean` a bool, `date` an age
  (`45s`, `2m5s`, `3h`: Kubernetes' HumanDuration); a value of the wrong type a null cell; every column is sent,
  with its `priority`: kubectl shows those above 0 only with `-o wide`;
- pods: the built-in columns NAME READY STATUS RESTARTS AGE, with `-o wide` IP NODE NOMINATED NODE READINESS GATES,
  STATUS as kubectl's pod printer reasons it (a waiting or terminated container's reason, `Terminating`,
  `Init:...` is not emulated: there are no init containers here);
- every other built-in kind: the API server's default table (NAME, CREATED AT in RFC 3339), not its own printer
  (a real server prints e.g. a ConfigMap's DATA or an Event's REASON; `kubectl get events` here shows only names);
- each row carries its object as `includeObject` asks: `Metadata` (the default: a PartialObjectMetadata),
  `Object`, or `None`.

Not emulated: the JSONPath language beyond a dotted path with `[index]` steps (enough for any CRD column here;
another path gives a null cell), `noHeaders`, and a Table in protobuf.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from tandem.columns import human_duration

from .catalog import Kind

TABLE_API_VERSIONS = {"v1": "meta.k8s.io/v1", "v1beta1": "meta.k8s.io/v1beta1"}
_NAME = {"name": "Name", "type": "string", "format": "name", "priority": 0,
         "description": "Name must be unique within a namespace."}
_AGE = {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}
_POD_COLUMNS = [("Ready", 0), ("Status", 0), ("Restarts", 0), ("Age", 0), ("IP", 1), ("Node", 1),
                ("Nominated Node", 1), ("Readiness Gates", 1)]
_STEP = re.compile(r"\.([^.\[\]]+)|\[(\d+)\]")


def table_version(accept: str | None) -> str | None:
    """The Table version the Accept header asks for first (`v1`, `v1beta1`), or None: plain JSON."""
    for alternative in (accept or "").split(","):
        params = dict(part.strip().partition("=")[::2] for part in alternative.split(";")[1:])
        if params.get("as") == "Table" and params.get("g", "meta.k8s.io") == "meta.k8s.io":
            version = params.get("v", "v1")
            if version in TABLE_API_VERSIONS:
                return version
        elif alternative.split(";")[0].strip() in ("application/json", "*/*"):
            return None
    return None


def table(kind: Kind, objects: Iterable[Mapping[str, Any]], *, version: str = "v1", include: str | None = None,
          resource_version: str | None = None, now: datetime | None = None) -> dict[str, Any]:
    now = now or datetime.now(UTC)
    columns = columns_of(kind)
    rows = [{"cells": cells(kind, obj, now), "object": row_object(obj, include, version)} for obj in objects]
    for row in rows:
        if row["object"] is None:
            del row["object"]
    metadata = {"resourceVersion": resource_version} if resource_version else {}
    return {"kind": "Table", "apiVersion": TABLE_API_VERSIONS[version], "metadata": metadata,
            "columnDefinitions": [{key: column[key] for key in ("name", "type", "format", "description", "priority")}
                                  for column in columns],
            "rows": rows}


def columns_of(kind: Kind) -> list[dict[str, Any]]:
    if kind.group == "" and kind.kind == "Pod":
        extra = [{"name": name, "type": "string", "priority": priority} for name, priority in _POD_COLUMNS]
    elif kind.schema is not None:  # a custom resource
        extra = list(kind.printer_columns) or [_AGE]
    else:
        extra = [{"name": "Created At", "type": "date", "format": "date", "priority": 0,
                  "description": "CreationTimestamp is a timestamp representing the server time when this object "
                                 "was created."}]
    return [_NAME, *({"format": "", "description": "", "priority": 0, **column} for column in extra)]


def cells(kind: Kind, obj: Mapping[str, Any], now: datetime) -> list[Any]:
    name = (obj.get("metadata") or {}).get("name", "")
    if kind.group == "" and kind.kind == "Pod":
        return [name, *pod_cells(obj, now)]
    if kind.schema is None:
        created = parse_time((obj.get("metadata") or {}).get("creationTimestamp"))
        return [name, created.strftime("%Y-%m-%dT%H:%M:%SZ") if created else None]
    return [name, *(cell(column, obj, now) for column in (kind.printer_columns or [_AGE]))]


def cell(column: Mapping[str, Any], obj: Mapping[str, Any], now: datetime) -> Any:
    """One custom column's cell, as apiextensions' table convertor makes it (cellForJSONValue)."""
    found, value = evaluate(column.get("jsonPath", ""), obj)
    if not found or value is None:
        return None
    kind = column.get("type", "string")
    if kind == "string":
        if isinstance(value, str):
            return value
        if isinstance(value, bool):
            return "true" if value else "false"
        return json.dumps(value, separators=(",", ":")) if isinstance(value, (dict, list)) else str(value)
    if kind == "integer" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    if kind == "number" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if kind == "boolean" and isinstance(value, bool):
        return value
    if kind == "date" and isinstance(value, str):
        when = parse_time(value)
        return "<invalid>" if when is None else human_duration((now - when).total_seconds())
    return None


def evaluate(path: str, obj: Any) -> tuple[bool, Any]:
    """A CRD column's JSONPath (`.status.progress.loss`, `.status.conditions[0].type`): (found, value)."""
    path = path.strip()
    if path.startswith("{") and path.endswith("}"):
        path = path[1:-1]
    steps = _STEP.findall(path)
    if "".join(f".{key}" if key else f"[{index}]" for key, index in steps) != path:
        return False, None  # a path this emulation does not evaluate
    value = obj
    for key, index in steps:
        if key and isinstance(value, Mapping) and key in value:
            value = value[key]
        elif not key and isinstance(value, list) and int(index) < len(value):
            value = value[int(index)]
        else:
            return False, None
    return True, value


def row_object(obj: Mapping[str, Any], include: str | None, version: str) -> dict[str, Any] | None:
    if include == "None":
        return None
    if include == "Object":
        return dict(obj)
    return {"kind": "PartialObjectMetadata", "apiVersion": TABLE_API_VERSIONS[version],
            "metadata": obj.get("metadata") or {}}


def pod_cells(pod: Mapping[str, Any], now: datetime) -> list[Any]:
    """READY STATUS RESTARTS AGE IP NODE NOMINATED NODE READINESS GATES, as kubernetes' printPod."""
    spec, status, meta = pod.get("spec") or {}, pod.get("status") or {}, pod.get("metadata") or {}
    containers = status.get("containerStatuses") or []
    reason = status.get("reason") or status.get("phase") or ""
    ready = restarts = 0
    running = False
    last_restart: datetime | None = None
    for container in reversed(containers):
        restarts += container.get("restartCount", 0)
        finished = parse_time(((container.get("lastState") or {}).get("terminated") or {}).get("finishedAt"))
        if finished and (last_restart is None or finished > last_restart):
            last_restart = finished
        state = container.get("state") or {}
        if (state.get("waiting") or {}).get("reason"):
            reason = state["waiting"]["reason"]
        elif state.get("terminated") is not None:
            terminated = state["terminated"]
            reason = terminated.get("reason") or (f"Signal:{terminated['signal']}" if terminated.get("signal")
                                                  else f"ExitCode:{terminated.get('exitCode', 0)}")
        elif state.get("running") is not None and container.get("ready"):
            running = True
            ready += 1
    if reason == "Completed" and running:
        conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
        reason = "Running" if conditions.get("Ready") == "True" else "NotReady"
    if meta.get("deletionTimestamp"):
        reason = "Unknown" if status.get("reason") == "NodeLost" else "Terminating"
    restarts_text = str(restarts)
    if restarts and last_restart is not None:
        restarts_text += f" ({human_duration((now - last_restart).total_seconds())} ago)"
    created = parse_time(meta.get("creationTimestamp"))
    gates = spec.get("readinessGates") or []
    return [f"{ready}/{len(spec.get('containers') or [])}", reason, restarts_text,
            human_duration((now - created).total_seconds()) if created else "<unknown>",
            status.get("podIP") or "<none>", spec.get("nodeName") or "<none>",
            status.get("nominatedNodeName") or "<none>",
            f"0/{len(gates)}" if gates else "<none>"]


def parse_time(value: Any) -> datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        when = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return when if when.tzinfo else when.replace(tzinfo=UTC)
