"""Chat messages with images and videos → prompt token ids with expanded placeholders + the media
(the server, the offline `LLM.chat` and `hylora generate` share it).

vLLM's request shapes: content parts `{"type": "image_url", "image_url": {"url": ...}}` and
`{"type": "video_url", "video_url": {"url": ...}}` (data:, file:// under the allowed local path,
http(s) to allowed hosts). Every bad input is a MediaError, which the server answers with a 400 that says
what to fix.

Where the work runs (hylora/media/pools.py): http(s) transfers on the event loop, data: / file:// reads on
the media fetch pool, decoding on the decode pool (a `data:video/jpeg` frame list's base64 too), the chat
template and tokenising on the render pool, never on the loop's default executor. A request's items load
concurrently, within its per-request slots, as one task group: the first failure cancels the rest (their
fetches at once, their decodes at the next frame), and so does the caller's cancellation (the client left).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hylora.config import VisionConfig
from hylora.engine.multimodal import MultimodalPrompt, build_multimodal_prompt
from hylora.media import (
    CancelFlag,
    Cancelled,
    FetchPolicy,
    MediaConfig,
    MediaError,
    MediaLimits,
    MediaPools,
    ProcessedMedia,
    VisionTokens,
    check_visual_tokens,
    expand_prompt_ids,
    fetch_url,
    http_client,
    process_image,
    process_video,
    shared_pools,
)
from hylora.media.cache import ProcessedCache
from hylora.media.config import layer_overrides
from hylora.media.fetch import is_frame_list
from hylora.media.pools import RequestSlots
from hylora.media.processor import process_frame_list
from hylora.tokenizer import PromptTooLong, chat_prompt

MEDIA_PARTS = {"image_url": "image", "video_url": "video"}


@dataclass
class MediaSettings:
    """What the server accepts (from its flags) and how it preprocesses (from the checkpoint)."""

    config: MediaConfig
    vision: VisionConfig
    tokens: VisionTokens
    limits: MediaLimits = field(default_factory=MediaLimits)
    policy: FetchPolicy = field(default_factory=FetchPolicy)
    limit_per_prompt: dict[str, int] = field(default_factory=lambda: {"image": 8, "video": 2})
    processor_kwargs: dict[str, Any] = field(default_factory=dict)  # server defaults (--mm-processor-kwargs)
    pools: MediaPools = field(default_factory=shared_pools)
    # preprocessed media by content (--mm-processor-cache-gb); None: every request processes its own
    cache: ProcessedCache | None = field(default_factory=ProcessedCache.from_gb)

    @classmethod
    def for_model(cls, model_dir: Path, vision: VisionConfig, tokenizer, **settings: Any) -> MediaSettings:
        return cls(MediaConfig.from_model_dir(model_dir), vision, VisionTokens.from_tokenizer(tokenizer), **settings)


@dataclass
class MediaRef:
    kind: str  # "image" | "video"
    url: str


def has_media(messages: list[Mapping[str, Any]]) -> bool:
    return any(
        isinstance(m.get("content"), list) and any(_part_type(p) in MEDIA_PARTS for p in m["content"]) for m in messages
    )


def normalise(messages: list[Mapping[str, Any]]) -> tuple[list[dict[str, Any]], list[MediaRef]]:
    """Messages as the chat template takes them (text, and `{"type": "image"}` / `{"type": "video"}`
    where a media part was) and the media in prompt order."""
    out, refs = [], []
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list):
            out.append({**m, "content": content or ""})
            continue
        parts = []
        for j, part in enumerate(content):
            kind = _part_type(part)
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise MediaError(f"a text content part needs a string 'text', got {part.get('text')!r:.80}")
                parts.append({"type": "text", "text": part["text"]})
            elif kind in MEDIA_PARTS:
                refs.append(MediaRef(MEDIA_PARTS[kind], _url(part, kind, f"messages[{i}].content[{j}]")))
                parts.append({"type": MEDIA_PARTS[kind]})
            else:
                raise MediaError(
                    f"messages[{i}].content[{j}]: content parts of type {kind!r} are not supported "
                    "(text, image_url, video_url)"
                )
        out.append({**m, "content": parts})
    return out, refs


async def multimodal_prompt(
    settings: MediaSettings,
    tokenizer,
    messages: list[Mapping[str, Any]],
    overrides: Mapping[str, Any] | None = None,
    *,
    max_chars: int | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> tuple[list[int], MultimodalPrompt]:
    """Fetch and preprocess every image and video (concurrently, on the media pools), render the chat
    template and expand its placeholders. Raises MediaError for anything the client must fix, and
    PromptTooLong when the rendered text has more than `max_chars` characters (checked before tokenising).
    The first of these cancels the request's other media work, as does cancelling this coroutine."""
    normalised, refs = normalise(messages)
    for kind in ("image", "video"):
        count, limit = sum(r.kind == kind for r in refs), settings.limit_per_prompt.get(kind, 0)
        if count > limit:
            raise MediaError(
                f"the request has {count} {kind}s; this server allows {limit} per prompt (--limit-mm-per-prompt)"
            )
    if overrides is not None and not isinstance(overrides, Mapping):
        raise MediaError("mm_processor_kwargs must be a JSON object")
    kwargs = layer_overrides(settings.processor_kwargs, overrides)
    pools, cancel = settings.pools, CancelFlag()
    try:
        async with _client_for(refs, pools) as client, asyncio.TaskGroup() as group:
            slots = pools.request_slots()
            loads = [group.create_task(_load(settings, ref, kwargs, slots, client, cancel)) for ref in refs]
            render = group.create_task(
                pools.run(
                    pools.render,
                    _render,
                    tokenizer,
                    normalised,
                    max_chars,
                    dict(template_kwargs or {}),
                    add_generation_prompt,
                    continue_final_message,
                )
            )
    except BaseExceptionGroup as failed:
        cancel.set()
        raise _first(failed) from None
    except BaseException:  # cancelled: the client left
        cancel.set()
        raise
    items = [task.result() for task in loads]
    check_visual_tokens(items, settings.limits)
    return await pools.run(pools.render, _expand, settings, tokenizer, render.result(), items)


