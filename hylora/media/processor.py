"""Bytes of one image or video → the tensors, grid and token count the vision tower and the prompt need."""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image

from hylora.media import image, pixels, video
from hylora.media.budget import CancelFlag, DecodeBudget
from hylora.media.cache import ProcessedCache
from hylora.media.config import MediaConfig, MediaLimits, VisionParams, apply_overrides
from hylora.media.errors import MediaError
from hylora.media.fetch import frame_bytes, split_frame_list
from hylora.media.frame_processes import WorkerCrashed
from hylora.media.pools import frame_pool, frame_processes, map_frames
from hylora.media.shared_rows import SharedRows, SharedRowsUnavailable, open_rows
from hylora.ops.host_to_device import host_to_device

log = logging.getLogger(__name__)
Kind = Literal["image", "video"]
DEFAULT_FRAME_LIST_FPS = 1.0  # vLLM's frame rate of a data:video/jpeg frame list without an fps
KEY_VERSION = "hylora-media-1"  # bump when preprocessing changes what the same parameters produce


@dataclass(frozen=True, eq=False)
class ProcessedMedia:
    kind: Kind
    # [t·h·w, C·temporal_patch·patch·patch], rows in merge-block order: float32 (the tower's input) or uint8
    # (resized pixels, which `table` normalises; pixels.py)
    pixels: torch.Tensor
    grid_thw: tuple[int, int, int]  # in patches
    merge_size: int
    key: str  # content hash for the media and encoder caches: the bytes and every parameter that changes the result
    timestamps: tuple[float, ...] = ()  # video: seconds of each temporal patch
    table: torch.Tensor | None = None  # float32 [C, 256]: each byte's normalised value, for uint8 pixels

    @property
    def pixel_values(self) -> torch.Tensor:
        """The tower's input: float32 rows on the host."""
        return self.rows(0, len(self.pixels))

    def rows(self, start: int, end: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """float32 rows [start, end) on `device`; uint8 rows travel as bytes and are normalised there. The
        copies (rows and byte table) go through page-locked memory: they do not wait for the step in flight."""
        part = host_to_device(self.pixels[start:end], device)
        return part if self.table is None else pixels.normalise_rows(part, host_to_device(self.table, device))

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
    cache: ProcessedCache | None = None,
) -> ProcessedMedia:
    """One image's rows (from `cache` when it holds them). `cancel` (set by the request's coroutine) stops
    the work before it decodes."""
    _check_bytes("image", data, limits)
    params = apply_overrides(cfg.image, overrides, limits)
    key = media_key("image", data, params)

    def run() -> ProcessedMedia:
        rows, grid = image.preprocess_image(image.decode_image(data, limits, cancel), params)
        table = pixels.byte_table(functools.partial(image.rescale_and_normalize, cfg=params), image.CHANNELS)
        return _finish("image", rows, grid, params, key, limits, table)

    return run() if cache is None else cache.get_or_process(key, run, cancel)


def process_video(
    data: bytes,
    cfg: MediaConfig,
    limits: MediaLimits,
    overrides: Mapping[str, Any] | None = None,
    cancel: CancelFlag | None = None,
    cache: ProcessedCache | None = None,
) -> ProcessedMedia:
    """One video's (or animated image's) rows (from `cache` when it holds them), within the decode budget;
    `cancel` stops it at the next frame."""
    _check_bytes("video", data, limits)
    params = apply_overrides(cfg.video, overrides, limits)
    key = media_key("video", data, params)

    def run() -> ProcessedMedia:
        return _video_rows(video.read_video(data, params, limits, cancel), params, key, limits)

    return run() if cache is None else cache.get_or_process(key, run, cancel)


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
    # PIL resizes and hashlib hashes without the GIL: the key is hashed beside the resizes
    key = frame_pool().submit(media_key, "video", memoryview(np.ascontiguousarray(frames)), params)

    def resized(k: int) -> np.ndarray:
        return image.resize(Image.fromarray(frames[indices[k]]), height, width, params.resample)

    rows = _frame_rows(resized, len(indices), height, width, params)
    return _video_item(rows, len(indices), height, width, indices, fps, params, key.result(), limits)


