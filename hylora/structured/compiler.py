"""Compiling output constraints off the engine's critical path: bounded, contained and cached.

One GrammarCompiler per tokenizer + model vocabulary (the cache key, the spec, is implicitly keyed
by the tokenizer too). A spec goes through:

1. a queue, smallest spec first (ties: first come). The wait there does not count against the
   spec's compile timeout; a compile that no thread took within `queue_timeout_s` answers
   CompilerBusy (HTTP 503) to its requester;
2. one of `max_workers` compile threads, each with its own grammar worker process
   (structured/sandbox.py). The worker checks the pre-compile bounds, compiles the spec with a
   `probe_stack_bytes` stack (2 MiB: as llguidance's mask threads) under a memory limit, and
   test-drives its first tokens (structured/probe.py). A crash there is that spec's 400 and the
   worker is restarted; a probe past `timeout_s` / 2 is killed (CompileTimeout, a 400): one slow
   spec holds one worker for at most that long, while smaller specs go to the other workers first;
3. the grammar text the worker returns is compiled again here, in the compile thread, whose stack
   (`compile_stack_bytes`, 32 MiB) is 16 times the worker's: what compiled there cannot overflow
   here.

Without worker processes (`isolate=False`, or they cannot be started: a log line says so) the same
checks run here, in the compile thread, with the pre-compile bounds as the only guard against a
native crash.

Results, failures included, are cached by spec (timeouts for `timeout_cache_s` only: the machine
may have been busy), least recently used out first past `cache_size` specs or `cache_chars`
characters of spec text. A compiled grammar's memory follows its text (a 1024-entry, 256 K-character
choice list holds ~4.7 MiB; CPU, 2026-12-06): 256 of the largest specs would hold ~1.2 GiB, 16 Mi
characters bound it (160 of them: RSS +370 MiB, level from the 64th), and 256 typical schemas (a
few KiB each) still fit. Concurrent requests for one spec share one compilation. `compile(spec)`
(async, for the server) / `compile_blocking(spec)` return a CompiledGrammar or raise
StructuredOutputError; `CompiledGrammar.matcher()` gives each request (each of its `n` choices) its
own GrammarMatcher, a copy of the compiled one (~5 µs, versus milliseconds to compile).

The compiler starts with its workers: the engine builds it lazily, at the first structured request,
so a server that never sees one never starts them. A worker costs ~60 ms to start plus building
the llguidance tokenizer (0.5–3.5 s and ~170–230 MiB RSS for a 200k–248k vocabulary), while the
server builds its own copy as before; the first worker starts at once, the others once it is
ready. Measured with a 200k vocabulary on 2 shared cores: the first structured request took
2.0 s (1.4 s without workers), later compiles milliseconds.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import heapq
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from copy import copy
from dataclasses import dataclass, field
from typing import Any

import llguidance
import llguidance.hf
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from hylora.structured.errors import CompilerBusy, CompileTimeout, StructuredOutputError
from hylora.structured.matcher import GrammarMatcher, VocabContext
from hylora.structured.probe import compile_text, probe_spec
from hylora.structured.sandbox import ProbeWorker, WorkerUnavailable
from hylora.structured.spec import StructuredSpec

log = logging.getLogger(__name__)

_STACK_LOCK = threading.Lock()
WORKER_RETRY_S = 30.0  # after a worker failed to start, compile in-process this long before trying again


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    spec: StructuredSpec
    compile_s: float
    _template: llguidance.LLMatcher  # never advanced: requests get copies
    _context: VocabContext

    def matcher(self, starts_after: Sequence[int] = ()) -> GrammarMatcher:
        """A request's own matcher; `starts_after`: the grammar applies after these tokens (`</think>`)."""
        return GrammarMatcher(self._template.deep_copy(), self._context, self.spec.label, starts_after)


@dataclass(eq=False)
class _Job:
    spec: StructuredSpec
    future: concurrent.futures.Future[CompiledGrammar] = field(default_factory=concurrent.futures.Future)
    started: concurrent.futures.Future[float] = field(default_factory=concurrent.futures.Future)  # monotonic start
    finished: float = 0.0


