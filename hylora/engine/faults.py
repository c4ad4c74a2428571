"""Fault injection, a testing aid (EngineConfig.fault_injection, `--enable-fault-injection`; never on
in production): a request may be made to fault in its next step the way a broken kernel or device
would, so that tests can prove a fault stays with its request.

- "nan": its GDN state slot and the KV pages it writes are filled with NaN before the forward (what a
  faulty kernel would leave behind; pages of a cached prefix it shares are read-only to it);
- "raise": the forward raises while this request is in the step (a bug this request triggers);
- "device": the forward raises what a CUDA fault raises.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from hylora.cache import PagedKVCache, StatePool
from hylora.engine.observer import StepObserver

if TYPE_CHECKING:
    from hylora.engine.scheduler import ScheduledChunk

FAULT_KINDS = ("nan", "raise", "device")


class FaultInjector(StepObserver):
    def __init__(self, kv: PagedKVCache, states: StatePool):
        self.kv, self.states = kv, states
        self._armed: dict[str, str] = {}  # request id → fault kind

    def arm(self, request_id: str, kind: str = "nan") -> None:
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; one of {', '.join(FAULT_KINDS)}")
        self._armed[request_id] = kind

    def before_forward(self, chunks: Sequence[ScheduledChunk]) -> None:
        """Called with the chunks of a step right before its forward runs."""
        for c in chunks:
            rid = c.request.request_id
            kind = self._armed.pop(rid, None)
            if kind == "nan":
                self._poison(c.request.state_slot, c.request.pages)
            elif kind == "raise":
                self._armed[rid] = kind  # keeps raising while this request is in a step
                raise RuntimeError(f"injected fault in the forward of request {rid!r}")
            elif kind == "device":
                raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")

    def _poison(self, state_slot: int | None, pages: list[int]) -> None:
        if state_slot is not None:
            self.states.recurrent[:, state_slot] = float("nan")
            self.states.conv[:, state_slot] = float("nan")
        for p in pages:
            if self.kv.shared(p):  # a cached prefix's page: the request only reads it
                continue
            rows = slice(p * self.kv.page_size, (p + 1) * self.kv.page_size)
            self.kv.k[:, rows] = float("nan")
            self.kv.v[:, rows] = float("nan")