def process_frame_list(
    url: str,
    cfg: MediaConfig,
    limits: MediaLimits,
    overrides: Mapping[str, Any] | None = None,
    cancel: CancelFlag | None = None,
    cache: ProcessedCache | None = None,
) -> ProcessedMedia:
    """A video sent as its frames (`data:video/jpeg;base64,<frame>,...`), as vLLM takes it: every frame is
    used, none sampled (vLLM passes do_sample_frames=False), at `fps` frames a second for the timestamps (the
    request's or the server's `fps`, else vLLM's default of 1); resized under the video pixel budget and
    normalised like a decoded video's frames.

    Keyed by the URL's text, so a video another request sent (three task adapters asking about one video) is
    found in `cache` without decoding its base64 again. Otherwise every frame's base64 is decoded first (a
    fraction of a millisecond for 20 frames of 720p, so a broken frame is refused before any JPEG work), then
    each frame is decoded as a JPEG, resized and written into the rows: by the frame processes where the server
    runs them (the rows in shared memory), else on the frame pool."""
    parts = split_frame_list(url, limits.max_bytes, limits.max_frames)
    params = apply_overrides(cfg.video, overrides, limits)
    rate = float((overrides or {}).get("fps") or DEFAULT_FRAME_LIST_FPS)
    key = media_key("video", f"frames {rate!r}\0".encode() + url.encode("utf-8", "surrogatepass"), params)

    def run() -> ProcessedMedia:
        frames = [frame_bytes(parts, i) for i in range(len(parts))]
        first = _decode_list_frame(frames[0], 0, limits, cancel)
        width, height = first.size  # every frame must have it: the decode budget is planned from it
        DecodeBudget(limits.max_decode_pixels, cancel, "the frame list").check_plan(len(parts), width, height)
        target = video.smart_resize(len(parts), height, width, params)
        made = image.resize(first, *target, params.resample)
        calls = [(frames[i], i, first.size, target, params, limits) for i in range(1, len(parts))]
        rows = _rows_in_processes(made, calls, len(parts), params, cancel)
        if rows is None:  # each frame decoded and resized at once: memory holds resized ones
            frame = lambda i: made if i == 0 else list_frame(*calls[i - 1], cancel)  # noqa: E731
            rows = _frame_rows(frame, len(parts), *target, params)
        return _video_item(rows, len(parts), *target, np.arange(len(parts)), rate, params, key, limits)

    return run() if cache is None else cache.get_or_process(key, run, cancel)


def list_frame(
    data: bytes,
    index: int,
    size: tuple[int, int],
    target: tuple[int, int],
    params: VisionParams,
    limits: MediaLimits,
    cancel: CancelFlag | None = None,
) -> np.ndarray:
    """Frame `index` of a frame list, which must be `size` (width, height: frame 0's), resized to `target`
    (height, width): uint8 [H, W, 3]."""
    frame = _decode_list_frame(data, index, limits, cancel)
    if frame.size != size:
        raise MediaError(
            f"frame {index} of the frame list is {frame.width}x{frame.height}, frame 0 is {size[0]}x{size[1]}: "
            "send the frames of a video at one size"
        )
    return image.resize(frame, *target, params.resample)


def list_frame_into(
    path: str, shape: tuple[int, int], count: int, data: bytes, index: int, size: tuple[int, int],
    target: tuple[int, int], params: VisionParams, limits: MediaLimits,
) -> None:  # fmt: skip
    """`list_frame` written into the shared rows at `path` (shared_rows.py) of `count` frames: a frame process's
    task."""
    made = list_frame(data, index, size, target, params, limits)
    _write_frame(open_rows(path, shape), index, made, count, params)


