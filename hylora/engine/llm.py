"""Offline API: `LLM(model_dir).generate(prompts, SamplingParams(...), lora=...)`."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import fields
from pathlib import Path
from typing import Any

from tqdm import tqdm

from hylora.engine.chat_input import has_media, multimodal_prompt
from hylora.engine.config import EngineConfig
from hylora.engine.engine import LLMEngine, RequestOutput
from hylora.engine.request import SamplingParams
from hylora.media import FetchPolicy
from hylora.tokenizer import chat_prompt

Prompt = str | list[int]


class LLM:
    def __init__(self, model_dir: str | Path, lora_modules: dict[str, str | Path] | None = None, **config):
        known = {f.name for f in fields(EngineConfig)}
        unknown = set(config) - known
        if unknown:
            raise TypeError(f"unknown engine options {sorted(unknown)}; known: {sorted(known)}")
        self.engine = LLMEngine(model_dir, EngineConfig(**config), lora_modules=lora_modules, progress=False)
        self.model_dir = Path(model_dir)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def chat(
        self,
        messages: list[dict[str, Any]],
        params: SamplingParams | None = None,
        lora: str | None = None,
        media_root: str | Path | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> RequestOutput:
        """One conversation in OpenAI's message format; image_url / video_url parts take data: URLs,
        or file:// URLs under `media_root`."""
        if not has_media(messages):
            return self.generate(chat_prompt(self.tokenizer, messages), params, lora)[0]
        root = Path(media_root).resolve() if media_root is not None else None
        settings = self.engine.media_settings(policy=FetchPolicy(root))
        if settings is None:
            raise ValueError("this model has no vision tower: send text only")
        ids, mm = asyncio.run(multimodal_prompt(settings, self.tokenizer, messages, mm_processor_kwargs))
        rid = f"offline-{next(self._ids)}"
        self.engine.add_request(rid, ids, params or SamplingParams(), lora, mm=mm)
        while True:
            for out in self.engine.step():
                if out.finished and out.request_id == rid:
                    return out

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
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * n
        lora_list = lora if isinstance(lora, list) else [lora] * n
        if len(params_list) != n or len(lora_list) != n:
            raise ValueError("params and lora lists must have one entry per prompt")
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
