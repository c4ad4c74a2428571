"""API key, request-body limit and the rules for loading adapters from disk at run time."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hylora.adapters.files import CONFIG_FILE


class Forbidden(PermissionError):
    pass


def key_matches(header: str | None, api_key: str) -> bool:
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer ") :].strip().encode(), api_key.encode())


class RequireKey:
    """ASGI middleware: with an API key set, every path but `open_paths` needs `Authorization: Bearer
    <key>`, else `refuse()` (a 401 response) answers. Plain ASGI, not Starlette's BaseHTTPMiddleware:
    that one hands the app a `receive` which never reports `http.disconnect`, so a non-streaming
    request whose client hung up would run to its end (Request.is_disconnected() stays False)."""

    def __init__(self, app: Any, api_key: str | None, open_paths: set[str], refuse: Callable[[], Any]):
        self.app, self.api_key, self.open_paths, self.refuse = app, api_key, open_paths, refuse

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and self.api_key and scope.get("path") not in self.open_paths:
            headers = dict(scope.get("headers") or [])
            header = headers.get(b"authorization", b"").decode("latin-1") or None
            if not key_matches(header, self.api_key):
                return await self.refuse()(scope, receive, send)
        return await self.app(scope, receive, send)


def adapter_dir_under(root: Path | None, requested: str) -> Path:
    """Resolve `requested` (relative to `root`, or absolute) and make sure it stays inside `root`
    after following every symlink and is an adapter directory (it holds adapter_config.json).
    Runtime loading is off without a root."""
    if root is None:
        raise Forbidden("runtime adapter loading is off; start the server with --adapter-root DIR to allow it")
    if not requested:
        raise ValueError("lora_path is empty; give the adapter's directory under the adapter root")
    root = root.resolve()
    candidate = Path(requested)
    if not candidate.is_absolute():
        candidate = root / candidate
    resolved = candidate.resolve()
    if not resolved.is_relative_to(root):
        raise Forbidden(f"adapter path {requested!r} is outside the adapter root")
    if not resolved.is_dir():
        raise FileNotFoundError(f"adapter path {requested!r} is not a directory under the adapter root")
    files = list(resolved.iterdir())
    if CONFIG_FILE not in {f.name for f in files}:
        raise ValueError(f"{requested!r} is not an adapter directory: it has no {CONFIG_FILE}")
    for f in files:  # weights reached through a link must stay under the root too
        if f.is_symlink() and not f.resolve().is_relative_to(root):
            raise Forbidden(f"adapter file {f.name!r} links outside the adapter root")
    return resolved
