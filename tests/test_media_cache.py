"""The preprocessed-media cache (hylora/media/cache.py): the same bytes with the same parameters are
decoded once, also when requests ask for them at the same time; other parameters are processed again;
a failure or a cancelled request is never handed to another request; the cache stays within its bytes."""

from __future__ import annotations

import threading

import pytest
import torch

from hylora.media import CancelFlag, Cancelled, MediaConfig, MediaLimits, ProcessedCache, process_video
from hylora.media import video as video_module
from hylora.media.processor import ProcessedMedia
from tests.media_helpers import video_bytes


def _item(nbytes: int, key: str = "k") -> ProcessedMedia:
    return ProcessedMedia("image", torch.zeros(nbytes, 1, dtype=torch.uint8), (1, 2, 2), 2, key)


@pytest.fixture
def decodes(monkeypatch) -> list[int]:
    """Counts read_video calls (each a decode of a video's bytes)."""
    calls: list[int] = []
    real = video_module.read_video

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(video_module, "read_video", counted)
    return calls


def test_same_video_is_decoded_once_and_other_parameters_again(decodes):
    data, cfg, limits = video_bytes(8, 64, 64, fps=4), MediaConfig(), MediaLimits()
    cache = ProcessedCache(1 << 30)
    first = process_video(data, cfg, limits, cache=cache)
    again = process_video(data, cfg, limits, cache=cache)
    assert again is first and len(decodes) == 1 and (cache.hits, cache.misses) == (1, 1)
    other = process_video(data, cfg, limits, {"fps": 4}, cache=cache)
    assert other.key != first.key and len(decodes) == 2
    uncached = process_video(data, cfg, limits)
    assert torch.equal(uncached.pixel_values, first.pixel_values) and len(decodes) == 3
    assert cache.bytes == first.pixels.numel() + other.pixels.numel()  # uint8 rows


def test_requests_at_once_share_one_processing():
    cache, started, release = ProcessedCache(1 << 20), threading.Event(), threading.Event()
    runs: list[int] = []

    def slow() -> ProcessedMedia:
        runs.append(1)
        started.set()
        release.wait(5)
        return _item(16)

    results: list[ProcessedMedia] = []
    owner = threading.Thread(target=lambda: results.append(cache.get_or_process("k", slow)))
    owner.start()
    started.wait(5)
    waiters = [threading.Thread(target=lambda: results.append(cache.get_or_process("k", slow))) for _ in range(3)]
    for t in waiters:
        t.start()
    release.set()
    for t in [owner, *waiters]:
        t.join(5)
    assert len(runs) == 1 and len(results) == 4 and all(r is results[0] for r in results)
    assert (cache.hits, cache.misses) == (3, 1)


def test_a_failed_owner_does_not_fail_its_waiter():
    cache, started, release = ProcessedCache(1 << 20), threading.Event(), threading.Event()

    def broken() -> ProcessedMedia:
        started.set()
        release.wait(5)
        raise ValueError("the owner's request failed")

    errors: list[BaseException] = []

    def owner() -> None:
        try:
            cache.get_or_process("k", broken)
        except ValueError as e:
            errors.append(e)

    t = threading.Thread(target=owner)
    t.start()
    started.wait(5)
    got: list[ProcessedMedia] = []
    waiter = threading.Thread(target=lambda: got.append(cache.get_or_process("k", lambda: _item(8))))
    waiter.start()
    release.set()
    t.join(5)
    waiter.join(5)
    assert len(errors) == 1 and len(got) == 1 and got[0].pixels.numel() == 8  # processed by the waiter itself
    assert len(cache) == 1


def test_a_cancelled_waiter_stops_waiting():
    cache, started, release = ProcessedCache(1 << 20), threading.Event(), threading.Event()

    def slow() -> ProcessedMedia:
        started.set()
        release.wait(5)
        return _item(8)

    t = threading.Thread(target=lambda: cache.get_or_process("k", slow))
    t.start()
    started.wait(5)
    cancel = CancelFlag()
    cancel.set()
    with pytest.raises(Cancelled):
        cache.get_or_process("k", slow, cancel)
    release.set()
    t.join(5)
    assert len(cache) == 1


def test_least_recently_used_leaves_first_and_too_large_is_not_kept():
    cache = ProcessedCache(100)
    for key in ("a", "b"):
        cache.get_or_process(key, lambda key=key: _item(40, key))
    cache.get_or_process("a", lambda: _item(40, "a"))  # a is now the most recent
    cache.get_or_process("c", lambda: _item(40, "c"))  # 120 > 100: b leaves
    assert cache.bytes == 80 and len(cache) == 2
    runs: list[int] = []
    cache.get_or_process("b", lambda: runs.append(1) or _item(40, "b"))
    assert runs == [1]  # b was evicted: processed again
    cache.get_or_process("big", lambda: _item(101, "big"))
    assert cache.bytes <= 100 and "big" not in cache._entries
    off = ProcessedCache(0)
    off.get_or_process("a", lambda: _item(1))
    assert len(off) == 0
