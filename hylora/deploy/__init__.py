"""hylora on Ray Serve: engine replicas behind one OpenAI-compatible ingress, requests routed to a
replica that holds their adapter through Ray Serve's model multiplexing (docs/DEPLOY.md).

Needs the `ray` extra (`pip install 'hylora[ray]'`); the rest of hylora imports without Ray.

    serve run hylora.deploy:build_app demo=true replicas=2          # or a config file's import_path
    hylora serve --demo --replicas 2                                 # the same application, one command
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray.serve import Application


def build_app(config: Mapping[str, Any]) -> Application:
    """Ray Serve application builder: `config` holds `hylora serve`'s flags by name (`model_dir` or
    `demo`, `lora_modules`, `task`, `max_loras`, `replicas`, `replica_gpus`, ...)."""
    from hylora.deploy.application import build_app as build

    return build(config)


__all__ = ["build_app"]
