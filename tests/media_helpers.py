"""Test media made offline (Pillow, PyAV's bundled FFmpeg), a torchvision stand-in for transformers' video code,
and hostile media: bombs written by hand and a local HTTP server that misbehaves on purpose."""

from __future__ import annotations

import base64
import enum
import functools
import gzip
import importlib
import io
import select
import socket
import struct
import threading
import types
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import av
import numpy as np
import torch
from PIL import Image

# --- images -------------------------------------------------------------------------------------------------


def pixels(height: int, width: int, channels: int = 3, seed: int = 0) -> np.ndarray:
    """Smooth gradients plus noise: resizing has something to do and every channel differs."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = [(x * 255 // max(width - 1, 1)), (y * 255 // max(height - 1, 1)), ((x + y) * 7) % 256, (x * y) % 256]
    img = np.stack(base[:channels], axis=-1).astype(np.int32) + rng.integers(-40, 40, (height, width, channels))
    return np.clip(img, 0, 255).astype(np.uint8)


def image_bytes(
    width: int, height: int, mode: str = "RGB", fmt: str = "PNG", seed: int = 0, exif_orientation: int | None = None
) -> bytes:
    """An encoded image in `mode`: RGB, RGBA, L, LA, P (palette, index 0 transparent), CMYK or I;16."""
    image = _pil_image(width, height, mode, seed)
    kwargs = {"transparency": 0} if mode == "P" else {}
    if exif_orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = exif_orientation
        kwargs["exif"] = exif
    buf = io.BytesIO()
    image.save(buf, fmt, **kwargs)
    return buf.getvalue()


def _pil_image(width: int, height: int, mode: str, seed: int) -> Image.Image:
    if mode == "I;16":
        return Image.fromarray(pixels(height, width, 1, seed)[..., 0].astype(np.uint16) * 257)
    if mode == "P":
        return Image.fromarray(pixels(height, width, 3, seed)).quantize(16)
    if mode == "CMYK":
        return Image.frombytes("CMYK", (width, height), pixels(height, width, 4, seed).tobytes())
    channels = {"RGB": 3, "RGBA": 4, "L": 1, "LA": 2}[mode]
    arr = pixels(height, width, channels, seed)
    return Image.fromarray(arr[..., 0] if channels == 1 else arr)


# --- videos -------------------------------------------------------------------------------------------------


def video_bytes(
    num_frames: int,
    width: int,
    height: int,
    fps: int = 10,
    fmt: str = "mp4",
    codec: str = "libx264",
    path: Path | None = None,
    options: dict[str, str] | None = None,
) -> bytes:
    """A clip whose frames all differ; written to `path` when the muxer needs a real file (mp4 faststart)."""
    target = str(path) if path else io.BytesIO()
    with av.open(target, "w", format=fmt, options=options or {}) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(num_frames):
            frame = pixels(height, width, 3, seed=i)
            frame[: height // 2, : (i * 7) % width] = (i * 23) % 256
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path.read_bytes() if path else target.getvalue()


def decode_all(data: bytes) -> tuple[np.ndarray, float]:
    """Every frame (uint8 [N, H, W, 3]) and the stream's average rate, straight from PyAV."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        return np.stack(frames), float(stream.average_rate)


def frame_list(frames: list[bytes]) -> str:
    """vLLM's video as its frames: data:video/jpeg;base64,<frame>,<frame>,..."""
    return "data:video/jpeg;base64," + ",".join(base64.b64encode(f).decode() for f in frames)


