"""Label and field selectors, as `?labelSelector=` and `?fieldSelector=` filter lists and watches.

Label selectors: `a=b`, `a==b`, `a!=b`, `a in (x,y)`, `a notin (x,y)`, `a` (exists), `!a` (does not exist),
joined by commas (all must hold). Field selectors: `path=value`, `path==value`, `path!=value` over any dotted path
of the object (`metadata.name`, `metadata.namespace`, `status.phase`, `spec.nodeName`, `involvedObject.name`...);
a missing field reads as "" (so `spec.nodeName=` selects unscheduled pods, as on a real cluster).

Deviation: a real API server accepts only the field paths each resource indexes and answers 400 for others; here
every path is accepted.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class SelectorError(ValueError):
    """A selector that does not parse: the API answers 400 BadRequest."""


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # '=', '!=', 'in', 'notin', 'exists', '!exists'
    values: tuple[str, ...] = ()


_EXISTS = re.compile(r"(!?)\s*([A-Za-z0-9][-A-Za-z0-9_./]*)")
_EQUALITY = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_./]*)\s*(==|=|!=)\s*([-A-Za-z0-9_.]*)")
_SET = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_./]*)\s+(in|notin)\s*\(([^)]*)\)")


def _terms(text: str) -> list[str]:
    """Split on the commas that are not inside `( ... )`."""
    terms, depth, current = [], 0, ""
    for char in text:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += char
    terms.append(current)
    return [term.strip() for term in terms if term.strip()]


def parse_labels(text: str | None) -> list[Requirement]:
    requirements = []
    for term in _terms(text or ""):
        if match := _SET.fullmatch(term):
            values = tuple(v.strip() for v in match[3].split(",") if v.strip())
            requirements.append(Requirement(match[1], match[2], values))
        elif match := _EQUALITY.fullmatch(term):
            requirements.append(Requirement(match[1], "!=" if match[2] == "!=" else "=", (match[3],)))
        elif match := _EXISTS.fullmatch(term):
            requirements.append(Requirement(match[2], "!exists" if match[1] else "exists"))
        else:
            raise SelectorError(f"unable to parse requirement: {term!r}")
    return requirements


def labels_match(requirements: list[Requirement], labels: Mapping[str, str] | None) -> bool:
    labels = labels or {}
    for req in requirements:
        present, value = req.key in labels, labels.get(req.key)
        if req.op == "exists":
            ok = present
        elif req.op == "!exists":
            ok = not present
        elif req.op == "=":
            ok = present and value == req.values[0]
        elif req.op == "!=":
            ok = value != req.values[0]
        elif req.op == "in":
            ok = present and value in req.values
        else:  # notin
            ok = value not in req.values
        if not ok:
            return False
    return True


def parse_fields(text: str | None) -> list[Requirement]:
    requirements = []
    for term in _terms(text or ""):
        match = re.fullmatch(r"([A-Za-z][\w.]*)\s*(==|=|!=)\s*(.*)", term)
        if not match:
            raise SelectorError(f"invalid field selector: {term!r}")
        requirements.append(Requirement(match[1], "!=" if match[2] == "!=" else "=", (match[3],)))
    return requirements


def field_value(obj: Mapping[str, Any], path: str) -> str:
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    if value is None:
        return ""
    return str(value).lower() if isinstance(value, bool) else str(value)


def fields_match(requirements: list[Requirement], obj: Mapping[str, Any]) -> bool:
    return all((field_value(obj, req.key) == req.values[0]) == (req.op == "=") for req in requirements)


@dataclass(frozen=True)
class Selection:
    """What one list or watch request asks for: a namespace (None: all), a name, label and field selectors."""

    namespace: str | None = None
    name: str | None = None
    labels: tuple[Requirement, ...] = ()
    fields: tuple[Requirement, ...] = ()

    @classmethod
    def of(cls, namespace: str | None, name: str | None, params: Mapping[str, str]) -> Selection:
        return cls(namespace, name, tuple(parse_labels(params.get("labelSelector"))),
                   tuple(parse_fields(params.get("fieldSelector"))))

    def matches(self, obj: Mapping[str, Any] | None) -> bool:
        if obj is None:
            return False
        meta = obj.get("metadata", {})
        return ((self.namespace is None or meta.get("namespace") == self.namespace)
                and (self.name is None or meta.get("name") == self.name)
                and labels_match(list(self.labels), meta.get("labels"))
                and fields_match(list(self.fields), obj))


def format_match_labels(selector: Mapping[str, Any] | None) -> str:
    """A LabelSelector object (matchLabels, matchExpressions) as the string form the scale subresource reports."""
    selector = selector or {}
    terms = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for expr in selector.get("matchExpressions") or []:
        op = expr["operator"]
        if op in ("In", "NotIn"):
            terms.append(f"{expr['key']} {op.lower()} ({','.join(expr.get('values', []))})")
        else:
            terms.append(expr["key"] if op == "Exists" else f"!{expr['key']}")
    return ",".join(terms)
