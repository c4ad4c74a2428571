"""Offline API: `LLM(model_dir).generate(prompts, SamplingParams(...), lora=...)`."""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from dataclasses import fields
from pathlib import Path
from typing import Any

from tqdm import tqdm

from hylora.adapters.registry import UnknownAdapter
from hylora.engine.chat_input import MediaSettings, has_media, multimodal_prompt
from hylora.engine.config import EngineConfig
from hylora.engine.engine import LLMEngine, RequestOutput
from hylora.engine.errors import RequestError
from hylora.engine.multimodal import MultimodalPrompt
from hylora.engine.request import FailureKind, SamplingParams
from hylora.media import FetchPolicy, MediaError
from hylora.tokenizer import PromptTooLong, chat_prompt

Prompt = str | list[int]
Conversation = list[dict[str, Any]]
WAIT_S = 0.1  # how often an idle chat() looks whether its preparing thread is still alive


class LLM:
    def __init__(self, model_dir: str | Path, lora_modules: dict[str, str | Path] | None = None, **config):
        known = {f.name for f in fields(EngineConfig)}
        unknown = set(config) - known
        if unknown:
            raise TypeError(f"unknown engine options {sorted(unknown)}; known: {sorted(known)}")
        self.engine = LLMEngine(model_dir, EngineConfig(**config), lora_modules=lora_modules, progress=False)
        self.model_dir = Path(model_dir)
        self._ids = itertools.count()
        self._media_settings: dict[Path | None, MediaSettings] = {}

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def chat(
        self,
        messages: Conversation | list[Conversation],
        params: SamplingParams | list[SamplingParams] | None = None,
        lora: str | None | list[str | None] = None,
        media_root: str | Path | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        use_tqdm: bool = False,
    ) -> RequestOutput | list[RequestOutput]:
        """Conversations in OpenAI's message format: one (→ its output; bad input raises) or a list
        (→ outputs in order, batched by the scheduler; a conversation whose media or adapter is bad
        gets an output with `error` set and the others run). image_url / video_url parts take data:
        URLs, or file:// URLs under `media_root`.

        Media are fetched and preprocessed on the media pools while the engine already runs the
        conversations that are ready; an image or video in several conversations (one video, several
        adapters) is decoded once, and the same in later calls (the preprocessed-media cache)."""
        single = not messages or not isinstance(messages[0], list)
        convs: list[Conversation] = [messages] if single else messages  # type: ignore[list-item]
        params_list, lora_list = _per_prompt(params, lora, len(convs))
        settings = self._media(media_root) if any(has_media(c) for c in convs) else None
        ready: queue.Queue[tuple[int, list[int] | BaseException, MultimodalPrompt | None]] = queue.Queue()
        preparing = threading.Thread(
            target=asyncio.run,
            args=(self._prepare(convs, settings, mm_processor_kwargs, ready),),
            name="hylora-offline-inputs",
            daemon=True,
        )
        preparing.start()
        results: list[RequestOutput | None] = [None] * len(convs)
        order: dict[str, int] = {}
        bar = tqdm(total=len(convs), desc="generating", disable=not use_tqdm)
        waiting = len(convs)  # conversations not yet prepared
        try:
            while any(r is None for r in results):
                while waiting:  # add what is ready; wait for the next one when there is nothing to run
                    try:
                        i, ids, mm = ready.get(block=not self.engine.has_unfinished(), timeout=WAIT_S)
                    except queue.Empty:
                        if not preparing.is_alive() and ready.empty():
                            raise RuntimeError("preparing the conversations stopped before all were ready") from None
                        if self.engine.has_unfinished():
                            break
                        continue
                    waiting -= 1
                    rid = f"offline-{next(self._ids)}"
                    try:
                        if isinstance(ids, BaseException):
                            raise ids
                        self.engine.add_request(rid, ids, params_list[i], lora_list[i], mm=mm)
                        order[rid] = i
                    except (MediaError, RequestError, PromptTooLong, ValueError, UnknownAdapter) as e:
                        if single:
                            raise
                        results[i] = RequestOutput(rid, [], [], "", True, "error", str(e), FailureKind.INVALID_REQUEST)
                        bar.update()
                for out in self.engine.step() if self.engine.has_unfinished() else ():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        bar.update()
        finally:
            for rid, i in order.items():  # interrupted (an error, Ctrl-C): nothing is left running
                if results[i] is None:
                    self.engine.abort(rid)
            bar.close()
        return results[0] if single else results  # type: ignore[return-value]

    def _media(self, media_root: str | Path | None) -> MediaSettings:
        """The media settings for `media_root`, made once (their preprocessed-media cache lives on)."""
        root = Path(media_root).resolve() if media_root is not None else None
        if root not in self._media_settings:
            settings = self.engine.media_settings(policy=FetchPolicy(root))
            if settings is None:
                raise ValueError("this model has no vision tower: send text only")
            self._media_settings[root] = settings
        return self._media_settings[root]

    async def _prepare(
        self,
        convs: list[Conversation],
        settings: MediaSettings | None,
        mm_processor_kwargs: dict[str, Any] | None,
        ready: queue.Queue,
    ) -> None:
        """Each conversation's prompt ids and media, all at once (the media pools bound the work), put
        on `ready` as each is done: (index, ids or the error, media)."""

        async def one(i: int, conv: Conversation) -> None:
            try:
                if settings is not None and has_media(conv):
                    ids, mm = await multimodal_prompt(settings, self.tokenizer, conv, mm_processor_kwargs)
                else:
                    ids, mm = chat_prompt(self.tokenizer, conv), None
                ready.put((i, ids, mm))
            except Exception as e:
                ready.put((i, e, None))

        await asyncio.gather(*(one(i, c) for i, c in enumerate(convs)))

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        params: SamplingParams | list[SamplingParams] | None = None,
        lora: str | None | list[str | None] = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion (batched by the scheduler); outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        n = len(prompts)
        params_list, lora_list = _per_prompt(params, lora, n)
        order = {}
        for prompt, p, adapter in zip(prompts, params_list, lora_list, strict=True):
            rid = f"offline-{next(self._ids)}"
            order[rid] = len(order)
            self.engine.add_request(rid, prompt, p, adapter)  # type: ignore[arg-type]
        results: list[RequestOutput | None] = [None] * n
        bar = tqdm(total=n, desc="generating", disable=not use_tqdm)
        while any(r is None for r in results):
            for out in self.engine.step():
                if out.finished and out.request_id in order:
                    results[order[out.request_id]] = out
                    bar.update()
        bar.close()
        return results  # type: ignore[return-value]


def _per_prompt(
    params: SamplingParams | list[SamplingParams] | None, lora: str | None | list[str | None], n: int
) -> tuple[list[SamplingParams], list[str | None]]:
    params_list = params if isinstance(params, list) else [params or SamplingParams()] * n
    lora_list = lora if isinstance(lora, list) else [lora] * n
    if len(params_list) != n or len(lora_list) != n:
        raise ValueError("params and lora lists must have one entry per prompt")
    return params_list, lora_list
