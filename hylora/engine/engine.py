"""The engine loop: schedule → run → check → sample → stream. One step at a time, one thread."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from hylora.cache import PagedKVCache, StatePool
from hylora.config import parse_dtype
from hylora.engine.config import EngineConfig
from hylora.engine.detokenizer import TextStream
from hylora.engine.memory import plan_caches
from hylora.engine.request import Request, SamplingParams, TokenLogprob
from hylora.engine.runner import ModelRunner
from hylora.engine.sampler import prompt_logprobs, sample
from hylora.engine.scheduler import Scheduler
from hylora.lora.registry import AdapterRegistry
from hylora.model.decoder import HybridDecoder
from hylora.model.loader import load_model
from hylora.ops.kernel_check import select_gdn_kernel
from hylora.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # every generated token so far
    new_token_ids: list[int]  # generated since the previous output of this request
    text: str  # generated text so far (stop strings removed unless asked to keep them)
    new_text: str
    finished: bool
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    error: str | None = None
    adapter: str | None = None
    logprobs: list[TokenLogprob] | None = None  # per generated token, when asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None  # first entry None, when asked for
    num_preemptions: int = 0


class RequestError(ValueError):
    """The request cannot be served as given; the message says what to change."""


class LLMEngine:
    def __init__(
        self,
        model_dir: str | Path,
        config: EngineConfig | None = None,
        lora_modules: dict[str, str | Path] | None = None,
        progress: bool = True,
        model: HybridDecoder | None = None,
    ):
        """Serve the checkpoint in `model_dir`, or `model` (already built, e.g. random weights for a
        benchmark) with the tokenizer of `model_dir`."""
        self.config = config = config or EngineConfig()
        device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = None if config.dtype == "auto" else parse_dtype(config.dtype)
        self.model_dir = Path(model_dir)
        self.model = model or load_model(model_dir, dtype=dtype, device=device, progress=progress)
        self.kernels = {"gated_delta_rule": select_gdn_kernel(self.model)}
        log.info("kernels: %s", self.kernels)
        self.tokenizer = load_tokenizer(model_dir)
        self.adapters = AdapterRegistry(self.model, config.max_loras, config.max_lora_rank, config.max_cpu_loras)
        for name, path in (lora_modules or {}).items():
            self.adapters.load(name, path)
        plan = plan_caches(self.model, config)
        self.kv = PagedKVCache(self.model.config, plan.num_pages, config.page_size, self.model.dtype, self.model.device)
        self.states = StatePool(self.model.config, plan.num_slots, self.model.dtype, self.model.device)
        self.scheduler = Scheduler(config, self.kv, self.states, self.adapters)
        self.runner = ModelRunner(self.model, self.kv, self.states)
        self.eos_ids = self._eos_ids()
        self.requests: dict[str, Request] = {}
        self._streams: dict[str, TextStream] = {}
        self._emitted: dict[str, int] = {}  # generated tokens already handed out per request
        self._faults: set[str] = set()
        self._pending: list[RequestOutput] = []  # outputs of requests ended outside step()
        self.step_count = 0

    # --- requests --------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        adapter: str | None = None,
    ) -> Request:
        params = params or SamplingParams()
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        ids = self.tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise RequestError("the prompt is empty")
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise RequestError(f"prompt token ids must be in [0, {vocab})")
        limit = self.config.max_model_len
        if len(ids) + params.max_tokens > limit:
            raise RequestError(
                f"this model's maximum context length is {limit} tokens; the request has {len(ids)} prompt "
                f"tokens and asks for up to {params.max_tokens} more ({len(ids) + params.max_tokens}); "
                "shorten the prompt or lower max_tokens"
            )
        pages = self.kv.pages_needed(len(ids) + params.max_tokens)
        if pages > self.kv.num_pages:  # could never be scheduled, even alone
            raise RequestError(
                f"the request needs up to {pages} KV pages ({len(ids)} prompt + {params.max_tokens} new tokens) "
                f"but the whole cache has {self.kv.num_pages}; lower max_tokens or start with more --num-pages"
            )
        if adapter is not None:
            self.adapters.get(adapter)  # UnknownAdapter names what is loaded
        req = Request(request_id=request_id, prompt_ids=ids, params=params, adapter=adapter)
        self.requests[request_id] = req
        self._streams[request_id] = TextStream(
            self.tokenizer, ids, params.stop, params.skip_special_tokens, params.include_stop_str_in_output
        )
        self._emitted[request_id] = 0
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> bool:
        """Stop a request at any point; everything it holds is freed. False if it is unknown/done."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return False
        self._finish(req, "abort")
        self._pending.append(self._output(req))
        return True

    def discard_all(self) -> list[str]:
        """After an internal error: end every request, free what it holds, drop pending outputs.
        Returns the ids that were in flight."""
        ids = list(self.requests)
        for rid in ids:
            with contextlib.suppress(Exception):  # free what can be freed; the bookkeeping is reset below
                self._finish(self.requests[rid], "error", error="internal engine error")
        self.requests.clear()
        self._streams.clear()
        self._emitted.clear()
        self._pending.clear()
        return ids

    def inject_fault(self, request_id: str) -> None:
        """Test hook: the next step that runs this request first fills its GDN state and KV pages
        with NaN (what a faulty kernel would leave behind)."""
        self._faults.add(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._pending)

    # --- the loop --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        plan = self.scheduler.schedule()
        self.step_count += 1
        for req in plan.failed:
            self._finish(req, "error", error=req.error)
            outputs.append(self._output(req))
        if not plan.chunks:
            return outputs
        for c in plan.chunks:
            if c.request.request_id in self._faults:
                self._faults.discard(c.request.request_id)
                self.runner.poison(c.request.state_slot, c.request.pages)

        results = self.runner.execute(plan.chunks)
        to_sample: list[tuple[Request, torch.Tensor]] = []
        for c, res in zip(plan.chunks, results, strict=True):
            req = c.request
            if not res.finite:
                where = f" with adapter {req.adapter!r}" if req.adapter else " on the base model"
                self._finish(
                    req,
                    "error",
                    scrub=True,
                    error=(
                        f"numerical fault: non-finite values (NaN/Inf) in request {req.request_id!r}{where} at "
                        f"engine step {self.step_count}; the request was stopped and its cache scrubbed, other "
                        "requests are unaffected"
                    ),
                )
                outputs.append(self._output(req))
                continue
            req.num_computed += c.num_tokens
            if req.params.prompt_logprobs is not None:
                self._add_prompt_logprobs(req, res.prompt_logits, res.prompt_positions)
            if res.sample_logits is not None:
                to_sample.append((req, res.sample_logits))
        if to_sample:
            reqs = [r for r, _ in to_sample]
            for req, (token, info) in zip(reqs, sample(torch.stack([lg for _, lg in to_sample]), reqs), strict=True):
                self._append_token(req, token, info)
                outputs.append(self._output(req))
        return outputs

    # --- internals -------------------------------------------------------------------------
    def _add_prompt_logprobs(self, req: Request, logits: torch.Tensor | None, positions: range) -> None:
        if not req.prompt_logprobs:
            req.prompt_logprobs.append(None)  # the first prompt token has no logprob
        if logits is not None:
            next_ids = [req.prompt_ids[p + 1] for p in positions]
            req.prompt_logprobs.extend(prompt_logprobs(logits, next_ids, req.params.prompt_logprobs or 0))

    def _append_token(self, req: Request, token: int, info: TokenLogprob | None) -> None:
        now = time.monotonic()
        req.first_token_time = req.first_token_time or now
        req.last_token_time = now
        req.output_ids.append(token)
        if info is not None:
            req.logprobs.append(info)
        p = req.params
        if (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
            self._finish(req, "stop")
            return
        if self._streams[req.request_id].append(token) is not None:
            self._finish(req, "stop")
        elif len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.config.max_model_len:
            self._finish(req, "length")

    def _finish(self, req: Request, reason: str, error: str | None = None, scrub: bool = False) -> None:
        self.scheduler.finish(req, scrub=scrub)
        req.finish_reason = reason
        req.error = error or req.error
        if error:
            log.warning("request %s failed: %s", req.request_id, error)

    def _output(self, req: Request) -> RequestOutput:
        rid = req.request_id
        stream = self._streams[rid]
        new_text = stream.take(req.finished)
        start = self._emitted[rid]
        self._emitted[rid] = len(req.output_ids)
        out = RequestOutput(
            request_id=rid,
            prompt_token_ids=req.prompt_ids,
            token_ids=list(req.output_ids),
            new_token_ids=req.output_ids[start:],
            text=stream.text if req.finished else stream.text[: stream.emitted],
            new_text=new_text,
            finished=req.finished,
            finish_reason=req.finish_reason,
            error=req.error,
            adapter=req.adapter,
            logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
            prompt_logprobs=list(req.prompt_logprobs) if req.params.prompt_logprobs is not None else None,
            num_preemptions=req.num_preemptions,
        )
        if req.finished:
            del self.requests[rid], self._streams[rid], self._emitted[rid]
        return out

    def _eos_ids(self) -> tuple[int, ...]:
        ids = set(self.model.config.eos_token_ids)
        gen = self.model_dir / "generation_config.json"
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))
