"""The engine loop: schedule → run → check → sample → stream, on one thread. A decode step may be
queued on the device before the one before it is read (decode ahead, `LLMEngine.step`)."""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hylora.cache import PagedKVCache, StatePool
from hylora.config import ModelConfig, parse_dtype
from hylora.engine.config import EngineConfig
from hylora.engine.detokenizer import TextStream
from hylora.engine.encoder_cache import EncoderCache
from hylora.engine.memory import plan_caches
from hylora.engine.multimodal import MultimodalPrompt, Segment
from hylora.engine.request import FailureKind, Request, SamplingParams, TokenLogprob
from hylora.engine.runner import ChunkResult, ModelRunner
from hylora.engine.sampler import PendingSample, SamplingError, launch_sample, prompt_logprobs, to_device
from hylora.engine.scheduler import ScheduledChunk, Scheduler
from hylora.lora.registry import AdapterRegistry, PreparedAdapter
from hylora.model.decoder import HybridDecoder
from hylora.model.loader import load_model
from hylora.ops.kernel_check import select_kernels
from hylora.structured import CompiledGrammar, GrammarCompiler, apply_token_masks
from hylora.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """What one step changed for one request. While it runs an output carries only what is new
    (streams send deltas, never cumulative copies); the final output (`finished`) also carries
    everything: all tokens, the whole text and the logprobs."""

    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]  # generated since the previous output of this request
    new_text: str
    finished: bool
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    error: str | None = None
    failure: FailureKind | None = None  # why it failed, when finish_reason is "error"
    adapter: str | None = None
    new_logprobs: list[TokenLogprob] | None = None  # for new_token_ids, when asked for
    num_output_tokens: int = 0
    num_preemptions: int = 0
    # final output only
    token_ids: list[int] = field(default_factory=list)  # every generated token
    text: str = ""  # generated text (stop strings removed unless asked to keep them)
    logprobs: list[TokenLogprob] | None = None  # per generated token, when asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None  # first entry None, when asked for

    def merged(self, later: RequestOutput) -> RequestOutput:
        """This output followed by `later` as one (a reader that fell behind gets one delta)."""
        new_logprobs = None
        if self.new_logprobs is not None or later.new_logprobs is not None:
            new_logprobs = (self.new_logprobs or []) + (later.new_logprobs or [])
        return dataclasses.replace(
            later,
            new_token_ids=self.new_token_ids + later.new_token_ids,
            new_text=self.new_text + later.new_text,
            new_logprobs=new_logprobs,
        )


class RequestError(ValueError):
    """The request cannot be served as given; the message says what to change."""


class DeviceFault(RuntimeError):
    """The accelerator failed (e.g. an illegal memory access): every request in flight is lost and
    the device state cannot be trusted; the process must restart."""


def is_device_error(error: BaseException) -> bool:
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(s in text for s in ("CUDA error", "CUBLAS_STATUS", "cuDNN error"))


MAX_SUSPECT_STEPS = 3  # a request in this many failed steps fails itself


@dataclass
class LaunchedStep:
    """A step queued on the device whose results the host has not read yet."""

    number: int
    chunks: list[ScheduledChunk]
    results: list[ChunkResult]
    sample: PendingSample | None  # the draw of the chunks that sample (None: none samples)


