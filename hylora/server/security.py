"""API key, request-body limit and the rules for loading adapters from disk at run time."""

from __future__ import annotations

import hmac
from pathlib import Path


class Forbidden(PermissionError):
    pass


def key_matches(header: str | None, api_key: str) -> bool:
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer ") :].strip().encode(), api_key.encode())


def adapter_dir_under(root: Path | None, requested: str) -> Path:
    """Resolve `requested` (relative to `root`, or absolute) and make sure it stays inside `root`
    after following every symlink. Runtime loading is off without a root."""
    if root is None:
        raise Forbidden("runtime adapter loading is off; start the server with --adapter-root DIR to allow it")
    root = root.resolve()
    candidate = Path(requested)
    if not candidate.is_absolute():
        candidate = root / candidate
    resolved = candidate.resolve()
    if not resolved.is_relative_to(root):
        raise Forbidden(f"adapter path {requested!r} is outside the adapter root")
    if not resolved.is_dir():
        raise FileNotFoundError(f"adapter path {requested!r} is not a directory under the adapter root")
    for f in resolved.iterdir():  # weights reached through a link must stay under the root too
        if f.is_symlink() and not f.resolve().is_relative_to(root):
            raise Forbidden(f"adapter file {f.name!r} links outside the adapter root")
    return resolved
