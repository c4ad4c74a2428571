"""Non-streaming response bodies serialised a piece at a time: one json.dumps of a 100 MB response
(prompt logprobs) holds the GIL, and so the event loop, for seconds; pieces of a few milliseconds,
run off the loop, let it serve everyone else in between."""

from __future__ import annotations

import functools
import json
from typing import Any

from fastapi.responses import Response


def json_response(content: dict[str, Any]) -> Response:
    """The bytes JSONResponse(content) sends, serialised a piece at a time (run it off the event loop)."""
    pieces: list[bytes] = []
    _render(content, pieces)
    return Response(b"".join(pieces), media_type="application/json")


_dumps = functools.partial(json.dumps, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
_PIECE = 20_000  # JSON values per json.dumps call: a few milliseconds


def _render(value: Any, out: list[bytes]) -> None:
    """`value` as JSON, appended to `out` in pieces of about _PIECE values."""
    size = _size(value)
    if size <= _PIECE:
        out.append(_dumps(value).encode("utf-8"))
    elif isinstance(value, dict):
        for i, (k, v) in enumerate(value.items()):
            key = k if isinstance(k, str) else _dumps(k)  # as json.dumps writes keys that are not strings
            out.append(f"{',' if i else '{'}{_dumps(key)}:".encode())
            _render(v, out)
        out.append(b"}")
    else:
        step = len(value) * _PIECE // size  # elements per piece
        for i in range(0, len(value), max(step, 1)):
            out.append(b"," if i else b"[")
            if step <= 1:
                _render(value[i], out)
            else:
                out.append(_dumps(value[i : i + step])[1:-1].encode("utf-8"))
        out.append(b"]")


# Python's str.splitlines, and so httpx's iter_lines and the clients built on it, also end a line at U+0085,
# U+2028 and U+2029 (the SSE spec ends lines at CR and LF only): escaped, a text holding one cannot cut an event's line
_LINE_BREAKS = ("\x85", "\u2028", "\u2029")


def event_json(payload: dict[str, Any]) -> str:
    """`payload` as one line of JSON for a server-sent event's data."""
    text = json.dumps(payload, ensure_ascii=False)
    for char in _LINE_BREAKS:
        if char in text:
            text = text.replace(char, f"\\u{ord(char):04x}")
    return text


def _size(value: Any) -> int:
    """About how many JSON values `value` holds; a list is judged by its first and last elements
    (a response's lists are alike but for a leading None, e.g. the first prompt token's logprobs)."""
    if isinstance(value, dict):
        return 1 + sum(map(_size, value.values()))
    if isinstance(value, (list, tuple)) and value:
        return 1 + len(value) * max(_size(value[0]), _size(value[-1]))
    return 1
