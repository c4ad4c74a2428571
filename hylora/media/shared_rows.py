"""A video's uint8 patch rows in shared memory, so the frame processes write them where the server reads them.

A file in /dev/shm, its pages reserved up front (`posix_fallocate`: a full /dev/shm, such as a container's
64 MB default, is an error here and not a SIGBUS on some later write) and mapped. The file is removed as soon
as every frame is in; its pages stay mapped as the rows' memory until the rows are dropped (the media cache
evicts them or the request ends), so /dev/shm holds the videos being decoded and the cached ones.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import uuid
from pathlib import Path

import numpy as np
import torch

SHM_DIR = Path("/dev/shm")


class SharedRowsUnavailable(Exception):
    """No room (or no /dev/shm) for a video's rows: the caller decodes it in its own process instead."""


class SharedRows:
    """`with SharedRows(shape) as shared:` a uint8 array of `shape` at `shared.path`, mapped as `shared.rows`."""

    def __init__(self, shape: tuple[int, ...]):
        self.path = str(SHM_DIR / f"hylora-rows-{os.getpid()}-{uuid.uuid4().hex}")
        size = max(1, math.prod(shape))
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError as e:
            raise SharedRowsUnavailable(f"cannot create {self.path}: {e}") from e
        try:
            os.posix_fallocate(fd, 0, size)
            self._map = mmap.mmap(fd, size)
        except OSError as e:
            os.unlink(self.path)
            raise SharedRowsUnavailable(f"no room for {size} bytes in {SHM_DIR}: {e}") from e
        finally:
            os.close(fd)
        self.rows = torch.from_numpy(np.ndarray(shape, np.uint8, buffer=self._map))

    def __enter__(self) -> SharedRows:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Remove the file; the mapping goes with the last view of `rows`."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def open_rows(path: str, shape: tuple[int, ...]) -> np.ndarray:
    """A worker's writable view of the rows at `path` (the mapping closes when the view is dropped)."""
    with open(path, "r+b") as f:
        return np.ndarray(shape, np.uint8, buffer=mmap.mmap(f.fileno(), 0))