def garbage(n: int = 4096, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


# --- transformers' video code without torchvision -----------------------------------------------------------


class _InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    LANCZOS = "lanczos"


def _resize(video: torch.Tensor, size: list[int], interpolation=None, antialias: bool = True) -> torch.Tensor:
    """PIL bicubic per frame: the one step where hylora (PIL) and transformers (torchvision) differ."""
    assert interpolation == _InterpolationMode.BICUBIC, interpolation
    h, w = size
    flat = video.reshape(-1, *video.shape[-3:])
    out = [
        torch.from_numpy(np.array(Image.fromarray(f.permute(1, 2, 0).numpy()).resize((w, h), Image.BICUBIC)))
        for f in flat
    ]
    return torch.stack(out).permute(0, 3, 1, 2).reshape(*video.shape[:-2], h, w)


def _normalize(image: torch.Tensor, mean, std, inplace: bool = False) -> torch.Tensor:
    """torchvision.transforms.v2.functional.normalize (float tensors)."""
    mean = torch.as_tensor(mean, dtype=image.dtype).view(-1, 1, 1)
    std = torch.as_tensor(std, dtype=image.dtype).view(-1, 1, 1)
    image = image.sub_(mean) if inplace else image.sub(mean)
    return image.div_(std)


def install_torchvision_stand_in(monkeypatch) -> None:
    """Let transformers' own `Qwen3VLVideoProcessor` and `Qwen3VLProcessor` run here: a 3-function `tvF`
    (resize = PIL bicubic, normalize, grayscale_to_rgb for RGB input) and the processor class check off
    (it looks the video processor class up in transformers' torchvision-gated namespace)."""
    from transformers.image_utils import PILImageResampling
    from transformers.processing_utils import ProcessorMixin

    tvf = types.SimpleNamespace(
        InterpolationMode=_InterpolationMode, resize=_resize, normalize=_normalize, grayscale_to_rgb=lambda v: v
    )
    for name in (
        "transformers.image_processing_backends",
        "transformers.video_processing_utils",
        "transformers.models.qwen3_vl.video_processing_qwen3_vl",
    ):
        monkeypatch.setattr(importlib.import_module(name), "tvF", tvf, raising=False)
    monkeypatch.setattr(
        importlib.import_module("transformers.image_processing_backends"),
        "pil_torch_interpolation_mapping",
        {PILImageResampling.BICUBIC: _InterpolationMode.BICUBIC},
    )
    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: type(arg))


# --- hostile media -------------------------------------------------------------------------------------------


