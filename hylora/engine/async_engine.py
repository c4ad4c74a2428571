"""Asynchronous front end: the engine loop runs on its own thread; each request gets a stream.

Everything that touches the engine (adding, aborting, adapter changes) runs on the engine thread
between steps, so the engine itself stays single-threaded. File I/O for adapters happens on worker
threads before a request reaches the engine thread, so a slow disk never stalls a step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from hylora.engine.engine import DeviceFault, LLMEngine, RequestOutput
from hylora.engine.multimodal import MultimodalPrompt
from hylora.engine.request import FailureKind, SamplingParams
from hylora.structured import CompiledGrammar

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class Submission:
    """One request as `AsyncEngine.submit_many` admits it (the arguments of `LLMEngine.add_request`)."""

    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    adapter: str | None = None
    inject_fault: str | None = None  # testing aid (engine/faults.py)
    mm: MultimodalPrompt | None = None
    grammar: CompiledGrammar | None = None
    grammar_after: Sequence[int] = ()
    group: str | None = None
    cache_salt: str | None = None


class EngineDead(RuntimeError):
    """The engine no longer accepts requests (shutting down, or stopped after a device fault)."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_fatal: Callable[[str], None] | None = None):
        """`on_fatal(reason)` is called (from the engine thread) after a device fault has ended every
        request: the process should exit so that a supervisor restarts it on a healthy device."""
        self.engine = engine
        self.on_fatal = on_fatal
        self.fatal: str | None = None
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._accepting = True
        self._thread = threading.Thread(target=self._loop, name="hylora-engine", daemon=True)

    def start(self) -> AsyncEngine:
        self._thread.start()
        return self

    # --- requests --------------------------------------------------------------------------
    async def submit(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        adapter: str | None = None,
        inject_fault: str | None = None,
        mm: MultimodalPrompt | None = None,
        grammar: CompiledGrammar | None = None,
        grammar_after: Sequence[int] = (),
        group: str | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Admit a request and return its output stream. Errors in the request (too long, unknown or
        broken adapter, bad ids) raise here, before any output; leaving the stream early aborts it."""
        request = Submission(
            request_id, prompt, params, adapter, inject_fault, mm, grammar, grammar_after, group, cache_salt
        )
        return (await self.submit_many([request]))[0]

    async def submit_many(self, requests: Sequence[Submission]) -> list[AsyncIterator[RequestOutput]]:
        """Admit several requests in one visit to the engine thread (between two steps), e.g. the n
        choices of a request: each would otherwise wait for a step of its own. All or none: when one
        is refused, the ones admitted before it are aborted and its error raises."""
        self._check_accepting()
        prepared: dict[str, Any] = {}
        for adapter in dict.fromkeys(r.adapter for r in requests if r.adapter is not None):
            # may read the adapter from disk: on a worker thread
            prepared[adapter] = await asyncio.to_thread(self.engine.adapters.prepare, adapter)
        loop = asyncio.get_running_loop()
        queues: list[asyncio.Queue] = [asyncio.Queue() for _ in requests]

        def add_all() -> None:
            self._check_accepting()
            added: list[str] = []
            try:
                for r, outputs in zip(requests, queues, strict=True):
                    self.engine.add_request(
                        r.request_id, r.prompt, r.params, r.adapter, prepared.get(r.adapter or ""), r.mm,
                        r.grammar, r.grammar_after, r.group, r.cache_salt,
                    )  # fmt: skip
                    added.append(r.request_id)
                    self._streams[r.request_id] = (loop, outputs)
                    if r.inject_fault:  # testing aid (engine/faults.py)
                        self.engine.inject_fault(r.request_id, r.inject_fault)
            except BaseException:
                for request_id in added:
                    self._streams.pop(request_id, None)
                    self.engine.abort(request_id)
                raise

        await self.call(add_all)
        return [self._outputs(r.request_id, q) for r, q in zip(requests, queues, strict=True)]

    async def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, adapter: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        async for out in await self.submit(request_id, prompt, params, adapter):
            yield out

    async def _outputs(self, request_id: str, outputs: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """Outputs as they come; a reader that fell behind gets what piled up merged into one."""
        finished = False
        try:
            while not finished:
                out: RequestOutput = await outputs.get()
                while not out.finished and not outputs.empty():
                    out = out.merged(outputs.get_nowait())
                finished = out.finished
                yield out
        finally:
            if not finished:  # the caller went away (client disconnect, cancellation, slow reader)
                self.abort(request_id)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.fatal is None

    @property
    def accepting(self) -> bool:
        return self._accepting and self.alive

    def abort(self, request_id: str) -> None:
        self._submit(lambda: self.engine.abort(request_id))

    async def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine thread between steps and return its result (or raise its error)."""
        if not self._thread.is_alive():
            raise EngineDead(self.fatal or "the engine is not running")
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def run() -> None:
            try:
                result: Any = fn()
            except BaseException as e:  # handed to the caller
                loop.call_soon_threadsafe(_settle, future, None, e)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)

        self._submit(run)
        return await future

    async def drain(self, timeout: float) -> int:
        """Stop admitting requests; let running ones finish for up to `timeout` seconds, then end
        the rest with a shutting-down error. Returns how many were ended that way."""
        self._accepting = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._thread.is_alive() and loop.time() < deadline and await self.call(self.engine.has_unfinished):
            await asyncio.sleep(0.05)
        if not self._thread.is_alive():
            return 0
        message = f"the server is shutting down; the request did not finish within the {timeout:g} s grace period"
        return await self.call(lambda: self._end_all(message, FailureKind.SHUTTING_DOWN))

    async def shutdown(self, grace_seconds: float = 10.0) -> None:
        """Drain (see `drain`), then stop the engine thread."""
        if self._thread.is_alive():
            await self.drain(grace_seconds)
            await asyncio.sleep(0.05)  # let the final outputs reach their streams
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            await asyncio.to_thread(self._thread.join, 5)

    # --- engine thread ---------------------------------------------------------------------
    def _check_accepting(self) -> None:
        if not self._accepting:
            raise EngineDead("the server is shutting down")
        if self.fatal is not None:
            raise EngineDead(self.fatal)

    def _submit(self, fn: Callable[[], None]) -> None:
        self._commands.put(fn)
        self._wake.set()

    def _end_all(self, message: str, failure: FailureKind) -> int:
        outputs = self.engine.fail_all(message, failure)
        for out in outputs:
            self._deliver(out)
        return len(outputs)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            while True:
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
                try:
                    command()
                except Exception:  # a command's own errors must not stop the loop
                    log.exception("engine command failed")
            if not self.engine.has_unfinished():
                self._wake.wait(timeout=0.5)
                continue
            try:
                outputs = self.engine.step()
            except DeviceFault as e:
                self._device_fault(e)
                return
            except Exception as e:  # a bug outside any one request: end what is in flight, keep serving
                log.exception("engine step failed; ending the requests in flight")
                self._end_all(f"internal engine error: {e!r}", FailureKind.INTERNAL)
                continue
            for out in outputs:
                self._deliver(out)

    def _device_fault(self, error: DeviceFault) -> None:
        log.critical("%s; ending every request and stopping the engine (restart the process)", error)
        self.fatal = f"{error}; the server is restarting"
        self._accepting = False
        try:
            self._end_all(self.fatal, FailureKind.DEVICE_FAULT)
        except Exception:
            log.exception("ending requests after the device fault failed")
            for rid in list(self._streams):
                self._deliver(RequestOutput(rid, [], [], "", True, "error", self.fatal, FailureKind.DEVICE_FAULT))
        if self.on_fatal is not None:
            self.on_fatal(self.fatal)

    def _deliver(self, out: RequestOutput) -> None:
        target = self._streams.pop(out.request_id, None) if out.finished else self._streams.get(out.request_id)
        if target is not None:
            loop, q = target
            with contextlib.suppress(RuntimeError):  # the event loop is closed (process exiting)
                loop.call_soon_threadsafe(q.put_nowait, out)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
