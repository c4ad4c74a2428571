"""Which adapter serves a request: by task (body `task` or header `X-Task`) or by `model`."""

from __future__ import annotations

import json
from pathlib import Path

from hylora.adapters.registry import AdapterRegistry


class RouteError(LookupError):
    """Unknown model or task; the message lists what exists."""


class ConflictError(ValueError):
    pass


class TaskRouter:
    def __init__(
        self,
        base_name: str,
        adapters: AdapterRegistry,
        tasks: dict[str, str] | None = None,
        aliases: list[str] | tuple[str, ...] = (),
    ):
        """`aliases`: more names of the base model (vLLM's --served-model-name with several names)."""
        self.base_name = base_name
        self.aliases = tuple(a for a in aliases if a != base_name)
        self.adapters = adapters
        self.tasks = dict(tasks or {})

    @staticmethod
    def read_task_map(path: str | Path) -> dict[str, str]:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"task map {path}: {e}") from None
        if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
            raise ValueError(f"task map {path}: expected a JSON object of task name → adapter name")
        return data

    def resolve(self, model: str | None, task: str | None) -> str | None:
        """Adapter name for the request, or None for the base model."""
        if task is not None:
            if task not in self.tasks:
                known = ", ".join(sorted(self.tasks)) or "none configured"
                raise RouteError(f"unknown task {task!r}; tasks: {known}")
            adapter = self.tasks[task]
            if adapter not in self.adapters.names():
                raise RouteError(f"task {task!r} maps to adapter {adapter!r}, which is not loaded")
            if model not in (None, self.base_name, *self.aliases, adapter):
                raise ConflictError(f"model {model!r} conflicts with task {task!r} (served by adapter {adapter!r})")
            return adapter
        if model is None or model == self.base_name or model in self.aliases:
            return None
        if model in self.adapters.names():
            return model
        raise RouteError(f"the model {model!r} does not exist; models: {', '.join(self.model_names())}")

    def model_names(self) -> list[str]:
        return [self.base_name, *self.aliases, *self.adapters.names()]