def hostile_gif(width: int, height: int, frames: int, delay_cs: int = 10) -> bytes:
    """An animated GIF with a `width` x `height` canvas and `frames` one-pixel frames, written by hand
    (a few bytes a frame; Pillow would need the canvas in memory to write it)."""
    out = bytearray(b"GIF89a" + struct.pack("<HH", width, height) + bytes([0x80, 0, 0]) + b"\0\0\0\xff\xff\xff")
    out += b"\x21\xff\x0bNETSCAPE2.0\x03\x01\0\0\0"  # loop forever
    for i in range(frames):
        out += b"\x21\xf9\x04\x00" + struct.pack("<H", delay_cs) + b"\0\0"  # graphic control: delay
        x, y = i % width, (i // width) % height
        out += b"\x2c" + struct.pack("<HHHH", x, y, 1, 1) + b"\0"  # one pixel at (x, y)
        out += b"\x02\x02\x44\x01\x00"  # LZW: clear, 0, end
    return bytes(out + b"\x3b")


def png_header_bomb(side: int) -> bytes:
    """A 1-bit grayscale PNG of `side` x `side` zero pixels (a few KB for gigapixels), streamed through zlib."""
    row = b"\0" * (1 + (side + 7) // 8)
    z = zlib.compressobj(9)
    idat = b"".join(z.compress(row) for _ in range(side)) + z.flush()

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def ico_wrapping(png: bytes) -> bytes:
    """An ICO whose one entry claims 256x256 and holds `png` (any size)."""
    entry = struct.pack("<BBBBHHII", 0, 0, 0, 0, 1, 32, len(png), 22)
    return struct.pack("<HHH", 0, 1, 1) + entry + png


@functools.cache
def gzip_layers(size: int, layers: int) -> bytes:
    """`size` zero bytes gzipped `layers` times (streamed: the zeros never sit in memory). Made once a
    process (over a second each): a fetch's time limit in a test must not include making its body."""
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    block = b"\0" * (1 << 20)
    parts = [z.compress(block) for _ in range(size // len(block))]
    data = b"".join([*parts, z.compress(b"\0" * (size % len(block))), z.flush()])
    for _ in range(layers - 1):
        data = gzip.compress(data, 9)
    return data


@dataclass
class Route:
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    mode: str = "answer"  # answer | silent | trickle-headers | trickle-body
    interval_s: float = 0.2
    delay_s: float = 0.0  # before answering at all


class HostileServer:
    """A local HTTP/1.1 server on 127.0.0.1 (one thread per connection) whose routes misbehave the ways
    a hostile or broken media host does. Built-in routes:

    /silent           accepts, reads the request, never answers
    /trickle-headers  a status line, then one header line every `interval_s`, forever
    /trickle-body     headers, then one body byte every `interval_s`, forever
    /gzip-gzip        `Content-Encoding: gzip, gzip` around 256 MiB of zeros (590 bytes on the wire)
    /gzip-bomb        `Content-Encoding: gzip` around 256 MiB of zeros (~256 KB)
    /br               `Content-Encoding: br`
    /bad-redirect     302 with a malformed Location
    /no-location      302 without Location
    /loop             302 to itself

    `add(path, ...)` serves anything else. `open_connections` counts connections whose client has not
    hung up yet, `connections` every one accepted: a cancelled fetch shows as a drop in the first.
    """

    def __init__(self) -> None:
        self.routes: dict[str, Route] = {
            "/silent": Route(mode="silent"),
            "/trickle-headers": Route(mode="trickle-headers"),
            "/trickle-body": Route(headers={"Content-Length": "1000000"}, mode="trickle-body"),
            "/gzip-gzip": Route(headers={"Content-Encoding": "gzip, gzip"}, body=gzip_layers(256 << 20, 2)),
            "/gzip-bomb": Route(headers={"Content-Encoding": "gzip"}, body=gzip_layers(256 << 20, 1)),
            "/br": Route(headers={"Content-Encoding": "br"}, body=b"\x0b\x02\x80hello\x03"),
            "/bad-redirect": Route(302, {"Location": "http://[::1"}),
            "/no-location": Route(302),
            "/loop": Route(302, {"Location": "/loop"}),
        }
        self.connections = 0
        self.open_connections = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def add(self, path: str, body: bytes = b"", status: int = 200, headers: dict[str, str] | None = None, **kw) -> str:
        self.routes[path] = Route(status, dict(headers or {}), body, **kw)
        return self.url(path)

    def __enter__(self) -> HostileServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._sock.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
                self.open_connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                request = b""
                while b"\r\n\r\n" not in request:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    request += chunk
                path = request.split(b" ", 2)[1].decode()
                route = self.routes.get(path, Route(404))
                self._respond(conn, route)
        except OSError:
            pass
        finally:
            with self._lock:
                self.open_connections -= 1

    def _respond(self, conn: socket.socket, route: Route) -> None:
        if route.delay_s and self._stop.wait(route.delay_s):
            return
        if route.mode == "silent":
            return self._hold(conn, lambda: None, route.interval_s)
        head = f"HTTP/1.1 {route.status} X\r\n"
        if route.mode == "trickle-headers":
            conn.sendall(head.encode())
            return self._hold(conn, lambda: conn.sendall(b"X-Slow: 1\r\n"), route.interval_s)
        body = route.body
        headers = {"Content-Length": str(len(body)), "Connection": "close"} | route.headers
        head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
        conn.sendall(head.encode("latin-1"))
        if route.mode == "trickle-body":
            return self._hold(conn, lambda: conn.sendall(b"x"), route.interval_s)
        conn.sendall(body)
        conn.shutdown(socket.SHUT_WR)
        self._hold(conn, lambda: None, route.interval_s)  # until the client closes

    def _hold(self, conn: socket.socket, tick, interval_s: float) -> None:
        """Call `tick` every `interval_s` until the client hangs up or the server stops."""
        while not self._stop.is_set():
            readable, _, _ = select.select([conn], [], [], interval_s)
            if readable and not conn.recv(65536):
                return
            tick()
