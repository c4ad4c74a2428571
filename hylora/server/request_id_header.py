"""vLLM's --enable-request-id-headers: every response carries `X-Request-Id`, the client's own where it
sent one, else a fresh id (so a client can quote it in a bug report and the server's logs can be searched)."""

from __future__ import annotations

import uuid

HEADER = b"x-request-id"


class RequestIdHeader:
    """ASGI middleware: `X-Request-Id` on every HTTP response (streamed ones too: it goes with the headers)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope["headers"] if k.lower() == HEADER), b"")
        request_id = given[:256] if given.strip() else uuid.uuid4().hex.encode()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER]
                message = message | {"headers": [*headers, (HEADER, request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
