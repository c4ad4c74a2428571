"""The bytes behind an `image_url` / `video_url`, the way vLLM users send them.

`data:<mime>;base64,...` always; `file://` only under an allowed local root (symlinks resolved; a path outside
it gets the same answer as a missing one, and the root is never named); `http(s)://` only to allowed hosts,
every redirect hop checked. The byte cap applies to all of them, for http(s) to the raw and to the decoded
body alike (encoding.py).

http(s) runs on the event loop with httpx.AsyncClient, under one deadline for the whole fetch (connect,
headers, body, every redirect): no thread waits on the network. Host names are resolved on the media fetch
pool, not the loop's default executor; data: and file:// are read there too (pools.py).
"""

from __future__ import annotations

import asyncio
import binascii
import functools
import ipaddress
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

import pybase64

from hylora.media.encoding import BodyDecoder
from hylora.media.errors import MediaError
from hylora.media.pools import MediaPools, shared_pools

if TYPE_CHECKING:
    import ssl
    from concurrent.futures import Executor

    import httpx

REDIRECTS = (301, 302, 303, 307, 308)
ACCEPT_ENCODING = "gzip, deflate"  # what encoding.py decodes


FRAME_LIST = "data:video/jpeg;base64,"  # vLLM's spelling of a video sent as its (already sampled) frames


@dataclass(frozen=True)
class FetchPolicy:
    allowed_local_root: Path | None = None  # vLLM's --allowed-local-media-path
    allowed_domains: frozenset[str] = frozenset()  # exact host names, vLLM's --allowed-media-domains
    timeout_s: float = 10.0  # one http(s) fetch, all of it: connect, headers, body, redirects
    max_redirects: int = 3


async def fetch_url(
    url: str,
    policy: FetchPolicy,
    max_bytes: int,
    *,
    client: httpx.AsyncClient | None = None,
    pools: MediaPools | None = None,
) -> bytes:
    """The bytes at `url`, or a MediaError that says why the server will not fetch them. `client` is reused
    for http(s) when given (`http_client`); otherwise one is opened for this fetch."""
    pools = pools or shared_pools()
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return await pools.run(pools.fetch, _data_url, url, max_bytes)
    if scheme == "file":
        return await pools.run(pools.fetch, _local_file, url, policy, max_bytes)
    if scheme in ("http", "https"):
        _check_url(url, policy)  # before waiting for a slot
        async with pools.http_slots():
            if client is not None:
                return await _http(client, url, policy, max_bytes)
            async with await http_client(pools) as own:
                return await _http(own, url, policy, max_bytes)
    raise MediaError(f"unsupported media URL scheme {scheme or url[:16]!r}: use data:, http(s):// or file://")


def fetch_bytes(url: str, policy: FetchPolicy, max_bytes: int, client: httpx.AsyncClient | None = None) -> bytes:
    """`fetch_url` for synchronous callers (scripts, tests): runs its own event loop."""
    return asyncio.run(fetch_url(url, policy, max_bytes, client=client))


async def http_client(pools: MediaPools | None = None) -> httpx.AsyncClient:
    """An AsyncClient whose host name lookups run on the media fetch pool (close it when done)."""
    import httpcore
    import httpx

    pools = pools or shared_pools()
    ctx = await pools.run(pools.fetch, _ssl_context)
    transport = httpx.AsyncHTTPTransport(verify=ctx)
    # httpx has no argument for the network backend: the pool it would build, with ours
    transport._pool = httpcore.AsyncConnectionPool(ssl_context=ctx, network_backend=_PoolResolver(pools.fetch))
    return httpx.AsyncClient(transport=transport, follow_redirects=False)


# --- data: and file:// (on the fetch pool) -----------------------------------------------------------------


def _data_url(url: str, max_bytes: int) -> bytes:
    header, sep, payload = url[len("data:") :].partition(",")
    if not sep or not header.lower().endswith(";base64"):
        raise MediaError("a data URL must look like data:<mime>;base64,<base64 bytes>")
    if len(payload) // 4 * 3 > max_bytes + 2:
        payload = "".join(payload.split())  # line breaks do not count
        if len(payload) // 4 * 3 > max_bytes + 2:
            raise MediaError(f"the data URL holds more than {max_bytes} bytes, the most the server accepts")
    try:
        data = _b64decode(payload)
    except (binascii.Error, ValueError) as e:
        raise MediaError(f"the data URL is not valid base64 ({e})") from e
    return _capped(data, max_bytes)


