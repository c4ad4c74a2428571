"""Bytes of one image or video → the tensors, grid and token count the vision tower and the prompt need."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image

from hylora.media import image, video
from hylora.media.budget import CancelFlag
from hylora.media.config import MediaConfig, MediaLimits, VisionParams, apply_overrides
from hylora.media.errors import MediaError

Kind = Literal["image", "video"]
KEY_VERSION = "hylora-media-1"  # bump when preprocessing changes what the same parameters produce


@dataclass(frozen=True, eq=False)
class ProcessedMedia:
    kind: Kind
    pixel_values: torch.Tensor  # float32 [t·h·w, C·temporal_patch·patch·patch], rows in merge-block order
    grid_thw: tuple[int, int, int]  # in patches
    merge_size: int
    key: str  # content hash for an encoder cache: the bytes and every parameter that changes the result
    timestamps: tuple[float, ...] = ()  # video: seconds of each temporal patch

    @property
    def num_tokens(self) -> int:
        """Placeholder tokens in the prompt (= rows out of the merger)."""
        t, h, w = self.grid_thw
        return t * h * w // self.merge_size**2

    @property
    def tokens_per_frame(self) -> int:
        """Placeholder tokens per temporal patch."""
        return self.grid_thw[1] * self.grid_thw[2] // self.merge_size**2


def process_image(
    data: bytes,
    cfg: MediaConfig,
    limits: MediaLimits,
    overrides: Mapping[str, Any] | None = None,
    cancel: CancelFlag | None = None,
) -> ProcessedMedia:
    """One image's rows. `cancel` (set by the request's coroutine) stops the work before it decodes."""
    _check_bytes("image", data, limits)
    params = apply_overrides(cfg.image, overrides, limits)
    rows, grid = image.preprocess_image(image.decode_image(data, limits, cancel), params)
    return _finish("image", rows, grid, params, media_key("image", data, params), limits)


def process_video(
    data: bytes,
    cfg: MediaConfig,
    limits: MediaLimits,
    overrides: Mapping[str, Any] | None = None,
    cancel: CancelFlag | None = None,
) -> ProcessedMedia:
    """One video's (or animated image's) rows, within the decode budget; `cancel` stops it at the next frame."""
    _check_bytes("video", data, limits)
    params = apply_overrides(cfg.video, overrides, limits)
    sampled = video.read_video(data, params, limits, cancel)
    return _video_rows(sampled, params, media_key("video", data, params), limits)


def process_frames(
    frames: np.ndarray,
    fps: float,
    cfg: MediaConfig,
    limits: MediaLimits,
    overrides: Mapping[str, Any] | None = None,
) -> ProcessedMedia:
    """Decoded frames (uint8 [N, H, W, 3] at `fps`) → the same rows as `process_video` gives for a
    video of those frames: sampled, resized under the pixel budget, timestamps."""
    params = apply_overrides(cfg.video, overrides, limits)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise MediaError(f"frames must be uint8 [N, H, W, 3], got {frames.dtype} {list(frames.shape)}")
    indices = video.sample_indices(len(frames), fps, params)
    if len(indices) < params.temporal_patch_size:
        raise MediaError(f"{len(indices)} frame(s) to sample; a video needs at least {params.temporal_patch_size}")
    height, width = video.smart_resize(len(indices), *frames.shape[1:3], params)
    resized = np.stack(
        [image.resize(Image.fromarray(frames[i]), height, width, params.resample) for i in indices.tolist()]
    )
    sampled = video.SampledVideo(frames=resized, indices=indices, fps=fps, total_frames=len(frames))
    return _video_rows(sampled, params, media_key("video", frames.tobytes(), params), limits)


def _video_rows(sampled: video.SampledVideo, params: VisionParams, key: str, limits: MediaLimits) -> ProcessedMedia:
    pixels = video.rescale_and_normalize(sampled.frames, params)
    rows = image.patchify(pixels, params.patch_size, params.merge_size, params.temporal_patch_size)
    n, height, width = len(sampled.frames), *sampled.frames.shape[1:3]
    grid = (-(-n // params.temporal_patch_size), height // params.patch_size, width // params.patch_size)
    stamps = tuple(video.timestamps(sampled.indices, sampled.fps, params.temporal_patch_size))
    return _finish("video", rows, grid, params, key, limits, stamps)


def media_key(kind: Kind, data: bytes, params: VisionParams) -> str:
    """sha256 of the bytes and the effective parameters (checkpoint config with overrides applied)."""
    h = hashlib.sha256()
    h.update(f"{KEY_VERSION}\0{kind}\0{params!r}\0".encode())
    h.update(data)
    return h.hexdigest()


def check_visual_tokens(items: Sequence[ProcessedMedia], limits: MediaLimits) -> None:
    """Refuse a request whose images and videos together need more placeholder tokens than the server allows."""
    total = sum(item.num_tokens for item in items)
    if total > limits.max_visual_tokens:
        raise MediaError(
            f"the images and videos of this request need {total} visual tokens; the server allows "
            f"{limits.max_visual_tokens}: send fewer or smaller items, or lower max_pixels / fps / num_frames"
        )


def _check_bytes(kind: Kind, data: bytes, limits: MediaLimits) -> None:
    if not data:
        raise MediaError(f"the {kind} is empty (0 bytes)")
    if len(data) > limits.max_bytes:
        raise MediaError(f"the {kind} is {len(data)} bytes; the server accepts at most {limits.max_bytes}")


def _finish(
    kind: Kind,
    rows: np.ndarray,
    grid: tuple[int, int, int],
    params: VisionParams,
    key: str,
    limits: MediaLimits,
    stamps: tuple[float, ...] = (),
) -> ProcessedMedia:
    item = ProcessedMedia(kind, torch.from_numpy(rows), grid, params.merge_size, key, stamps)
    check_visual_tokens([item], limits)
    return item
