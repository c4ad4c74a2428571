"""Ending an event stream whose replica is gone.

A stream relayed from a replica that dies (or that the ingress ends at shutdown) cannot be finished
by the replica's app, so the ingress finishes it the way `hylora serve` finishes a stream that ends
early: every choice that has not ended gets a chunk with a finish_reason (`error`, or `abort` at
shutdown), then an OpenAI error event, then `[DONE]` — never a bare `[DONE]` or a cut connection.
A Responses stream (`/v1/responses`, typed events) ends as `hylora serve` ends one that fails: a
`response.failed` event with the Response so far (its finished output items) and the error.
"""

from __future__ import annotations

import json
from typing import Any

from hylora.server.errors import APIError
from hylora.server.json_body import event_json

CHAT_CHUNK = "chat.completion.chunk"
RESPONSES_ROUTE = "/v1/responses"
RESPONSE_ENDS = ("response.completed", "response.incomplete", "response.failed")


class StreamTracker:
    """Watches a relayed stream's events: the chunk identity and which choices have ended (a chat or
    completion stream), or the Response, its finished output items and the last sequence number (a
    Responses stream)."""

    def __init__(self, choices: int, path: str = ""):
        self.choices = max(1, choices)
        self.base: dict[str, Any] | None = None
        self.ended: set[int] = set()
        self.done = False
        self.responses = path.rstrip("/") == RESPONSES_ROUTE
        self.response: dict[str, Any] | None = None  # as response.created gave it
        self.output: list[Any] = []
        self.sequence = -1

    @staticmethod
    def requested_choices(body: bytes) -> int:
        try:
            n = json.loads(body).get("n", 1)
        except (ValueError, AttributeError, UnicodeDecodeError):
            return 1
        return n if isinstance(n, int) and 0 < n <= 128 else 1

    def observe(self, chunk: bytes) -> None:
        for event in chunk.split(b"\n\n"):
            lines = [line for line in event.strip().split(b"\n") if line.startswith(b"data:")]
            if not lines:
                continue
            data = lines[0][len(b"data:") :].strip()
            if self.responses:
                self._observe_response_event(data)
                continue
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

    def _observe_response_event(self, data: bytes) -> None:
        try:
            payload = json.loads(data)
        except ValueError:
            return
        if not isinstance(payload, dict):
            return
        if isinstance(payload.get("sequence_number"), int):
            self.sequence = payload["sequence_number"]
        kind = payload.get("type")
        if kind == "response.created" and isinstance(payload.get("response"), dict):
            self.response = payload["response"]
        elif kind == "response.output_item.done":
            self.output.append(payload.get("item"))
        elif kind in RESPONSE_ENDS:
            self.done = True

    def ending(self, error: APIError, finish_reason: str) -> bytes:
        """The events that close the stream: a finish_reason for every open choice, the error, [DONE];
        for a Responses stream, response.failed."""
        if self.done:
            return b""
        if self.responses:
            return self._response_failed(error)
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
        text = "".join(f"data: {event_json(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return text.encode()

    def _response_failed(self, error: APIError) -> bytes:
        response = self.response or {"id": "resp_unknown", "object": "response", "model": None, "usage": None}
        failed = response | {
            "status": "failed",
            "output": self.output,
            "error": {"code": error.code or "server_error", "message": error.message},
        }
        event = {"type": "response.failed", "sequence_number": self.sequence + 1, "response": failed}
        return f"event: response.failed\ndata: {event_json(event)}\n\n".encode()