def _b64decode(text: str) -> bytes:
    """Strict base64 that allows whitespace (line breaks) between its characters, by pybase64 (SIMD, the GIL
    released): a 5.2 MB frame list split and decoded in ~7 ms against 15–18 with the stdlib's `base64`,
    which held the GIL throughout while the engine thread waited (`python3 bench/media_cpu.py`). The
    whitespace is only taken out when strict decoding failed: a split and a join of every part held the GIL
    ~2.5 ms per frame list."""
    try:
        return pybase64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        stripped = "".join(text.split())
        if stripped == text:
            raise
        return pybase64.b64decode(stripped, validate=True)


def is_frame_list(url: str) -> bool:
    """vLLM's video as its frames: `data:video/jpeg;base64,<frame>,<frame>,...`."""
    return url[: len(FRAME_LIST)].lower() == FRAME_LIST


def split_frame_list(url: str, max_bytes: int, max_frames: int) -> list[str]:
    """The base64 parts of a `data:video/jpeg;base64,...` URL, one a frame, within the server's limits on
    frames and bytes; `frame_bytes` decodes one."""
    parts = url[len(FRAME_LIST) :].split(",")
    if len(parts) > max_frames:
        raise MediaError(
            f"the video is a list of {len(parts)} frames; the server takes at most {max_frames} (--max-video-frames)"
        )
    if sum(len(p) for p in parts) // 4 * 3 > max_bytes + 2 * len(parts):
        raise MediaError(f"the frame list holds more than {max_bytes} bytes, the most the server accepts")
    return parts


def frame_bytes(parts: list[str], i: int) -> bytes:
    """Frame i of a frame list (`split_frame_list`), decoded from base64."""
    try:
        data = _b64decode(parts[i])
    except (binascii.Error, ValueError) as e:
        raise MediaError(f"frame {i} of the data:video/jpeg frame list is not valid base64 ({e})") from e
    if not data:
        raise MediaError(f"frame {i} of the data:video/jpeg frame list is empty")
    return data


def _local_file(url: str, policy: FetchPolicy, max_bytes: int) -> bytes:
    if policy.allowed_local_root is None:
        raise MediaError("file:// URLs are disabled on this server (no allowed local media path)")
    try:
        parts = urlsplit(url)
    except ValueError as e:
        raise MediaError(f"malformed file:// URL {_show(url)!r}: {e}") from None
    if parts.netloc not in ("", "localhost"):
        raise MediaError(f"file:// URL with host {parts.netloc[:100]!r}: only local files are allowed")
    name = unquote(parts.path)
    shown = repr(name[:200])
    if "\0" in name:
        raise MediaError(f"the file:// path {shown} contains a NUL byte")
    # One answer for missing, outside the root (symlinks resolved) and unreadable: which of them it is,
    # and where the root is, are the server's business.
    refused = MediaError(f"no readable file {shown} under the server's allowed local media path")
    root = Path(policy.allowed_local_root).resolve()
    try:
        path = Path(name).resolve(strict=True)
        found = path.is_relative_to(root) and path.is_file()  # not a directory, FIFO or device
        size = path.stat().st_size if found else 0
    except (OSError, RuntimeError, ValueError):  # missing, a symlink loop, permissions, a name too long
        found = False
    if not found:
        raise refused
    if size > max_bytes:
        raise MediaError(f"{shown} is {size} bytes; the server accepts at most {max_bytes}")
    try:
        with path.open("rb") as f:
            data = f.read(max_bytes + 1)
    except OSError:
        raise refused from None
    return _capped(data, max_bytes)


def _capped(data: bytes, max_bytes: int) -> bytes:
    if len(data) > max_bytes:
        raise MediaError(f"the media is {len(data)} bytes; the server accepts at most {max_bytes}")
    return data


# --- http(s) (on the event loop) ---------------------------------------------------------------------------


