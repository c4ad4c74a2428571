"""The engine loop: schedule → run → check → sample → stream, on one thread. A step may be queued
on the device before the one before it is read (decode ahead, `LLMEngine.step`; for steps with
prompt chunks, engine/plan_ahead.py)."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import torch

from hylora.adapters.registry import AdapterRegistry, PreparedAdapter
from hylora.cache import PagedKVCache, StatePool
from hylora.config import ModelConfig, parse_dtype, read_json_object
from hylora.engine.chat_input import MediaSettings
from hylora.engine.config import AUTO, EngineConfig
from hylora.engine.cuda_graphs import make_graph_draft
from hylora.engine.encoder_cache import EncoderCache
from hylora.engine.errors import DeviceFault, RequestError, is_device_error
from hylora.engine.faults import FaultInjector
from hylora.engine.intake import RequestIntake
from hylora.engine.media_encoding import MediaEncoder, media_key
from hylora.engine.memory import plan_caches
from hylora.engine.multimodal import MultimodalPrompt
from hylora.engine.observer import StepObserver
from hylora.engine.outputs import OutputProcessor, RequestOutput
from hylora.engine.plan_ahead import AheadLaunchFailed, drawn_rows, ends_by_length, mark_ahead, projected
from hylora.engine.prefix_cache import PendingSnapshot, PrefixCache
from hylora.engine.request import FailureKind, Request, SamplingParams
from hylora.engine.runner import ChunkResult, ModelRunner
from hylora.engine.sampler import (
    PendingSample,
    SamplingError,
    draws_without_host,
    launch_sample,
    prompt_logprobs,
    to_device,
)
from hylora.engine.scheduler import ScheduledChunk, Scheduler
from hylora.engine.short_step import VerifyAhead
from hylora.engine.speculative import (
    Drafter,
    PendingDrafts,
    PendingVerify,
    SpecStats,
    commit_state,
    grammar_masks,
    launch_verify,
)
from hylora.engine.stats import EngineStats
from hylora.kernels import as_text, select_kernels, serve_fp8
from hylora.model.decoder import HybridDecoder
from hylora.model.fp8 import dequantize_linears, quantize_linears
from hylora.model.loader import load_model
from hylora.structured import CompiledGrammar, GrammarCompiler, GrammarError, apply_token_masks
from hylora.tokenizer import load_tokenizer

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])


MAX_SUSPECT_STEPS = 3  # a request in this many failed steps fails itself


def _grammar_failure(error: BaseException) -> FailureKind:
    """A grammar that breaks while a request runs (a limit of the matcher, a document that cannot go on)
    is the client's spec (HTTP 400); anything else in the mask step is ours."""
    return FailureKind.INVALID_REQUEST if isinstance(error, GrammarError) else FailureKind.INTERNAL


@dataclass
class LaunchedStep:
    """A step queued on the device whose results the host has not read yet."""

    number: int
    chunks: list[ScheduledChunk]
    results: list[ChunkResult]
    sample: PendingSample | None  # the draw of the chunks that sample (None: none samples)
    snapshots: list[PendingSnapshot] = field(default_factory=list)  # prefix-cache states taken behind it
    verify: PendingVerify | None = None  # the acceptance of its speculative verify chunks
    drafts: PendingDrafts | None = None  # the next drafts, queued behind `verify` (Drafter.launch)


