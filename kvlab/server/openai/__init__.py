"""The OpenAI-compatible HTTP server: `kvlab serve`.

    async_engine   one thread drives Engine.step(); requests are asyncio queues
    protocol       request bodies (strictly typed), errors, sampling settings
    formats        completions vs chat shapes: choices, deltas, logprobs, usage
    tools          tool calls: the plan a request's tools make, parsing them from the reply
    serving        one API call: its engine requests, their submission, its JSON or SSE answer
    tokenize       /tokenize and /detokenize in vLLM's and llama.cpp's shapes
    guard          the API key and the body size, checked before any handler
    prom           Prometheus /metrics, written by hand
    app            FastAPI routes, error mapping, disconnects, uvicorn

Other front ends reuse `create_app(AsyncEngine(engine), routers=[...])` and add their own
routes (the visualiser, kvlab.server.viz, is one); `AsyncEngine.call(fn)` runs fn(engine) on
the engine thread (e.g. `engine.kv_view(id)`). Nothing here imports them.
"""

from kvlab.server.openai.app import create_app, serve
from kvlab.server.openai.async_engine import AsyncEngine

__all__ = ["AsyncEngine", "create_app", "serve"]
