"""Grammars that enforce `tool_choice` = "required" or a named function, in the model's own
tool-call format, as Lark text for llguidance (hylora/structured compiles it).

The output is one call (named function, or `required` without parallel calls) or one or more
calls separated by "\\n" (as the Qwen templates write them), nothing before, nothing after; every
call's arguments are valid against its function's `parameters` schema (objects closed: no key the
schema does not list, as hylora's structured outputs). The tool parser of the same format reads
back exactly what the grammar allows.

- hermes: `<tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>`, ARGS a compact
  `json.dumps`-style JSON object from the schema (llguidance `%json`).
- qwen3_coder: `<tool_call>\\n<function=NAME>\\n` + one `<parameter=KEY>\\nVALUE\\n</parameter>\\n`
  per parameter (required ones always, optional ones may be left out, in the schema's order) +
  `</function>\\n</tool_call>`. VALUE is what the parser converts back: for a string, the raw text
  (any text without `</parameter>` or `</function>`; `enum` / `const`, `minLength` / `maxLength`
  and `pattern` enforced, `format` not); for every other type the JSON text (`%json` of the
  parameter's schema, which `int()` / `float()` / JSON read back). The parser converts a value to
  the schema's first non-null type, so a union allows that type's form only (plus null): with
  `anyOf: [integer, string]` the model writes integers.

Schemas the grammar cannot carry raise ValueError (answer 400, param "tools"): a parameter name the
XML cannot hold (with `>`, whitespace or `<`), a function name the format cannot carry.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import llguidance

from hylora.server.parsers.tool_calls.base import TOOL_CALL_END, TOOL_CALL_START
from hylora.server.parsers.tool_calls.qwen3_coder import valid_function_name
from hylora.server.parsers.tool_calls.schema import (
    MAX_UNION_DEPTH,
    arguments_schema,
    is_string_type,
    json_types,
    primary_type,
    resolve,
)
from hylora.structured.grammar import JSON_LAYOUT, close_objects
from hylora.structured.limits import check_json_schema

GRAMMAR_FORMATS: tuple[str, ...] = ("qwen3_coder", "hermes")
FREE_TEXT = "FREE_TEXT"  # the terminal of string values with no constraint (shared)
_NO_TAGS = r"~/(?s:.*)<\/(?:parameter|function)>(?s:.*)/"  # raw string values never hold these
_DEFS_KEYS = ("$defs", "definitions")
_SCALARS = {"integer", "number", "boolean", "null"}  # JSON texts without whitespace anyway


def tool_choice_grammar(
    tools: Sequence[Mapping[str, Any]],
    fmt: str,
    function: str | None = None,
    parallel: bool = True,
    token_tags: Collection[str] = (),
) -> str:
    """The Lark grammar for `tool_choice`: `function` = the named function's name (exactly one call
    to it), or None for "required" (one call to any tool, or several when `parallel`).

    `token_tags`: the tags (`<tool_call>`, `</tool_call>`) that are one added token each in the
    model's tokenizer (Qwen3.5 / 3.6's are). llguidance keeps added tokens apart from text, so a
    quoted "<tool_call>" could only be spelled byte by byte; the grammar names such a tag as the
    token itself (`<tool_call>`, llguidance's special-token syntax), the way the model writes it."""
    if fmt not in GRAMMAR_FORMATS:
        raise ValueError(f"no tool-call grammar for format {fmt!r}; use one of {', '.join(GRAMMAR_FORMATS)}")
    functions = [t["function"] for t in tools if isinstance(t, Mapping) and isinstance(t.get("function"), Mapping)]
    if function is not None:
        functions = [f for f in functions if f.get("name") == function][:1]
        if not functions:
            raise ValueError(f"the function {function!r} is not among the tools")
    if not functions:
        raise ValueError("tool_choice needs at least one tool")
    lines: list[str] = []
    calls = []
    for i, fn in enumerate(functions):
        name = fn.get("name")
        if not isinstance(name, str) or not valid_function_name(name):
            raise ValueError(f"the function name {name!r} cannot be written in the {fmt} format")
        params = fn.get("parameters")
        params = dict(params) if isinstance(params, Mapping) else {"properties": {}}
        params.setdefault("type", "object")  # an untyped schema would let `"arguments": 5` through
        try:  # the bounds response_format's schemas meet (a schema with no finite instance: no call could end)
            check_json_schema(params)
        except ValueError as e:
            raise ValueError(f"the parameters of the function {name!r}: {e}") from None
        rule = f"call_{i}"
        calls.append(rule)
        if fmt == "hermes":
            lines.append(_hermes_call(rule, name, params, token_tags))
        else:
            lines.extend(_qwen3_coder_call(rule, name, params, token_tags))
    repeat = ' ("\\n" call)*' if function is None and parallel else ""
    head = [f"start: call{repeat}", "call: " + " | ".join(calls)]
    if any(FREE_TEXT in line for line in lines):
        head.append(f'{FREE_TEXT}: ({_raw_string_regex({})}) "\\n</parameter>\\n"')
    return "\n".join(head + lines) + "\n"


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _with_tags(text: str, token_tags: Collection[str]) -> str:
    """`text` as Lark, its `<tool_call>` / `</tool_call>` as token references where they are tokens."""
    pieces, rest = [], text
    for tag in (TOOL_CALL_START, TOOL_CALL_END):
        if tag in token_tags and tag in rest:
            before, _, rest = rest.partition(tag)
            pieces += [_lark_string(before)] if before else []
            pieces.append(tag)
    pieces += [_lark_string(rest)] if rest else []
    return " ".join(pieces)


def _json_directive(schema: Any, root: Mapping[str, Any]) -> str:
    """`%json {...}` for `schema` (with the root's `$defs` when it refers to them, objects closed,
    the compact `json.dumps` layout wherever an object or array may appear)."""
    if isinstance(schema, Mapping):
        schema = dict(schema)
        text = json.dumps(schema)
        if "$ref" in text:
            for key in _DEFS_KEYS:
                if key in root and key not in schema:
                    schema[key] = root[key]
        schema = close_objects(schema)
        types = set(json_types(schema, root))
        if not types or not types <= _SCALARS or "$ref" in text:
            schema["x-guidance"] = {**JSON_LAYOUT, **(schema.get("x-guidance") or {})}
    elif schema is True:
        schema = {"x-guidance": dict(JSON_LAYOUT)}
    return "%json " + json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


def _hermes_call(rule: str, name: str, params: Mapping[str, Any], token_tags: Collection[str]) -> str:
    head = _with_tags('<tool_call>\n{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": ', token_tags)
    tail = _with_tags("}\n</tool_call>", token_tags)
    return f"{rule}: {head} {_json_directive(params, params)} {tail}"


def _qwen3_coder_call(rule: str, name: str, params: Mapping[str, Any], token_tags: Collection[str]) -> list[str]:
    """One rule per function (its parameters inline) + one terminal per free-text parameter: a
    large tool list stays far below the structured-output bounds on rules."""
    top = arguments_schema(params)
    props = top.get("properties") if isinstance(top.get("properties"), Mapping) else {}
    required = top.get("required") if isinstance(top.get("required"), list) else []
    names = list(props) + [r for r in required if isinstance(r, str) and r not in props]
    body, lines = [], []
    for j, key in enumerate(names):
        if not isinstance(key, str) or not key or set(key) & set("<>\n\r\t "):
            raise ValueError(f"the parameter name {key!r} of {name!r} cannot be written in the qwen3_coder format")
        value, terminal = _qwen3_coder_value(f"{rule.upper()}_P{j}", key, props.get(key, {}), params)
        lines.extend(terminal)
        block = f"({_lark_string(f'<parameter={key}>' + chr(10))} {value})"
        body.append(block if key in required else f"{block}?")
    head = _with_tags(f"<tool_call>\n<function={name}>\n", token_tags)
    tail = _with_tags("</function>\n</tool_call>", token_tags)
    return [" ".join([f"{rule}:", head, *body, tail])] + lines


def _qwen3_coder_value(terminal: str, key: str, schema: Any, root: Mapping[str, Any]) -> tuple[str, list[str]]:
    """The value of one `<parameter=KEY>` block with its closing tag, as a Lark expression (and the
    terminal it uses, if any).

    The parser converts a value to the schema's first non-null type, so only that type's form is
    allowed (with "null" where the schema admits null): raw text for a string, JSON otherwise (an
    object or array type reads any JSON back, so there the other non-string branches stay)."""
    close = "\\n</parameter>\\n"
    resolved = resolve(schema, root)
    types = json_types(resolved, root)
    kind = primary_type(types)
    if types and all(t == "null" for t in types):
        return f'"null{close}"', []
    if not types or is_string_type(kind):
        branch = _string_branch(resolved, root)
        literals = _string_literals(branch)
        if literals is None:
            regex = _raw_string_regex(branch)
            if regex == _raw_string_regex({}):
                return FREE_TEXT, []
            return terminal, [f'{terminal}: ({regex}) "{close}"']
        if not literals:
            raise ValueError(f"the parameter {key!r} admits no value")
        return "(" + " | ".join(f'"{_lark_inner(v)}{close}"' for v in literals) + ")", []
    container = kind in ("object", "array")
    keep = [t for t in types if not is_string_type(t)] if container else [kind, "null"]
    return f'{_json_directive(_restrict(resolved, keep, root), root)} "{close}"', []


def _lark_inner(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _string_branch(schema: Any, root: Mapping[str, Any]) -> Any:
    """The part of `schema` that describes its string values (a union's string option)."""
    for _ in range(MAX_UNION_DEPTH):
        if not isinstance(schema, Mapping) or "type" in schema:
            return schema
        options = [resolve(o, root) for key in ("anyOf", "oneOf") for o in schema.get(key) or ()]
        branch = next((o for o in options if any(is_string_type(t) for t in json_types(o, root))), None)
        if branch is None:
            return schema
        schema = branch
    return schema


def _string_literals(schema: Any) -> list[str] | None:
    """The fixed strings a string parameter may take (`enum` / `const`), or None when free."""
    if not isinstance(schema, Mapping):
        return None
    if "const" in schema:
        return [schema["const"]] if isinstance(schema["const"], str) else []
    if isinstance(schema.get("enum"), list):
        return [v for v in schema["enum"] if isinstance(v, str)]
    return None


def _raw_string_regex(schema: Any) -> str:
    """The Lark terminal body for a raw string value (length, pattern, no closing tags)."""
    low, high = 0, None
    parts = []
    if isinstance(schema, Mapping):
        if isinstance(schema.get("minLength"), int):
            low = max(0, schema["minLength"])
        if isinstance(schema.get("maxLength"), int):
            high = max(low, schema["maxLength"])
        pattern = schema.get("pattern")
        if isinstance(pattern, str):
            parts.append(f"/{_anchored(pattern)}/")
    length = f"{{{low},{'' if high is None else high}}}"
    parts.insert(0, f"/(?s:.{length})/")
    parts.append(_NO_TAGS)
    return " & ".join(parts)


def _anchored(pattern: str) -> str:
    """A JSON-schema `pattern` (a search, ECMAScript flavour) as a whole-text Lark regex body."""
    start = pattern.startswith("^")
    end = pattern.endswith("$") and not pattern.endswith("\\$")
    core = pattern[1 if start else 0 : len(pattern) - 1 if end else len(pattern)]
    body = llguidance.regex_to_lark(core, "dw")
    return ("" if start else "(?s:.*)") + f"(?:{body})" + ("" if end else "(?s:.*)")


def _restrict(schema: Any, keep: list[str], root: Mapping[str, Any]) -> Any:
    """`schema` narrowed to the JSON types in `keep` (a `type` list filtered, union options whose
    types are all elsewhere dropped)."""
    if not isinstance(schema, Mapping):
        return schema
    if isinstance(schema.get("type"), list):
        kinds = [k for k in schema["type"] if isinstance(k, str) and k.strip().lower() in keep]
        return {**schema, "type": kinds[0] if len(kinds) == 1 else kinds}
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            options = [o for o in schema[key] if set(json_types(o, root)) & set(keep)]
            return {**schema, key: options}
    return schema
