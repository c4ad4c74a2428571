"""Worker processes for a frame list's frames: JPEG decoding and resizing out of the server's process.

Why processes: the engine thread launches each step's kernels from Python, and every torch call releases and
takes back the GIL. With a thread per core decoding frames beside it, each of those takes back costs a wait
behind whichever frame thread grabbed the GIL in between, and a 7 ms burst of launches stretched to 0.6-1.1 s
while 8 videos were decoded on 16 cores (docs/BASELINE.md run 50 c). Worker processes hold no lock of the
server's: the server's process only sends each frame's JPEG bytes and waits, while the workers write the
resized frames into the video's patch rows in shared memory (shared_rows.py).

A worker that dies (a decoder crash, the kernel's OOM killer) breaks its pool and every call still in it. The
calls are run again once in a fresh pool, then alone in a process of their own: a call that kills even that
one is the culprit (`WorkerCrashed`); the others, other requests' frames among them, get their results.
"""

from __future__ import annotations

import multiprocessing
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from PIL import Image

T = TypeVar("T")

# imported once by the fork server, so a worker starts as a fork of a process that already has them
PRELOAD = ["hylora.media.processor"]
PILLOW_BLOCKS = 4  # freed image blocks a worker keeps (Pillow's block size is 16 MiB at most)


class WorkerCrashed(Exception):
    """Call `index` of a `FrameProcesses.map` killed the process that ran it, even alone."""

    def __init__(self, index: int):
        super().__init__(f"call {index} killed its worker process")
        self.index = index


def _context() -> multiprocessing.context.BaseContext:
    """Fork server where the platform has one (no fork of the server's threads or CUDA state), else spawn."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        return ctx
    return multiprocessing.get_context("spawn")


def _worker_setup() -> None:
    """Ctrl-C stops the server, which stops its workers: they need not print tracebacks of their own. Pillow
    keeps a few freed image blocks for the next frame: without them a fresh process maps and zeroes new pages
    for every image, and a 720p frame's decode and resize took 16 ms there against 10.5 ms in the server's
    process (2-core dev box)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    Image.core.set_blocks_max(PILLOW_BLOCKS)


class FrameProcesses:
    """A pool of `workers` processes, started on first use; `map` runs calls on it in submission order."""

    def __init__(self, workers: int):
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"the frame processes need a positive number of workers, got {workers!r}")
        self.workers = workers
        self._lock = threading.Lock()
        self._pool: ProcessPoolExecutor | None = None

    def _executor(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(self.workers, _context(), initializer=_worker_setup)
            return self._pool

    def _drop(self, broken: ProcessPoolExecutor) -> None:
        """Forget a broken pool (once, however many of its calls report it)."""
        with self._lock:
            if self._pool is broken:
                self._pool = None
        broken.shutdown(wait=False, cancel_futures=True)

    def start(self) -> None:
        """Start the workers now rather than on the first video (the server calls this at start-up)."""
        list(self.map(int, [(0,)] * self.workers))

    def map(self, fn: Callable[..., T], calls: Sequence[tuple[Any, ...]]) -> Iterator[T]:
        """fn(*call) for each call, in worker processes; each result is yielded once it and those before it are
        done. A call's exception is raised as it comes (the calls after it are dropped), as is `WorkerCrashed`.
        `fn` and the arguments must pickle (`fn` a module-level function)."""
        pool = self._executor()
        futures: list[Future] = [pool.submit(fn, *call) for call in calls]
        owners = [pool] * len(calls)
        crashes = [0] * len(calls)
        try:
            for i in range(len(calls)):
                while True:
                    try:
                        yield futures[i].result()
                        break
                    except BrokenProcessPool:
                        crashes[i] += 1
                    broken = owners[i]
                    self._drop(broken)
                    if crashes[i] > 1:  # it broke a fresh pool too: alone, in a process of its own
                        futures[i] = self._alone(fn, calls[i], i)
                        continue
                    pool = self._executor()
                    for j in range(i, len(calls)):  # the calls the broken pool took with it
                        if owners[j] is broken and not _succeeded(futures[j]):
                            futures[j].cancel()
                            futures[j], owners[j] = pool.submit(fn, *calls[j]), pool
        finally:
            for f in futures:
                f.cancel()

    def _alone(self, fn: Callable[..., T], call: tuple[Any, ...], index: int) -> Future:
        single = ProcessPoolExecutor(1, _context(), initializer=_worker_setup)
        try:
            result: Future = Future()
            try:
                result.set_result(single.submit(fn, *call).result())
            except BrokenProcessPool:
                raise WorkerCrashed(index) from None
            except Exception as e:  # noqa: BLE001 - the call's own error, raised where its result is read
                result.set_exception(e)
            return result
        finally:
            single.shutdown(wait=False)

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


def _succeeded(future: Future) -> bool:
    return future.done() and not future.cancelled() and future.exception() is None
