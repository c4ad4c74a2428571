"""Test media made offline (Pillow, PyAV's bundled FFmpeg) and a torchvision stand-in for transformers' video code."""

from __future__ import annotations

import enum
import importlib
import io
import types
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
