"""kvlab's HTTP front ends over the public engine API.

    openai/     the OpenAI-compatible server (`kvlab serve`): the asyncio engine, the API's
                routes, /health and /metrics; knows nothing of the visualiser or the estimator
    viz/        the live visualiser (`kvlab viz`, and /viz under `kvlab serve`): a router the
                server mounts through `create_app(engine, routers=[viz.router])`
    replicas/   the same server over N engine replicas under Ray Serve (`--replicas`)

`create_app`, `serve` and `AsyncEngine` are the OpenAI server's (kvlab.server.openai).
"""

from kvlab.server.openai import AsyncEngine, create_app, serve

__all__ = ["AsyncEngine", "create_app", "serve"]
