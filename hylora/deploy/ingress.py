"""The one HTTP endpoint of a Ray deployment: it relays each request to an engine replica and
relays the answer back, byte for byte.

- Generation requests carry their adapter (task routing applied, `affinity.py`) as the multiplexed
  model id, so Ray Serve sends them to a replica that holds it; base-model requests go anywhere.
- `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` run on one replica and, when they succeed,
  enter the catalog that every replica applies before its next request (`catalog.py`).
- A replica that dies fails its in-flight requests here: a request not yet answered gets 503
  (`replica_failed`); a stream gets a finish_reason `error` per open choice, an error event and
  `[DONE]`. New requests go to the other replicas while Ray Serve starts a replacement.
- `/health` answers for the endpoint (503 while draining or when no replica answers); `/metrics`
  is the ingress's counters plus every replica's metrics labelled `replica`.
- `drain` (SIGTERM in `hylora serve --replicas`): new requests get 503, running ones get the grace
  period, the rest end with finish_reason `abort` and a `shutting_down` error.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import generate_latest
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from hylora.deploy.affinity import RoutingTable, multiplexed_model_id
from hylora.deploy.catalog import AdapterCatalog, AdapterChange
from hylora.deploy.forwarding import REPLICA_HEADER, ForwardedRequest, ResponseHead
from hylora.deploy.logs import configure_logging
from hylora.deploy.metrics import IngressMetrics, ReplicaMetricsBoard
from hylora.deploy.stream_end import StreamTracker
from hylora.server.errors import APIError, error_response
from hylora.server.security import key_matches

log = logging.getLogger(__name__)
ADAPTER_ROUTES = {"/v1/load_lora_adapter": True, "/v1/unload_lora_adapter": False}  # route → is a load
HEALTH_TIMEOUT_S = 10.0
POLL_S = 0.5


@dataclass(frozen=True)
class IngressSettings:
    api_key: str | None = None
    public_metrics: bool = False
    max_body_bytes: int = 8 << 20
    shutdown_grace_s: float = 30.0


class _Ended(Exception):
    """The relay was ended from outside: the client left, or the ingress is shutting down."""

    def __init__(self, error: APIError, finish_reason: str):
        self.error, self.finish_reason = error, finish_reason


class HyloraIngress:
    def __init__(self, engine: DeploymentHandle, settings: IngressSettings):
        configure_logging()
        self.engine = engine
        self.settings = settings
        self.catalog = AdapterCatalog()
        self.metrics = IngressMetrics()
        self.board = ReplicaMetricsBoard()
        self._table: RoutingTable | None = None
        self._draining = False
        self._shutdown = asyncio.Event()  # set when the drain's grace period is over
        self._in_flight = 0

    def __serve_build_asgi_app__(self) -> Starlette:
        methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]
        return Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.render_metrics, methods=["GET"]),
                Route("/{path:path}", self.forward, methods=methods),
            ],
            exception_handlers={Exception: self._bug},
        )

    # --- called by replicas and by `hylora serve --replicas` --------------------------------
    def report_metrics(self, replica: str, text: str) -> None:
        self.board.report(replica, text)

    async def drain(self, grace_s: float | None = None) -> int:
        """Stop admitting requests, wait up to the grace period for running ones, end the rest.
        Returns how many were ended."""
        grace = self.settings.shutdown_grace_s if grace_s is None else grace_s
        self._draining = True
        deadline = time.monotonic() + grace
        while self._in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        ended = self._in_flight
        self._shutdown.set()
        while self._in_flight and time.monotonic() < deadline + 5:
            await asyncio.sleep(0.05)
        if ended:
            await asyncio.sleep(0.2)  # let the last events reach their clients
        return ended

    # --- routes ----------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        if self._draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        try:
            head, _ = await asyncio.wait_for(self._first(ForwardedRequest("GET", "/health"), ""), HEALTH_TIMEOUT_S)
        except Exception as e:
            return JSONResponse({"status": "no replica answered", "reason": repr(e)}, status_code=503)
        return Response(head.body, head.status, media_type="application/json")

    async def render_metrics(self, request: Request) -> Response:
        key = self.settings.api_key
        if key and not self.settings.public_metrics and not key_matches(request.headers.get("authorization"), key):
            return error_response(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                  "authentication_error", "invalid_api_key")  # fmt: skip
        self.metrics.replicas_reporting.set(len(self.board.live()))
        text = generate_latest(self.metrics.registry) + self.board.render()
        return Response(text, media_type="text/plain; version=0.0.4")

    async def forward(self, request: Request) -> Response:
        if self._draining:
            return error_response(503, "the server is shutting down", "server_error", "shutting_down")
        body = await self._body(request)
        path = request.url.path
        forwarded = ForwardedRequest(
            request.method,
            path,
            request.url.query.encode(),
            list(request.headers.raw),
            body,
            (request.client.host, request.client.port) if request.client else None,
            self.catalog.changes(),
        )
        if path in ADAPTER_ROUTES:
            return await self._adapter_change(forwarded, ADAPTER_ROUTES[path])
        try:
            table = await self._routing_table()
        except Exception as e:
            return _error(self._failure(e, "before_response"))
        model_id = multiplexed_model_id(table, path, body, request.headers.get("x-task"))
        return await self._relay(forwarded, model_id, request)

    # --- relaying --------------------------------------------------------------------------
    async def _relay(self, forwarded: ForwardedRequest, model_id: str, request: Request) -> Response:
        self._in_flight += 1
        self.metrics.in_flight.inc()
        handed_over = False
        try:
            response = self.engine.options(stream=True, multiplexed_model_id=model_id).handle.remote(forwarded)
            chunks = response.__aiter__()
            try:
                head = await self._next(chunks, request)
            except _Ended as e:
                response.cancel()
                return _error(e.error)
            except Exception as e:
                return _error(self._failure(e, "before_response"))
            replica = head.header(REPLICA_HEADER) or "unknown"
            self.metrics.responses.labels(replica=replica, code=str(head.status)).inc()
            if not head.more:
                return _response(head)
            handed_over = True
            relayed = _Relayed(head, on_close=lambda: self._closed(relayed, response))
            relayed.body_iterator = self._rest(head, chunks, relayed, forwarded)
            return relayed
        finally:
            if not handed_over:
                self._done()

    async def _rest(
        self, head: ResponseHead, chunks: AsyncIterator, relayed: _Relayed, forwarded: ForwardedRequest
    ) -> AsyncIterator[bytes]:
        """The body after the head; a stream whose replica fails (or that shutdown ends) is closed
        the way `hylora serve` closes a stream that ends early."""
        events = (head.header("content-type") or "").startswith("text/event-stream")
        tracker = StreamTracker(StreamTracker.requested_choices(forwarded.body), forwarded.path)
        if events:
            tracker.observe(head.body)
        yield head.body
        while True:
            try:
                chunk = await self._next(chunks, None)
            except StopAsyncIteration:
                relayed.finished = True
                return
            except _Ended as e:
                if events:
                    yield tracker.ending(e.error, e.finish_reason)
                return
            except Exception as e:
                error = self._failure(e, "mid_stream")
                if events:
                    yield tracker.ending(error, "error")
                return
            if events:
                tracker.observe(chunk)
            yield chunk

    def _closed(self, relayed: _Relayed, response: Any) -> None:
        """A relayed stream's response is over, however it ended."""
        if not relayed.finished:  # the client left, or the relay was ended: abort the replica's request
            response.cancel()
        self._done()

    async def _next(self, chunks: AsyncIterator, request: Request | None) -> Any:
        """The next piece from the replica, unless shutdown ends the relay or the client leaves."""
        task = asyncio.ensure_future(chunks.__anext__())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=POLL_S)
                if done:
                    return task.result()
                if self._shutdown.is_set():
                    message = "the server is shutting down; the request did not finish within the grace period"
                    raise _Ended(APIError(503, message, "server_error", "shutting_down"), "abort")
                if request is not None and await request.is_disconnected():
                    raise _Ended(APIError(499, "client disconnected"), "abort")
        finally:
            if not task.done():
                task.cancel()

    async def _first(self, forwarded: ForwardedRequest, model_id: str) -> tuple[ResponseHead, bytes]:
        """Head and whole body of a short request (health, adapter changes)."""
        response = self.engine.options(stream=True, multiplexed_model_id=model_id).handle.remote(forwarded)
        head: ResponseHead | None = None
        rest = []
        async for item in response:
            if isinstance(item, ResponseHead):
                head = item
            else:
                rest.append(item)
        if head is None:
            raise RuntimeError("the replica sent no response")
        return head, head.body + b"".join(rest)

    def _failure(self, error: BaseException, stage: str) -> APIError:
        if isinstance(error, (ActorDiedError, ActorUnavailableError, RayActorError)):
            self.metrics.replica_failures.labels(stage=stage).inc()
            log.warning("a replica failed with a request in flight (%s): %s", stage, error)
            return APIError(
                503, "the engine replica serving this request stopped; retry the request", "server_error",
                "replica_failed",
            )  # fmt: skip
        log.error("relaying a request failed (%s): %r", stage, error)
        return APIError(500, f"internal server error: {error!r}", "server_error", "internal_error")

    async def _bug(self, request: Request, error: Exception) -> Response:
        log.exception("unhandled error in %s %s", request.method, request.url.path, exc_info=error)
        return _error(APIError(500, f"internal server error: {error!r}", "server_error", "internal_error"))

    def _done(self) -> None:
        self._in_flight -= 1
        self.metrics.in_flight.dec()

    # --- adapters and routing --------------------------------------------------------------
    async def _adapter_change(self, forwarded: ForwardedRequest, load: bool) -> Response:
        change = _proposed_change(self.catalog, forwarded.body, load)
        if change is not None:
            forwarded = dataclasses.replace(forwarded, change=change)
        try:
            head, body = await self._first(forwarded, "")
        except Exception as e:
            return _error(self._failure(e, "before_response"))
        if head.status == 200 and change is not None:
            self.catalog.commit(change)
            if self._table is not None and load:
                self._table.adapters.add(change.name)
            elif self._table is not None:
                self._table.adapters.discard(change.name)
            log.info("adapter %s %s on every replica", change.name, "loaded" if load else "unloaded")
        return _response(ResponseHead(head.status, head.headers, body, False))

    async def _routing_table(self) -> RoutingTable:
        if self._table is None:
            self._table = await self.engine.routing_table.remote(self.catalog.changes())
        return self._table

    async def _body(self, request: Request) -> bytes:
        """The body, read up to one byte past --max-body-bytes: the replica's own limit answers 413."""
        limit, chunks, size = self.settings.max_body_bytes, [], 0
        async for chunk in request.stream():
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                break
        return b"".join(chunks)


