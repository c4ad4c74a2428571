"""The bounded thread pools media work runs on, and the limits on how much of them one request may hold.

Three pools, separate from each other, from text-only requests and from the event loop's default executor:

- fetch (4 threads): data: URL base64 (a frame list's is decoded by the decode thread that processes it),
  file:// reads, DNS lookups of http(s) hosts. The http(s) transfers themselves run on the event loop
  (httpx.AsyncClient) and hold no thread; at most `http_fetches` are in flight in the process, each under one
  deadline (fetch.py).
- decode (one thread per core, 2 to 8): video decoding and preprocessing, the CPU-heavy part; a request uses
  at most half of its decode slots at once, so one request's videos cannot hold them all.
- image decode (half as many threads): images, on threads of their own. An image costs at most about a
  second (`MediaLimits.max_source_pixels`: an 8192² PNG decodes in 0.7-1.3 s), a video up to tens of seconds
  (`max_decode_pixels`: an 8192² GIF of 240 one-pixel frames is a 5.5 KB file and ~10 s of decoding). On one
  pool two such videos held both threads of a 2-core machine and every image request waited behind them
  (10.6 s for a 64² PNG); now images never queue behind a video.
- render (2 threads): the chat template, tokenising, placeholder expansion and M-RoPE positions of media
  requests.

A video's frames (a frame list's JPEG decoding and resizing, a decoded video's resizes, then each
frame's copy into the video's patch rows) run on one more pool, process-wide, of one thread per core
(`map_frames`; `--media-frame-threads`): in submission order, so when many videos arrive at once the first
one's frames are done first and its request reaches the engine while the others are still being prepared
(with a pool per video, 8 videos shared the cores and all finished together, the engine idle until then).
On 4 or more cores a frame list's JPEG decoding and resizing run in worker processes instead, one per core (at most
32; Ray replicas divide the cores; `--media-frame-processes`), which write the patch rows into shared memory
(frame_processes.py, shared_rows.py): the server's process then holds no thread per core that competes with the
engine thread for the GIL.

Each request takes at most `fetches_per_request` fetch slots and `decodes_per_request` decode slots at once
(`RequestSlots`). A pool's size is the global limit for its kind of work: a cancelled request's running decode
keeps its thread only until its next frame (budget.py).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from hylora.media import shared_rows
from hylora.media.frame_processes import FrameProcesses

T = TypeVar("T")
log = logging.getLogger(__name__)


def available_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclass
class RequestSlots:
    """One request's share of the pools (made per request, on its event loop)."""

    fetch: asyncio.Semaphore
    decode: asyncio.Semaphore


