"""Compiling output constraints off the engine's critical path, with a bounded LRU cache.

One GrammarCompiler per tokenizer + model vocabulary (so the cache key, the spec, is implicitly
keyed by the tokenizer too). Work runs in a small thread pool (llguidance drops the GIL):

- at construction, the tokenizer's byte trie is built (~2.4 s for a 248k vocabulary, once);
- `compile(spec)` (async, for the server) / `compile_blocking(spec)` return a CompiledGrammar or
  raise StructuredOutputError (HTTP 400) for a spec that cannot be compiled or takes longer than
  `timeout_s`. Results, failures included, are cached by spec; concurrent requests for one spec
  share one compilation;
- `CompiledGrammar.matcher()` gives each request (each of its `n` choices) its own GrammarMatcher,
  a copy of the compiled one (~5 µs, versus milliseconds to compile).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
import llguidance.hf
from transformers import PreTrainedTokenizerBase

from hylora.structured.grammar import grammar_text
from hylora.structured.matcher import GrammarMatcher, VocabContext
from hylora.structured.spec import StructuredOutputError, StructuredSpec


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    spec: StructuredSpec
    compile_s: float
    _template: llguidance.LLMatcher  # never advanced: requests get copies
    _context: VocabContext

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._template.deep_copy(), self._context, self.spec.label)


class GrammarCompiler:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        eos_ids: Sequence[int],
        *,
        cache_size: int = 256,
        timeout_s: float = 10.0,
        max_workers: int = 2,
        mask_threads: int | None = None,
    ):
        """`vocab_size`: the model's logits width (may exceed the tokenizer's size: padding rows);
        `eos_ids`: every id that ends generation (the only tokens allowed once the grammar is done);
        `mask_threads`: llguidance's threads for filling a batch's masks (default: 80% of the CPUs)."""
        if cache_size < 1 or timeout_s <= 0:
            raise ValueError("cache_size must be >= 1 and timeout_s > 0")
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self._cache: OrderedDict[StructuredSpec, concurrent.futures.Future[CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="hylora-grammar")
        self._context = self._pool.submit(_vocab_context, tokenizer, vocab_size, tuple(eos_ids), mask_threads)

    def submit(self, spec: StructuredSpec) -> concurrent.futures.Future[CompiledGrammar]:
        """The (shared, cached) compilation of `spec`; never blocks."""
        with self._lock:
            future = self._cache.get(spec)
            if future is not None and not future.cancelled():
                self._cache.move_to_end(spec)
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[spec] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return future

    async def compile(self, spec: StructuredSpec) -> CompiledGrammar:
        """For the server: await the compilation without blocking the event loop."""
        future = asyncio.wrap_future(self.submit(spec))
        try:  # shield: a timeout or a client that hangs up must not cancel the shared compilation
            return await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
        except TimeoutError:
            raise self._timeout(spec) from None
        except StructuredOutputError as e:  # a fresh error each time: re-raising the cached one grows its traceback
            raise StructuredOutputError(str(e)) from None

    def compile_blocking(self, spec: StructuredSpec) -> CompiledGrammar:
        """For offline callers (LLM.generate, tests)."""
        try:
            return self.submit(spec).result(self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise self._timeout(spec) from None
        except StructuredOutputError as e:
            raise StructuredOutputError(str(e)) from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _timeout(self, spec: StructuredSpec) -> StructuredOutputError:
        return StructuredOutputError(f"compiling the {spec.label} took longer than {self.timeout_s:g} s; simplify it")

    def _compile(self, spec: StructuredSpec) -> CompiledGrammar:
        start = time.perf_counter()
        try:
            context = self._context.result()
        except Exception as e:
            raise StructuredOutputError(f"structured outputs are unavailable for this model's tokenizer: {e}") from e
        try:
            text = grammar_text(spec)
        except Exception as e:  # llguidance raises ValueError for what it cannot parse
            raise StructuredOutputError(f"invalid {spec.label}: {e}") from None
        try:
            matcher = llguidance.LLMatcher(context.tokenizer, text, log_level=0, limits=_LIMITS)
        except Exception as e:  # llguidance reports grammar errors through is_error(); this is unexpected
            raise StructuredOutputError(f"cannot compile the {spec.label}: {e}") from e
        if matcher.is_error():
            raise StructuredOutputError(f"cannot compile the {spec.label}: {_clip(matcher.get_error())}")
        return CompiledGrammar(spec, time.perf_counter() - start, matcher, context)


# llguidance's default work limits bound compile and per-step time; terse errors keep the
# client's schema out of our logs and error messages.
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)


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


def _clip(message: str, limit: int = 1000) -> str:
    message = message.strip() or "unknown error"
    return message if len(message) <= limit else message[:limit] + " …"