class GrammarCompiler:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        eos_ids: Sequence[int],
        *,
        cache_size: int = 256,
        cache_chars: int = 16 << 20,
        timeout_s: float = 10.0,
        max_workers: int = 3,
        mask_threads: int | None = None,
        isolate: bool = True,
        queue_timeout_s: float = 60.0,
        timeout_cache_s: float = 60.0,
        probe_stack_bytes: int = 2 << 20,
        compile_stack_bytes: int = 32 << 20,
        worker_memory_bytes: int = 2 << 30,
    ):
        """`vocab_size`: the model's logits width (may exceed the tokenizer's size: padding rows);
        `eos_ids`: every id that ends generation (the only tokens allowed once the grammar is done);
        `max_workers`: compile threads, each with a worker process (`isolate`);
        `mask_threads`: llguidance's threads for filling a batch's masks (default: 80% of the CPUs)."""
        if cache_size < 1 or cache_chars < 1 or timeout_s <= 0 or max_workers < 1 or queue_timeout_s <= 0:
            raise ValueError("cache_size, cache_chars and max_workers must be >= 1, timeout_s and queue_timeout_s > 0")
        if compile_stack_bytes < 4 * probe_stack_bytes:
            raise ValueError("the compile threads' stack must be several times the probe's")
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.queue_timeout_s = queue_timeout_s
        self.timeout_cache_s = timeout_cache_s
        self.cache_size = cache_size
        self.cache_chars = cache_chars
        self._cached_chars = 0  # spec text held by the cache
        self.isolate = isolate
        self._tokenizer = tokenizer
        self._eos_ids = tuple(eos_ids)
        self._probe_stack_bytes = probe_stack_bytes
        self._worker_memory_bytes = worker_memory_bytes
        self._cache: OrderedDict[StructuredSpec, _Job] = OrderedDict()
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._queue: list[tuple[int, int, _Job]] = []  # (spec size, arrival, job): a heap
        self._arrivals = itertools.count()
        self._closed = False
        self._local = threading.local()  # the compile thread's worker, for _compile
        self._workers: list[ProbeWorker] = []
        self._setup: dict[str, Any] | None = None
        self._setup_lock = threading.Lock()
        self._warned = False
        self._context: concurrent.futures.Future[VocabContext] = concurrent.futures.Future()
        threading.Thread(
            target=self._build_context,
            args=(tokenizer, vocab_size, mask_threads),
            name="hylora-grammar-vocab",
            daemon=True,
        ).start()
        self._first_worker = threading.Event()
        self._threads = [
            _start_thread(lambda i=i: self._drive(i), f"hylora-grammar-{i}", compile_stack_bytes)
            for i in range(max_workers)
        ]

    # --- requests --------------------------------------------------------------------------
    def submit(self, spec: StructuredSpec) -> concurrent.futures.Future[CompiledGrammar]:
        """The (shared, cached) compilation of `spec`; never blocks."""
        return self._job(spec).future

    async def compile(self, spec: StructuredSpec) -> CompiledGrammar:
        """For the server: await the compilation without blocking the event loop. The timeout
        counts from when a compile thread takes the spec, not from the queue."""
        job = self._job(spec)
        try:  # shield: a timeout or a client that hangs up must not cancel the shared compilation
            started = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(job.started)), self.queue_timeout_s)
        except TimeoutError:
            raise self._busy(spec) from None
        except StructuredOutputError as e:
            raise type(e)(str(e)) from None
        try:
            if job.future.done():  # a cached compile: its result, however long ago it started (a wait
                # of 0 s on the wrapped future would time out before the loop copies the result over)
                return job.future.result()
            remaining = max(0.0, started + self.timeout_s - time.monotonic())
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(job.future)), remaining)
        except TimeoutError:
            raise self._timeout(spec) from None
        except StructuredOutputError as e:  # a fresh error each time: re-raising the cached one grows its traceback
            raise type(e)(str(e)) from None

    def compile_blocking(self, spec: StructuredSpec) -> CompiledGrammar:
        """For offline callers (LLM.generate, tests)."""
        job = self._job(spec)
        try:
            started = job.started.result(self.queue_timeout_s)
        except TimeoutError:
            raise self._busy(spec) from None
        except StructuredOutputError as e:
            raise type(e)(str(e)) from None
        try:
            return job.future.result(max(0.0, started + self.timeout_s - time.monotonic()))
        except TimeoutError:
            raise self._timeout(spec) from None
        except StructuredOutputError as e:
            raise type(e)(str(e)) from None

    def close(self) -> None:
        """Stop the compile threads and worker processes; queued compiles fail."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            queued, self._queue = self._queue, []
            self._ready.notify_all()
        for _, _, job in queued:
            _fail(job, StructuredOutputError("the grammar compiler was shut down"))
        for worker in list(self._workers):
            worker.close()

    # --- internals -------------------------------------------------------------------------
    def _job(self, spec: StructuredSpec) -> _Job:
        with self._lock:
            if self._closed:
                raise StructuredOutputError("the grammar compiler was shut down")
            job = self._cache.get(spec)
            if job is not None and not self._stale(job):
                self._cache.move_to_end(spec)
                return job
            job = _Job(spec)
            heapq.heappush(self._queue, (_size(spec), next(self._arrivals), job))
            self._ready.notify()
            if (stale := self._cache.pop(spec, None)) is not None:
                self._cached_chars -= _size(stale.spec)
            self._cache[spec] = job
            self._cached_chars += _size(spec)
            while len(self._cache) > 1 and (
                len(self._cache) > self.cache_size or self._cached_chars > self.cache_chars
            ):  # the newest entry stays, however large: its requester holds it anyway
                _, evicted = self._cache.popitem(last=False)
                self._cached_chars -= _size(evicted.spec)
            return job

    def _stale(self, job: _Job) -> bool:
        """A cached timeout (or a cancelled compile) is tried again after a while."""
        if not job.future.done():
            return False
        if job.future.cancelled():
            return True
        return isinstance(job.future.exception(), CompileTimeout) and (
            time.monotonic() - job.finished > self.timeout_cache_s
        )

    def _take(self) -> _Job | None:
        with self._lock:
            while not self._queue and not self._closed:
                self._ready.wait()
            if self._closed:
                return None
            return heapq.heappop(self._queue)[2]

    def _drive(self, index: int) -> None:
        """A compile thread: (re)start its worker, take the next spec, compile it, repeat. The
        first thread's worker starts at once, the others' after it (a few seconds of tokenizer
        building each on a big vocabulary: they would slow the first one down)."""
        try:
            worker = self._new_worker(index) if self.isolate else None
        except Exception as e:  # e.g. the tokenizer cannot be serialised
            self._warn_in_process(f"{type(e).__name__}: {e}")
            worker = None
        if index > 0:
            self._first_worker.wait(WORKER_RETRY_S)
        retry_at = 0.0
        try:
            while True:
                if worker is not None and time.monotonic() >= retry_at:
                    try:
                        worker.ensure_started()  # before taking a spec: restarts count against nobody
                    except WorkerUnavailable as e:
                        self._warn_in_process(str(e))
                        retry_at = time.monotonic() + WORKER_RETRY_S
                if index == 0:
                    self._first_worker.set()
                with contextlib.suppress(Exception):  # a failed tokenizer: _compile says so to each request
                    self._context.result()  # before taking a spec, too
                job = self._take()
                if job is None:
                    return
                if not job.future.set_running_or_notify_cancel():
                    continue  # a caller cancelled it (through submit()): nobody waits for it
                if not job.started.done():
                    job.started.set_result(time.monotonic())
                self._local.worker = worker if worker is not None and worker.alive() else None
                try:
                    job.future.set_result(self._compile(job.spec))
                except StructuredOutputError as e:
                    job.future.set_exception(e)
                except BaseException as e:  # a bug: the requester gets it (HTTP 500), the thread lives on
                    log.exception("compiling a %s failed unexpectedly", job.spec.label)
                    job.future.set_exception(e)
                finally:
                    job.finished = time.monotonic()
                    self._local.worker = None
        finally:
            if worker is not None:
                worker.stop()

    def _compile(self, spec: StructuredSpec) -> CompiledGrammar:
        """Probe `spec` in this thread's worker (or here), then compile it here; raises StructuredOutputError."""
        start = time.perf_counter()
        try:
            context = self._context.result()
        except Exception as e:
            raise StructuredOutputError(f"structured outputs are unavailable for this model's tokenizer: {e}") from e
        worker: ProbeWorker | None = getattr(self._local, "worker", None)
        text: str | None = None
        if worker is not None:
            try:  # half the time: the compile here, as long again at worst, gets the other half
                text = worker.probe(spec, self.timeout_s / 2)
            except WorkerUnavailable:
                text = None
        if text is None:
            _, matcher = probe_spec(spec, context.tokenizer, context.tokenizer_size, context.eos_ids)
        else:
            matcher = compile_text(spec, context.tokenizer, text)
        return CompiledGrammar(spec, time.perf_counter() - start, matcher, context)

    def _build_context(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, mask_threads: int | None) -> None:
        try:
            self._context.set_result(_vocab_context(tokenizer, vocab_size, self._eos_ids, mask_threads))
        except BaseException as e:
            self._context.set_exception(e)

    def _new_worker(self, index: int) -> ProbeWorker | None:
        with self._setup_lock:
            if self._setup is None:
                text = _tokenizer_json(self._tokenizer)
                if text is None:
                    self._warn_in_process("the tokenizer is not a fast (tokenizers) one")
                    return None
                self._setup = {
                    "tokenizer": text,
                    "vocab_size": self.vocab_size,
                    "tokenizer_size": len(self._tokenizer),
                    "eos_ids": list(self._eos_ids),
                    "stack_bytes": self._probe_stack_bytes,
                    "memory_bytes": self._worker_memory_bytes,
                }
            worker = ProbeWorker(self._setup, name=str(index))
            self._workers.append(worker)
            return worker

    def _warn_in_process(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning(
                "grammar worker processes are unavailable (%s): compiling structured-output specs in the server "
                "process, guarded by the pre-compile bounds only",
                why,
            )

    def _timeout(self, spec: StructuredSpec) -> StructuredOutputError:
        return CompileTimeout(f"compiling the {spec.label} took longer than {self.timeout_s:g} s; simplify it")

    def _busy(self, spec: StructuredSpec) -> StructuredOutputError:
        return CompilerBusy(
            f"no grammar compiler was free for the {spec.label} within {self.queue_timeout_s:g} s; retry later"
        )


def _start_thread(target: Any, name: str, stack_bytes: int) -> threading.Thread:
    """A daemon thread with its own stack size (threading.stack_size is process-wide: set, start, restore)."""
    with _STACK_LOCK:
        previous = threading.stack_size(stack_bytes)
        try:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    return thread


def _fail(job: _Job, error: BaseException) -> None:
    for future in (job.started, job.future):
        if not future.done():
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                future.set_exception(error)


def _size(spec: StructuredSpec) -> int:
    return sum(len(c) for c in spec.payload) if spec.kind == "choice" else len(spec.payload)


def _tokenizer_json(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The tokenizers JSON the worker builds its llguidance tokenizer from (as llguidance.hf does)."""
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        return None
    backend = copy(tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str()


def _vocab_context(
    tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_ids: tuple[int, ...], mask_threads: int | None
) -> VocabContext:
    size = len(tokenizer)
    if size > vocab_size:
        raise ValueError(f"the tokenizer has {size} tokens but the model only {vocab_size} vocabulary rows")
    if not eos_ids or any(not 0 <= e < vocab_size for e in eos_ids):
        raise ValueError(f"EOS ids {list(eos_ids)} must be non-empty and in [0, {vocab_size})")
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos_ids))
    return VocabContext.build(ll_tokenizer, vocab_size, size, eos_ids, mask_threads)
