"""An engine replica: one `hylora serve` — the same ServerState, engine thread and FastAPI app,
built from the same flags — inside a Ray Serve deployment, one per GPU (or CPU process).

The ingress hands it whole HTTP requests (`handle`); it answers them with its own app, so routes,
validation, containment, error bodies, streams and metrics are `hylora serve`'s. Model
multiplexing: the request's adapter is its multiplexed model id; `_resident` (wrapped with
`serve.multiplexed`, as many ids as the engine has device LoRA slots) readies the adapter in host
memory and tells Ray Serve this replica holds it, so later requests for it are routed here.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ray import serve

from hylora.deploy.affinity import RoutingTable
from hylora.deploy.catalog import AdapterChange, AppliedChanges
from hylora.deploy.forwarding import REPLICA_HEADER, ForwardedRequest, ResponseHead, call, relay
from hylora.deploy.logs import configure_logging
from hylora.deploy.metrics import PUSH_INTERVAL_S

log = logging.getLogger(__name__)
INGRESS_NAME = "HyloraIngress"
ENGINE_NAME = "HyloraEngine"


@dataclass(frozen=True)
class ResidentAdapter:
    """What Ray Serve's multiplexing cache holds for an adapter: its name (the engine owns the
    tensors, in its CPU cache and device slots)."""

    name: str


class EngineReplica:
    async def __init__(self, serve_args: dict[str, Any]):
        from hylora.server.app import build_app
        from hylora.server.serve import build_state

        configure_logging()
        args = argparse.Namespace(**serve_args)
        self.state = await asyncio.to_thread(build_state, args)
        self.state.aengine.on_fatal = self._fatal
        self.state.aengine.start()
        self.app = build_app(self.state)
        context = serve.get_replica_context()
        self.replica_id = context.replica_tag
        self.app_name = context.app_name
        self._replica_header = [(REPLICA_HEADER.encode(), self.replica_id.encode())]
        self._applied = AppliedChanges()
        self._sync_lock = asyncio.Lock()

        async def resident(adapter: str) -> ResidentAdapter:  # a plain function: Ray keeps its cache on it
            return await self._make_resident(adapter)

        self._resident = serve.multiplexed(max_num_models_per_replica=max(1, args.max_loras))(resident)
        self._metrics_task = asyncio.get_running_loop().create_task(self._push_metrics())
        log.info("replica %s serving %s", self.replica_id, self.state.router.base_name)

    # --- requests --------------------------------------------------------------------------
    async def handle(self, request: ForwardedRequest) -> AsyncIterator[ResponseHead | bytes]:
        """Answer one HTTP request with this replica's app; the response head carries this
        replica's id (header x-hylora-replica)."""
        await self._sync(request.catalog)
        adapter = serve.get_multiplexed_model_id()
        if adapter:
            await self._resident(adapter)
        async for item in relay(self.app, request, self._replica_header):
            if isinstance(item, ResponseHead) and request.change is not None and item.status == 200:
                self._applied.mark(request.change)
            yield item

    async def routing_table(self, catalog: tuple[AdapterChange, ...] = ()) -> RoutingTable:
        await self._sync(catalog)
        router = self.state.router
        return RoutingTable(router.base_name, dict(router.tasks), set(router.adapters.names()))

    async def metrics_text(self) -> str:
        headers = [(b"authorization", f"Bearer {self.state.api_key}".encode())] if self.state.api_key else []
        status, body = await call(self.app, ForwardedRequest("GET", "/metrics", headers=headers))
        if status != 200:
            raise RuntimeError(f"/metrics answered {status}")
        return body.decode()

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine stopped (device fault) is replaced."""
        if not self.state.aengine.alive:
            raise RuntimeError(self.state.aengine.fatal or "the engine stopped")

    async def __del__(self) -> None:
        """Ray Serve's graceful shutdown, after in-flight requests finished (or its timeout)."""
        self._metrics_task.cancel()
        await self.state.aengine.shutdown(self.state.shutdown_grace_s)

    # --- adapters --------------------------------------------------------------------------
    async def _make_resident(self, adapter: str) -> ResidentAdapter:
        """Ready `adapter` in host memory (file reads on a worker thread). A failure is left to the
        request: the app answers it (404 unknown, 409 broken) as `hylora serve` does."""
        try:
            await asyncio.to_thread(self.state.engine.adapters.prepare, adapter)
        except Exception as e:
            log.warning("replica %s: adapter %s not ready: %s", self.replica_id, adapter, e)
        return ResidentAdapter(adapter)

    async def _sync(self, catalog: tuple[AdapterChange, ...]) -> None:
        """Apply the loads / unloads this replica has not applied yet, through its own routes."""
        if not self._applied.pending(catalog):
            return
        async with self._sync_lock:
            for change in self._applied.pending(catalog):
                status, body = await call(
                    self.app, ForwardedRequest.json(change.route, change.payload(), self.state.api_key)
                )
                if status != 200:  # e.g. the files are not on this node: requests for it get 404 here
                    log.warning("replica %s: applying %s failed (%d): %s", self.replica_id, change, status, body[:500])
                self._applied.mark(change)

    # --- background ------------------------------------------------------------------------
    async def _push_metrics(self) -> None:
        ingress = None
        while True:
            await asyncio.sleep(PUSH_INTERVAL_S)
            try:
                if ingress is None:
                    ingress = serve.get_deployment_handle(INGRESS_NAME, app_name=self.app_name)
                await ingress.report_metrics.remote(self.replica_id, await self.metrics_text())
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the ingress restarting, or not up yet
                log.debug("replica %s: metrics not reported: %s", self.replica_id, e)

    def _fatal(self, reason: str) -> None:  # engine thread
        log.critical("replica %s: %s; Ray Serve replaces it at its next health check", self.replica_id, reason)
