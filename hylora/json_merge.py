"""One JSON object merged over another (vLLM's --hf-overrides over config.json, its dotted flags over a flag's
object). No imports: the CLI uses it before anything heavy loads."""

from __future__ import annotations

from typing import Any


def merge_json(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over`'s keys over `base`'s: objects in both are merged the same way, any other value replaced."""
    merged = dict(base)
    for key, value in over.items():
        both = isinstance(value, dict) and isinstance(merged.get(key), dict)
        merged[key] = merge_json(merged[key], value) if both else value
    return merged
