"""The Ray Serve application: N engine replicas behind one ingress.

`build_app(config)` is the builder for `serve run hylora.deploy:build_app ...` and for the
`import_path` of a `serve deploy` config; `application(args)` is what `hylora serve --replicas`
deploys. Deployment options set here (replicas, GPUs, health checks) can be overridden per
deployment in a Serve config file, under the names `HyloraEngine` and `HyloraIngress`.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

import ray
from ray import serve
from ray.serve import Application

from hylora.deploy.ingress import IngressSettings, ingress_class
from hylora.deploy.options import ReplicaPlan, hylora_env, parse_config
from hylora.deploy.replica import ENGINE_NAME, INGRESS_NAME, EngineReplica

HEALTH_CHECK_PERIOD_S = 5.0
HEALTH_CHECK_TIMEOUT_S = 30.0
INGRESS_MAX_ONGOING = 4096


def build_app(config: Mapping[str, Any]) -> Application:
    args = parse_config(config)
    if args.demo:  # written once here rather than by every replica at the same time
        from hylora.demo import ensure_demo

        ensure_demo()
    return application(args)


def cluster_gpus() -> float:
    """GPUs of the Ray cluster this process is connected to (0 when not connected)."""
    return float(ray.cluster_resources().get("GPU", 0)) if ray.is_initialized() else 0.0


def application(args: argparse.Namespace) -> Application:
    plan = ReplicaPlan.from_args(args, cluster_gpus())
    runtime_env = {"env_vars": hylora_env()}
    engine = serve.deployment(EngineReplica).options(
        name=ENGINE_NAME,
        num_replicas=plan.replicas,
        max_ongoing_requests=plan.max_ongoing,
        ray_actor_options={"num_cpus": plan.cpus, "num_gpus": plan.gpus, "runtime_env": runtime_env},
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S,
        graceful_shutdown_timeout_s=args.shutdown_timeout + 5,
    )
    ingress = serve.deployment(ingress_class()).options(
        name=INGRESS_NAME,
        num_replicas=1,  # holds the adapter catalog and the replicas' metrics
        max_ongoing_requests=INGRESS_MAX_ONGOING,
        ray_actor_options={"num_cpus": 0, "runtime_env": runtime_env},
        logging_config={"enable_access_log": False},  # replicas report metrics every few seconds
        graceful_shutdown_timeout_s=args.shutdown_timeout + 5,
    )
    settings = IngressSettings(
        api_key=args.api_key,
        public_metrics=args.public_metrics,
        max_body_bytes=args.max_body_bytes,
        shutdown_grace_s=args.shutdown_timeout,
    )
    serve_args = {k: v for k, v in vars(args).items() if k != "func"}
    return ingress.bind(engine.bind(serve_args), settings)
