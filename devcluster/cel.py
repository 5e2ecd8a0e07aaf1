"""A CRD's validation rules (`x-kubernetes-validations`), evaluated with cel-python as the API server evaluates them.

- where: each rule is evaluated with `self` bound to the value at the schema node that carries it (any depth; per
  item under `items`, per value under `additionalProperties`), after pruning and defaulting; a node whose value is
  absent is not evaluated. At the root, `self` holds apiVersion, kind, `metadata.name`/`generateName` and the rest;
- types: values are converted by their schema, as the API server types them: `type: number` is a double even when
  written `1`, `integer` an int, `format: byte` bytes, `duration` a duration, `date`/`date-time` a timestamp;
  property names that are not CEL identifiers are escaped (`foo-bar` is `self.foo__dash__bar`, a property named
  `namespace` is `self.__namespace__`);
- a rule that is false answers `<path>: Invalid value: "<type>": <message>` (`spec: Invalid value: "object": ...`,
  the message being `messageExpression`'s value, else `message`, else `failed rule: <rule>`); `reason`
  (FieldValueForbidden, FieldValueRequired, FieldValueDuplicate) and `fieldPath` change the wording and the path as
  they do on a server. Paths are the API server's: `spec.items[0]`, `spec.labels[key]`, `<nil>` for the root;
- transition rules (those naming `oldSelf`) are evaluated on updates only, where the old object has a value at the
  same place (by property name, map key, or the keys of an `x-kubernetes-list-type: map` list), and skipped on
  create and elsewhere, as on a server. Deviation: `optionalOldSelf` rules are skipped too where no old value exists
  (cel-python has no optional values);
- ratcheting (as on servers since 1.30): on an update, a rule that does not name `oldSelf` is not evaluated where the
  value equals the old one, so an object stored before a rule was added can still have its status and metadata
  written.

Errors, a choice: a rule (or messageExpression) that does not parse makes the CRD's create or update answer 422, as a
real server refuses a CRD whose rule does not compile (`crd_problems`). cel-python does not type-check, so what a
server's compiler also refuses (an undeclared identifier, a function it does not know, a type mismatch) is found
only when a write evaluates the rule: that, like any evaluation error a server meets at run time (`no such key`,
division by zero), is answered as the server answers one, a failed validation: `spec: Invalid value: "object":
<error> evaluating rule: <message or rule>`. Nothing a rule does raises out of the server.

Not emulated: the cost budget, the Kubernetes CEL libraries beyond CEL's standard functions (`lowerAscii`, `split`,
`isSorted`, `url`, `quantity`, ... answer as evaluation errors), set/map-list equality semantics (lists compare in
order), and the rule limits a server checks on a CRD.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_KEYWORDS = frozenset({"true", "false", "null", "in", "as", "break", "const", "continue", "else", "for", "function",
                       "if", "import", "let", "loop", "package", "namespace", "return", "var", "void", "while"})
_IDENT = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_ESCAPABLE = re.compile(r"[a-zA-Z_.\-/][a-zA-Z0-9_.\-/]*")
_META_KEPT = ("name", "generateName")
_REASONS = {"FieldValueForbidden": "Forbidden", "FieldValueRequired": "Required value"}
BLOCKED = ('<nil>: Invalid value: "null": some validation rules were not checked because the object was invalid; '
           'correct the existing errors to complete validation')

_environment: Any = None
_programs: dict[str, Any] = {}  # rule text -> compiled program: each rule compiled once, whichever CRD holds it
_plans: dict[int, tuple[Mapping[str, Any], dict[int, tuple[Rule, ...]], frozenset[int]]] = {}


class RuleError(ValueError):
    """A rule that does not compile."""


@dataclass(frozen=True)
class Rule:
    rule: str
    program: Any
    message: str = ""
    message_program: Any = None
    reason: str = ""
    field_path: str = ""
    transition: bool = False
    error: str = ""  # why it does not compile (a schema served without a CRD's admission check)


def _env() -> Any:
    global _environment
    if _environment is None:
        import celpy  # imported on first use: a cluster with no rules never pays for it

        _environment = celpy.Environment()
    return _environment


def _compile(text: str) -> tuple[Any, bool]:
    """The program of a CEL expression and whether it names `oldSelf`; RuleError when it does not parse."""
    cached = _programs.get(text)
    if cached is None:
        import celpy
        from lark import Token

        try:
            tree = _env().compile(text)
        except celpy.CELParseError as error:
            raise RuleError(" ".join(str(error).split())) from None
        except Exception as error:  # a rule must never crash the server
            raise RuleError(f"{type(error).__name__}: {error}") from None
        transition = any(True for _ in tree.scan_values(lambda v: isinstance(v, Token) and v.type == "IDENT"
                                                        and v == "oldSelf"))
        cached = _programs[text] = (_env().program(tree), transition)
    return cached


def _rule(spec: Mapping[str, Any]) -> Rule:
    try:
        program, transition = _compile(str(spec.get("rule", "")))
        message_program = None
        if spec.get("messageExpression"):
            message_program, uses_old = _compile(str(spec["messageExpression"]))
            transition = transition or uses_old
    except RuleError as error:
        return Rule(rule=str(spec.get("rule", "")), program=None, message=str(spec.get("message") or ""),
                    error=str(error))
    return Rule(rule=str(spec.get("rule", "")), program=program, message=str(spec.get("message") or ""),
                message_program=message_program, reason=str(spec.get("reason") or ""),
                field_path=str(spec.get("fieldPath") or ""), transition=transition)


def _children(schema: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """(how a CRD's field path names it, sub-schema) for each schema below this one."""
    found = [(f".properties[{key}]", sub) for key, sub in (schema.get("properties") or {}).items()
             if isinstance(sub, Mapping)]
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), Mapping):
            found.append((f".{key}", schema[key]))
    return found


