"""Ending an event stream whose replica is gone.

A stream relayed from a replica that dies (or that the ingress ends at shutdown) cannot be finished
by the replica's app, so the ingress finishes it the way `hylora serve` finishes a stream that ends
early: every choice that has not ended gets a chunk with a finish_reason (`error`, or `abort` at
shutdown), then an OpenAI error event, then `[DONE]` — never a bare `[DONE]` or a cut connection.
"""

from __future__ import annotations

import json
from typing import Any

from hylora.server.errors import APIError

CHAT_CHUNK = "chat.completion.chunk"


class StreamTracker:
    """Watches a relayed stream's events: the chunk identity and which choices have ended."""

    def __init__(self, choices: int):
        self.choices = max(1, choices)
        self.base: dict[str, Any] | None = None
        self.ended: set[int] = set()
        self.done = False

    @staticmethod
    def requested_choices(body: bytes) -> int:
        try:
            n = json.loads(body).get("n", 1)
        except (ValueError, AttributeError, UnicodeDecodeError):
            return 1
        return n if isinstance(n, int) and 0 < n <= 128 else 1

    def observe(self, chunk: bytes) -> None:
        for event in chunk.split(b"\n\n"):
            data = event.strip()
            if not data.startswith(b"data:"):
                continue
            data = data[len(b"data:") :].strip()
            if data == b"[DONE]":
                self.done = True
                continue
            try:
                payload = json.loads(data)
            except ValueError:
                continue
            if not isinstance(payload, dict) or "choices" not in payload:
                continue
            if self.base is None:
                self.base = {k: payload[k] for k in ("id", "object", "created", "model") if k in payload}
            for choice in payload["choices"]:
                if isinstance(choice, dict) and choice.get("finish_reason") is not None:
                    self.ended.add(choice.get("index", 0))

    def ending(self, error: APIError, finish_reason: str) -> bytes:
        """The events that close the stream: a finish_reason for every open choice, the error, [DONE]."""
        if self.done:
            return b""
        base = self.base or {"object": CHAT_CHUNK}
        events = []
        for i in range(self.choices):
            if i in self.ended:
                continue
            if base.get("object") == CHAT_CHUNK:
                choice = {"index": i, "delta": {}, "logprobs": None, "finish_reason": finish_reason}
            else:
                choice = {"index": i, "text": "", "logprobs": None, "finish_reason": finish_reason}
            events.append(base | {"choices": [choice]})
        events.append(error.body())
        text = "".join(f"data: {json.dumps(e, ensure_ascii=False)}\n\n" for e in events) + "data: [DONE]\n\n"
        return text.encode()