async def _http(client: httpx.AsyncClient, url: str, policy: FetchPolicy, max_bytes: int) -> bytes:
    import httpx

    first = url
    try:
        async with asyncio.timeout(policy.timeout_s):
            for _ in range(policy.max_redirects + 1):
                _check_url(url, policy)
                async with client.stream(
                    "GET", url, headers={"Accept-Encoding": ACCEPT_ENCODING}, timeout=policy.timeout_s
                ) as response:
                    if response.status_code in REDIRECTS:
                        url = _redirect(response, url)
                        continue
                    if response.status_code != 200:
                        raise MediaError(f"fetching {_show(url)} failed: HTTP {response.status_code}")
                    return await _body(response, url, max_bytes)
            raise MediaError(f"{_show(first)}: more than {policy.max_redirects} redirects")
    except MediaError:
        raise
    except (TimeoutError, httpx.TimeoutException):
        raise MediaError(
            f"fetching {_show(url)} timed out: the server allows {policy.timeout_s} s for connecting, headers and body"
        ) from None
    except (httpx.HTTPError, httpx.InvalidURL, ValueError) as e:  # httpx parses a Location even unfollowed
        raise MediaError(f"fetching {_show(url)} failed: {type(e).__name__}: {e}") from None


async def _body(response: httpx.Response, url: str, max_bytes: int) -> bytes:
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise MediaError(f"{_show(url)} is {declared} bytes; the server accepts at most {max_bytes}")
    size = int(declared) if declared.isdigit() else None
    decoder = BodyDecoder(response.headers.get_list("content-encoding"), max_bytes, _show(url), size)
    async for raw in response.aiter_raw():
        for _ in decoder.feed(raw):
            await asyncio.sleep(0)  # a highly compressed chunk decodes in slices; let the loop breathe
    return decoder.finish()


def _redirect(response: httpx.Response, url: str) -> str:
    import httpx

    location = response.headers.get("location")
    if not location:
        raise MediaError(f"fetching {_show(url)} failed: HTTP {response.status_code} without a Location header")
    try:
        return str(response.url.join(location))
    except (httpx.InvalidURL, ValueError) as e:
        raise MediaError(f"{_show(url)} redirects to a malformed Location {location[:200]!r}: {e}") from None


def _check_url(url: str, policy: FetchPolicy) -> None:
    import httpx  # parse the host exactly as the request will

    try:
        parsed = httpx.URL(url)
        scheme, host, port = parsed.scheme, (parsed.host or "").lower(), parsed.port
    except (httpx.InvalidURL, ValueError) as e:  # IDNA errors are ValueErrors
        raise MediaError(f"invalid media URL {_show(url)}: {e}") from None
    if scheme not in ("http", "https"):
        raise MediaError(f"media URL {_show(url)}: only http(s) may be fetched from the network")
    if port is not None and not 0 < port < 65536:
        raise MediaError(f"invalid media URL {_show(url)}: port {port} is out of range")
    if host not in {d.lower() for d in policy.allowed_domains}:
        allowed = ", ".join(sorted(policy.allowed_domains)) or "none"
        raise MediaError(f"media host {host[:200]!r} is not allowed on this server (allowed: {allowed})")


def _show(url: str) -> str:
    return url if len(url) <= 200 else url[:200] + "..."


_ssl_lock = threading.Lock()


@functools.cache
def _ssl_context_once() -> ssl.SSLContext:
    import httpx

    return httpx.create_ssl_context()


def _ssl_context() -> ssl.SSLContext:
    with _ssl_lock:  # built once (certifi's store), on the fetch pool
        return _ssl_context_once()


# --- name resolution on the fetch pool ---------------------------------------------------------------------


def _addresses(host: str, port: int) -> list[str]:
    try:
        ipaddress.ip_address(host)
        return [host]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        import httpcore

        raise httpcore.ConnectError(f"cannot resolve {host!r}: {e}") from None
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


class _PoolResolver:
    """httpcore's anyio network backend, with host names resolved on `executor` (anyio would resolve them on
    the loop's default executor); connects to each address in turn."""

    def __init__(self, executor: Executor):
        import httpcore

        self._inner = httpcore.AnyIOBackend()
        self._executor = executor

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> Any:
        import httpcore

        addresses = await asyncio.get_running_loop().run_in_executor(self._executor, _addresses, host, port)
        error: Exception = httpcore.ConnectError(f"no address for {host!r}")
        for address in addresses:
            try:
                return await self._inner.connect_tcp(address, port, timeout, local_address, socket_options)
            except (httpcore.NetworkError, httpcore.TimeoutException) as e:
                error = e
            except Exception as e:  # anyio's own errors (an exception group, say): this address failed
                error = httpcore.ConnectError(f"{type(e).__name__}: {e}")
        raise error

    async def connect_unix_socket(self, path: str, timeout: float | None = None, socket_options: Any = None) -> Any:
        return await self._inner.connect_unix_socket(path, timeout, socket_options)

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)