def crd_problems(crd: Mapping[str, Any]) -> list[str]:
    """The rules of a CustomResourceDefinition that do not compile, one line each, worded as the API server words
    them (`spec.versions[0].schema.openAPIV3Schema.properties[spec].x-kubernetes-validations[0].rule: ...`)."""
    lines: list[str] = []

    def visit(schema: Mapping[str, Any], path: str) -> None:
        for index, rule in enumerate(schema.get("x-kubernetes-validations") or []):
            for field in ("rule", "messageExpression"):
                if field == "rule" or (isinstance(rule, Mapping) and rule.get(field)):
                    text = rule.get(field, "") if isinstance(rule, Mapping) else ""
                    try:
                        if not str(text).strip():
                            raise RuleError("the rule is empty")
                        _compile(str(text))
                    except RuleError as error:
                        lines.append(f"{path}.x-kubernetes-validations[{index}].{field}: Invalid value: {text!r}: "
                                     f"compilation failed: {error}")
        for name, sub in _children(schema):
            visit(sub, path + name)

    spec = crd.get("spec") or {}
    for index, version in enumerate(spec.get("versions") or []):
        schema = ((version or {}).get("schema") or {}).get("openAPIV3Schema")
        if isinstance(schema, Mapping):
            visit(schema, f"spec.versions[{index}].schema.openAPIV3Schema")
    return lines


def _plan(schema: Mapping[str, Any]) -> tuple[dict[int, tuple[Rule, ...]], frozenset[int]]:
    """The compiled rules of each schema node (by id) and the nodes with rules at or below them; once per schema."""
    cached = _plans.get(id(schema))
    if cached is None or cached[0] is not schema:
        rules: dict[int, tuple[Rule, ...]] = {}
        ruled: set[int] = set()

        def visit(node: Mapping[str, Any]) -> bool:
            found = False
            declared = node.get("x-kubernetes-validations") or []
            if declared:
                rules[id(node)] = tuple(_rule(spec) for spec in declared if isinstance(spec, Mapping))
                found = True
            for _, sub in _children(node):
                found = visit(sub) or found
            if found:
                ruled.add(id(node))
            return found

        visit(schema)
        cached = _plans[id(schema)] = (schema, rules, frozenset(ruled))
    return cached[1], cached[2]


