"""OpenAI-style errors, the exception handlers that produce them, and the request-body limit."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hylora.engine.request import FailureKind
from hylora.server.metrics import ServerMetrics
from hylora.server.protocol import Unsupported

log = logging.getLogger(__name__)

# why a request failed in the engine → (HTTP status, OpenAI error type)
FAILURE_STATUS: dict[FailureKind, tuple[int, str]] = {
    FailureKind.INVALID_REQUEST: (400, "invalid_request_error"),
    FailureKind.ADAPTER_NOT_FOUND: (404, "invalid_request_error"),
    FailureKind.ADAPTER_BROKEN: (409, "invalid_request_error"),
    FailureKind.NUMERICAL_FAULT: (500, "server_error"),
    FailureKind.INTERNAL: (500, "server_error"),
    FailureKind.SHUTTING_DOWN: (503, "server_error"),
    FailureKind.DEVICE_FAULT: (503, "server_error"),
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ):
        """`param`: the request field at fault, as OpenAI's error bodies name it."""
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param

    @classmethod
    def from_failure(cls, failure: FailureKind | None, message: str | None) -> APIError:
        failure = failure or FailureKind.INTERNAL
        status, kind = FAILURE_STATUS[failure]
        return cls(status, message or "the request failed", kind, failure.value)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def error_response(
    status: int, message: str, kind: str = "invalid_request_error", code: str | None = None, param: str | None = None
) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def install_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        metrics.rejected.labels(code=str(e.status)).inc()
        return error_response(e.status, e.message, e.kind, e.code, e.param)

    @app.exception_handler(Unsupported)
    async def unsupported(request: Request, e: Unsupported) -> JSONResponse:
        metrics.rejected.labels(code="400").inc()
        return error_response(400, str(e), param=e.param)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        metrics.rejected.labels(code="400").inc()
        problems, fields = [], []
        for err in e.errors():
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            problems.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
            fields.append(where)
        return error_response(400, "invalid request: " + "; ".join(problems), param=fields[0] if fields else None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        if isinstance(e.__cause__, BodyTooLarge):  # a streamed body past the limit, met while FastAPI read it
            metrics.rejected.labels(code="413").inc()
            return error_response(413, str(e.__cause__))
        if e.status_code == 400 and e.detail == BODY_PARSE_ERROR and e.__cause__ is not None:
            return error_response(400, _unparsable_body(e.__cause__))
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def bug(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error in %s %s", request.method, request.url.path, exc_info=e)
        metrics.rejected.labels(code="500").inc()
        return error_response(500, f"internal server error: {e!r}", "server_error", "internal_error")


BODY_PARSE_ERROR = "There was an error parsing the body"  # FastAPI's detail when json.loads raised


def _unparsable_body(cause: BaseException) -> str:
    """What to fix in a body Python's JSON parser refused for a reason other than its syntax."""
    if isinstance(cause, RecursionError):
        return "the request body nests arrays or objects too deeply to parse: flatten it"
    if isinstance(cause, ValueError) and "digits" in str(cause):
        return "the request body holds an integer with more than 4300 digits: send a smaller number"
    return f"the request body could not be parsed as JSON: {cause}"


class BodyLimit:
    """ASGI middleware: refuse request bodies above `limit` bytes with 413 (Content-Length or streamed)."""

    def __init__(self, app, limit: int, metrics: ServerMetrics):
        self.app, self.limit, self.metrics = app, limit, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        try:
            await self.app(scope, limited_receive, send)
        except BodyTooLarge:  # read outside FastAPI's body parsing (which wraps it: see install_error_handlers)
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope, receive, send):
        self.metrics.rejected.labels(code="413").inc()
        response = error_response(413, str(BodyTooLarge(self.limit)))
        await response(scope, receive, send)


class BodyTooLarge(Exception):
    """A request body past BodyLimit's limit (raised while it is received)."""

    def __init__(self, limit: int):
        super().__init__(f"request body larger than {limit} bytes")
