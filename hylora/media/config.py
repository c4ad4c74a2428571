"""Preprocessing parameters from a checkpoint's processor files, request overrides, and the server's caps.

Defaults are transformers' own class defaults (`Qwen2VLImageProcessorPil` for images, `Qwen3VLVideoProcessor`
for videos), used only when a file or a key is absent. Files are looked up in transformers' order: the nested
`processor_config.json`, then `preprocessor_config.json` (images) or `video_preprocessor_config.json` falling
back to `preprocessor_config.json` (videos).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from hylora.config import read_json_object
from hylora.media.errors import MediaError

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGENET_STANDARD_MEAN = (0.5, 0.5, 0.5)
IMAGENET_STANDARD_STD = (0.5, 0.5, 0.5)
PIL_BICUBIC = 3


@dataclass(frozen=True)
class VisionParams:
    """What turns pixels into rows for the tower. `min_pixels` / `max_pixels` are transformers'
    `size["shortest_edge"]` / `size["longest_edge"]`: pixel budgets, despite the names."""

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    resample: int

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


@dataclass(frozen=True)
class ImageConfig(VisionParams):
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    resample: int = PIL_BICUBIC


@dataclass(frozen=True)
class VideoConfig(VisionParams):
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 128 * 32 * 32
    max_pixels: int = 32 * 32 * 768  # over all sampled frames together
    image_mean: tuple[float, ...] = IMAGENET_STANDARD_MEAN
    image_std: tuple[float, ...] = IMAGENET_STANDARD_STD
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    resample: int = PIL_BICUBIC
    fps: float | None = 2
    num_frames: int | None = None
    min_frames: int = 4
    max_frames: int = 768
    do_sample_frames: bool = True
    # transformers 5.24 treats an unset `cap_pixels_per_frame` as False (with a warning).
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 768


@dataclass(frozen=True)
class MediaConfig:
    image: ImageConfig = ImageConfig()
    video: VideoConfig = VideoConfig()

    @classmethod
    def from_model_dir(cls, path: str | Path) -> MediaConfig:
        path = Path(path)
        nested = _read_json(path / "processor_config.json")
        image = nested.get("image_processor") or _read_json(path / "preprocessor_config.json")
        video = (
            nested.get("video_processor")
            or _read_json(path / "video_preprocessor_config.json")
            or _read_json(path / "preprocessor_config.json")
        )
        return cls(image=_parse(ImageConfig, image, legacy_pixels=True), video=_parse(VideoConfig, video))


@dataclass(frozen=True)
class MediaLimits:
    """Server-side caps; a request over any of them gets a MediaError naming the cap."""

    max_bytes: int = 64 << 20  # one image or video as fetched
    max_source_pixels: int = 8192 * 8192  # width × height of one decoded image or video frame
    max_source_frames: int = 18_000  # frames decoded from one video (10 min at 30 fps)
    # width × height × frames decoded from one video or animated image, every frame at its full canvas size:
    # a 10-minute 720p video at 30 fps (1280·720·18,000 = 1.66e10) is the most it allows, so an 8000² GIF of
    # 500 one-pixel frames (3.2e10) is refused from its header. At 1-3 ns a pixel for FFmpeg, tens of seconds.
    max_decode_pixels: int = 1280 * 720 * 18_000
    max_frames: int = 768  # frames sampled from one video
    max_fps: float = 30.0  # a request's fps override
    max_visual_tokens: int = 65_536  # one request, all items together

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if not getattr(self, f.name) > 0:
                raise ValueError(f"MediaLimits.{f.name} must be positive, got {getattr(self, f.name)!r}")


IMAGE_OVERRIDES = frozenset({"min_pixels", "max_pixels", "size"})
VIDEO_OVERRIDES = frozenset({"fps", "num_frames", "min_frames", "max_frames", "size", "do_sample_frames"})
# transformers' choice of processor class (fast / slow): hylora has one preprocessing; accepted, no effect.
# `truncation` (the processor's tokenizer): hylora never cuts a prompt, so only false is accepted (below).
IGNORED_OVERRIDES = frozenset({"use_fast", "truncation"})
C = TypeVar("C", ImageConfig, VideoConfig)


def apply_overrides(cfg: C, overrides: Mapping[str, Any] | None, limits: MediaLimits) -> C:
    """`cfg` with a request's `mm_processor_kwargs` applied, validated and capped by `limits`.

    One dict serves images and videos, as in transformers: keys that only the other kind takes are ignored
    (`min_pixels` / `max_pixels` are image keys there; a video's budget is `size`). Pixel budgets may not exceed
    the checkpoint's `max_pixels`. The result always has `max_frames <= limits.max_frames`.
    """
    if overrides is not None and not isinstance(overrides, Mapping):
        raise MediaError("mm_processor_kwargs must be a JSON object")
    if (overrides or {}).get("truncation") not in (None, False):
        raise MediaError("mm_processor_kwargs truncation: hylora never truncates a prompt (one too long is a 400)")
    overrides = {k: v for k, v in (overrides or {}).items() if k not in IGNORED_OVERRIDES}
    unknown = set(overrides) - IMAGE_OVERRIDES - VIDEO_OVERRIDES
    if unknown:
        accepted = ", ".join(sorted(IMAGE_OVERRIDES | VIDEO_OVERRIDES))
        raise MediaError(f"unsupported mm_processor_kwargs {sorted(unknown)}; accepted: {accepted}")
    is_video = isinstance(cfg, VideoConfig)
    own = {k: v for k, v in overrides.items() if k in (VIDEO_OVERRIDES if is_video else IMAGE_OVERRIDES)}
    pixels: dict[str, Any] = {}
    if "size" in own:
        size = own["size"]
        if not isinstance(size, Mapping) or not size or set(size) - {"shortest_edge", "longest_edge"}:
            raise MediaError('mm_processor_kwargs "size" must be {"shortest_edge": int, "longest_edge": int}')
        pixels = {"min_pixels": size.get("shortest_edge"), "max_pixels": size.get("longest_edge")}
    pixels.update({k: own[k] for k in ("min_pixels", "max_pixels") if own.get(k) is not None})
    changes: dict[str, Any] = {}
    for key, value in pixels.items():
        if value is None:
            continue
        changes[key] = _positive_int(key, value)
        if changes[key] > cfg.max_pixels:  # min_pixels grows small inputs, so it is capped too
            raise MediaError(f"{key}={changes[key]} is above this model's limit of {cfg.max_pixels} pixels")
    if changes.get("min_pixels", 0) > changes.get("max_pixels", float("inf")):  # both sent, crossed
        raise MediaError(f"min_pixels={changes['min_pixels']} is above max_pixels={changes['max_pixels']}")
    if is_video:
        changes.update(_video_overrides(cfg, own, limits))
    return dataclasses.replace(cfg, **changes)


def merge_overrides(processor_kwargs: Mapping[str, Any] | None, io_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """vLLM's two places for preprocessing options as one dict for `apply_overrides`: `mm_processor_kwargs`
    and the per-kind `media_io_kwargs` ({"video": {"num_frames": 16}}). `num_frames: -1` there is vLLM's
    "the loader keeps every frame", which hylora's loader always does before sampling: it is dropped."""
    merged = dict(processor_kwargs or {})
    for kind, kind_kwargs in (io_kwargs or {}).items():
        if isinstance(kind_kwargs, Mapping):
            unknown = set(kind_kwargs) - IMAGE_OVERRIDES - VIDEO_OVERRIDES - IGNORED_OVERRIDES
            if unknown:  # named here: apply_overrides would blame mm_processor_kwargs
                accepted = ", ".join(sorted(IMAGE_OVERRIDES | VIDEO_OVERRIDES))
                raise MediaError(f"unsupported media_io_kwargs[{kind!r}] {sorted(unknown)}; accepted: {accepted}")
            merged |= {k: v for k, v in kind_kwargs.items() if not (k == "num_frames" and v == -1)}
    return merged


def layer_overrides(defaults: Mapping[str, Any], request: Mapping[str, Any] | None) -> dict[str, Any]:
    """A request's options over the server's defaults. fps and num_frames exclude each other, so a
    request's own fps replaces a default num_frames and the other way round (as vLLM merges them)."""
    merged, request = dict(defaults), request or {}
    if "num_frames" in request and "fps" not in request:
        merged.pop("fps", None)
    if "fps" in request and "num_frames" not in request:
        merged.pop("num_frames", None)
    return merged | dict(request)


def _video_overrides(cfg: VideoConfig, own: dict[str, Any], limits: MediaLimits) -> dict[str, Any]:
    changes: dict[str, Any] = {}
    if own.get("fps") is not None and own.get("num_frames") is not None:
        raise MediaError("fps and num_frames are mutually exclusive: send one of them")
    if own.get("fps") is not None:
        fps = own["fps"]
        if isinstance(fps, bool) or not isinstance(fps, int | float) or not 0 < fps <= limits.max_fps:
            raise MediaError(f"fps must be a number in (0, {limits.max_fps}], got {fps!r}")
        changes.update(fps=fps, num_frames=None)
    if own.get("num_frames") is not None:
        n = _positive_int("num_frames", own["num_frames"])
        if not cfg.temporal_patch_size <= n <= limits.max_frames:
            raise MediaError(f"num_frames must be in [{cfg.temporal_patch_size}, {limits.max_frames}], got {n}")
        changes.update(num_frames=n, fps=None)
    max_frames = min(cfg.max_frames, limits.max_frames)
    if own.get("max_frames") is not None:
        max_frames = _positive_int("max_frames", own["max_frames"])
        if max_frames > limits.max_frames:
            raise MediaError(f"max_frames={max_frames} is above the server's limit of {limits.max_frames}")
    min_frames = cfg.min_frames if own.get("min_frames") is None else _positive_int("min_frames", own["min_frames"])
    if min_frames > max_frames:
        raise MediaError(f"min_frames={min_frames} is above max_frames={max_frames}")
    changes.update(max_frames=max_frames, min_frames=min_frames)
    if own.get("do_sample_frames") is not None:  # false: every decoded frame (clients that sampled already)
        if not isinstance(own["do_sample_frames"], bool):
            raise MediaError(f"do_sample_frames must be true or false, got {own['do_sample_frames']!r}")
        changes["do_sample_frames"] = own["do_sample_frames"]
    num_frames = changes.get("num_frames", cfg.num_frames)
    if num_frames is not None and num_frames > limits.max_frames:
        changes["num_frames"] = limits.max_frames
    return changes


def _positive_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MediaError(f"{key} must be a positive integer, got {value!r}")
    return value


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    return read_json_object(path)


def _parse(cls: type[C], raw: Mapping[str, Any], legacy_pixels: bool = False) -> C:
    """A config from one processor dict; None values and absent keys keep the class default."""
    raw = {k: v for k, v in raw.items() if v is not None}
    if raw.get("do_resize") is False:
        raise ValueError(f"{cls.__name__}: do_resize=false is not supported (the tower needs multiples of the patch)")
    values: dict[str, Any] = {}
    size = raw.get("size")
    if size is not None:
        if not isinstance(size, Mapping) or not {"shortest_edge", "longest_edge"} <= set(size):
            raise ValueError(f"{cls.__name__}: size must have shortest_edge and longest_edge, got {size!r}")
        values.update(min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"])
    if legacy_pixels:  # Qwen2VLImageProcessor.__init__: top-level min/max_pixels override size
        values.update({k: raw[k] for k in ("min_pixels", "max_pixels") if k in raw})
    names = {f.name for f in dataclasses.fields(cls)} - {"min_pixels", "max_pixels"}
    values.update({k: v for k, v in raw.items() if k in names})
    for key in ("image_mean", "image_std"):
        if key in values:
            v = values[key]
            values[key] = tuple(float(x) for x in v) if isinstance(v, list | tuple) else (float(v),) * 3
    if "resample" in values:
        values["resample"] = int(values["resample"])
    cfg = cls(**values)
    _validate(cfg)
    return cfg


def _validate(cfg: VisionParams) -> None:
    name = type(cfg).__name__
    for key in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels"):
        value = getattr(cfg, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}.{key} must be a positive integer, got {value!r}")
    if cfg.min_pixels > cfg.max_pixels:
        raise ValueError(f"{name}: min_pixels {cfg.min_pixels} > max_pixels {cfg.max_pixels}")
    std_ok = all(math.isfinite(s) and s != 0 for s in cfg.image_std)
    if len(cfg.image_mean) != 3 or len(cfg.image_std) != 3 or not std_ok:
        raise ValueError(f"{name}: image_mean / image_std need 3 finite values, std non-zero")
    if isinstance(cfg, VideoConfig):
        if not 1 <= cfg.min_frames <= cfg.max_frames:
            raise ValueError(f"{name}: need 1 <= min_frames <= max_frames, got {cfg.min_frames}, {cfg.max_frames}")
        if cfg.fps is not None and not cfg.fps > 0:
            raise ValueError(f"{name}.fps must be positive, got {cfg.fps!r}")
