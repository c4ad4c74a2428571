"""How much one video or animated image may decode, and the flag that stops a request's decoding.

A decode is charged width × height for every frame it decodes (an animated GIF / APNG frame at its full
canvas size, which is what FFmpeg hands back), checked before each frame is used; the plan is checked from
the container's header before the first frame. Decoding runs on worker threads that asyncio cannot stop, so
the request's `CancelFlag` is checked at the same place: once the request failed or its client left, the
decode ends at its next frame.
"""

from __future__ import annotations

import threading

from hylora.media.errors import MediaError


class Cancelled(Exception):
    """The request that wanted this work is gone (it failed or its client left); nobody reads the result."""


class CancelFlag:
    """Set once by the coroutine that owns a request's media work; read by its worker threads."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def set(self) -> None:
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def check(self) -> None:
        if self._event.is_set():
            raise Cancelled


class DecodeBudget:
    """Pixels × frames one pass over a stream may decode (`MediaLimits.max_decode_pixels`)."""

    def __init__(self, max_pixels: int, cancel: CancelFlag | None = None, what: str = "the video"):
        self.max_pixels, self.cancel, self.what = max_pixels, cancel, what
        self.used = 0

    def check_plan(self, frames: int, width: int, height: int) -> None:
        """Refuse from the header: `frames` frames of `width` x `height` would not fit."""
        if frames * width * height > self.max_pixels:
            raise MediaError(
                f"{self.what} has {frames} frames of {width}x{height}: {frames * width * height} pixels to decode; "
                f"the server decodes at most {self.max_pixels} pixels (width x height x frames) per video"
            )

    def charge(self, width: int, height: int) -> None:
        """One more frame of `width` x `height`; raises Cancelled or a MediaError once over."""
        if self.cancel is not None:
            self.cancel.check()
        self.used += width * height
        if self.used > self.max_pixels:
            raise MediaError(
                f"{self.what} needs more than {self.max_pixels} decoded pixels (width x height x frames), "
                "the most the server decodes per video"
            )
