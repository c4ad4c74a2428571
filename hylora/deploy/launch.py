"""`hylora serve ... --replicas N`: start Ray (or join `--ray-address`), deploy the application,
serve on `--host`/`--port` until SIGTERM/SIGINT, then drain and stop.

The first signal drains (new requests 503, running ones get `--shutdown-timeout` seconds, the rest
end with finish_reason `abort`); a second one stops at once. On a cluster it joined, only this
application is deleted; a local Ray instance it started is shut down.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading

log = logging.getLogger(__name__)
APP_NAME = "hylora"
EXIT_RAY_UNAVAILABLE = 3  # Ray is not installed or cannot start here


class RayUnavailable(RuntimeError):
    pass


def run(args: argparse.Namespace) -> int:
    try:
        import ray
        from ray import serve
    except ImportError:
        log.error("--replicas needs Ray Serve: pip install 'hylora[ray]'")
        return EXIT_RAY_UNAVAILABLE
    from hylora.deploy.application import application
    from hylora.deploy.replica import INGRESS_NAME
    from hylora.server.serve import HTTP_FLAGS

    if given := [f"--{f.replace('_', '-')}" for f in HTTP_FLAGS if getattr(args, f, None)]:
        log.error("%s: not with --replicas (Ray Serve's proxy serves the HTTP); leave them out", ", ".join(given))
        return 2
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        log.warning("listening on %s without --api-key: anyone who can reach it can use it", args.host)
    if args.demo:  # write it once here, not in every replica at the same time
        from hylora.demo import ensure_demo

        ensure_demo()
    try:
        _start_ray(ray, args)
    except RayUnavailable as e:
        log.error("could not start Ray: %s", e)
        return EXIT_RAY_UNAVAILABLE
    try:
        _check_gpus(ray, args)
        serve.start(http_options={"host": args.host, "port": args.port})
        try:
            serve.run(application(args), name=APP_NAME, route_prefix="/", blocking=False)
        except RuntimeError as e:  # a replica could not start (bad model directory, flags, ...): Ray says why
            log.error("the application did not start: %s%s", e, _why(serve))
            return 1
        stop = _Signals()
        log.info("serving on http://%s:%d with %d replica(s) (Ray Serve)", args.host, args.port, args.replicas)
        stop.wait_first()
        if not stop.forced:
            log.info("signal: draining (up to %g s), then stopping", args.shutdown_timeout)
            ingress = serve.get_deployment_handle(INGRESS_NAME, app_name=APP_NAME)
            response = ingress.drain.remote(args.shutdown_timeout)
            while not stop.forced:
                try:
                    ended = response.result(timeout_s=0.5)
                except TimeoutError:
                    continue
                if ended:
                    log.warning("ended %d unfinished request(s) at shutdown", ended)
                break
        return 0
    finally:
        if args.ray_address:
            serve.delete(APP_NAME)
        else:
            serve.shutdown()
            ray.shutdown()


def _start_ray(ray, args: argparse.Namespace) -> None:
    try:
        if args.ray_address:
            ray.init(address=args.ray_address, log_to_driver=True)
            return
        # a new local instance ("local": never one found through RAY_ADDRESS or `ray start`), where CPU
        # replicas always fit (one CPU each, oversubscribing cores if needed)
        cpus = max(os.cpu_count() or 1, args.replicas)
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=True)
    except Exception as e:
        raise RayUnavailable(repr(e)) from e


def _why(serve) -> str:
    try:
        deployments = serve.status().applications[APP_NAME].deployments
    except Exception:
        return ""
    return "".join(f"\n{name}: {d.message}" for name, d in deployments.items() if d.message)


def _check_gpus(ray, args: argparse.Namespace) -> None:
    """On a local instance, refuse GPU replicas that could never be placed (Ray would wait for ever)."""
    from hylora.deploy.options import ReplicaPlan

    gpus = ray.cluster_resources().get("GPU", 0)
    plan = ReplicaPlan.from_args(args, gpus)
    if not args.ray_address and plan.replicas * plan.gpus > gpus:
        raise ValueError(
            f"{plan.replicas} replicas of {plan.gpus:g} GPU need {plan.replicas * plan.gpus:g} GPUs; "
            f"this machine has {gpus:g}"
        )


class _Signals:
    """The first SIGTERM/SIGINT asks for a drain; a second one for an immediate stop."""

    def __init__(self) -> None:
        self.count = 0
        self.event = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, sig: int, frame: object) -> None:
        self.count += 1
        self.event.set()

    @property
    def forced(self) -> bool:
        return self.count > 1

    def wait_first(self) -> None:
        while not self.event.wait(0.5):
            pass
