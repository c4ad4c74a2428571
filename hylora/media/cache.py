"""Preprocessed images and videos by content (vLLM's `--mm-processor-cache-gb`): the same video sent to
`relic`, `tomb` and `mural` is fetched for each request but decoded and resized once.

Keyed by `processor.media_key` (the bytes and every effective preprocessing parameter), least recently
used first out, bounded by the bytes of the items' pixel rows. A request that needs media another request
is processing waits for that work instead of repeating it. If that work fails, or its request goes away,
the waiter processes the media itself: a failure is never handed to another request.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from hylora.media.budget import CancelFlag

if TYPE_CHECKING:
    from hylora.media.processor import ProcessedMedia

DEFAULT_CAPACITY_GB = 4.0  # vLLM's mm_processor_cache_gb default
WAIT_S = 0.05  # how often a waiter looks at its own request's cancel flag


class ProcessedCache:
    def __init__(self, capacity_bytes: int):
        self.capacity = max(0, int(capacity_bytes))
        self._entries: OrderedDict[str, ProcessedMedia] = OrderedDict()
        self._running: dict[str, Future[ProcessedMedia]] = {}
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = 0  # served from the cache or from another request's work in progress
        self.misses = 0  # processed here (or tried: a failure counts too)

    @classmethod
    def from_gb(cls, gb: float = DEFAULT_CAPACITY_GB) -> ProcessedCache | None:
        """A cache of `gb` GiB of pixel rows; None (no cache) for 0."""
        return cls(int(gb * 2**30)) if gb > 0 else None

    def __len__(self) -> int:
        return len(self._entries)

    def get_or_process(
        self, key: str, process: Callable[[], ProcessedMedia], cancel: CancelFlag | None = None
    ) -> ProcessedMedia:
        """The cached item for `key`, another request's result for it, or `process()` (then cached).
        Runs on a decode thread; `cancel` (this request's) ends a wait with `Cancelled`."""
        while True:
            with self._lock:
                item = self._entries.get(key)
                if item is not None:
                    self._entries.move_to_end(key)
                    self.hits += 1
                    return item
                running = self._running.get(key)
                if running is None:
                    mine: Future[ProcessedMedia] = Future()
                    self._running[key] = mine
                    self.misses += 1
            if running is None:
                return self._process(key, process, mine)
            item = self._wait(running, cancel)
            if item is not None:
                with self._lock:
                    self.hits += 1
                return item
            # its owner failed or went away: look again (this request may process it)

    def _process(self, key: str, process: Callable[[], ProcessedMedia], mine: Future) -> ProcessedMedia:
        try:
            item = process()
        except BaseException as e:
            with self._lock:
                del self._running[key]
            mine.set_exception(e)
            raise
        with self._lock:
            del self._running[key]
            self._put(key, item)
        mine.set_result(item)
        return item

    @staticmethod
    def _wait(running: Future, cancel: CancelFlag | None) -> ProcessedMedia | None:
        """The other request's result, or None when its work failed."""
        while True:
            if cancel is not None:
                cancel.check()
            try:
                return running.result(timeout=WAIT_S)
            except TimeoutError:
                continue
            except BaseException:
                return None

    def _put(self, key: str, item: ProcessedMedia) -> None:
        size = _size(item)
        if size > self.capacity:
            return
        self._entries[key] = item
        self.bytes += size
        while self.bytes > self.capacity:
            _, evicted = self._entries.popitem(last=False)
            self.bytes -= _size(evicted)


def _size(item: ProcessedMedia) -> int:
    return item.pixels.numel() * item.pixels.element_size()
