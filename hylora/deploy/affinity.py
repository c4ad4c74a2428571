"""Which adapter a request is for, as the ingress sees it: that adapter's name is the request's
multiplexed model id, so Ray Serve routes it to a replica that already holds the adapter.

This is only a routing hint. The replica's own app decides (TaskRouter: 404 for an unknown model or
task, 400 for a model that contradicts the task) with the same table, so a request the hint cannot
place — base model, unknown name, a body that is not JSON — simply goes to any replica and gets
exactly the answer `hylora serve` gives. Unknown names never become model ids, so made-up names
cannot push real adapters out of a replica's multiplexing cache.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

GENERATION_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})


@dataclass
class RoutingTable:
    base_name: str
    tasks: dict[str, str] = field(default_factory=dict)
    adapters: set[str] = field(default_factory=set)

    def adapter_for(self, model: object, task: object) -> str | None:
        if isinstance(task, str):
            adapter = self.tasks.get(task)
            return adapter if adapter in self.adapters else None
        if isinstance(model, str) and model != self.base_name and model in self.adapters:
            return model
        return None


def multiplexed_model_id(table: RoutingTable, path: str, body: bytes, task_header: str | None) -> str:
    """The adapter of a generation request ('' = no preference: base model or not an adapter)."""
    if path not in GENERATION_ROUTES:
        return ""
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return ""
    if not isinstance(payload, dict):
        return ""
    task = payload.get("task") or task_header  # the body's task wins over X-Task, as in the server
    return table.adapter_for(payload.get("model"), task) or ""