def has_rules(schema: Mapping[str, Any] | None) -> bool:
    return bool(schema) and id(schema) in _plan(schema)[1]


# -- values -----------------------------------------------------------------------------------------------------------
def _escape(name: str) -> str:
    if name in _KEYWORDS:
        return f"__{name}__"
    if _IDENT.fullmatch(name) and "__" not in name:
        return name
    if not _ESCAPABLE.fullmatch(name):
        return name  # not reachable as a field (only by a map's index), as on a server
    return (name.replace("__", "__underscores__").replace(".", "__dot__").replace("-", "__dash__")
            .replace("/", "__slash__"))


def to_cel(value: Any, schema: Mapping[str, Any] | None, *, root: bool = False) -> Any:
    """A JSON value as CEL sees it under its schema."""
    import celpy.celtypes as ct

    schema = schema or {}
    if value is None:
        return None
    if isinstance(value, bool):
        return ct.BoolType(value)
    if isinstance(value, (int, float)):
        if schema.get("type") == "number":
            return ct.DoubleType(float(value))
        return ct.IntType(value) if isinstance(value, int) else ct.DoubleType(value)
    if isinstance(value, str):
        try:
            fmt = schema.get("format")
            if fmt == "byte":
                return ct.BytesType(base64.b64decode(value))
            if fmt == "duration":
                return ct.DurationType(value)
            if fmt in ("date", "date-time"):
                return ct.TimestampType(value if fmt == "date-time" else value + "T00:00:00Z")
        except Exception:  # an unparsable value stays a string
            pass
        return ct.StringType(value)
    if isinstance(value, list):
        items = schema.get("items") if isinstance(schema.get("items"), Mapping) else None
        return ct.ListType([to_cel(item, items) for item in value])
    if isinstance(value, Mapping):
        properties = schema.get("properties") or {}
        additional = schema.get("additionalProperties")
        result = {}
        for key, item in value.items():
            if root and key == "metadata" and isinstance(item, Mapping):
                item = {k: v for k, v in item.items() if k in _META_KEPT}
            if key in properties:
                result[ct.StringType(_escape(key))] = to_cel(item, properties[key])
            else:
                result[ct.StringType(key)] = to_cel(item, additional if isinstance(additional, Mapping) else None)
        return ct.MapType(result)
    return value


# -- evaluation -------------------------------------------------------------------------------------------------------
def _type_name(schema: Mapping[str, Any]) -> str:
    return str(schema.get("type") or "")


def _join(path: str, child: str) -> str:
    if child.startswith("["):
        return (path if path != "<nil>" else "") + child
    return child if path == "<nil>" else f"{path}.{child}"


def _with_field_path(path: str, field_path: str) -> str:
    for part in re.findall(r"\.([^.\[]+)|(\[[^\]]*\])", field_path):
        name, index = part
        if name:
            path = _join(path, name)
        else:
            key = index[1:-1].strip("'\"")
            path = _join(path, f"[{key}]")
    return path


def _evaluate(program: Any, activation: dict[str, Any]) -> Any:
    import celpy

    result = program.evaluate(activation)
    if isinstance(result, celpy.evaluation.CELEvalError):
        raise result
    return result


def _error_text(error: Exception) -> str:
    args = getattr(error, "args", ())
    text = str(args[0]) if args else str(error)
    if text.startswith("undeclared reference to"):
        text = text.split(" (in activation", 1)[0]
    return " ".join(text.split())


