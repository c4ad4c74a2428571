"""What a tool's JSON schema says about one parameter: its JSON types (after `$ref`), and the
conversion of the raw text a qwen3_coder `<parameter=…>` block holds into that type.

The conversion follows vLLM's qwen3_coder parser (`_convert_param_value`): the first non-null type
of `type` / `anyOf` decides; "null" / "None" become null where the schema admits null, and for any
non-string type; strings stay as written; integers by `int()`, numbers by `float()` (integral values
as integers); booleans are `true` when the text is "true" (any case); objects and arrays by JSON,
then Python-literal syntax; anything that does not convert stays a string. Differences, on purpose:
`$ref` is followed (vLLM treats it as a string), a `type` list (["integer", "null"]) is read like
`anyOf`, an untyped `enum` / `const` takes its values' types, and a non-finite number or a Python
literal that is not JSON (a set, complex, bytes) stays a string instead of failing.
"""

from __future__ import annotations

import ast
import json
import math
from collections.abc import Mapping
from typing import Any

_STRING_TYPES = {"string", "str", "text", "varchar", "char", "enum"}
_INT_PREFIXES = ("int", "uint", "long", "short", "unsigned")
_BOOL_TYPES = {"boolean", "bool", "binary"}
_MAX_REF_HOPS = 16
MAX_UNION_DEPTH = 16  # anyOf in anyOf ...: deeper is not looked into (no recursion on client data)


def tool_schemas(tools: Any) -> dict[str, dict[str, Any]]:
    """name → parameters schema, from an OpenAI `tools` list (the first tool of a name wins;
    malformed entries are skipped: validate the request first)."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            continue
        params = function.get("parameters")
        out.setdefault(function["name"], dict(params) if isinstance(params, Mapping) else {})
    return out


def resolve(schema: Any, root: Mapping[str, Any]) -> Any:
    """`schema` with its local `$ref`s (`#/$defs/…`, `#/definitions/…`, `#`) followed."""
    for _ in range(_MAX_REF_HOPS):
        if not isinstance(schema, Mapping) or not isinstance(schema.get("$ref"), str):
            return schema
        target: Any = root
        ref = schema["$ref"]
        if not ref.startswith("#"):
            return {}
        for part in filter(None, ref[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, Mapping) or part not in target:
                return {}
            target = target[part]
        schema = target
    return {}


def arguments_schema(params: Mapping[str, Any]) -> Mapping[str, Any]:
    """The object schema of a function's arguments: `params`, or the target of its root `$ref` into its
    own `$defs` (as pydantic writes some models); {} when that is no schema object."""
    top = resolve(params, params)
    return top if isinstance(top, Mapping) else {}


def property_schema(params: Mapping[str, Any], name: str) -> Any:
    """The (resolved) schema of parameter `name`, or None when the function does not declare it."""
    props = arguments_schema(params).get("properties")
    if not isinstance(props, Mapping) or name not in props:
        return None
    return resolve(props[name], params)


def json_types(schema: Any, root: Mapping[str, Any], depth: int = 0) -> list[str]:
    """The JSON types `schema` admits, in the order it lists them (lower-case, may be empty when
    the schema says nothing about types; unions nested deeper than MAX_UNION_DEPTH say nothing)."""
    schema = resolve(schema, root)
    if not isinstance(schema, Mapping) or depth > MAX_UNION_DEPTH:
        return []
    if "type" in schema:
        kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        return [str(k).strip().lower() for k in kinds]
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            out: list[str] = []
            for option in schema[key]:
                out.extend(t for t in json_types(option, root, depth + 1) if t not in out)
            return out
    values = schema["enum"] if isinstance(schema.get("enum"), list) else None
    if values is None and "const" in schema:
        values = [schema["const"]]
    if values is not None:
        out = []
        for value in values:
            kind = _value_type(value)
            if kind not in out:
                out.append(kind)
        return out
    if "properties" in schema:
        return ["object"]
    if "items" in schema or "prefixItems" in schema:
        return ["array"]
    return []


def _value_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def primary_type(types: list[str]) -> str:
    """The type a raw value is converted to: the first that is not null ("string" when none)."""
    return next((t for t in types if t != "null"), "string")


def is_string_type(kind: str) -> bool:
    return kind in _STRING_TYPES


def convert_value(raw: str, schema: Any, root: Mapping[str, Any]) -> Any:
    """The JSON value of a qwen3_coder parameter's raw text, for its schema (None: undeclared
    parameter → the raw string)."""
    if schema is None:
        return raw
    types = json_types(schema, root)
    kind = primary_type(types)
    lowered = raw.lower()
    if "null" in types and lowered in ("null", "none"):
        return None
    if kind in _STRING_TYPES:
        return raw
    if lowered in ("null", "none"):
        return None
    if kind.startswith(_INT_PREFIXES):
        try:
            return int(raw)
        except ValueError:
            return raw
    if kind.startswith(("num", "float")):
        try:
            number = float(raw)
        except ValueError:
            return raw
        if not math.isfinite(number):
            return raw
        return int(number) if number.is_integer() else number
    if kind in _BOOL_TYPES:
        return lowered == "true"
    container = kind in ("object", "array", "arr") or kind.startswith(("dict", "list"))
    if container:
        try:
            value = json.loads(raw)
        except (ValueError, RecursionError):
            pass
        else:
            if isinstance(value, str):  # a JSON-encoded Python repr ("{'k': 'v'}"), as vLLM
                value = _literal(value, value)
            return value
    value = _literal(raw, raw)
    if container and isinstance(value, str):
        value = _literal(value, value)
    return value


def _literal(text: str, default: Any) -> Any:
    """`ast.literal_eval(text)` when it gives a JSON value, else `default`."""
    try:
        return json.loads(json.dumps(ast.literal_eval(text), allow_nan=False))  # tuples → lists
    except Exception:  # SyntaxError, ValueError, RecursionError, MemoryError, TypeError (not JSON)...
        return default
