"""Asynchronous front end: the engine loop runs on its own thread; each request gets a stream.

Everything that touches the engine (adding, aborting, adapter changes) runs on the engine thread
between steps, so the engine itself stays single-threaded.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from hylora.engine.engine import LLMEngine, RequestOutput
from hylora.engine.request import SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineDead(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
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
        inject_fault: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """Admit a request and return its output stream. Errors in the request (too long, unknown
        adapter, bad ids) raise here, before any output; leaving the stream early aborts it."""
        if not self._accepting:
            raise EngineDead("the server is shutting down")
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()

        def add() -> None:
            self.engine.add_request(request_id, prompt, params, adapter)
            self._streams[request_id] = (loop, outputs)
            if inject_fault:  # test hook (see LLMEngine.inject_fault)
                self.engine.inject_fault(request_id)

        await self.call(add)
        return self._outputs(request_id, outputs)

    async def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, adapter: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        async for out in await self.submit(request_id, prompt, params, adapter):
            yield out

    async def _outputs(self, request_id: str, outputs: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                out = await outputs.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:  # the caller went away (client disconnect, cancellation)
                self.abort(request_id)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def abort(self, request_id: str) -> None:
        self._submit(lambda: self.engine.abort(request_id))

    async def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine thread between steps and return its result (or raise its error)."""
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

    async def shutdown(self, grace_seconds: float = 10.0) -> None:
        """Stop accepting requests, let running ones finish for up to `grace_seconds`, abort the rest."""
        self._accepting = False
        deadline = asyncio.get_running_loop().time() + grace_seconds
        while asyncio.get_running_loop().time() < deadline and await self.call(self.engine.has_unfinished):
            await asyncio.sleep(0.05)
        await self.call(self._abort_all)
        await asyncio.sleep(0.05)  # let the abort outputs reach their streams
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)

    # --- engine thread ---------------------------------------------------------------------
    def _submit(self, fn: Callable[[], None]) -> None:
        self._commands.put(fn)
        self._wake.set()

    def _abort_all(self) -> None:
        for rid in list(self.engine.requests):
            self.engine.abort(rid)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            while True:
                try:
                    self._commands.get_nowait()()
                except queue.Empty:
                    break
            if not self.engine.has_unfinished():
                self._wake.wait(timeout=0.5)
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a bug, not a numerical fault: fail what is in flight, keep serving
                log.exception("engine step failed; ending the requests in flight")
                self._fail_all(e)
                continue
            for out in outputs:
                self._deliver(out.request_id, out, out.finished)

    def _deliver(self, request_id: str, item: Any, last: bool) -> None:
        target = self._streams.pop(request_id, None) if last else self._streams.get(request_id)
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _fail_all(self, error: Exception) -> None:
        for rid in self.engine.discard_all():
            self._deliver(rid, RuntimeError(f"internal engine error: {error}"), last=True)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
