"""The bytes behind an `image_url` / `video_url`, the way vLLM users send them.

`data:<mime>;base64,...` always; `file://` only under an allowed local root (symlinks resolved); `http(s)://`
only to allowed hosts (every redirect hop checked), with a timeout. The byte cap applies to all of them.
"""

from __future__ import annotations

import base64
import binascii
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit

from hylora.media.errors import MediaError

if TYPE_CHECKING:
    import httpx


@dataclass(frozen=True)
class FetchPolicy:
    allowed_local_root: Path | None = None  # vLLM's --allowed-local-media-path
    allowed_domains: frozenset[str] = frozenset()  # exact host names, vLLM's --allowed-media-domains
    timeout_s: float = 10.0
    max_redirects: int = 3


def fetch_bytes(url: str, policy: FetchPolicy, max_bytes: int, client: httpx.Client | None = None) -> bytes:
    """The bytes at `url`, or a MediaError that says why the server will not fetch them."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _data_url(url, max_bytes)
    if scheme == "file":
        return _local_file(url, policy, max_bytes)
    if scheme in ("http", "https"):
        return _http(url, policy, max_bytes, client)
    raise MediaError(f"unsupported media URL scheme {scheme or url[:16]!r}: use data:, http(s):// or file://")


def _data_url(url: str, max_bytes: int) -> bytes:
    header, sep, payload = url[len("data:") :].partition(",")
    if not sep or not header.lower().endswith(";base64"):
        raise MediaError("a data URL must look like data:<mime>;base64,<base64 bytes>")
    payload = "".join(payload.split())
    if len(payload) // 4 * 3 > max_bytes + 2:
        raise MediaError(f"the data URL holds more than {max_bytes} bytes, the most the server accepts")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise MediaError(f"the data URL is not valid base64 ({e})") from e
    return _capped(data, max_bytes)


def _local_file(url: str, policy: FetchPolicy, max_bytes: int) -> bytes:
    if policy.allowed_local_root is None:
        raise MediaError("file:// URLs are disabled on this server (no allowed local media path)")
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError(f"file:// URL with host {parts.netloc!r}: only local files are allowed")
    root = Path(policy.allowed_local_root).resolve()
    try:
        path = Path(unquote(parts.path)).resolve(strict=True)
    except (OSError, RuntimeError) as e:
        raise MediaError(f"no such local file: {unquote(parts.path)}") from e
    if not path.is_relative_to(root):
        raise MediaError(f"{unquote(parts.path)} is outside the allowed local media path {root}")
    if not path.is_file():
        raise MediaError(f"{unquote(parts.path)} is not a regular file")
    if (size := path.stat().st_size) > max_bytes:
        raise MediaError(f"{unquote(parts.path)} is {size} bytes; the server accepts at most {max_bytes}")
    return _capped(path.read_bytes(), max_bytes)


def _http(url: str, policy: FetchPolicy, max_bytes: int, client: httpx.Client | None) -> bytes:
    import httpx  # only http(s) media needs it

    own = client is None
    client = client or httpx.Client()
    deadline = time.monotonic() + policy.timeout_s  # httpx's timeout is per read; this one is for the whole body
    try:
        for _ in range(policy.max_redirects + 1):
            _check_host(url, policy)
            with client.stream("GET", url, timeout=policy.timeout_s, follow_redirects=False) as response:
                if response.is_redirect:
                    url = str(response.url.join(response.headers.get("location", "")))
                    continue
                if response.status_code != 200:
                    raise MediaError(f"fetching {url} failed: HTTP {response.status_code}")
                declared = response.headers.get("content-length")
                if declared and declared.isdigit() and int(declared) > max_bytes:
                    raise MediaError(f"{url} is {declared} bytes; the server accepts at most {max_bytes}")
                body = bytearray()
                for chunk in response.iter_bytes():
                    body += chunk
                    if len(body) > max_bytes:
                        raise MediaError(f"{url} is larger than {max_bytes} bytes, the most the server accepts")
                    if time.monotonic() > deadline:
                        raise httpx.ReadTimeout("deadline", request=response.request)
                return bytes(body)
        raise MediaError(f"{url}: more than {policy.max_redirects} redirects")
    except httpx.TimeoutException as e:
        raise MediaError(f"fetching {url} timed out after {policy.timeout_s} s") from e
    except httpx.HTTPError as e:
        raise MediaError(f"fetching {url} failed: {e}") from e
    finally:
        if own:
            client.close()


def _check_host(url: str, policy: FetchPolicy) -> None:
    import httpx  # parse the host exactly as the request will

    try:
        host = (httpx.URL(url).host or "").lower()
    except httpx.InvalidURL as e:
        raise MediaError(f"invalid media URL {url[:200]!r}: {e}") from e
    if host not in {d.lower() for d in policy.allowed_domains}:
        allowed = ", ".join(sorted(policy.allowed_domains)) or "none"
        raise MediaError(f"media host {host!r} is not allowed on this server (allowed: {allowed})")


def _capped(data: bytes, max_bytes: int) -> bytes:
    if len(data) > max_bytes:
        raise MediaError(f"the media is {len(data)} bytes; the server accepts at most {max_bytes}")
    return data
