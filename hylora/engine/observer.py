"""Watching the engine's forwards: `LLMEngine.add_observer(observer)` calls `before_forward` and
`after_forward` with the chunks of every step (benchmarks time steps this way; the fault injector
acts before the forward). An exception from `before_forward` counts as the forward's own."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hylora.engine.scheduler import ScheduledChunk


class StepObserver:
    def before_forward(self, chunks: Sequence[ScheduledChunk]) -> None:
        """Right before the step's forward is queued."""

    def after_forward(self, chunks: Sequence[ScheduledChunk]) -> None:
        """Right after the forward was queued (on a GPU it may still be running)."""
