"""Image and video input: fetch the bytes, turn them into vision-tower rows, expand the prompt."""

from hylora.media.config import MediaConfig, MediaLimits
from hylora.media.errors import MediaError
from hylora.media.fetch import FetchPolicy, fetch_bytes
from hylora.media.processor import ProcessedMedia, check_visual_tokens, process_image, process_video
from hylora.media.prompt import VisionTokens, expand_prompt_ids

__all__ = [
    "FetchPolicy",
    "MediaConfig",
    "MediaError",
    "MediaLimits",
    "ProcessedMedia",
    "VisionTokens",
    "check_visual_tokens",
    "expand_prompt_ids",
    "fetch_bytes",
    "process_image",
    "process_video",
]
