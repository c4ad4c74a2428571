"""StructuredSpec → llguidance grammar text (what LLMatcher compiles).

JSON is generated without free whitespace, in `json.dumps` style (`{"a": 1, "b": [2, 3]}`): a
model cannot stall in whitespace, every document ends, and streaming clients see one line. (vLLM
does the same with `disable_any_whitespace`; here it is the default, and `whitespace_pattern`
re-allows whitespace where a client wants it.)
"""

from __future__ import annotations

import json
import re
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark

from hylora.structured.spec import StructuredSpec

_LARK_START = re.compile(r"(?m)^\s*(%llguidance\b|[?!]?start\s*:)")
JSON_LAYOUT: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(spec: StructuredSpec) -> str:
    """Raises ValueError (with llguidance's message) when the text cannot even be parsed; most
    errors (unsupported schema keywords, bad regex syntax) surface when LLMatcher compiles it."""
    if spec.kind in ("json_object", "json_schema"):
        schema: Any = {"type": "object"} if spec.kind == "json_object" else json.loads(str(spec.payload))
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


def lark_text(grammar: str) -> str:
    """A grammar in Lark syntax as is; GBNF / EBNF (`root ::= ...`, vLLM's xgrammar spelling)
    converted to Lark. (llguidance's own detection misses Lark grammars that start with `?start:`.)"""
    if _LARK_START.search(grammar) or "::=" not in grammar:
        return grammar
    try:
        return gbnf_to_lark(grammar)
    except Exception as e:
        raise ValueError(f"cannot read it as GBNF/EBNF (rules `name ::= ...`) nor as Lark: {e}") from None


def close_objects(schema: Any) -> Any:
    """A copy of `schema` where every object schema that does not set `additionalProperties` gets
    `false` (vLLM's `disable_additional_properties`)."""
    if isinstance(schema, list):
        return [close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):  # name → schema: the map itself is no schema
            out[key] = {name: close_objects(s) for name, s in value.items()}
        elif key in _LITERALS:
            out[key] = value
        else:
            out[key] = close_objects(value)
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


_SCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
_LITERALS = {"enum", "const", "default", "examples"}
