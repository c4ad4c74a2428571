"""Frame lists decoded in worker processes (`--media-frame-processes`): the same rows as in the server's own
threads, the same errors, nothing left in /dev/shm, and a worker that dies hurts only the call that killed it."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from hylora.media import MediaConfig, MediaError, MediaLimits, pools, processor, shared_rows
from hylora.media.frame_processes import FrameProcesses, WorkerCrashed
from hylora.media.pools import MediaPools, frame_processes, set_frame_processes
from hylora.media.processor import process_frame_list
from tests.media_helpers import frame_list, garbage, image_bytes

pytestmark = pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="the frame processes write into /dev/shm")

CFG = MediaConfig()
LIMITS = MediaLimits()


def rows_files() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("hylora-rows-*")}


@pytest.fixture(scope="module")
def workers():
    set_frame_processes(2)
    yield frame_processes()
    set_frame_processes(0)


def in_threads(url: str, **kwargs):
    saved = frame_processes()
    try:
        set_frame_processes(0)
        return process_frame_list(url, CFG, LIMITS, **kwargs)
    finally:
        set_frame_processes(2 if saved is not None else 0)


@pytest.mark.parametrize("count", [2, 5])  # even, and odd (the last frame fills its temporal patch)
def test_frame_processes_give_the_rows_the_threads_give(workers, count):
    url = frame_list([image_bytes(96, 64, fmt="JPEG", seed=i) for i in range(count)])
    before = rows_files()
    there = process_frame_list(url, CFG, LIMITS)
    assert rows_files() == before  # the file is removed once the frames are in
    here = in_threads(url)
    assert there.grid_thw == here.grid_thw and there.timestamps == here.timestamps
    assert torch.equal(there.pixels, here.pixels)
    assert torch.equal(there.table, here.table)


def test_a_broken_frame_gets_the_same_error_from_the_processes(workers):
    good = image_bytes(64, 64, fmt="JPEG")
    other_size = image_bytes(96, 64, fmt="JPEG")
    before = rows_files()
    for frames, message in [
        ([good, good, good, garbage()], "frame 3 of the frame list: could not decode image"),
        ([good, good, other_size], "frame 2 of the frame list is 96x64, frame 0 is 64x64"),
    ]:
        with pytest.raises(MediaError, match=message):
            process_frame_list(frame_list(frames), CFG, LIMITS)
    assert rows_files() == before
    assert process_frame_list(frame_list([good] * 4), CFG, LIMITS).grid_thw[0] == 2  # and the next one is served


def test_no_room_in_dev_shm_falls_back_to_the_threads(workers, monkeypatch, tmp_path, caplog):
    """Served on the threads, with one warning that says what to give the container (not one per video)."""
    monkeypatch.setattr(shared_rows, "SHM_DIR", tmp_path / "missing")
    monkeypatch.setattr(processor, "_warned", set())
    for seed in (0, 10):
        url = frame_list([image_bytes(64, 64, fmt="JPEG", seed=seed + i) for i in range(3)])
        assert torch.equal(process_frame_list(url, CFG, LIMITS).pixels, in_threads(url).pixels)
    warnings = [r for r in caplog.records if "/dev/shm has no room" in r.getMessage()]
    assert len(warnings) == 1 and "--shm-size" in warnings[0].getMessage()


def test_a_worker_that_dies_fails_only_its_own_call():
    """A call that kills its process (as a decoder crash would) is named; the calls beside it, another
    request's among them, get their results, and the pool serves the next call."""
    pool = FrameProcesses(2)
    try:
        other: list[int] = []
        beside = threading.Thread(target=lambda: other.extend(pool.map(abs, [(-i,) for i in range(40)])))
        beside.start()
        with pytest.raises(WorkerCrashed) as crashed:
            list(pool.map(os._exit, [(3,)]))
        assert crashed.value.index == 0
        with pytest.raises(WorkerCrashed) as crashed:
            list(pool.map(_exit_on_three, [(-1,), (-2,), (3,), (-4,)]))
        assert crashed.value.index == 2
        beside.join()
        assert other == list(range(40))
        assert list(pool.map(abs, [(-5,), (-6,)])) == [5, 6]
    finally:
        pool.close()


def _exit_on_three(value: int) -> int:
    if value == 3:
        os._exit(3)
    return abs(value)


def test_the_server_flag_sizes_the_processes(monkeypatch):
    """`--media-frame-processes N`; by default one per core from 4 cores, none below (the threads)."""
    try:
        assert MediaPools(decode_threads=1, frame_processes=2).sizes["frame_processes"] == 2
        assert frame_processes().workers == 2
        for cores, expected in [(2, 0), (3, 0), (4, 4)]:
            monkeypatch.setattr(pools, "available_cpus", lambda cores=cores: cores)
            assert MediaPools(decode_threads=1, frame_processes="auto").sizes["frame_processes"] == expected
            running = frame_processes()
            assert (running.workers if running else 0) == expected
    finally:
        set_frame_processes(0)
    assert frame_processes() is None
    with pytest.raises(ValueError, match="0 or more"):
        MediaPools(frame_processes=-1)


def test_replicas_on_one_machine_share_its_cores(monkeypatch):
    """Eight Ray replicas on a 128-core host must not start 128 frame processes each."""
    for cores, servers, expected in [(16, 1, 16), (16, 2, 8), (8, 4, 0), (128, 1, 32), (128, 8, 16)]:
        monkeypatch.setattr(pools, "available_cpus", lambda cores=cores: cores)
        assert pools.default_frame_processes(servers) == expected


def test_frame_processes_that_cannot_start(monkeypatch, caplog):
    """Asked for by number, the server refuses to start and says what to do; by default it warns and decodes
    on threads."""

    def fails(self):
        raise OSError("no forkserver here")

    monkeypatch.setattr(FrameProcesses, "start", fails)
    monkeypatch.setattr(pools, "available_cpus", lambda: 8)
    with pytest.raises(RuntimeError, match="run with --media-frame-processes 0"):
        MediaPools(frame_processes=2)
    assert MediaPools(frame_processes="auto").sizes["frame_processes"] == 0
    assert frame_processes() is None and "decoded on threads" in caplog.text
