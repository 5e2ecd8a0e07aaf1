"""Reading and validating manifests: every problem named by its field path, with what is allowed."""

from __future__ import annotations

import difflib
import io
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from openapi_schema_validator import OAS30Validator
from pydantic import ValidationError

from tandem.api import API_VERSION, KINDS, InferencePool, ParallelTrainingJob
from tandem.crd import RESOURCES, structural_schema

Resource = ParallelTrainingJob | InferencePool


class ManifestError(ValueError):
    """A manifest that cannot be used; `problems` holds one line per problem, each naming its field."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        super().__init__(f"{source}: invalid manifest\n" + "\n".join(f"  - {p}" for p in problems))


def load_file(path: str | Path) -> list[Resource]:
    """Every resource in a YAML file (several documents allowed); ManifestError lists all problems."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise ManifestError(str(path), [f"cannot read the file: {error.strerror}"]) from error
    try:
        stream = io.StringIO(text)
        stream.name = str(path)  # what YAML's errors name: the file, not "<unicode string>"
        documents = [doc for doc in yaml.safe_load_all(stream) if doc is not None]
    except yaml.YAMLError as error:
        raise ManifestError(str(path), [f"not valid YAML: {error}"]) from error
    if not documents:
        raise ManifestError(str(path), ["the file holds no manifest"])
    resources, problems = [], []
    for index, document in enumerate(documents):
        try:
            resources.append(parse(document))
        except ManifestError as error:
            prefix = f"document {index + 1}: " if len(documents) > 1 else ""
            problems += [prefix + p for p in error.problems]
    if problems:
        raise ManifestError(str(path), problems)
    return resources


def load_one(path: str | Path, kind: type[Resource]) -> Resource:
    """The single resource of `kind` in a file (what `tandem run` and `tandem serve` take)."""
    matching = [r for r in load_file(path) if isinstance(r, kind)]
    if len(matching) != 1:
        raise ManifestError(
            str(path), [f"expected exactly one {kind.__name__} in the file, found {len(matching)}"]
        )
    return matching[0]


def parse(document: Any, source: str = "manifest") -> Resource:
    """Validate one manifest (a mapping) against the CRD schema and the API model."""
    if not isinstance(document, dict):
        found = type(document).__name__
        raise ManifestError(source, [f"a manifest is a mapping with apiVersion, kind, metadata, spec; got {found}"])
    kind = document.get("kind")
    if kind not in KINDS:
        raise ManifestError(source, [f"kind: {kind!r} is not a Tandem kind; use one of {', '.join(KINDS)}"])
    if document.get("apiVersion") != API_VERSION:
        raise ManifestError(source, [f"apiVersion: {document.get('apiVersion')!r} is not served; use {API_VERSION}"])
    model = KINDS[kind]
    problems: dict[str, str] = {}
    try:
        resource = model.model_validate(document)
    except ValidationError as error:
        for detail in error.errors():
            path = _field_path(kind, detail["loc"])
            problems.setdefault(path, _describe(kind, path, detail))
        resource = None
    for path, message in _schema_problems(kind, document):
        if not any(known == path or known.startswith((path + ".", path + "[")) for known in problems):
            problems.setdefault(path, f"{path}: {message}")
    if problems or resource is None:
        raise ManifestError(source, list(problems.values()))
    return resource


@cache
def _schema(kind: str) -> dict[str, Any]:
    return structural_schema(RESOURCES[kind].model)


def _schema_problems(kind: str, document: dict[str, Any]) -> list[tuple[str, str]]:
    validator = OAS30Validator(_schema(kind))
    found = []
    for error in validator.iter_errors(without_nulls(document)):
        path = _join(list(error.absolute_path)) or "(top level)"
        found.append((path, error.message))
    return found


def merge_patched(target: Any, patch: Any) -> Any:
    """`target` with the JSON merge patch `patch` applied (RFC 7386: a null deletes its key; None where the patch
    deletes the whole). The result shares unchanged sub-objects with `target`, which is never mutated."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patched(result.get(key), value)
    return result


def without_nulls(value: Any) -> Any:
    """What the API server validates: it drops null fields that the schema does not mark nullable."""
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value


def _field_path(kind: str, loc: tuple[Any, ...]) -> str:
    """Pydantic's error location as a manifest path, without its internal union/validator tags."""
    node: dict[str, Any] | None = _schema(kind)
    parts: list[str | int] = []
    for part in loc:
        if node is None:
            parts.append(part)
        elif isinstance(part, int) and "items" in node:
            parts.append(part)
            node = node["items"]
        elif isinstance(part, str) and part in node.get("properties", {}):
            parts.append(part)
            node = node["properties"][part]
        elif isinstance(part, str) and isinstance(node.get("additionalProperties"), dict):
            parts.append(part)
            node = node["additionalProperties"]
        elif isinstance(part, str) and not _looks_like_tag(part):
            parts.append(part)  # an unknown field: it has no schema node
            node = None
    return _join(parts) or "(top level)"


def _looks_like_tag(part: str) -> bool:
    return "[" in part or part in {"int", "str", "float", "bool", "dict", "list", "none"}


def _join(parts: list[str | int]) -> str:
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _describe(kind: str, path: str, detail: dict[str, Any]) -> str:
    kind_of_error = detail["type"]
    if kind_of_error == "extra_forbidden":
        allowed = _allowed_fields(kind, path.rsplit(".", 1)[0] if "." in path else "")
        guess = difflib.get_close_matches(path.rsplit(".", 1)[-1], allowed, n=1)
        hint = f"did you mean {guess[0]!r}? " if guess else ""
        return f"{path}: unknown field; {hint}allowed here: {', '.join(allowed)}"
    if kind_of_error == "missing":
        return f"{path}: required field is missing"
    message = detail["msg"].removeprefix("Value error, ")
    if "input" in detail and kind_of_error not in {"model_type", "dict_type"} and not isinstance(detail["input"], dict):
        return f"{path}: {message} (got {detail['input']!r})"
    return f"{path}: {message}"


def _allowed_fields(kind: str, parent: str) -> list[str]:
    node = _schema(kind)
    for part in parent.replace("[", ".[").split(".") if parent else []:
        node = node.get("items", {}) if part.startswith("[") else node.get("properties", {}).get(part, {})
    return sorted(node.get("properties", {}))