def _rows_in_processes(
    first: np.ndarray, calls: list[tuple[Any, ...]], count: int, params: VisionParams, cancel: CancelFlag | None
) -> torch.Tensor | None:
    """The rows of frame 0 (`first`, made here) and `calls`' frames, made and written by the frame processes
    into shared memory; None where the server runs none or /dev/shm has no room (the frame pool then does)."""
    workers = frame_processes()
    if workers is None:
        return None
    height, width = first.shape[:2]
    shape = pixels.rows_shape(count, height, width, image.CHANNELS, params.patch_size, params.temporal_patch_size)
    try:
        shared = SharedRows(shape)
    except SharedRowsUnavailable as e:
        _warn_no_shared_rows(e)
        return None
    with shared:
        _write_frame(shared.rows.numpy(), 0, first, count, params)
        try:
            for _ in workers.map(list_frame_into, [(shared.path, shape, count, *call) for call in calls]):
                if cancel is not None:
                    cancel.check()
        except WorkerCrashed as e:
            raise MediaError(
                f"frame {e.index + 1} of the frame list crashed the JPEG decoder's process: send valid JPEG frames"
            ) from None
        return shared.rows


_warned: set[str] = set()


def _warn_no_shared_rows(error: Exception) -> None:
    """Once per process: a full /dev/shm would otherwise log a line for every video."""
    if "shm" not in _warned:
        _warned.add("shm")
        log.warning(
            "frame lists are decoded in the server's own process while /dev/shm has no room (%s); give the "
            "container a larger /dev/shm (docker --shm-size 8g, or --ipc=host)",
            error,
        )


def _decode_list_frame(data: bytes, index: int, limits: MediaLimits, cancel: CancelFlag | None) -> Image.Image:
    try:
        return image.decode_image(data, limits, cancel)
    except MediaError as e:
        raise MediaError(f"frame {index} of the frame list: {e}") from None


def _frame_rows(
    frame: Callable[[int], np.ndarray], count: int, height: int, width: int, params: VisionParams
) -> torch.Tensor:
    """The rows of frames 0..count-1 (uint8 [height, width, 3] each, made by `frame`): a task of the frame
    pool per frame, which makes the frame and writes it into the rows, queued behind the frames submitted
    before (pools.map_frames)."""
    rows = pixels.empty_rows(count, height, width, image.CHANNELS, params.patch_size, params.temporal_patch_size)
    map_frames(lambda i: _write_frame(rows.numpy(), i, frame(i), count, params), count)
    return rows


def _write_frame(rows: np.ndarray, i: int, made: np.ndarray, count: int, params: VisionParams) -> None:
    """Frame i of `count` into the rows; the last frame also fills the rest of its temporal patch."""
    p, m, tp = params.patch_size, params.merge_size, params.temporal_patch_size
    for slot in range(i, pixels.padded_count(count, tp) if i == count - 1 else i + 1):
        pixels.write_frame_rows(rows, slot, made, p, m, tp)


def _video_rows(sampled: video.SampledVideo, params: VisionParams, key: str, limits: MediaLimits) -> ProcessedMedia:
    rows = pixels.patchify(sampled.frames, params.patch_size, params.merge_size, params.temporal_patch_size)
    n, height, width = len(sampled.frames), *sampled.frames.shape[1:3]
    return _video_item(rows, n, height, width, sampled.indices, sampled.fps, params, key, limits)


def _video_item(
    rows: torch.Tensor,
    count: int,
    height: int,
    width: int,
    indices: np.ndarray,
    fps: float,
    params: VisionParams,
    key: str,
    limits: MediaLimits,
) -> ProcessedMedia:
    """A video's item from its rows: `count` frames of height×width, `indices` in the source at `fps`."""
    table = pixels.byte_table(functools.partial(video.rescale_and_normalize, cfg=params), image.CHANNELS)
    grid = (-(-count // params.temporal_patch_size), height // params.patch_size, width // params.patch_size)
    stamps = tuple(video.timestamps(indices, fps, params.temporal_patch_size))
    return _finish("video", rows, grid, params, key, limits, table, stamps)


def media_key(kind: Kind, data: bytes | memoryview, params: VisionParams) -> str:
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
    rows: torch.Tensor,
    grid: tuple[int, int, int],
    params: VisionParams,
    key: str,
    limits: MediaLimits,
    table: torch.Tensor,
    stamps: tuple[float, ...] = (),
) -> ProcessedMedia:
    item = ProcessedMedia(kind, rows, grid, params.merge_size, key, stamps, table)
    check_visual_tokens([item], limits)
    return item