def _proposed_change(catalog: AdapterCatalog, body: bytes, load: bool) -> AdapterChange | None:
    try:
        payload = json.loads(body)
        name, path = payload["lora_name"], payload.get("lora_path") if load else None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None  # the replica answers the malformed request
    if not isinstance(name, str) or (load and not isinstance(path, str)):
        return None
    return catalog.propose(name, path)


def _error(error: APIError) -> Response:
    return error_response(error.status, error.message, error.kind, error.code)


def _response(head: ResponseHead) -> Response:
    response = Response(head.body, head.status)
    response.raw_headers = list(head.headers)
    return response


class _Relayed(StreamingResponse):
    """A relayed stream with the replica's status and headers; `on_close` runs once it is over,
    whether the body was read to the end, cut, or never started (the client left first)."""

    def __init__(self, head: ResponseHead, on_close: Callable[[], None]):
        super().__init__(iter(()), head.status)
        self.raw_headers = [(k, v) for k, v in head.headers if k.lower() != b"content-length"]
        self.on_close = on_close
        self.finished = False  # the replica sent the whole body

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[override]
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def ingress_class() -> type:
    """The ingress as a Ray Serve ASGI class (its app is built per replica by
    `__serve_build_asgi_app__`)."""
    return serve.ingress()(HyloraIngress)
