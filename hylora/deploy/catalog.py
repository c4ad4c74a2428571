"""Adapters loaded or unloaded at run time, kept the same on every replica.

The ingress checks a load / unload on one replica (through that replica's own route, so the answer
— 400, 403, 404 — is exactly `hylora serve`'s) and, when it succeeds, records it here. Every request
the ingress forwards carries the catalog; a replica applies what it has not applied yet before it
serves the request. So a change reaches every replica before that replica serves its next request,
including replicas Ray starts later to replace one that died.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class AdapterChange:
    generation: int
    name: str
    path: str | None  # the lora_path as the client sent it (under --adapter-root); None = unloaded

    @property
    def route(self) -> str:
        return "/v1/load_lora_adapter" if self.path is not None else "/v1/unload_lora_adapter"

    def payload(self) -> dict[str, str]:
        return {"lora_name": self.name} | ({"lora_path": self.path} if self.path is not None else {})


class AdapterCatalog:
    """The ingress's record: the latest change per adapter name, numbered in order."""

    def __init__(self) -> None:
        self._latest: dict[str, AdapterChange] = {}
        self._generation = 0

    def propose(self, name: str, path: str | None) -> AdapterChange:
        self._generation += 1
        return AdapterChange(self._generation, name, path)

    def commit(self, change: AdapterChange) -> None:
        current = self._latest.get(change.name)
        if current is None or current.generation < change.generation:
            self._latest[change.name] = change

    def changes(self) -> tuple[AdapterChange, ...]:
        return tuple(sorted(self._latest.values(), key=lambda c: c.generation))


class AppliedChanges:
    """A replica's side: which change of each adapter name it has applied."""

    def __init__(self) -> None:
        self._applied: dict[str, int] = {}

    def pending(self, changes: Iterable[AdapterChange]) -> list[AdapterChange]:
        return [c for c in changes if self._applied.get(c.name, 0) < c.generation]

    def mark(self, change: AdapterChange) -> None:
        self._applied[change.name] = max(self._applied.get(change.name, 0), change.generation)
