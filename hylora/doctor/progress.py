"""A progress line per phase on stderr: what, how many of how many, elapsed — so that a long phase
(a 4096-token reference on the CPU, the 27B's sweep) is never silent."""

from __future__ import annotations

import sys
import time
from typing import TextIO

UPDATE_S = 5.0  # within a phase, a line at most this often


class Progress:
    def __init__(self, phases: int, stream: TextIO | None = None, update_s: float = UPDATE_S):
        self.phases, self.stream, self.update_s = phases, stream, update_s
        self.started = time.monotonic()
        self.index = 0
        self.name, self.unit, self.total, self.done = "", "", 0, 0
        self._phase_started = self._last = self.started

    def phase(self, name: str, total: int, unit: str = "requests") -> None:
        """Start the next phase: `total` things (`unit`) to do."""
        self.index += 1
        self.name, self.unit, self.total, self.done = name, unit, total, 0
        self._phase_started = self._last = time.monotonic()
        self._line()

    def tick(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if self.done >= self.total or now - self._last >= self.update_s:
            self._last = now
            self._line(final=self.done >= self.total)

    def _line(self, final: bool = False) -> None:
        if self.stream is None:
            return
        now = time.monotonic()
        took = f" in {now - self._phase_started:.1f} s" if final else ""
        self.stream.write(
            f"doctor [{self.index}/{self.phases}] {self.name}: {self.done}/{self.total} {self.unit}{took} "
            f"({now - self.started:.0f} s elapsed)\n"
        )
        self.stream.flush()


def to_stderr(phases: int) -> Progress:
    return Progress(phases, sys.stderr)
