"""Server-sent events with a bounded cost per client: a client that stops reading is cut.

A stream's text is produced by the engine whether or not the client reads it. Outputs are deltas and
a reader that fell behind gets them merged (AsyncEngine), so memory per stream is bounded by the
request's own length; and once the socket stops draining for `stall_timeout` seconds the request is
aborted and the connection dropped, so an idle reader does not hold a sequence slot for ever.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from starlette.responses import StreamingResponse
from starlette.types import Send

from hylora.server.metrics import ServerMetrics

log = logging.getLogger(__name__)


class SlowReader(Exception):
    pass


class EventStream(StreamingResponse):
    def __init__(self, events: AsyncIterator[str], stall_timeout: float, metrics: ServerMetrics):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.events, self.stall_timeout, self.metrics = events, stall_timeout, metrics

    async def stream_response(self, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for event in self.events:
                message = {"type": "http.response.body", "body": event.encode("utf-8"), "more_body": True}
                try:
                    await asyncio.wait_for(send(message), self.stall_timeout)
                except TimeoutError:
                    self.metrics.slow_readers.inc()
                    log.warning("a client read nothing for %g s; its stream is cut", self.stall_timeout)
                    raise SlowReader from None
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except SlowReader:
            pass  # the app returns without completing the response: the server closes the connection
        finally:
            await self.events.aclose()  # type: ignore[attr-defined]  # aborts the requests still running