def _check(rule: Rule, value: Any, old: Any, schema: Mapping[str, Any], path: str, root: bool) -> str | None:
    import celpy.celtypes as ct

    type_name = _type_name(schema)
    if rule.error:
        return f'{path}: Invalid value: "{type_name}": compilation failed: {rule.error} (rule: {rule.rule.strip()})'
    activation = {"self": to_cel(value, schema, root=root)}
    if rule.transition:
        activation["oldSelf"] = to_cel(old, schema, root=root)
    try:
        result = _evaluate(rule.program, activation)
        if not isinstance(result, (bool, ct.BoolType)):
            raise TypeError(f"the rule evaluated to {type(result).__name__}, not a bool")
    except Exception as error:  # an evaluation error is a failed validation, never a crash
        return (f'{path}: Invalid value: "{type_name}": {_error_text(error)} evaluating rule: '
                f"{(rule.message or rule.rule).strip()}")
    if bool(result):
        return None
    message = rule.message.strip() or f"failed rule: {rule.rule.strip()}"
    if rule.message_program is not None:
        try:
            produced = _evaluate(rule.message_program, activation)
            if isinstance(produced, str) and produced.strip():
                message = str(produced)
        except Exception:  # a failed messageExpression falls back to the message, as on a server
            pass
    path = _with_field_path(path, rule.field_path) if rule.field_path else path
    if rule.reason in _REASONS:
        return f"{path}: {_REASONS[rule.reason]}: {message}"
    if rule.reason == "FieldValueDuplicate":
        return f'{path}: Duplicate value: "{message}"'
    return f'{path}: Invalid value: "{type_name}": {message}'


def _old_items(value: list, old: Any, schema: Mapping[str, Any]) -> list[tuple[bool, Any]]:
    """For each item of a list, (whether an old item corresponds, the old item): only map lists correlate."""
    keys = schema.get("x-kubernetes-list-map-keys") or []
    if schema.get("x-kubernetes-list-type") != "map" or not keys or not isinstance(old, list):
        return [(False, None)] * len(value)

    def key_of(item: Any) -> Any:
        return tuple(item.get(k) for k in keys) if isinstance(item, Mapping) else None

    by_key = {key_of(item): item for item in old if isinstance(item, Mapping)}
    return [(key_of(item) in by_key, by_key.get(key_of(item))) for item in value]


def violations(obj: Mapping[str, Any], schema: Mapping[str, Any] | None, old: Mapping[str, Any] | None = None
               ) -> list[str]:
    """One line per rule the object breaks (`spec: Invalid value: "object": <message>`); `old` is the stored object
    of an update (None on create)."""
    if not schema:
        return []
    rules, ruled = _plan(schema)
    lines: list[str] = []

    def walk(value: Any, node: Mapping[str, Any], path: str, has_old: bool, old_value: Any, root: bool = False
             ) -> None:
        if id(node) not in ruled or value is None:
            return
        unchanged = has_old and value == old_value
        for rule in rules.get(id(node), ()):
            if rule.transition and not has_old:
                continue  # a transition rule: only where an old value exists
            if unchanged and not rule.transition:
                continue  # ratcheting
            line = _check(rule, value, old_value, node, path, root)
            if line:
                lines.append(line)
        if isinstance(value, Mapping):
            properties = node.get("properties") or {}
            additional = node.get("additionalProperties")
            old_map = old_value if has_old and isinstance(old_value, Mapping) else {}
            for key, item in value.items():
                if root and key in ("apiVersion", "kind", "metadata"):
                    continue
                sub = properties.get(key)
                if sub is None and isinstance(additional, Mapping):
                    sub, child = additional, f"[{key}]"
                else:
                    child = key
                if isinstance(sub, Mapping):
                    walk(item, sub, _join(path, child), key in old_map, old_map.get(key))
        elif isinstance(value, list) and isinstance(node.get("items"), Mapping):
            for index, (item, (found, old_item)) in enumerate(zip(value, _old_items(value, old_value, node),
                                                                  strict=True)):
                walk(item, node["items"], _join(path, f"[{index}]"), found, old_item)

    walk(obj, schema, "<nil>", old is not None, old, root=True)
    return lines
