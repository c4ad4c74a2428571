"""Videos: PyAV decoding from bytes, Qwen3-VL frame sampling, the pixel budget over all frames, timestamps.

Rules from transformers' `Qwen3VLVideoProcessor` (sampling, smart_resize, patch padding, fused normalise) and
`Qwen3VLProcessor._calculate_timestamps`; metadata as its PyAV reader reads it (`stream.frames`,
`stream.average_rate`). Frames are resized with PIL bicubic (transformers uses torchvision, which is not
usable here) as they are decoded, so memory holds the resized frames only.

Decoding is bounded by `MediaLimits.max_decode_pixels` (budget.py): the plan (frame count × frame size) is
checked from the header before the first frame, counting packets where the header has no frame count, and
every decoded frame is charged at its full size; the request's cancel flag is checked at every frame.
A header without a frame count (webm, matroska) costs two passes, each within the budget: one to count the
frames, one to decode the sampled ones.
"""

from __future__ import annotations

import io
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image

from hylora.media.budget import CancelFlag, DecodeBudget
from hylora.media.config import MediaLimits, VideoConfig
from hylora.media.errors import MediaError
from hylora.media.image import check_aspect_ratio, resize

if TYPE_CHECKING:
    import av

DEFAULT_FPS = 24.0  # transformers' fallback when a video has no frame rate


@dataclass(frozen=True)
class SampledVideo:
    frames: np.ndarray  # uint8 [N, H, W, 3], already resized
    indices: np.ndarray  # source frame index of each sampled frame
    fps: float  # source frame rate
    total_frames: int


def sample_indices(total_frames: int, source_fps: float, cfg: VideoConfig) -> np.ndarray:
    """`Qwen3VLVideoProcessor.sample_frames`: n = int(total / source_fps × fps) clamped to
    [min_frames, max_frames] and to the total, or an explicit `num_frames` (not clamped: indices repeat)."""
    if not cfg.do_sample_frames:
        return np.arange(total_frames)
    num_frames = cfg.num_frames
    if num_frames is None and cfg.fps is not None:
        num_frames = int(total_frames / source_fps * cfg.fps)
        num_frames = min(max(num_frames, cfg.min_frames), cfg.max_frames, total_frames)
    if num_frames is None:
        num_frames = min(max(total_frames, cfg.min_frames), cfg.max_frames)
    return np.linspace(0, total_frames - 1, num_frames).round().astype(int)


