"""What a request asks its output to match, read from the OpenAI / vLLM request fields.

One parser, `parse_structured_outputs(body)`, reads every spelling clients use:

- OpenAI `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}`,
  `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`;
- vLLM `structured_outputs`: `{"json" | "regex" | "choice" | "grammar" | "json_object": ...}` plus its
  options `disable_any_whitespace`, `disable_additional_properties`, `whitespace_pattern`;
- vLLM's older extras `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`,
  `guided_whitespace_pattern` (`guided_decoding_backend` is accepted and ignored).

At most one constraint may be set across all of them (as vLLM). Anything unusable raises
StructuredOutputError with a message the client can act on (the server answers 400).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from hylora.structured.errors import StructuredOutputError
from hylora.structured.limits import MAX_JSON_DEPTH, json_text_depth, object_depth

__all__ = [
    "KINDS",
    "MAX_CHOICES",
    "MAX_SPEC_CHARS",
    "StructuredOutputError",
    "StructuredSpec",
    "parse_structured_outputs",
]

Kind = Literal["json_object", "json_schema", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = ("json_object", "json_schema", "regex", "choice", "grammar")

MAX_SPEC_CHARS = 256 * 1024  # a schema / regex / grammar / all choices together, as text
# llguidance's Earley rows hold at most 2000 items (LLParserLimits.max_items_in_row) and a choice list
# of n entries that share their first token puts n + 1 items in the row after that token: 2000
# choices compile and fail at the first token. 1024 keeps the row at half the limit.
MAX_CHOICES = 1024

_SO_CONSTRAINTS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
_SO_OPTIONS = {"disable_any_whitespace", "disable_additional_properties", "whitespace_pattern", "disable_fallback"}
_GUIDED = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


@dataclass(frozen=True)
class StructuredSpec:
    """One output constraint. Hashable: it is the compile cache's key.

    payload: json_schema → the schema as JSON text (key order kept: it is the order fields are
    generated in); regex / grammar → the pattern / grammar text (grammar: Lark or GBNF/EBNF);
    choice → the strings; json_object → "".
    """

    kind: Kind
    payload: str | tuple[str, ...] = ""
    whitespace_pattern: str | None = None  # JSON kinds: whitespace allowed between tokens (default: none)
    additional_properties: bool = True  # False: objects that do not say otherwise get no extra keys

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise StructuredOutputError(f"unknown structured output kind {self.kind!r}; use one of {', '.join(KINDS)}")
        if self.kind == "choice":
            if not isinstance(self.payload, tuple) or not all(isinstance(c, str) for c in self.payload):
                raise StructuredOutputError("choice needs a list of strings")
            if len(self.payload) > MAX_CHOICES:
                raise StructuredOutputError(
                    f"the choice list has {len(self.payload)} entries; at most {MAX_CHOICES} are accepted"
                )
            size = sum(len(c) for c in self.payload)
        else:
            if not isinstance(self.payload, str):
                raise StructuredOutputError(f"{self.kind} needs a string payload")
            size = len(self.payload)
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise StructuredOutputError("whitespace_pattern must be a string (a regex)")
        size += len(self.whitespace_pattern or "")
        if size > MAX_SPEC_CHARS:
            raise StructuredOutputError(
                f"the {self.label} is {size} characters long; at most {MAX_SPEC_CHARS} are accepted"
            )

    @property
    def label(self) -> str:
        """How error messages name it."""
        return {
            "json_object": "JSON object format",
            "json_schema": "JSON schema",
            "regex": "regex",
            "choice": "choice list",
            "grammar": "grammar",
        }[self.kind]

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str, **options: Any) -> StructuredSpec:
        return cls("json_schema", _schema_text(schema, "json_schema"), **options)

    @classmethod
    def choice(cls, choices: list[str] | tuple[str, ...]) -> StructuredSpec:
        return cls("choice", _choices(choices, "choice"))


def parse_structured_outputs(body: Mapping[str, Any]) -> StructuredSpec | None:
    """The one constraint a request body sets (None: unconstrained). Raises StructuredOutputError."""
    found: list[tuple[str, Kind, Any]] = []  # (field as the client spelled it, kind, raw value)
    options: dict[str, Any] = {}

    response_format = body.get("response_format")
    if response_format is not None:
        found += _from_response_format(response_format)

    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, Mapping):
            raise StructuredOutputError('structured_outputs must be an object, e.g. {"json": {...schema...}}')
        unknown = sorted(set(so) - set(_SO_CONSTRAINTS) - _SO_OPTIONS - {"json_object", "structural_tag"})
        if unknown:
            known = sorted([*_SO_CONSTRAINTS, "json_object", *_SO_OPTIONS])
            raise StructuredOutputError(f"structured_outputs: unknown field(s) {unknown}; known: {known}")
        if so.get("structural_tag") is not None:
            raise StructuredOutputError("structured_outputs.structural_tag is not supported")
        for key, kind in _SO_CONSTRAINTS.items():
            if so.get(key) is not None:
                found.append((f"structured_outputs.{key}", kind, so[key]))  # type: ignore[arg-type]
        if so.get("json_object"):
            found.append(("structured_outputs.json_object", "json_object", None))
        options = {k: so[k] for k in _SO_OPTIONS if so.get(k) is not None}

    for key, kind in _GUIDED.items():
        if body.get(key) is not None:
            found.append((key, kind, body[key]))  # type: ignore[arg-type]
    if body.get("guided_whitespace_pattern") is not None:
        options.setdefault("whitespace_pattern", body["guided_whitespace_pattern"])

    if not found:
        return None
    if len(found) > 1:
        raise StructuredOutputError(
            f"set only one output constraint; this request sets {len(found)}: {', '.join(f for f, _, _ in found)}"
        )
    where, kind, value = found[0]
    return _build(where, kind, value, options)


def _from_response_format(rf: Any) -> list[tuple[str, Kind, Any]]:
    if not isinstance(rf, Mapping):
        raise StructuredOutputError('response_format must be an object such as {"type": "json_object"}')
    kind = rf.get("type", "text")
    if kind == "text":
        return []
    if kind == "json_object":
        return [("response_format", "json_object", None)]
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, Mapping) or js.get("schema") is None:
            raise StructuredOutputError(
                "response_format of type json_schema needs json_schema.schema: "
                '{"type": "json_schema", "json_schema": {"name": "...", "schema": {...}}}'
            )
        return [("response_format.json_schema.schema", "json_schema", js["schema"])]
    raise StructuredOutputError(
        f"response_format type {kind!r} is not supported; use 'text', 'json_object' or 'json_schema'"
    )


def _build(where: str, kind: Kind, value: Any, options: Mapping[str, Any]) -> StructuredSpec:
    pattern = options.get("whitespace_pattern")
    if pattern is not None and not isinstance(pattern, str):
        raise StructuredOutputError("whitespace_pattern must be a string (a regex)")
    json_options: dict[str, Any] = {
        "whitespace_pattern": pattern,
        "additional_properties": not bool(options.get("disable_additional_properties", False)),
    }
    if kind == "json_object":
        return StructuredSpec("json_object", "", **json_options)
    if kind == "json_schema":
        return StructuredSpec("json_schema", _schema_text(value, where), **json_options)
    if kind == "choice":
        return StructuredSpec("choice", _choices(value, where))
    if not isinstance(value, str) or not value.strip():
        raise StructuredOutputError(f"{where} must be a non-empty string")
    return StructuredSpec(kind, value)


def _schema_text(schema: Any, where: str) -> str:
    if isinstance(schema, str):
        if len(schema) > MAX_SPEC_CHARS:
            raise StructuredOutputError(f"{where}: the JSON schema is longer than {MAX_SPEC_CHARS} characters")
        depth = json_text_depth(schema)  # before json.loads, which recurses once per level
        if depth > MAX_JSON_DEPTH:
            raise _too_deep(where, str(depth))
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as e:
            raise StructuredOutputError(f"{where} is not valid JSON: {e}") from None
    if not isinstance(schema, Mapping):
        raise StructuredOutputError(f"{where} must be a JSON schema object, got {type(schema).__name__}")
    if object_depth(schema, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:  # before json.dumps, which recurses too
        raise _too_deep(where, f"more than {MAX_JSON_DEPTH}")
    try:
        text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        raise StructuredOutputError(f"{where} cannot be serialised as JSON: {e}") from None
    try:  # a schema sent as a string may escape a lone surrogate ("\\ud800") that no UTF-8 text holds
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise StructuredOutputError(f"{where} contains invalid Unicode (a lone surrogate); send valid UTF-8") from None
    return text


def _too_deep(where: str, depth: str) -> StructuredOutputError:
    return StructuredOutputError(
        f"{where}: the JSON schema is nested {depth} levels deep; at most {MAX_JSON_DEPTH} are accepted"
    )


def _choices(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not value:
        raise StructuredOutputError(f"{where} must be a non-empty list of strings")
    if len(value) > MAX_CHOICES:
        raise StructuredOutputError(f"{where} has {len(value)} entries; at most {MAX_CHOICES} are accepted")
    if not all(isinstance(c, str) and c for c in value):
        raise StructuredOutputError(f"{where} must contain only non-empty strings")
    return tuple(value)
