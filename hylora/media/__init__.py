"""Image and video input: fetch the bytes, turn them into vision-tower rows, expand the prompt."""

from hylora.media.budget import CancelFlag, Cancelled, DecodeBudget
from hylora.media.cache import ProcessedCache
from hylora.media.config import MediaConfig, MediaLimits
from hylora.media.errors import MediaError
from hylora.media.fetch import FetchPolicy, fetch_bytes, fetch_url, http_client
from hylora.media.pools import MediaPools, shared_pools
from hylora.media.processor import ProcessedMedia, check_visual_tokens, process_image, process_video
from hylora.media.prompt import VisionTokens, expand_prompt_ids

__all__ = [
    "CancelFlag",
    "Cancelled",
    "DecodeBudget",
    "FetchPolicy",
    "MediaConfig",
    "MediaError",
    "MediaLimits",
    "MediaPools",
    "ProcessedCache",
    "ProcessedMedia",
    "VisionTokens",
    "check_visual_tokens",
    "expand_prompt_ids",
    "fetch_bytes",
    "fetch_url",
    "http_client",
    "process_image",
    "process_video",
    "shared_pools",
]