class MediaPools:
    def __init__(
        self,
        decode_threads: int | None = None,
        fetch_threads: int = 4,
        render_threads: int = 2,
        http_fetches: int = 32,
        fetches_per_request: int = 4,
        decodes_per_request: int | None = None,
        frame_threads: int | None = None,
        frame_processes: int | Literal["auto"] | None = None,
        servers: int = 1,
    ):
        """`frame_threads` sizes the process-wide frame pool (`set_frame_threads`) and `frame_processes` the
        frame lists' worker processes (`set_frame_processes`: 0 none, "auto" one per core, the cores shared by
        `servers` engines on the machine), where they are given."""
        decode_threads = decode_threads or max(2, min(8, available_cpus()))
        sizes = dict(
            frame_threads=default_frame_threads() if frame_threads is None else frame_threads,
            decode_threads=decode_threads,
            fetch_threads=fetch_threads,
            render_threads=render_threads,
            http_fetches=http_fetches,
            fetches_per_request=fetches_per_request,
            decodes_per_request=decodes_per_request or max(1, decode_threads // 2),
        )
        for name, value in sizes.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"MediaPools.{name} must be a positive integer, got {value!r}")
        self.sizes = sizes
        if frame_threads is not None:
            set_frame_threads(frame_threads)
        if frame_processes is not None:
            self.sizes["frame_processes"] = set_frame_processes(frame_processes, servers)
        self.fetch = ThreadPoolExecutor(fetch_threads, thread_name_prefix="hylora-media-fetch")
        self.decode = ThreadPoolExecutor(decode_threads, thread_name_prefix="hylora-media-decode")
        self.image_decode = ThreadPoolExecutor(max(1, decode_threads // 2), thread_name_prefix="hylora-media-image")
        self.render = ThreadPoolExecutor(render_threads, thread_name_prefix="hylora-media-render")
        # asyncio primitives belong to one loop; offline callers run a fresh loop per call
        self._http: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )

    def http_slots(self) -> asyncio.Semaphore:
        """The process-wide limit on http(s) transfers in flight, for the running loop."""
        loop = asyncio.get_running_loop()
        if loop not in self._http:
            self._http[loop] = asyncio.Semaphore(self.sizes["http_fetches"])
        return self._http[loop]

    def request_slots(self) -> RequestSlots:
        return RequestSlots(
            asyncio.Semaphore(self.sizes["fetches_per_request"]), asyncio.Semaphore(self.sizes["decodes_per_request"])
        )

    async def run(self, executor: ThreadPoolExecutor, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on `executor`; cancelling the await drops it if it has not started."""
        return await asyncio.get_running_loop().run_in_executor(executor, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        for pool in (self.fetch, self.decode, self.image_decode, self.render):
            pool.shutdown(wait=False, cancel_futures=True)


_frame_pool: ThreadPoolExecutor | None = None
_frame_threads: int | None = None
_frame_lock = threading.Lock()


def default_frame_threads() -> int:
    return max(2, available_cpus())


def set_frame_threads(threads: int | None) -> None:
    """The frame pool's size from now on (None: one thread per core, at least 2); `--media-frame-threads`.
    Work already queued on the pool before finishes there."""
    global _frame_pool, _frame_threads
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ValueError(f"the frame pool needs a positive number of threads, got {threads!r}")
    with _frame_lock:
        old, _frame_pool, _frame_threads = _frame_pool, None, threads
    if old is not None:
        old.shutdown(wait=False)


def frame_pool() -> ThreadPoolExecutor:
    """The process's threads for per-frame work (PIL decodes and resizes and numpy copies release the GIL)."""
    global _frame_pool
    with _frame_lock:
        if _frame_pool is None:
            threads = _frame_threads or default_frame_threads()
            _frame_pool = ThreadPoolExecutor(threads, thread_name_prefix="hylora-media-frames")
        return _frame_pool


_frame_processes: FrameProcesses | None = None
MIN_CORES_FOR_PROCESSES = 4  # on fewer, the processes' copies cost more than the GIL they spare
MAX_DEFAULT_FRAME_PROCESSES = 32  # 8 videos of 20 frames keep 32 busy; more only hold memory


def default_frame_processes(servers: int = 1) -> int:
    """One frame process per core (at most 32) on a machine of 4 or more cores with /dev/shm, else none (the
    threads). `servers` engines on the machine (Ray replicas) share its cores."""
    cpus = available_cpus() // max(1, servers)
    if cpus < MIN_CORES_FOR_PROCESSES or not shared_rows.SHM_DIR.is_dir():
        return 0
    return min(cpus, MAX_DEFAULT_FRAME_PROCESSES)


def set_frame_processes(workers: int | Literal["auto"], servers: int = 1) -> int:
    """Decode and resize frame lists' frames in `workers` processes from now on (0: on the frame pool's
    threads; "auto": `default_frame_processes(servers)`, and the threads if they fail to start); started here.
    Returns the number running."""
    global _frame_processes
    auto = workers == "auto"
    if auto:
        workers = default_frame_processes(servers)
    if not isinstance(workers, int) or workers < 0:
        raise ValueError(f"the frame processes need a number of workers of 0 or more, got {workers!r}")
    new = FrameProcesses(workers) if workers else None
    with _frame_lock:
        old, _frame_processes = _frame_processes, new
    if old is not None:
        old.close()
    if new is None:
        return 0
    try:
        new.start()
    except Exception as e:
        with _frame_lock:
            if _frame_processes is new:
                _frame_processes = None
        new.close()
        if not auto:
            raise RuntimeError(
                f"the {workers} frame processes did not start ({e!r}); run with --media-frame-processes 0"
            ) from e
        log.warning("frame lists are decoded on threads: the frame processes did not start (%r)", e)
        return 0
    return workers


def frame_processes() -> FrameProcesses | None:
    """The worker processes that decode frame lists' frames, if the server runs them (frame_processes.py)."""
    return _frame_processes


def map_frames(fn: Callable[[int], T], count: int) -> list[T]:
    """[fn(0), ..., fn(count - 1)] on the frame pool, queued behind the frames submitted before them. On the
    first error the frames not started are dropped and the error raised."""
    futures = [frame_pool().submit(fn, i) for i in range(count)]
    try:
        return [f.result() for f in futures]
    except BaseException:
        for f in futures:
            f.cancel()
        raise


@functools.cache
def shared_pools() -> MediaPools:
    """The process's pools, for callers that do not bring their own (the offline LLM, tools, tests)."""
    return MediaPools()
