"""CustomResourceDefinitions generated from the API models (`tandem crds`); `crds/` is never edited by hand.

Pydantic's JSON Schema is turned into a structural OpenAPI v3 schema, as apiextensions.k8s.io/v1
requires: references inlined, `X | None` reduced to X, `int | str` to x-kubernetes-int-or-string,
free-form maps to x-kubernetes-preserve-unknown-fields, JSON-Schema-2020 exclusive bounds to
OpenAPI 3.0 booleans, titles dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from tandem.api import GROUP, VERSION, InferencePool, ParallelTrainingJob

_DROPPED_KEYS = {"title", "$defs", "additionalProperties", "anyOf", "$ref", "const", "discriminator"}


@dataclass(frozen=True)
class ResourceInfo:
    model: type[BaseModel]
    plural: str
    singular: str
    short_names: list[str]
    replicas_path: str
    status_replicas_path: str
    printer_columns: list[dict[str, Any]]


RESOURCES = {
    "ParallelTrainingJob": ResourceInfo(
        model=ParallelTrainingJob,
        plural="paralleltrainingjobs",
        singular="paralleltrainingjob",
        # `trainingjobs` also names AWS SageMaker's TrainingJob (another group): `ptj` never clashes.
        short_names=["ptj", "trainingjob", "trainingjobs"],
        replicas_path=".spec.workers",
        status_replicas_path=".status.workers.total",
        # Rank 0 writes the texts beside its numbers (tandem/columns.py): an API server prints a `number` column at
        # full precision. Default columns fit about 110 characters; -o wide adds what only some jobs or some
        # readers need: the Kueue queue (empty without Kueue) and the checkpoint's full path.
        printer_columns=[
            {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
            {"name": "Ready", "type": "string", "jsonPath": ".status.workers.summary",
             "description": "ready/total workers"},
            {"name": "Step", "type": "string", "jsonPath": ".status.progress.summary",
             "description": "step/total steps"},
            {"name": "Loss", "type": "string", "jsonPath": ".status.progress.lossText",
             "description": "the running loss to four significant figures (status.progress.loss: full precision)"},
            {"name": "Samples/s", "type": "string", "jsonPath": ".status.progress.samplesPerSecondText",
             "description": "examples per second over all ranks"},
            {"name": "ETA", "type": "string", "jsonPath": ".status.progress.etaText",
             "description": "time left at the measured rate, while Running"},
            {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts"},
            {"name": "Checkpoint", "type": "string", "jsonPath": ".status.checkpoint.latestFile",
             "description": "the file of the latest checkpoint complete on disk"},
            {"name": "Queue", "type": "string", "jsonPath": ".status.queue.name", "priority": 1,
             "description": "the Kueue LocalQueue (kueue.x-k8s.io/queue-name)"},
            {"name": "Lent", "type": "integer", "jsonPath": ".status.lent.workers", "priority": 1,
             "description": "workers lent to InferencePools (spec.elastic.lendTo)"},
            {"name": "Checkpoint Path", "type": "string", "jsonPath": ".status.checkpoint.latest", "priority": 1,
             "description": "the latest checkpoint's full path"},
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        ],
    ),
    "InferencePool": ResourceInfo(
        model=InferencePool,
        plural="inferencepools",
        singular="inferencepool",
        # The Gateway API inference extension also has an InferencePool kind (another group, no short
        # names of these): `tip`/`tpool` always mean Tandem's.
        short_names=["tip", "tpool"],
        replicas_path=".spec.replicas",
        status_replicas_path=".status.replicas",
        printer_columns=[
            {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
            {"name": "Ready", "type": "string", "jsonPath": ".status.readySummary",
             "description": "ready/desired replicas"},
            {"name": "Mode", "type": "string", "jsonPath": ".spec.inferenceMode"},
            {"name": "Model", "type": "string", "jsonPath": ".status.model.source"},
            {"name": "Checkpoint", "type": "string", "jsonPath": ".status.model.checkpointFile",
             "description": "the file of the checkpoint the ready replicas serve"},
            {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint", "priority": 1,
             "description": "the Open Inference Protocol (v2) base URL inside the cluster"},
            {"name": "Checkpoint Path", "type": "string", "jsonPath": ".status.model.checkpoint", "priority": 1,
             "description": "the served checkpoint's full path"},
            {"name": "Metric", "type": "string", "jsonPath": ".status.model.gateMetric", "priority": 1,
             "description": "with a promotion gate: its metric of the served checkpoint"},
            {"name": "Borrowed", "type": "integer", "jsonPath": ".status.borrowed.workers", "priority": 1,
             "description": "workers training jobs lend the pool (their spec.elastic.lendTo)"},
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        ],
    ),
}


def structural_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The openAPIV3Schema of a resource's spec and status."""
    schema = model.model_json_schema(by_alias=True)
    defs = schema.get("$defs", {})
    properties = schema["properties"]
    return {
        "type": "object",
        "description": schema.get("description", ""),
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": _convert(properties["spec"], defs),
            "status": _convert(properties["status"], defs),
        },
    }