def _plannable_ahead(req: Request) -> bool:
    """Its next draw needs nothing that only the host knows once the current draw is in: no grammar
    (its mask follows the token), no penalties (they count the tokens), min_tokens already met."""
    p = req.params
    return (
        req.grammar is None
        and p.repetition_penalty == 1.0
        and not p.frequency_penalty
        and not p.presence_penalty
        and len(req.output_ids) >= p.min_tokens
    )


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
        config = config or EngineConfig()
        device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.config = config = config.for_device(device)
        dtype = None if config.dtype == "auto" else parse_dtype(config.dtype)
        self.model_dir = Path(model_dir)
        vision = model is None and ModelConfig.from_dir(model_dir).vision is not None
        self.model = model or load_model(model_dir, dtype=dtype, device=device, progress=progress, vision=vision)
        self.kernels = select_kernels(self.model, config.page_size)
        log.info("kernels: %s", self.kernels)
        self.tokenizer = load_tokenizer(model_dir)
        self.adapters = AdapterRegistry(self.model, config.max_loras, config.max_lora_rank, config.max_cpu_loras)
        for name, path in (lora_modules or {}).items():
            self.adapters.load(name, path)
        plan = plan_caches(self.model, config)
        self.kv = PagedKVCache(self.model.config, plan.num_pages, config.page_size, self.model.dtype, self.model.device)
        self.states = StatePool(self.model.config, plan.num_slots, self.model.dtype, self.model.device)
        self.encoder_cache = EncoderCache(int(config.encoder_cache_gb * (1 << 30)))
        self.scheduler = Scheduler(config, self.kv, self.states, self.adapters, self.encoder_cache, self._media_key)
        self.runner = ModelRunner(self.model, self.kv, self.states, config)
        self.eos_ids = self._eos_ids()
        self.requests: dict[str, Request] = {}
        self._streams: dict[str, TextStream] = {}
        self._emitted: dict[str, int] = {}  # generated tokens already handed out per request
        self._faults: dict[str, str] = {}  # test hook: request id → fault kind
        self._pending: list[RequestOutput] = []  # outputs of requests ended outside step()
        self._compiler: GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._seeds = random.Random(config.seed) if config.seed is not None else None
        self.step_count = 0
        self._inflight: LaunchedStep | None = None  # a decode step queued ahead, not read yet
        self.steps_ahead = 0  # decode steps queued before the step before them was read

    # --- requests --------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        adapter: str | None = None,
        prepared: PreparedAdapter | None = None,
        mm: MultimodalPrompt | None = None,
        grammar: CompiledGrammar | None = None,
    ) -> Request:
        """Queue a request. Bad input raises RequestError (UnknownAdapter / AdapterBroken for the
        adapter) and changes nothing. `prepared` is the adapter already read off this thread
        (AsyncEngine does that); without it the adapter is prepared here. `mm` holds the prompt's
        images and videos (its placeholder tokens already expanded in `prompt`); `grammar` constrains
        the output (structured outputs, compiled off this thread by `grammar_compiler()`)."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        if params.seed is None and self._seeds is not None and not params.greedy:
            params = dataclasses.replace(params, seed=self._seeds.getrandbits(63))
        ids = self._prompt_ids(prompt)
        if mm is not None:
            self._check_media(ids, mm)
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise RequestError(f"stop_token_ids must be in [0, {vocab})")
        if params.logit_bias and any(not 0 <= t < vocab for t in params.logit_bias):
            outside = sorted(t for t in params.logit_bias if not 0 <= t < vocab)[:5]
            raise RequestError(f"logit_bias token ids must be in [0, {vocab}); got {outside}")
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
        if adapter is not None and (prepared is None or prepared.version.name != adapter):
            prepared = self.adapters.prepare(adapter)  # UnknownAdapter names what is loaded
        try:
            stream = TextStream(
                self.tokenizer, ids, params.stop, params.skip_special_tokens, params.include_stop_str_in_output
            )
        except Exception as e:
            raise RequestError(f"cannot detokenise this prompt: {e}") from None
        req = Request(request_id=request_id, prompt_ids=ids, params=params, adapter=adapter, mm=mm)
        req.grammar = grammar.matcher() if grammar is not None else None
        req.prepared = prepared if adapter is not None else None
        self.requests[request_id] = req
        self._streams[request_id] = stream
        self._emitted[request_id] = 0
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str, error: str | None = None, failure: FailureKind | None = None) -> bool:
        """Stop a request at any point; everything it holds is freed. With `error` it ends as an
        error (finish_reason "error"), else as "abort". False if it is unknown/done."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return False
        if error is None:
            self._finish(req, "abort")
        else:
            self._finish(req, "error", error=error, failure=failure or FailureKind.INTERNAL)
        self._pending.append(self._output(req))
        return True

    def fail_all(self, error: str, failure: FailureKind) -> list[RequestOutput]:
        """End every request with `error` and free what it holds (after an internal error, a device
        fault, or at shutdown). Returns their final outputs."""
        outputs, self._pending = self._pending, []
        self._inflight = None  # its requests end here; what it queued is never read
        for rid in list(self.requests):
            req = self.requests[rid]
            try:
                reason = "abort" if failure is FailureKind.SHUTTING_DOWN else "error"
                self._finish(req, reason, error=error, failure=failure, scrub=True)
                outputs.append(self._output(req))
            except Exception:  # the bookkeeping itself is broken: forget the request
                log.exception("could not end request %s cleanly", rid)
                outputs.append(RequestOutput(rid, req.prompt_ids, [], "", True, "error", error, failure))
                self.requests.pop(rid, None)
                self._streams.pop(rid, None)
                self._emitted.pop(rid, None)
        return outputs

    def inject_fault(self, request_id: str, kind: str = "nan") -> None:
        """Test hook, for the next step that runs this request: "nan" first fills its GDN state and
        KV pages with NaN (what a faulty kernel would leave behind); "raise" makes the forward raise
        (a bug triggered by this request); "device" raises what a CUDA fault raises."""
        if kind not in ("nan", "raise", "device"):
            raise ValueError(f"unknown fault kind {kind!r}")
        self._faults[request_id] = kind

    def grammar_compiler(self) -> GrammarCompiler:
        """The structured-output compiler for this tokenizer and vocabulary, built on first use (it
        indexes the whole vocabulary: seconds for Qwen's 248k tokens — call it off the event loop)."""
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(self.tokenizer, self.model.config.vocab_size, self.eos_ids)
            return self._compiler

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._pending)

    # --- the loop --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step. Whatever goes wrong for one request ends that request alone; only a
        device fault (DeviceFault) escapes, since it may have corrupted every request's memory.

        Decode ahead (`async_scheduling`): when the next step can only be one more token for each
        request of a decode step, that step is queued on the device behind the current one, its
        input tokens read there from the current step's draw, before the host waits for the
        current step's tokens. Detokenising, stop checks and scheduling then overlap the device's
        work; a request that stopped meanwhile has its extra token dropped. The outputs of the step
        in flight come with the next call."""
        outputs, self._pending = self._pending, []
        if self._inflight is not None:
            step, self._inflight = self._inflight, None
            outputs.extend(self._decode_ahead_and_finish(step))
            if self._inflight is not None:
                return outputs
        plan = self.scheduler.schedule()
        for req in plan.failed:
            self._finish(req, "error", error=req.error, failure=req.failure)
            outputs.append(self._output(req))
        chunks = self._prepare_media(plan.chunks, outputs) if any(c.media for c in plan.chunks) else plan.chunks
        if not chunks:
            return outputs
        step = self._launch(chunks, outputs)
        if step is not None:
            outputs.extend(self._decode_ahead_and_finish(step))
        return outputs

    def _decode_ahead_and_finish(self, step: LaunchedStep) -> list[RequestOutput]:
        """Queue the step after `step` if it can be planned ahead (it becomes `_inflight`), then
        wait for `step`'s results and hand them out."""
        ahead_error: Exception | None = None
        try:
            self._inflight = self._launch_ahead(step)
        except DeviceFault:
            raise
        except Exception as e:  # queued nothing usable: its requests recompute, as after any failed step
            ahead_error = e
        outputs = self._finish_step(step)
        if ahead_error is not None:
            live = [c for c in step.chunks if not c.request.finished]
            outputs.extend(self._quarantine(live, ahead_error) if live else [])
        return outputs

    def _launch(
        self, chunks: list[ScheduledChunk], outputs: list[RequestOutput], input_ids: torch.Tensor | None = None
    ) -> LaunchedStep | None:
        """Queue the forward and the sampler of `chunks` on the device (nothing waits for it). None:
        the forward raised, and its requests were failed or requeued into `outputs`."""
        self.step_count += 1
        try:
            results = self._execute(chunks, input_ids)
        except Exception as e:
            if is_device_error(e):
                raise DeviceFault(f"device fault at engine step {self.step_count}: {e}") from e
            if input_ids is not None:
                raise  # a step planned ahead: the caller requeues its requests after the step before
            outputs.extend(self._quarantine(chunks, e))
            return None
        # Sampling is queued before any finiteness flag is read: the device runs the model and the
        # sampler back to back and the host waits once. A faulted row's draw is dropped.
        to_sample = [(c.request, res.sample_logits) for c, res in zip(chunks, results, strict=True)]
        to_sample = [(req, lg) for req, lg in to_sample if lg is not None]
        pending = None
        if to_sample:
            reqs, logits = self._constrain([r for r, _ in to_sample], [lg for _, lg in to_sample], outputs)
            pending = launch_sample(logits, reqs, self.eos_ids) if reqs else None
        return LaunchedStep(self.step_count, chunks, results, pending)

    def _launch_ahead(self, step: LaunchedStep) -> LaunchedStep | None:
        """Queue the decode step that follows `step` — one more token for each of its requests — if
        nothing but its draw decides that step: no waiting request could start (none waits, or
        every running place or state slot is taken), every running request is in `step` and
        samples, its rows need nothing that only the host knows (grammar, penalties, min_tokens),
        and pages are free. A request that ends by length in `step` is left out; one that stops
        on a token is found when `step` is read and its draw dropped."""
        decode = self.runner.decode
        if not self.config.async_scheduling or decode is None or step.sample is None or self.scheduler.can_admit():
            return None  # (the CPU runs no padded decode step: it never plans ahead)
        if len(step.chunks) > decode.max_batch or any(c.num_tokens != 1 for c in step.chunks):
            return None
        drawn = {id(r): i for i, r in enumerate(step.sample.requests)}
        chunks, rows = [], []
        for c in step.chunks:
            req = c.request
            if req.finished:
                continue
            if id(req) not in drawn or not _plannable_ahead(req):
                return None
            after = len(req.output_ids) + 1  # generated tokens once `step`'s draw is appended
            if after >= req.params.max_tokens or req.num_tokens + 1 >= self.config.max_model_len:
                continue  # ends by length in `step`
            chunks.append(ScheduledChunk(req, c.start + 1, 1, ahead=True))
            rows.append(drawn[id(req)])
        live = sum(not c.request.finished for c in step.chunks)
        if not chunks or len(self.scheduler.running) != live:
            return None  # nothing to continue, or another running request needs the scheduler
        for c in chunks:
            if not self.scheduler.ensure_pages(c.request, c.start + 1):
                return None  # the scheduler decides who is preempted
        input_ids = step.sample.tokens[to_device(rows, step.sample.tokens.device)]
        launched = self._launch(chunks, [], input_ids)
        self.steps_ahead += 1
        return launched

    def _finish_step(self, step: LaunchedStep) -> list[RequestOutput]:
        """Wait for `step`'s draw and flags, then check, append and stream each request's token."""
        outputs: list[RequestOutput] = []
        sampled: dict[int, tuple | SamplingError] = {}
        if step.sample is not None:
            for req, result in zip(step.sample.requests, step.sample.results(), strict=True):
                sampled[id(req)] = result
        for c, res in zip(step.chunks, step.results, strict=True):
            req = c.request
            if req.finished:  # stopped or aborted since this step was queued, or its grammar failed
                continue
            if not res.is_finite():
                where = f" with adapter {req.adapter!r}" if req.adapter else " on the base model"
                self._finish(
                    req,
                    "error",
                    scrub=True,
                    failure=FailureKind.NUMERICAL_FAULT,
                    error=(
                        f"numerical fault: non-finite values (NaN/Inf) in request {req.request_id!r}{where} at "
                        f"engine step {step.number}; the request was stopped and its cache scrubbed, other "
                        "requests are unaffected"
                    ),
                )
                outputs.append(self._output(req))
                continue
            req.num_computed += c.num_tokens
            if req.mm is not None:
                req.mm.release_before(req.num_computed)
            try:
                if req.params.prompt_logprobs is not None:
                    self._add_prompt_logprobs(req, res.prompt_logits, res.prompt_positions)
            except Exception as e:
                outputs.append(self._fail(req, f"computing prompt logprobs failed: {e!r}", FailureKind.INTERNAL))
                continue
            result = sampled.get(id(req))
            if result is None:
                continue
            if isinstance(result, SamplingError):
                outputs.append(self._fail(req, f"sampling failed: {result}", FailureKind.INVALID_REQUEST))
                continue
            try:
                if req.grammar is not None:
                    req.grammar.accept(result[0])
            except Exception as e:
                outputs.append(self._fail(req, f"structured output failed: {e}", FailureKind.INTERNAL))
                continue
            try:
                self._append_token(req, *result)
                outputs.append(self._output(req))
            except Exception as e:  # detokenisation or stop handling
                log.exception("request %s: handling its new token failed", req.request_id)
                outputs.append(self._fail(req, f"detokenising the output failed: {e!r}", FailureKind.INTERNAL))
        return outputs

    def _constrain(
        self, reqs: list[Request], rows: list[torch.Tensor], outputs: list[RequestOutput]
    ) -> tuple[list[Request], torch.Tensor]:
        """Stack the rows to sample from and apply every structured-output request's token mask (one
        masked fill for the whole batch); a request whose grammar fails fails alone."""
        logits = torch.stack(rows)
        matchers = [r.grammar for r in reqs]
        if all(m is None for m in matchers):
            return reqs, logits
        try:
            errors = apply_token_masks(logits, matchers)
        except Exception as e:  # the mask step itself broke: fail only the constrained requests
            log.exception("structured-output masks failed")
            errors = [e if m is not None else None for m in matchers]
        keep = [i for i, err in enumerate(errors) if err is None]
        for i, err in enumerate(errors):
            if err is not None:
                outputs.append(self._fail(reqs[i], f"structured output failed: {err}", FailureKind.INTERNAL))
        return [reqs[i] for i in keep], logits[keep]

    # --- internals -------------------------------------------------------------------------
    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            try:
                ids = self.tokenizer.encode(prompt, add_special_tokens=False)
            except Exception as e:
                raise RequestError(f"cannot tokenise the prompt: {e}") from None
        else:
            ids = list(prompt)
        if not ids:
            raise RequestError("the prompt is empty")
        vocab = self.model.config.vocab_size
        if any(not (isinstance(t, int) and 0 <= t < vocab) for t in ids):
            raise RequestError(f"prompt token ids must be in [0, {vocab})")
        return ids

    def _check_media(self, ids: list[int], mm: MultimodalPrompt) -> None:
        if self.model.visual is None:
            raise RequestError("this model has no vision tower: send text only")
        if mm.positions.prompt_len != len(ids):
            raise RequestError("the media positions do not match the prompt")
        budget = self.config.max_num_encoder_tokens
        largest = max((s.num_tokens for s in mm.segments), default=0)
        if largest > budget:
            raise RequestError(
                f"one image or video frame of this request is {largest} visual tokens, more than the "
                f"{budget} the server encodes per step (--max-num-encoder-tokens); send it smaller"
            )

    def _media_key(self, req: Request, seg: Segment) -> tuple:
        """Encoder-cache key: the media content and preprocessing, the temporal patch, and the
        adapter version when it changes the tower."""
        version = req.lora.version if req.lora is not None else None
        tower = (version.name, version.version) if version is not None and version.has_tower_lora else None
        return (req.mm.items[seg.item].key, seg.t, tower)  # type: ignore[union-attr]

    def _prepare_media(self, chunks: list[ScheduledChunk], outputs: list[RequestOutput]) -> list[ScheduledChunk]:
        """Make every segment the chunks need ready: from the encoder cache, else encoded (one tower
        call for all of them). A request whose media fail to encode fails alone."""
        todo: list[tuple[Request, Segment]] = []
        for c in chunks:
            for seg in c.media:
                cached = self.encoder_cache.get(self._media_key(c.request, seg))
                if cached is not None:
                    c.request.mm.ready[seg.id] = cached  # type: ignore[union-attr]
                else:
                    todo.append((c.request, seg))
        failed: dict[str, RequestOutput] = {}
        if todo:
            self._encode(todo, failed)
            outputs.extend(failed.values())
        return [c for c in chunks if c.request.request_id not in failed]

    @torch.inference_mode()
    def _encode(self, todo: list[tuple[Request, Segment]], failed: dict[str, RequestOutput]) -> None:
        try:
            pieces = [req.mm.pixels(seg) for req, seg in todo]  # type: ignore[union-attr]
            pixels = torch.cat([p for p, _ in pieces]).to(self.model.device)
            grids = torch.tensor([g for _, g in pieces])
            slots = [req.lora.tower_slot if req.lora is not None else -1 for req, _ in todo]
            out = self.model.visual(pixels, grids, slots).split([seg.num_tokens for _, seg in todo])  # type: ignore[misc]
        except Exception as e:
            if is_device_error(e):
                raise DeviceFault(f"device fault in the vision tower at engine step {self.step_count}: {e}") from e
            requests = {id(req): req for req, _ in todo}
            if len(requests) > 1:  # find the request that breaks it: encode each alone
                for rid in requests:
                    self._encode([(r, s) for r, s in todo if id(r) == rid], failed)
                return
            req = todo[0][0]
            failed[req.request_id] = self._fail(req, f"encoding its media failed: {e!r}", FailureKind.INTERNAL)
            return
        for (req, seg), rows in zip(todo, out, strict=True):
            if req.request_id in failed:
                continue
            if not torch.isfinite(rows).all():
                message = (
                    f"numerical fault: non-finite values (NaN/Inf) in the vision tower output of request "
                    f"{req.request_id!r} (media item {seg.item}, temporal patch {seg.t}); other requests are unaffected"
                )
                failed[req.request_id] = self._fail(req, message, FailureKind.NUMERICAL_FAULT)
                continue
            req.mm.ready[seg.id] = rows  # type: ignore[union-attr]
            self.encoder_cache.put(self._media_key(req, seg), rows)

    def _execute(self, chunks: list[ScheduledChunk], input_ids: torch.Tensor | None = None):
        for c in chunks:
            kind = self._faults.pop(c.request.request_id, None)
            if kind == "nan":
                self.runner.poison(c.request.state_slot, c.request.pages)
            elif kind == "raise":
                self._faults[c.request.request_id] = kind  # keeps raising while this request is in a step
                raise RuntimeError(f"injected fault in the forward of request {c.request.request_id!r}")
            elif kind == "device":
                raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
        return self.runner.execute(chunks, input_ids)

    def _quarantine(self, chunks: list[ScheduledChunk], error: Exception) -> list[RequestOutput]:
        """The forward raised. A request that was alone fails with the error; a batch goes back to the
        queue and each of its requests recomputes alone, so the one that raises fails by itself."""
        log.error("engine step %d failed with %d request(s) in it: %r", self.step_count, len(chunks), error)
        outputs = []
        for c in reversed(chunks):  # requeued at the head, in their original order
            req = c.request
            if len(chunks) == 1 or req.suspect_count + 1 >= MAX_SUSPECT_STEPS:
                message = f"internal error while running this request (engine step {self.step_count}): {error!r}"
                outputs.append(self._fail(req, message, FailureKind.INTERNAL))
            else:
                self.scheduler.requeue_suspect(req)
        return outputs

    def _fail(self, req: Request, error: str, failure: FailureKind) -> RequestOutput:
        self._finish(req, "error", error=error, failure=failure, scrub=True)
        return self._output(req)

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
        constrained = req.grammar is not None  # a grammar's EOS ends the document, ignore_eos or not
        if (token in self.eos_ids and (constrained or not p.ignore_eos)) or token in p.stop_token_ids:
            self._finish(req, "stop")
            return
        hit = self._streams[req.request_id].append(token)
        if hit is not None or (constrained and req.grammar.is_terminated()):  # type: ignore[union-attr]
            self._finish(req, "stop")
        elif len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.config.max_model_len:
            self._finish(req, "length")

    def _finish(
        self,
        req: Request,
        reason: str,
        error: str | None = None,
        scrub: bool = False,
        failure: FailureKind | None = None,
    ) -> None:
        self.scheduler.finish(req, scrub=scrub)
        req.finish_reason = reason
        req.error = error or req.error
        req.failure = failure or req.failure
        req.prepared = None
        if req.mm is not None:
            req.mm.ready.clear()
        if error:
            log.warning("request %s failed: %s", req.request_id, error)

    def _output(self, req: Request) -> RequestOutput:
        rid = req.request_id
        stream = self._streams[rid]
        try:
            new_text = stream.take(req.finished)
        except Exception:  # a broken stream must not keep the request from ending
            log.exception("request %s: taking its text failed", rid)
            new_text = ""
        start = self._emitted[rid]
        self._emitted[rid] = len(req.output_ids)
        wants_logprobs = req.params.logprobs is not None
        out = RequestOutput(
            request_id=rid,
            prompt_token_ids=req.prompt_ids,
            new_token_ids=req.output_ids[start:],
            new_text=new_text,
            finished=req.finished,
            finish_reason=req.finish_reason,
            error=req.error,
            failure=req.failure,
            adapter=req.adapter,
            new_logprobs=req.logprobs[start:] if wants_logprobs else None,
            num_output_tokens=len(req.output_ids),
            num_preemptions=req.num_preemptions,
        )
        if req.finished:
            out.token_ids = list(req.output_ids)
            out.text = stream.text
            out.logprobs = list(req.logprobs) if wants_logprobs else None
            out.prompt_logprobs = list(req.prompt_logprobs) if req.params.prompt_logprobs is not None else None
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