def smart_resize(num_frames: int, height: int, width: int, cfg: VideoConfig) -> tuple[int, int]:
    """Qwen3-VL's video rule: like the image rule, but the pixel budget covers all frames together."""
    factor, temporal = cfg.factor, cfg.temporal_patch_size
    max_pixels = cfg.max_pixels
    if cfg.cap_pixels_per_frame:
        frame_cap = cfg.max_video_tokens * factor * factor
        max_pixels = max(min(frame_cap, cfg.max_pixels // num_frames), int(cfg.min_pixels * 1.05)) * num_frames
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    check_aspect_ratio(height, width)
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal) * temporal
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < cfg.min_pixels:
        beta = math.sqrt(cfg.min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def timestamps(indices: np.ndarray, source_fps: float, temporal_patch_size: int) -> list[float]:
    """Seconds of each temporal patch: the mean of its first and last frame's index / source fps
    (`Qwen3VLProcessor._calculate_timestamps`; the padding frame repeats the last index)."""
    idx = indices.tolist()
    idx += idx[-1:] * (-len(idx) % temporal_patch_size)
    times = [i / source_fps for i in idx]
    return [(times[i] + times[i + temporal_patch_size - 1]) / 2 for i in range(0, len(times), temporal_patch_size)]


def rescale_and_normalize(frames: np.ndarray, cfg: VideoConfig) -> np.ndarray:
    """uint8 [N, H, W, C] → float32 [N, C, H, W]. The video processor fuses rescale into the mean and std
    ((x - mean/scale) / (std/scale), float32), which differs from the image path in the last bit."""
    x = np.moveaxis(frames, -1, 1).astype(np.float32)
    if cfg.do_normalize:
        mean = np.asarray(cfg.image_mean, dtype=np.float32)
        std = np.asarray(cfg.image_std, dtype=np.float32)
        if cfg.do_rescale:
            inv = np.float32(1.0 / cfg.rescale_factor)
            mean, std = mean * inv, std * inv
        return (x - mean[:, None, None]) / std[:, None, None]
    return x * np.float32(cfg.rescale_factor) if cfg.do_rescale else x


def read_video(data: bytes, cfg: VideoConfig, limits: MediaLimits, cancel: CancelFlag | None = None) -> SampledVideo:
    """Decode the sampled frames of `data`, resized to the size the budget allows.

    Refuses by stream metadata before decoding where it can (pixels, frame count, pixels × frames); a header
    that says 0 frames (webm / matroska) is checked by counting packets, then counted by decoding, stopping at
    `limits.max_source_frames`.
    """
    with _open(data) as container:
        stream = _video_stream(container)
        width, height = stream.codec_context.width, stream.codec_context.height
        _check_pixels(width, height, limits)
        rate = stream.average_rate or stream.guessed_rate
        fps = float(rate) if rate else DEFAULT_FPS
        total = stream.frames
        if total > limits.max_source_frames:
            raise MediaError(f"video has {total} frames; the server decodes at most {limits.max_source_frames}")
        planned = total if total > 0 else _count_packets(container, stream, limits, width * height, cancel)
        _budget(limits, cancel).check_plan(planned, width, height)
    if total <= 0:
        total = _count_frames(data, limits, _budget(limits, cancel))
    if total == 0:
        raise MediaError("video has no decodable frames")
    indices = sample_indices(total, fps, cfg)
    if len(indices) > limits.max_frames:
        raise MediaError(f"{len(indices)} frames sampled; the server takes at most {limits.max_frames} per video")
    if len(indices) < cfg.temporal_patch_size:
        raise MediaError(
            f"video has {len(indices)} frame(s) to sample; it needs at least {cfg.temporal_patch_size} "
            "(send a single frame as an image)"
        )
    frames = _decode_frames(data, indices, cfg, limits, total, _budget(limits, cancel))
    return SampledVideo(frames=frames, indices=indices, fps=fps, total_frames=total)


def _open(data: bytes) -> av.container.InputContainer:
    import av  # only decoding needs PyAV

    try:
        try:
            return av.open(io.BytesIO(data), mode="r", metadata_errors="ignore")
        except TypeError:  # PyAV 19 (Python >= 3.12) has no metadata_errors
            return av.open(io.BytesIO(data), mode="r")
    except (av.FFmpegError, OSError, ValueError) as e:
        raise MediaError(f"could not open video: unknown container format or corrupt file ({e})") from e


def _video_stream(container: av.container.InputContainer) -> av.VideoStream:
    if not container.streams.video:
        raise MediaError("the file has no video stream")
    stream = container.streams.video[0]
    if stream.codec_context is None:
        raise MediaError("the video codec is unknown or unsupported (h264, h265, vp8, vp9, av1, mpeg4 work)")
    stream.thread_type = "AUTO"
    return stream


def _check_pixels(width: int, height: int, limits: MediaLimits) -> None:
    if width * height > limits.max_source_pixels:
        raise MediaError(
            f"video frames are {width}x{height} = {width * height} pixels; the server accepts at most "
            f"{limits.max_source_pixels} pixels per frame"
        )


def _budget(limits: MediaLimits, cancel: CancelFlag | None) -> DecodeBudget:
    return DecodeBudget(limits.max_decode_pixels, cancel)


def _count_packets(
    container: av.container.InputContainer, stream: av.VideoStream, limits: MediaLimits, pixels: int, cancel
) -> int:
    """Packets of the video stream (one a frame for most codecs; an animated GIF's frames are packets), read
    without decoding, stopping once they are more than the frame cap or the decode budget allows."""
    import av

    most = min(limits.max_source_frames, limits.max_decode_pixels // max(pixels, 1))
    count = 0
    try:
        for packet in container.demux(stream):
            if cancel is not None:
                cancel.check()
            count += packet.size > 0
            if count > most:
                break
    except (av.FFmpegError, OSError, ValueError):
        pass  # a corrupt tail: decoding says so, with a better message
    if count > limits.max_source_frames:
        raise MediaError(f"video has more than {limits.max_source_frames} frames, the most the server decodes")
    return count


def _frames(
    container: av.container.InputContainer, stream: av.VideoStream, limits: MediaLimits, budget: DecodeBudget
) -> Iterator[av.VideoFrame]:
    import av

    decoded = 0
    try:
        for frame in container.decode(stream):
            _check_pixels(frame.width, frame.height, limits)
            budget.charge(frame.width, frame.height)
            yield frame
            decoded += 1
    except (av.FFmpegError, OSError, ValueError) as e:
        if isinstance(e, MediaError):
            raise
        raise MediaError(f"video data is corrupt or truncated: decoding failed after {decoded} frames ({e})") from e


def _count_frames(data: bytes, limits: MediaLimits, budget: DecodeBudget) -> int:
    with _open(data) as container:
        count = 0
        for _ in _frames(container, _video_stream(container), limits, budget):
            count += 1
            if count > limits.max_source_frames:
                raise MediaError(f"video has more than {limits.max_source_frames} frames, the most the server decodes")
        return count


def _decode_frames(
    data: bytes, indices: np.ndarray, cfg: VideoConfig, limits: MediaLimits, total: int, budget: DecodeBudget
) -> np.ndarray:
    wanted = Counter(indices.tolist())  # an explicit num_frames above the total repeats indices
    last = int(indices[-1])
    out: list[np.ndarray] = []
    source_size = target = None
    with _open(data) as container:
        index = -1
        for index, frame in enumerate(_frames(container, _video_stream(container), limits, budget)):
            if index in wanted:
                if source_size is None:
                    source_size = (frame.height, frame.width)
                    target = smart_resize(len(indices), frame.height, frame.width, cfg)
                elif (frame.height, frame.width) != source_size:
                    raise MediaError("video changes resolution mid-stream; re-encode it at one resolution")
                image = Image.fromarray(frame.to_ndarray(format="rgb24"))
                out.extend([resize(image, *target, cfg.resample)] * wanted[index])
            if index >= last:
                break
    if index < last:
        raise MediaError(
            f"video is truncated: it ended after {index + 1} frames but its header says {total}; send the complete file"
        )
    return np.stack(out)