def _convert(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    node = _inline(node, defs)
    out: dict[str, Any] = {key: value for key, value in node.items() if key not in _DROPPED_KEYS}
    if "const" in node:
        out["enum"] = [node["const"]]
    if isinstance(node.get("exclusiveMinimum"), int | float) and not isinstance(node["exclusiveMinimum"], bool):
        out["minimum"], out["exclusiveMinimum"] = node["exclusiveMinimum"], True
    if isinstance(node.get("exclusiveMaximum"), int | float) and not isinstance(node["exclusiveMaximum"], bool):
        out["maximum"], out["exclusiveMaximum"] = node["exclusiveMaximum"], True
    if "default" in out and out["default"] is None:
        del out["default"]
    if "properties" in node:
        out["properties"] = {name: _convert(sub, defs) for name, sub in node["properties"].items()}
    if "items" in node:
        out["items"] = _convert(node["items"], defs)
    extra = node.get("additionalProperties")
    if isinstance(extra, dict):
        if extra:
            out["additionalProperties"] = _convert(extra, defs)
        else:
            out["x-kubernetes-preserve-unknown-fields"] = True
    elif extra is True:
        out["x-kubernetes-preserve-unknown-fields"] = True
    if out.get("type") == "object" and "properties" not in out and "additionalProperties" not in out:
        out["x-kubernetes-preserve-unknown-fields"] = True
    if "type" not in out and not out.get("x-kubernetes-int-or-string"):
        out["x-kubernetes-preserve-unknown-fields"] = True
    if out.get("type") == "object" and isinstance(out.get("default"), dict):
        # Nested defaults are applied by the API server once the object exists.
        out["default"] = {}
    return _ordered(out)


_KEY_ORDER = ("type", "description")


def _ordered(node: dict[str, Any]) -> dict[str, Any]:
    """type and description first, then the rest as pydantic wrote them: easier to read in crds/."""
    return {**{k: node[k] for k in _KEY_ORDER if k in node}, **{k: v for k, v in node.items() if k not in _KEY_ORDER}}


def _inline(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Resolve $ref and reduce anyOf to one structural type (keeping the node's own keys)."""
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        node = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _inline(node, defs)
    if "anyOf" in node:
        variants = [v for v in node["anyOf"] if v.get("type") != "null"]
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        if len(variants) == 1:
            return _inline({**_inline(variants[0], defs), **rest}, defs)
        if {v.get("type") for v in variants} == {"integer", "string"}:
            return {**rest, "x-kubernetes-int-or-string": True}
        raise ValueError(f"no structural form for anyOf {variants}")
    return node


def crd(kind: str) -> dict[str, Any]:
    info = RESOURCES[kind]
    version = {
        "name": VERSION,
        "served": True,
        "storage": True,
        "schema": {"openAPIV3Schema": structural_schema(info.model)},
        "subresources": {
            "status": {},
            "scale": {
                "specReplicasPath": info.replicas_path,
                "statusReplicasPath": info.status_replicas_path,
                "labelSelectorPath": ".status.selector",
            },
        },
        "additionalPrinterColumns": info.printer_columns,
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{info.plural}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": info.plural,
                "singular": info.singular,
                "shortNames": info.short_names,
                "categories": ["tandem"],
            },
            "versions": [version],
        },
    }


def crd_files() -> dict[str, str]:
    """File name -> YAML text, for every CRD."""
    header = "# Generated by `tandem crds` from tandem/api: do not edit by hand.\n"
    return {
        f"{GROUP}_{RESOURCES[kind].plural}.yaml": header + yaml.safe_dump(crd(kind), sort_keys=False, width=110)
        for kind in RESOURCES
    }


def write_crds(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in crd_files().items():
        path = directory / name
        path.write_text(text)
        written.append(path)
    return written
