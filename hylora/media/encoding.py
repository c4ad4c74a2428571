"""An http(s) body's Content-Encoding, decoded here with bounded decompressors.

httpx would decode every listed coding, each raw chunk in one call: `gzip, gzip` turns a few KB into
gigabytes before any byte cap sees them. Here the raw body is fed in, at most one coding is accepted
(gzip / x-gzip / deflate; identity is no coding), and zlib produces at most `SLICE` bytes per call, so the
decoded body never exceeds the cap by more than a slice and nothing else grows with the compression ratio.
"""

from __future__ import annotations

import io
import zlib
from collections.abc import Iterable, Iterator

from hylora.media.errors import MediaError

SLICE = 256 << 10  # decoded bytes per zlib call (the caller may yield to its event loop between slices)
CODINGS = {"gzip": zlib.MAX_WBITS | 16, "x-gzip": zlib.MAX_WBITS | 16, "deflate": zlib.MAX_WBITS}


class BodyDecoder:
    """Raw body bytes in (`feed`), the decoded body out (`finish`); MediaError past `max_bytes` either way."""

    def __init__(self, content_encoding: Iterable[str], max_bytes: int, where: str, size_hint: int | None = None):
        codings = [c.strip().lower() for value in content_encoding for c in value.split(",")]
        codings = [c for c in codings if c and c != "identity"]
        if len(codings) > 1:
            raise MediaError(
                f"{where} is sent with Content-Encoding {', '.join(codings)!r}: the server decodes at most one "
                "coding (gzip or deflate)"
            )
        if codings and codings[0] not in CODINGS:
            raise MediaError(
                f"{where} is sent with Content-Encoding {codings[0]!r}, which the server does not decode: "
                "send it uncompressed, gzip or deflate"
            )
        self.coding = codings[0] if codings else None
        self.max_bytes, self.where = max_bytes, where
        self.raw = self.size = 0
        self.body = io.BytesIO()  # getvalue() hands its buffer over: the body is never held twice
        if self.coding is None and size_hint and 0 < size_hint <= max_bytes:  # Content-Length: no regrowth
            self.body = io.BytesIO(bytes(size_hint))  # its only reference, so writing into it does not copy it
        self._z: zlib._Decompress | None = None
        self._head = b""  # deflate: the first bytes, until they show a zlib header or raw deflate
        self._done = False  # gzip: the last member ended; what follows is ignored, as browsers do

    def feed(self, raw: bytes) -> Iterator[None]:
        """Decode `raw`, yielding between slices of decoded output (iterate it to the end)."""
        self.raw += len(raw)
        if self.raw > self.max_bytes:
            raise self._too_large()
        if self.coding is None:
            self._append(raw)
            return
        data = self._head + raw
        if self._z is None:
            if self.coding == "deflate" and len(data) < 2:
                self._head = data
                return
            self._head = b""
            self._z = self._new(data)
        while data and not self._done:
            try:
                out = self._z.decompress(data, SLICE)
            except zlib.error as e:
                raise MediaError(f"{self.where}: its {self.coding} body is corrupt ({e})") from None
            self._append(out)
            data = self._z.unconsumed_tail
            if self._z.eof:
                data = self._z.unused_data
                if self.coding != "deflate" and data[:2] == b"\x1f\x8b":  # another gzip member
                    self._z = self._new(data)
                else:
                    self._done = True
            if data and not self._done:
                yield

    def finish(self) -> bytes:
        if self.coding is not None and self._z is not None and not self._done:
            try:
                self._append(self._z.flush())  # no input is left, so this is what zlib still holds
            except zlib.error as e:
                raise MediaError(f"{self.where}: its {self.coding} body is corrupt ({e})") from None
        self.body.truncate()  # a body shorter than its Content-Length
        return self.body.getvalue()

    def _new(self, data: bytes) -> zlib._Decompress:
        wbits = CODINGS[self.coding]
        if self.coding == "deflate" and (data[0] & 0x0F != 8 or (data[0] << 8 | data[1]) % 31):
            wbits = -zlib.MAX_WBITS  # raw deflate without the zlib header, which some servers send
        return zlib.decompressobj(wbits)

    def _append(self, out: bytes) -> None:
        self.size += len(out)
        if self.size > self.max_bytes:
            raise self._too_large()
        self.body.write(out)

    def _too_large(self) -> MediaError:
        return MediaError(f"{self.where} is larger than {self.max_bytes} bytes, the most the server accepts")
