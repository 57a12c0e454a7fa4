"""The Serve application: the ingress bound to the replicas, and running it until a signal.

    Ingress (1 replica, no CPU reserved) --handle--> EngineReplica x N
        num_cpus = threads per replica; fixed N, or autoscaled on ongoing requests
        request router = PrefixRouter | RoundRobinRouter | Serve's power of two choices

`launch` is `kvlab serve --replicas`: it joins the Ray cluster at `ray_address` or starts a
local one, runs the application on host:port and blocks until SIGINT / SIGTERM; then it
deletes the application from a cluster it joined, or shuts down the Ray it started.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import AutoscalingConfig, RequestRouterConfig

from kvlab.server.replicas.ingress import Ingress
from kvlab.server.replicas.replica import EngineReplica
from kvlab.server.replicas.router import PrefixRouter, RoundRobinRouter
from kvlab.server.replicas.settings import AppSettings

APP_NAME = "kvlab"
INGRESS = "KvlabIngress"
REPLICA = "KvlabEngine"
INGRESS_MAX_ONGOING = 4096  # the ingress only relays bytes; the replicas bound the work
# Serve runs user code and each handle's router on event loops of their own by default: a
# thread hop per streamed chunk in every replica, the ingress and the proxy. kvlab's
# deployments never block their loop (the engine steps on its own thread, blocking work goes
# to worker threads), so a Ray that kvlab starts runs them on the main loop.
SERVE_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
             "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}


def replica_options(s: AppSettings) -> dict[str, Any]:
    """Deployment options of the engine replicas: CPUs, scaling, request router."""
    batch = s.engine.max_num_seqs
    opts: dict[str, Any] = {
        "name": REPLICA, "ray_actor_options": {"num_cpus": s.threads},
        # Serve holds nothing back: beyond the batch and the engine's own waiting room a
        # request gets the engine's 503, as without replicas
        "max_ongoing_requests": batch + s.max_waiting,
        "health_check_period_s": 5.0, "health_check_timeout_s": 30.0,
        "graceful_shutdown_timeout_s": 10.0,
    }
    if s.autoscaling:
        opts["autoscaling_config"] = AutoscalingConfig(
            min_replicas=s.min_replicas, max_replicas=s.max_replicas,
            initial_replicas=max(1, s.min_replicas or 0),
            target_ongoing_requests=s.target_ongoing_requests or max(1, batch // 2))
    else:
        opts["num_replicas"] = s.replicas
    if s.routing == "prefix":
        opts["request_router_config"] = RequestRouterConfig(
            request_router_class=PrefixRouter, request_router_kwargs={"imbalance": s.imbalance})
    elif s.routing == "round-robin":
        opts["request_router_config"] = RequestRouterConfig(
            request_router_class=RoundRobinRouter)
    return opts


def build(s: AppSettings) -> Application:
    """The application for `serve.run` (nothing is loaded until Serve starts the replicas)."""
    replicas = serve.deployment(EngineReplica).options(**replica_options(s)).bind(s, INGRESS)
    ingress = serve.deployment(Ingress).options(
        name=INGRESS, num_replicas=1, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=INGRESS_MAX_ONGOING)
    return ingress.bind(replicas, s)


def launch(s: AppSettings, host: str, port: int, ray_address: str | None,
           log_level: str = "info") -> None:
    """Run the application until SIGINT / SIGTERM."""
    import ray

    joined = ray_address is not None
    if not joined:  # Ray's processes inherit this environment; one set by the user wins
        for name, value in SERVE_ENV.items():
            os.environ.setdefault(name, value)
    # a local Ray collects no Ray metrics: kvlab's /metrics are its own, and the agent that
    # gathers Ray's would take CPU from the replicas
    local = {"num_cpus": local_cpus(s), "_system_config": {"enable_metrics_collection": False}}
    ray.init(address=ray_address, include_dashboard=False, logging_level=log_level.upper(),
             **({} if joined else local))
    try:
        # per-call access lines (each request twice, each replica report) only when debugging
        logs = {"log_level": log_level.upper(), "enable_access_log": log_level == "debug"}
        serve.start(http_options={"host": host, "port": port}, logging_config=logs)
        serve.run(build(s), name=APP_NAME, route_prefix="/", logging_config=logs)
        scale = (f"{s.min_replicas}..{s.max_replicas}" if s.autoscaling else str(s.replicas))
        print(f"kvlab serve: {scale} replicas x {s.threads} threads, {s.routing} routing, on "
              f"http://{host}:{port}/v1", file=sys.stderr, flush=True)
        wait_for_signal()
    finally:
        if joined:  # the cluster keeps Serve and its other applications
            serve.delete(APP_NAME)
        else:
            serve.shutdown()
        ray.shutdown()


def local_cpus(s: AppSettings) -> int:
    """CPUs a local Ray declares: the machine's, or enough for every replica if more."""
    return max(os.cpu_count() or 1, s.most_replicas * s.threads)


def wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