def _timed(counter: str) -> Callable[[F], F]:
    """Adds the host seconds of each call to the engine's `counter` (how busy its thread was)."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def timed(self, *args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(self, *args, **kwargs)
            finally:
                setattr(self, counter, getattr(self, counter) + time.perf_counter() - started)

        return timed  # type: ignore[return-value]

    return wrap


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
        model_config = None if model is not None else ModelConfig.from_dir(model_dir, config.hf_overrides)
        served = model_config or model.config
        yarn = "config.json's YaRN rope_parameters: original_max_position_embeddings x factor"
        config.check_context(served.max_context, yarn if served.yarn else "config.json")  # before the weights load
        auto_len = config.max_model_len == AUTO  # the model's context; plan_caches may shorten it to fit
        if auto_len:
            config = replace(config, max_model_len=served.max_context)
        vision = model_config is not None and model_config.vision is not None and not config.language_model_only
        speculate = config.num_speculative_tokens > 0
        fp8 = model_config is not None and serve_fp8(model_config, config.quantization, device, dtype)
        self.model = model or load_model(
            model_dir, dtype=dtype, device=device, progress=progress, vision=vision, mtp=speculate, fp8=fp8,
            config=model_config,
        )  # fmt: skip
        # --quantization fp8 on an unquantised checkpoint (or its values, dequantised, for doctor's reference)
        round_trip = config.quantization == "fp8-dequantized"
        fp8_checkpoint = model_config is not None and model_config.quantization is not None
        if (fp8 or round_trip) and model_config is not None and not fp8_checkpoint:
            count = quantize_linears(self.model)
            log.info("quantised %d projections to FP8 at load (e4m3, 128x128 block scales)", count)
            if round_trip:
                dequantize_linears(self.model)
        # the served weights are FP8 values, dequantised (doctor's fp8 check compares against them)
        self.dequantised_fp8 = not fp8 and (round_trip or fp8_checkpoint)
        self.kernels = select_kernels(self.model, config.page_size, config.kernels, config.max_num_batched_tokens)
        # what the served weights are ("fp8": FP8 GEMMs; doctor's fp8 check reads it)
        self.quantization = "fp8" if any(getattr(m, "is_fp8", False) for m in self.model.modules()) else None
        if config.kernels.fp8_activations != "dynamic" and self.quantization is None:
            log.warning("fp8_activations %r: no effect, no weights are served as FP8", config.kernels.fp8_activations)
        log.info("kernels: %s", as_text(self.kernels))
        self.adapters = AdapterRegistry(self.model, config.max_loras, config.max_lora_rank, config.max_cpu_loras)
        for name, path in (lora_modules or {}).items():
            self.adapters.load(name, path)
        plan = plan_caches(self.model, config, shorten_to_fit=auto_len)
        if auto_len:
            config = replace(config, max_model_len=plan.max_model_len or config.max_model_len)
            shortened = " (shortened to what the memory holds)" if plan.max_model_len else ""
            log.info("max_model_len auto: %d tokens, the model's context %d%s", config.max_model_len,
                     served.max_context, shortened)  # fmt: skip
        self.config = config
        self.kv = PagedKVCache(
            self.model.config,
            plan.num_pages,
            config.page_size,
            self.model.dtype,
            self.model.device,
            self.model.kv_layers,
        )
        self.states = StatePool(self.model.config, plan.num_slots, self.model.dtype, self.model.device)
        self.encoder_cache = EncoderCache(config.encoder_cache_bytes)
        self.tokenizer = load_tokenizer(model_dir)
        self.prefix_cache = self._prefix_cache(plan.num_snapshots)
        self.scheduler = Scheduler(
            config, self.kv, self.states, self.adapters, self.encoder_cache, media_key, self.prefix_cache
        )
        self.runner = ModelRunner(self.model, self.kv, self.states, config)
        k = config.num_speculative_tokens
        self.drafter = None
        if speculate:
            padded = make_graph_draft(self.model, self.kv, self.states, config)
            reserve = self.scheduler.ensure_pages if config.queue_drafts else (lambda req, num_tokens: False)
            self.drafter = Drafter(self.model, self.kv, self.states, k, padded, config.max_model_len, reserve)
        self.spec_stats = SpecStats(accepted_per_position=[0] * k)
        self.eos_ids = self._eos_ids()
        self.requests: dict[str, Request] = {}
        vocab, has_vision = self.model.config.vocab_size, self.model.visual is not None
        self.intake = RequestIntake(config, self.tokenizer, vocab, self.kv, has_vision)
        self.outputs = OutputProcessor(self.tokenizer, self.eos_ids, config.max_model_len)
        self.media = MediaEncoder(self.model, self.encoder_cache, self._fail)
        self.faults = FaultInjector(self.kv, self.states) if config.fault_injection else None
        self._observers: list[StepObserver] = [self.faults] if self.faults is not None else []
        self._pending: list[RequestOutput] = []  # outputs of requests ended outside step()
        self._compiler: GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self.step_count = 0
        self._inflight: LaunchedStep | None = None  # a step queued ahead, not read yet
        self.steps_ahead = 0  # decode / verify steps queued before the step before them was read
        self.prefill_steps_ahead = 0  # steps the scheduler planned before the step before them was read
        # host seconds in step() and in add_request() (cumulative): how busy the engine's thread was
        self.step_seconds = 0.0
        self.add_seconds = 0.0

    # --- requests --------------------------------------------------------------------------
    @_timed("add_seconds")
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        adapter: str | None = None,
        prepared: PreparedAdapter | None = None,
        mm: MultimodalPrompt | None = None,
        grammar: CompiledGrammar | None = None,
        grammar_after: Sequence[int] = (),
        group: str | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        """Queue a request. Bad input raises RequestError (UnknownAdapter / AdapterBroken for the
        adapter) and changes nothing. `prepared` is the adapter already read off this thread
        (AsyncEngine does that); without it the adapter is prepared here. `mm` holds the prompt's
        images and videos (its placeholder tokens already expanded in `prompt`); `grammar` constrains
        the output (structured outputs, compiled off this thread by `grammar_compiler()`), from the
        token after `grammar_after` (a thinking model's `</think>`) when that is given. `group` names
        the client request this sequence belongs to (n > 1, a list of prompts): waiting sequences are
        admitted fairly between groups (engine/scheduler.py). `cache_salt` (vLLM's): the request
        shares prefix-cache entries only with requests of the same salt."""
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        ids, params = self.intake.admit(prompt, params or SamplingParams(), mm)
        if adapter is not None and (prepared is None or prepared.version.name != adapter):
            prepared = self.adapters.prepare(adapter)  # UnknownAdapter names what is loaded
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise RequestError("cache_salt must be a non-empty string", "cache_salt")
        req = Request(
            request_id=request_id, prompt_ids=ids, params=params, adapter=adapter, mm=mm, group=group,
            cache_salt=cache_salt,
        )  # fmt: skip
        self.outputs.add(req)
        req.grammar = grammar.matcher(grammar_after) if grammar is not None else None
        req.prepared = prepared if adapter is not None else None
        self.requests[request_id] = req
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
                self.outputs.forget(rid)
        return outputs

    def inject_fault(self, request_id: str, kind: str = "nan") -> None:
        """Testing aid (engine/faults.py): the next step that runs this request faults as `kind` says."""
        if self.faults is None:
            raise RuntimeError("fault injection is off (EngineConfig.fault_injection)")
        self.faults.arm(request_id, kind)

    def grammar_compiler(self) -> GrammarCompiler:
        """The structured-output compiler for this tokenizer and vocabulary, built on first use (it
        indexes the whole vocabulary: seconds for Qwen's 248k tokens — call it off the event loop)."""
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(self.tokenizer, self.model.config.vocab_size, self.eos_ids)
            return self._compiler

    def media_settings(self, **settings: Any) -> MediaSettings | None:
        """How this model's images and videos are preprocessed (the checkpoint's processor files) and
        what is accepted (`settings`: MediaSettings' limits, fetch policy, per-prompt limits, ...);
        None for a model without a vision tower. The one place media settings are built."""
        vision = self.model.config.vision
        if self.model.visual is None or vision is None:
            return None
        return MediaSettings.for_model(self.model_dir, vision, self.tokenizer, **settings)

    def stats(self) -> EngineStats:
        """A snapshot of the engine's resources and queues (call on the engine thread)."""
        sched, adapters = self.scheduler, self.adapters.stats()
        running: dict[str, int] = {}
        waiting: dict[str, int] = {}
        for table, reqs in ((running, sched.running), (waiting, sched.waiting)):
            for r in reqs:
                table[r.adapter or ""] = table.get(r.adapter or "", 0) + 1
        return EngineStats(
            queue=len(sched.waiting),
            running=len(sched.running),
            kv_used=self.kv.num_pages - self.kv.num_free - (self.prefix_cache.idle_pages if self.prefix_cache else 0),
            kv_total=self.kv.num_pages,
            slots_used=self.states.num_slots - self.states.num_free,
            slots_total=self.states.num_slots,
            lora_slots_used=adapters["slots_used"],
            lora_slots_total=adapters["slots_total"],
            adapters_loaded=len(adapters["loaded"]),
            adapters_on_cpu=adapters["on_cpu"],
            encoder_hits=self.encoder_cache.hits,
            encoder_misses=self.encoder_cache.misses,
            encoder_bytes=self.encoder_cache.bytes,
            encoder_entries=len(self.encoder_cache),
            engine_steps=self.step_count,
            steps_ahead=self.steps_ahead,
            prefill_steps_ahead=self.prefill_steps_ahead,
            step_seconds=self.step_seconds,
            add_seconds=self.add_seconds,
            preemptions=sched.num_preemptions,
            **self._prefix_stats({"", *adapters["loaded"], *running, *waiting}),
            spec_drafts=self.spec_stats.drafts,
            spec_draft_tokens=self.spec_stats.draft_tokens,
            spec_accepted_tokens=self.spec_stats.accepted_tokens,
            spec_accepted_per_position=list(self.spec_stats.accepted_per_position),
            on_device={name: int(name in adapters["on_device"]) for name in adapters["loaded"]},
            running_by_adapter=running,
            waiting_by_adapter=waiting,
        )

    def _prefix_stats(self, live: set[str]) -> dict:
        """The prefix cache's counts; the per-adapter ones of adapters no longer loaded, running or
        waiting are dropped (runtime loading makes names come and go)."""
        cache = self.prefix_cache
        if cache is None:
            return {}
        s = cache.stats
        s.forget_adapters(live)
        return {
            "prefix_cache_queries": s.queries,
            "prefix_cache_hits": s.hits,
            "prefix_cache_entries": len(cache),
            "prefix_hits_by_adapter": dict(s.by_adapter),
            "prefix_queries_by_adapter": dict(s.queries_by_adapter),
        }

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._pending)

    # --- the loop --------------------------------------------------------------------------
    @_timed("step_seconds")
    def step(self) -> list[RequestOutput]:
        """One engine step. Whatever goes wrong for one request ends that request alone; only a
        device fault (DeviceFault) escapes, since it may have corrupted every request's memory.

        Decode ahead (`async_scheduling`): when the next step can only be one more token for each
        request of a decode step, that step is queued on the device behind the current one, its
        input tokens read there from the current step's draw, before the host waits for the
        current step's tokens. Detokenising, stop checks and scheduling then overlap the device's
        work; a request that stopped meanwhile has its extra token dropped. Any other step is planned
        ahead by the scheduler where the requests allow (engine/plan_ahead.py). The outputs of the
        step in flight come with the next call."""
        outputs = self._step()
        if self._inflight is not None and not self.has_unfinished():
            # the last requests stopped while it ran: read it now rather than at the next arrival
            step, self._inflight = self._inflight, None
            outputs.extend(self._finish_step(step))
        return outputs

    def _step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        if self._inflight is not None:
            step, self._inflight = self._inflight, None
            outputs.extend(self._decode_ahead_and_finish(step))
            if self._inflight is not None:
                return outputs
        plan = self.scheduler.schedule(step=self.step_count + 1)
        for req in plan.failed:
            self._finish(req, "error", error=req.error, failure=req.failure)
            outputs.append(self._output(req))
        chunks, encoded = plan.chunks, None
        if any(c.media for c in chunks):
            chunks, failed, encoded = self.media.prepare(chunks, self.step_count + 1)
            outputs.extend(failed)
        if not chunks:
            return outputs + self.media.settle(encoded)
        step = self._launch(chunks, outputs)
        outputs.extend(self.media.settle(encoded))
        if step is not None:
            outputs.extend(self._decode_ahead_and_finish(step))
        return outputs

    def _decode_ahead_and_finish(self, step: LaunchedStep) -> list[RequestOutput]:
        """Queue the step after `step` if it can be planned ahead (it becomes `_inflight`), then
        wait for `step`'s results and hand them out."""
        ahead_error: Exception | None = None
        outputs: list[RequestOutput] = []
        try:
            self._inflight = self._launch_ahead(step, outputs)
        except DeviceFault:
            raise
        except Exception as e:  # queued nothing usable: its requests recompute, as after any failed step
            ahead_error = e
        outputs.extend(self._finish_step(step))
        if self._inflight is not None:  # where the decode rows planned ahead start is known now
            for c in self._inflight.chunks:
                if c.ahead and not c.request.finished:
                    c.start = c.request.num_computed
        if ahead_error is not None:
            chunks = step.chunks + (ahead_error.chunks if isinstance(ahead_error, AheadLaunchFailed) else [])
            live = list({id(c.request): c for c in chunks if not c.request.finished}.values())
            outputs.extend(self._quarantine(live, ahead_error) if live else [])
        return outputs

    def _launch(
        self,
        chunks: list[ScheduledChunk],
        outputs: list[RequestOutput],
        input_ids: torch.Tensor | None = None,
        verify_ahead: tuple[VerifyAhead, torch.Tensor] | None = None,
        planned_ahead: bool = False,
    ) -> LaunchedStep | None:
        """Queue the forward and the sampler of `chunks` on the device (nothing waits for it). None:
        the forward raised, and its requests were failed or requeued into `outputs`. A step planned
        ahead (its forward raises instead) gives the inputs of its chunks `ahead` (`input_ids`, in
        order) or its verify inputs and drafts [R] on the device."""
        self.step_count += 1
        ahead, device_drafts = verify_ahead if verify_ahead is not None else (None, None)
        try:
            results = self._execute(chunks, input_ids, ahead)
        except Exception as e:
            if is_device_error(e):
                raise DeviceFault(f"device fault at engine step {self.step_count}: {e}") from e
            if planned_ahead or input_ids is not None or ahead is not None:
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
            pending = launch_sample(logits, reqs, self.eos_ids, self.model.kernels.logits_scan) if reqs else None
        verify = [
            (c, res.verify_logits) for c, res in zip(chunks, results, strict=True) if res.verify_logits is not None
        ]
        accepting = None
        if verify:
            masked, errors = grammar_masks(
                [c.request for c, _ in verify], [c.drafts for c, _ in verify], [lg for _, lg in verify]
            )
            for (c, _), err in zip(verify, errors, strict=True):
                if err is not None:
                    outputs.append(self._fail(c.request, f"structured output failed: {err}", _grammar_failure(err)))
            verify = [(c, lg) for (c, _), lg, err in zip(verify, masked, errors, strict=True) if err is None]
        drafts = None
        if verify:
            accepting = launch_verify(
                [lg for _, lg in verify],
                [c.request for c, _ in verify],
                [c.drafts for c, _ in verify],
                self.eos_ids,
                device_drafts,
            )
            if len(verify) == len(chunks):
                drafts = self._queue_drafts(chunks, results, accepting, ahead)
        return LaunchedStep(self.step_count, chunks, results, pending, self._snapshot(chunks), accepting, drafts)

    def _queue_drafts(
        self,
        chunks: list[ScheduledChunk],
        results: list[ChunkResult],
        verify: PendingVerify,
        ahead: VerifyAhead | None = None,
    ) -> PendingDrafts | None:
        """The next drafts of a step of verify chunks, queued behind its acceptance (the device drafts
        while the host reads the step); None: they are made once the step is read (`_draft`)."""
        assert self.drafter is not None
        try:
            ran = [(c, res.hidden) for c, res in zip(chunks, results, strict=True)]
            return self.drafter.launch(ran, verify, ahead)  # type: ignore[arg-type]
        except Exception as e:
            if ahead is not None:
                raise  # the step planned ahead needs its drafts: its requests recompute
            if is_device_error(e):
                raise DeviceFault(f"device fault while drafting at engine step {self.step_count}: {e}") from e
            log.exception("queueing the drafts failed at engine step %d; they are made after it", self.step_count)
            return None

    def _snapshot(self, chunks: list[ScheduledChunk]) -> list[PendingSnapshot]:
        """Prefix-cache snapshots of the chunks that end at one of their request's snapshot points,
        queued behind the step's forward (committed once the step is read and found finite)."""
        if self.prefix_cache is None:
            return []
        taken = []
        for c in chunks:
            end = c.start + c.num_tokens
            if not c.ahead and end in c.request.cache_points:
                pending = self.prefix_cache.snapshot(c.request, end)
                if pending is not None:
                    taken.append(pending)
        return taken

    def _launch_ahead(self, step: LaunchedStep, outputs: list[RequestOutput]) -> LaunchedStep | None:
        """Queue the step after `step` before `step` is read: decode ahead when it can only be one
        more token for each of `step`'s requests, else the scheduler's plan (`_plan_ahead`). Requests
        that fail while it is planned or queued go to `outputs`."""
        if not self.config.async_scheduling:
            return None
        if self.drafter is not None:
            return None if self.scheduler.can_admit() else self._verify_ahead(step)
        if not self.scheduler.can_admit() and all(c.num_tokens == 1 for c in step.chunks):
            launched = self._decode_ahead(step)
            if launched is not None:
                return launched
        if self.model.device.type != "cuda" and not self.config.padded_decode:
            return None  # nothing overlaps on the CPU (padded_decode: the tests drive these paths)
        return self._plan_ahead(step, outputs)

    def _decode_ahead(self, step: LaunchedStep) -> LaunchedStep | None:
        """Queue the decode step that follows `step` — one more token for each of its requests — if
        nothing but its draw decides that step: no waiting request could start (none waits, or
        every running place or state slot is taken), every running request is in `step` and
        samples, its rows need nothing that only the host knows (grammar, penalties, min_tokens),
        and pages are free. A request that ends by length in `step` is left out; one that stops
        on a token is found when `step` is read and its draw dropped."""
        decode = self.runner.decode
        if decode is None or step.sample is None or len(step.chunks) > decode.max_batch:
            return None
        drawn = {id(r): i for i, r in enumerate(step.sample.requests)}
        chunks, rows = [], []
        for c in step.chunks:
            req = c.request
            if req.finished:
                continue
            if id(req) not in drawn or not draws_without_host(req):
                return None
            if ends_by_length(req, self.config.max_model_len):
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

    def _plan_ahead(self, step: LaunchedStep, outputs: list[RequestOutput]) -> LaunchedStep | None:
        """Queue the step the scheduler plans after `step`, on the requests as they will be once `step`
        is read (engine/plan_ahead.py); None where it must wait for the read."""
        if not self.config.plan_prefill_ahead:
            return None
        drawn = drawn_rows(step.chunks, step.sample)
        if drawn is None:
            return None
        with projected(step.chunks, drawn, self.config.max_model_len):
            plan = self.scheduler.schedule(preempt=False, step=self.step_count + 1)
            rows = mark_ahead(plan.chunks, drawn)
        for req in plan.failed:
            self._finish(req, "error", error=req.error, failure=req.failure)
            outputs.append(self._output(req))
        if plan.blocked or not plan.chunks:
            return None  # admitted requests keep their place: the plan made once `step` is read runs them
        chunks, encoded = plan.chunks, None
        if any(c.media for c in chunks):
            # the tower queued behind `step`; a request whose media fail ends here, as in a step of its own
            row_of = dict(zip((id(c) for c in chunks if c.ahead), rows, strict=True))
            chunks, failed, encoded = self.media.prepare(chunks, self.step_count + 1)
            outputs.extend(failed)
            if not chunks:
                outputs.extend(self.media.settle(encoded))
                return None
            rows = [row_of[id(c)] for c in chunks if c.ahead]
        input_ids = None
        if rows:
            assert step.sample is not None
            input_ids = step.sample.tokens[to_device(rows, step.sample.tokens.device)]
        try:
            launched = self._launch(chunks, outputs, input_ids, planned_ahead=True)
        except Exception as e:
            if isinstance(e, DeviceFault):
                raise
            outputs.extend(self.media.settle(encoded))
            raise AheadLaunchFailed(chunks, e) from e
        outputs.extend(self.media.settle(encoded))
        self.prefill_steps_ahead += 1
        return launched

    def _verify_ahead(self, step: LaunchedStep) -> LaunchedStep | None:
        """Queue the verify step that follows `step` — each request's new token and the k drafts
        queued behind `step`'s acceptance — before the host reads `step`, if nothing but the device
        decides that step: `step` verified every running request and queued its drafts, no request
        needs the host between tokens (grammar, penalties, min_tokens), and each has room for k more
        drafts however many `step` accepts (max_tokens, max_model_len, KV pages). Where each request's
        chunk starts, which token it verifies and which state slot it holds are read on the device
        (`short_step.VerifyAhead`); the host learns them when it reads `step`."""
        assert self.drafter is not None
        k, drafts, accepted = self.drafter.k, step.drafts, step.verify
        if drafts is None or accepted is None or self.runner.short is None:
            return None
        if len(step.chunks) != len(self.scheduler.running):
            return None  # another running request needs the scheduler
        if len(step.chunks) * (k + 1) > self.runner.short.max_tokens:
            return None  # too many tokens for a padded short step
        chunks = []
        for c in step.chunks:
            req = c.request
            after = len(c.drafts) + 1  # the most tokens `step` gives
            if req.finished or not draws_without_host(req):
                return None
            if len(req.output_ids) + after + k + 1 > req.params.max_tokens:
                return None  # it may end by length: the scheduler plans its last steps
            if req.num_tokens + after + k + 1 > self.config.max_model_len:
                return None
            if not self.scheduler.ensure_pages(req, req.num_tokens + after + k):
                return None
            chunks.append(ScheduledChunk(req, c.start + 1, 1, ahead=True, drafts=[0] * k))
        device = accepted.accepted.device
        new_tokens = accepted.new_tokens()  # [n]
        by_request = drafts.tokens.T  # [n, k]
        ahead = VerifyAhead(
            shift=accepted.accepted,
            drafted=to_device([len(c.drafts) for c in step.chunks], device, torch.long),
            ids=torch.cat([new_tokens[:, None], by_request], 1).reshape(-1),
        )
        rows = torch.cat([by_request, torch.full_like(new_tokens, -1)[:, None]], 1).reshape(-1)  # [n (k+1)]
        launched = self._launch(chunks, [], verify_ahead=(ahead, rows))
        self.steps_ahead += 1
        return launched

    def _finish_step(self, step: LaunchedStep) -> list[RequestOutput]:
        """Wait for `step`'s draw and flags, then check, append and stream each request's token."""
        outputs = self._read_step(step)
        for pending in step.snapshots:  # a faulted request leaves no cache entry
            faulted = pending.request.failure is FailureKind.NUMERICAL_FAULT
            (self.prefix_cache.drop if faulted else self.prefix_cache.commit)(pending)  # type: ignore[union-attr]
        if step.drafts is not None:
            self._collect_drafts(step.drafts, step.number)
        elif self.drafter is not None:
            self._draft(step)
        return outputs

    def _collect_drafts(self, drafts: PendingDrafts, number: int) -> None:
        """The drafts queued behind step `number`, as many as each request may verify next."""
        try:
            drafts.collect(self._draft_budget)
        except Exception as e:
            if is_device_error(e):
                raise DeviceFault(f"device fault while drafting at engine step {number}: {e}") from e
            log.exception("reading the drafts failed at engine step %d; the next step does not speculate", number)
            for req in drafts.requests:
                req.draft_ids = []

    def _draft(self, step: LaunchedStep) -> None:
        """The MTP layer over what `step` computed, and the drafts of the next step. A failure here
        costs speculation for one step, never a request: drafts only change how fast tokens come."""
        assert self.drafter is not None
        ran = [(c, res.hidden) for c, res in zip(step.chunks, step.results, strict=True) if res.hidden is not None]
        try:
            self.drafter.propose([(c, h) for c, h in ran if not c.request.finished], self._draft_budget)
        except Exception as e:
            if is_device_error(e):
                raise DeviceFault(f"device fault while drafting at engine step {step.number}: {e}") from e
            log.exception("drafting failed at engine step %d; the next step does not speculate", step.number)
            for c, _ in ran:
                c.request.draft_ids = []

    def _draft_budget(self, req: Request) -> int:
        """Drafts `req`'s next step verifies, with KV pages for them (0 when none are free)."""
        assert self.drafter is not None
        k = self.drafter.budget(req, self.config.max_model_len)
        return k if k and self.scheduler.ensure_pages(req, req.num_tokens + k) else 0

    def _read_step(self, step: LaunchedStep) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        sampled: dict[int, tuple | SamplingError] = {}
        if step.sample is not None:
            for req, result in zip(step.sample.requests, step.sample.results(), strict=True):
                sampled[id(req)] = result
        verified: dict[int, list | SamplingError] = {}
        if step.verify is not None:
            for req, result in zip(step.verify.requests, step.verify.results(), strict=True):
                verified[id(req)] = result
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
            if c.drafts:
                outputs.extend(self._accept(req, c, verified[id(req)]))
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
                outputs.append(self._fail(req, f"structured output failed: {e}", _grammar_failure(e)))
                continue
            try:
                reason = self.outputs.append_token(req, *result)
                if reason is not None:
                    self._finish(req, reason)
                outputs.append(self._output(req))
            except Exception as e:  # detokenisation or stop handling
                log.exception("request %s: handling its new token failed", req.request_id)
                outputs.append(self._fail(req, f"detokenising the output failed: {e!r}", FailureKind.INTERNAL))
        return outputs

    def _accept(self, req: Request, c: ScheduledChunk, result: list | SamplingError) -> list[RequestOutput]:
        """A verify chunk's outcome: keep the state after the accepted drafts, then append the
        accepted drafts and the token after them one by one (a stop on any of them ends there)."""
        if isinstance(result, SamplingError):
            return [self._fail(req, f"sampling failed: {result}", FailureKind.INVALID_REQUEST)]
        accepted = len(result) - 1
        stats = self.spec_stats
        stats.drafts += 1
        stats.draft_tokens += len(c.drafts)
        stats.accepted_tokens += accepted
        for i in range(accepted):
            stats.accepted_per_position[i] += 1
        try:
            commit_state(req, accepted, len(c.drafts))
            req.num_computed += accepted
            for token, info in result:
                if req.grammar is not None:
                    req.grammar.accept(token)
                reason = self.outputs.append_token(req, token, info)
                if reason is not None:
                    self._finish(req, reason)
                    break
            return [self._output(req)]
        except GrammarError as e:
            return [self._fail(req, f"structured output failed: {e}", FailureKind.INVALID_REQUEST)]
        except Exception as e:
            log.exception("request %s: handling its verified tokens failed", req.request_id)
            return [self._fail(req, f"detokenising the output failed: {e!r}", FailureKind.INTERNAL)]

    def _constrain(
        self, reqs: list[Request], rows: list[torch.Tensor], outputs: list[RequestOutput]
    ) -> tuple[list[Request], torch.Tensor]:
        """Stack the rows to sample from and apply every structured-output request's token mask (one
        masked fill for the whole batch); a request whose grammar fails fails alone."""
        logits = torch.stack(rows)
        matchers = [r.grammar if r.grammar is not None and r.grammar.active else None for r in reqs]
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
                outputs.append(self._fail(reqs[i], f"structured output failed: {err}", _grammar_failure(err)))
        return [reqs[i] for i in keep], logits[keep]

    # --- internals -------------------------------------------------------------------------
    def add_observer(self, observer: StepObserver) -> None:
        """Call `observer` around every forward from now on (engine/observer.py)."""
        self._observers.append(observer)

    def remove_observer(self, observer: StepObserver) -> None:
        self._observers.remove(observer)

    def _execute(
        self, chunks: list[ScheduledChunk], input_ids: torch.Tensor | None = None, ahead: VerifyAhead | None = None
    ):
        for observer in self._observers:
            observer.before_forward(chunks)
        out = self.runner.execute(chunks, input_ids, ahead)
        for observer in self._observers:
            observer.after_forward(chunks)
        return out

    def _quarantine(self, chunks: list[ScheduledChunk], error: Exception) -> list[RequestOutput]:
        """The forward raised. A request that was alone fails with the error; a batch goes back to the
        queue and each of its requests recomputes alone, so the one that raises fails by itself."""
        log.error(
            "engine step %d failed with %d request(s) in it: %r", self.step_count, len(chunks), error, exc_info=error
        )
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
        out = self.outputs.output(req)
        if req.finished:
            del self.requests[req.request_id]
        return out

    def _prefix_cache(self, num_snapshots: int) -> PrefixCache | None:
        if not self.config.enable_prefix_caching or num_snapshots == 0:
            return None
        snapshots = StatePool(self.model.config, num_snapshots, self.model.dtype, self.model.device)
        vocab = self.tokenizer.get_vocab()
        return PrefixCache(self.kv, self.states, snapshots, vocab.get("<|im_start|>"), vocab.get("<|vision_end|>"))

    def _eos_ids(self) -> tuple[int, ...]:
        ids = set(self.model.config.eos_token_ids)
        gen = self.model_dir / "generation_config.json"
        if gen.is_file():
            eos = read_json_object(gen).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))
