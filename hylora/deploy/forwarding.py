"""An HTTP request carried from the ingress to an engine replica, and the replica's side: run it
through the replica's own hylora FastAPI app (the one `hylora serve` runs) and stream the response
back in pieces. Every route, check, error body and stream format is that app's; nothing here knows
the OpenAI API."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from hylora.deploy.catalog import AdapterChange

ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]
REPLICA_HEADER = "x-hylora-replica"


@dataclass(frozen=True)
class ForwardedRequest:
    method: str
    path: str
    query: bytes = b""
    headers: Headers = field(default_factory=list)
    body: bytes = b""
    client: tuple[str, int] | None = None
    catalog: tuple[AdapterChange, ...] = ()  # adapter loads / unloads the replica applies first
    change: AdapterChange | None = None  # this request is that load / unload

    @classmethod
    def json(cls, path: str, payload: dict[str, Any], api_key: str | None = None) -> ForwardedRequest:
        headers = [(b"content-type", b"application/json")]
        if api_key:
            headers.append((b"authorization", f"Bearer {api_key}".encode()))
        return cls("POST", path, headers=headers, body=json.dumps(payload).encode())


@dataclass(frozen=True)
class ResponseHead:
    """The status and headers, with the first piece of the body (one message for a JSON answer)."""

    status: int
    headers: Headers
    body: bytes
    more: bool  # more pieces follow (a stream)

    def header(self, name: str) -> str | None:
        key = name.lower().encode()
        return next((v.decode("latin-1") for k, v in self.headers if k.lower() == key), None)


async def relay(
    app: ASGIApp, request: ForwardedRequest, extra_headers: Headers = ()
) -> AsyncIterator[ResponseHead | bytes]:
    """Run `request` through `app`; yield its ResponseHead, then each further body piece. Leaving
    the iterator early (the ingress cancelled: its client went away) disconnects the request, which
    aborts its engine requests as a client disconnect does in `hylora serve`."""
    messages: asyncio.Queue[dict | None] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_given = False

    async def receive() -> dict:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await messages.put(message)

    async def run() -> None:
        try:
            await app(_scope(request), receive, send)
        finally:
            await messages.put(None)

    task = asyncio.create_task(run())
    start: dict | None = None
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                start = message
                continue
            if message["type"] != "http.response.body":
                continue
            body, more = message.get("body", b""), message.get("more_body", False)
            if start is not None:
                headers = list(start.get("headers", [])) + list(extra_headers)
                yield ResponseHead(start["status"], headers, body, more)
                start = None
            elif body or not more:
                yield body
            if not more:
                break
        await task  # the app's own error, if it failed before answering
    finally:
        disconnected.set()
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def call(app: ASGIApp, request: ForwardedRequest) -> tuple[int, bytes]:
    """Status and whole body of a request to `app` (for internal calls: replays, metrics)."""
    status, chunks = 500, []
    async for item in relay(app, request):
        if isinstance(item, ResponseHead):
            status = item.status
            chunks.append(item.body)
        else:
            chunks.append(item)
    return status, b"".join(chunks)


def _scope(request: ForwardedRequest) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode(),
        "root_path": "",
        "query_string": request.query,
        "headers": list(request.headers),
        "client": request.client,
        "server": ("hylora-replica", 0),
        "state": {},
    }
