"""StructuredSpec → llguidance grammar text (what LLMatcher compiles).

JSON is generated without free whitespace, in `json.dumps` style (`{"a": 1, "b": [2, 3]}`): a
model cannot stall in whitespace, every document ends, and streaming clients see one line. (vLLM
does the same with `disable_any_whitespace`; here it is the default, and `whitespace_pattern`
re-allows whitespace where a client wants it.)

Nothing here recurses in Python on client data, and the Lark-vs-GBNF test is linear: the
earlier `^\\s*` let every line start scan the whole run of blank lines after it (quadratic: 40,000
newlines held the GIL for 12 s).
"""

from __future__ import annotations

import json
import re
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark

from hylora.structured.spec import StructuredSpec

# `[ \t]*` cannot leave its line, so each line start scans only its own indentation: linear
_LARK_START = re.compile(r"(?m)^[ \t\f\v]*+(?:%llguidance\b|[?!]?start[ \t]*+:)")
JSON_LAYOUT: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(spec: StructuredSpec) -> str:
    """Raises ValueError (with llguidance's message) when the text cannot even be parsed; most
    errors (unsupported schema keywords, bad regex syntax) surface when LLMatcher compiles it."""
    if spec.kind in ("json_object", "json_schema"):
        try:
            schema: Any = {"type": "object"} if spec.kind == "json_object" else json.loads(str(spec.payload))
        except RecursionError:  # the pre-compile bounds refuse such depths first
            raise ValueError("the JSON schema is nested too deeply") from None
        if not spec.additional_properties:
            schema = close_objects(schema)
        layout = dict(JSON_LAYOUT)
        if spec.whitespace_pattern is not None:
            layout["whitespace_pattern"] = spec.whitespace_pattern
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=layout)  # type: ignore[arg-type]
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(str(spec.payload))
    if spec.kind == "choice":
        return llguidance.grammar_from("choice", list(spec.payload))  # type: ignore[arg-type]
    return llguidance.LLMatcher.grammar_from_lark(lark_text(str(spec.payload)))


def is_lark(grammar: str) -> bool:
    """Lark syntax (else GBNF / EBNF, `root ::= ...`). llguidance's own test misses Lark grammars
    that start with `?start:` (and is the quadratic regex)."""
    return _LARK_START.search(grammar) is not None or "::=" not in grammar


def lark_text(grammar: str) -> str:
    """A grammar in Lark syntax as is; GBNF / EBNF (vLLM's xgrammar spelling) converted to Lark."""
    if is_lark(grammar):
        return grammar
    try:
        return gbnf_to_lark(grammar)
    except Exception as e:
        raise ValueError(f"cannot read it as GBNF/EBNF (rules `name ::= ...`) nor as Lark: {e}") from None


def close_objects(schema: Any) -> Any:
    """A copy of `schema` where every object schema that does not set `additionalProperties` gets
    `false` (vLLM's `disable_additional_properties`). Iterative: the copy is built top-down."""
    out_root: list[Any] = [None]
    # (value to copy, container of the copy, key or index in it, whether the value is a schema)
    stack: list[tuple[Any, Any, Any, bool]] = [(schema, out_root, 0, True)]
    closing: list[dict[str, Any]] = []  # copied object schemas, to close once filled
    while stack:
        value, parent, slot, is_schema = stack.pop()
        if isinstance(value, list):
            copy: Any = [None] * len(value)
            stack.extend((v, copy, i, is_schema) for i, v in enumerate(value))
        elif isinstance(value, dict) and is_schema:
            copy = {}
            for key, sub in value.items():
                copy[key] = None  # keeps the key order
                if key in _SCHEMA_MAPS and isinstance(sub, dict):  # name → schema: the map itself is no schema
                    names: dict[str, Any] = {name: None for name in sub}
                    copy[key] = names
                    stack.extend((s, names, name, True) for name, s in sub.items())
                elif key in _LITERALS:
                    copy[key] = sub
                else:
                    stack.append((sub, copy, key, True))
            closing.append(copy)
        else:
            copy = value  # scalars (and literal data) are shared, not copied
        parent[slot] = copy
    for copy in closing:
        # `false` forbids every name outside the schema's own `properties`: an object schema that has none
        # and takes its properties from a `$ref` or a combinator (`{"$ref": ..., "type": "object"}`) stays open
        borrowed = "properties" not in copy and any(k in copy for k in _BORROWS_PROPERTIES)
        is_object = copy.get("type") == "object" or "properties" in copy
        if is_object and "additionalProperties" not in copy and not borrowed:
            copy["additionalProperties"] = False
    return out_root[0]


_SCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
_LITERALS = {"enum", "const", "default", "examples"}
_BORROWS_PROPERTIES = ("$ref", "allOf", "anyOf", "oneOf")