async def _load(
    settings: MediaSettings,
    ref: MediaRef,
    kwargs: dict[str, Any],
    slots: RequestSlots,
    client,
    cancel: CancelFlag,
) -> ProcessedMedia:
    pools, limits = settings.pools, settings.limits
    try:
        if ref.kind == "video" and is_frame_list(ref.url):  # the frames themselves, already sampled
            async with slots.decode:
                return await pools.run(
                    pools.decode, process_frame_list, ref.url, settings.config, limits, kwargs, cancel, settings.cache
                )
        async with slots.fetch:
            data = await fetch_url(ref.url, settings.policy, limits.max_bytes, client=client, pools=pools)
        process, pool = (process_image, pools.image_decode) if ref.kind == "image" else (process_video, pools.decode)
        async with slots.decode:
            return await pools.run(pool, process, data, settings.config, limits, kwargs, cancel, settings.cache)
    except BaseException:  # this item failed or the request is going away: every decode of it stops
        cancel.set()
        raise


def _client_for(refs: list[MediaRef], pools: MediaPools) -> contextlib.AbstractAsyncContextManager:
    """One http client for the request's http(s) items (none without them)."""
    if not any(ref.url[:8].lower().startswith(("http://", "https://")) for ref in refs):
        return contextlib.nullcontext()

    @contextlib.asynccontextmanager
    async def opened():
        async with await http_client(pools) as client:
            yield client

    return opened()


def _first(group: BaseExceptionGroup) -> BaseException:
    """The first exception of a failed task group that is not a decode stopped because of it."""
    flat = [_first(e) if isinstance(e, BaseExceptionGroup) else e for e in group.exceptions]
    return next((e for e in flat if not isinstance(e, Cancelled)), flat[0])


def _expand(settings: MediaSettings, tokenizer, ids: list[int], items: list[ProcessedMedia]):
    expanded = expand_prompt_ids(ids, items, tokenizer, settings.tokens)
    try:
        return expanded, build_multimodal_prompt(expanded, items, settings.vision)
    except ValueError as e:  # placeholders typed into the text, for instance
        raise MediaError(f"the prompt's image / video placeholders do not fit its media: {e}") from None


def _render(
    tokenizer,
    messages: list[dict[str, Any]],
    max_chars: int | None,
    template_kwargs: dict[str, Any],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> list[int]:
    try:
        return chat_prompt(
            tokenizer, messages, add_generation_prompt, continue_final_message=continue_final_message,
            max_chars=max_chars, **template_kwargs,
        )  # fmt: skip
    except PromptTooLong:
        raise
    except Exception as e:
        roles = sorted({str(m.get("role")) for m in messages if m.get("role") != "user" and _has_media_part(m)})
        hint = f" (images and videos in {', '.join(roles)} messages: put them in a user message)" if roles else ""
        raise MediaError(f"the chat template cannot render these messages{hint}: {e}") from None


def _has_media_part(message: Mapping[str, Any]) -> bool:
    content = message.get("content")
    return isinstance(content, list) and any(_part_type(p) not in (None, "text") for p in content)


def _part_type(part: Any) -> str | None:
    """A part's `type`; a list or an object sent there becomes its repr (refused as an unknown type,
    where hashing it would raise)."""
    kind = part.get("type") if isinstance(part, Mapping) else None
    return kind if kind is None or isinstance(kind, str) else repr(kind)


def _url(part: Mapping[str, Any], kind: str, where: str) -> str:
    value = part.get(kind)
    url = value.get("url") if isinstance(value, Mapping) else value
    if not isinstance(url, str) or not url:
        raise MediaError(f'{where}: expected {{"type": "{kind}", "{kind}": {{"url": "..."}}}}')
    return url
