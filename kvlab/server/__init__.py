"""The OpenAI-compatible HTTP server: `kvlab serve`.

    async_engine   one thread drives Engine.step(); requests are asyncio queues
    protocol       request bodies (strictly typed), errors, sampling settings
    formats        completions vs chat shapes: choices, deltas, logprobs, usage
    serving        an API call -> engine requests -> JSON or server-sent events
    prom           Prometheus /metrics, written by hand
    app            FastAPI routes, error mapping, disconnects, uvicorn
    replicas/      the same API over N engine replicas under Ray Serve (`--replicas`)

Other front ends reuse `create_app(AsyncEngine(engine))` and add their own routes;
`AsyncEngine.call(fn)` runs fn(engine) on the engine thread (e.g. `engine.kv_view(id)`).
"""

from kvlab.server.app import create_app, serve
from kvlab.server.async_engine import AsyncEngine

__all__ = ["AsyncEngine", "create_app", "serve"]
