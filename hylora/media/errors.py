"""The one exception of the media package."""

from __future__ import annotations


class MediaError(ValueError):
    """An image or video the server will not take; the message tells the client what to fix (HTTP 400)."""
