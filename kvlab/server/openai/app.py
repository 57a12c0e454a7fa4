"""The HTTP server: OpenAI's /v1/completions, /v1/chat/completions and /v1/models, vLLM's and
llama.cpp's /tokenize and /detokenize, plus /health and Prometheus /metrics, on FastAPI under
uvicorn.

Every error is OpenAI's JSON shape (`{"error": {"message", "type", "param", "code"}}`), so the
official client raises BadRequestError / NotFoundError / ... unchanged. A client that hangs
up, mid-stream or while waiting for a whole answer, has its requests aborted at once, which
frees their KV blocks. On shutdown uvicorn lets requests in flight finish for
`shutdown_timeout` seconds, then cancels them; the engine then aborts whatever is left.

The event loop only moves bytes: `RequestGuard` checks the key and the body size first,
then a small pool of worker threads decodes, validates, renders and tokenizes each body
(the native tokenizer releases the GIL), so a huge prompt never delays /health, other
clients' streams or the engine's steps.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, TypeVar

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send

from kvlab.engine import Engine
from kvlab.errors import KvlabError
from kvlab.server.openai.async_engine import AsyncEngine, EngineOverloaded, EngineUnavailable
from kvlab.server.openai.guard import RequestGuard, ServerLimits
from kvlab.server.openai.prom import CONTENT_TYPE
from kvlab.server.openai.protocol import ApiError
from kvlab.server.openai.serving import Call, Serving
from kvlab.server.openai.tokenize import detokenize, tokenize

log = logging.getLogger("kvlab.server")
T = TypeVar("T")
CLIENT_CLOSED = 499  # nginx's code for "the client closed the connection"
PREP_THREADS = 4  # bodies decoded and tokenized at once, off the event loop


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


class EventStream(StreamingResponse):
    """A call's server-sent events; the call is closed however the response ends."""

    def __init__(self, call: Call) -> None:
        super().__init__(call.events(), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.call = call

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.call.close()


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def as_api_error(exc: Exception) -> ApiError:
    """Map the exceptions a handler may raise to the status and type the client sees."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, KvlabError):
        return ApiError(400, str(exc))
    if isinstance(exc, (EngineOverloaded, EngineUnavailable)):
        return ApiError(503, str(exc), type_="service_unavailable_error")
    if isinstance(exc, RequestValidationError):  # a query parameter of the wrong type
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"][1:]) or None
        return ApiError(400, f"invalid value for '{where}': {err['msg']} "
                             f"(got {err.get('input')!r})", param=where)
    if isinstance(exc, HTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "internal_server_error"
        return ApiError(exc.status_code, str(exc.detail), type_=kind)
    log.exception("unhandled error", exc_info=exc)
    return ApiError(500, f"internal error: {exc}", type_="internal_server_error")


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await work, but cancel it (and raise ClientGone) if the client hangs up first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if task not in done:
        raise ClientGone()
    return task.result()


def create_app(engine: AsyncEngine, routers: Sequence[APIRouter] = (),
               limits: ServerLimits | None = None) -> FastAPI:
    """The FastAPI app; starting it starts the engine thread, stopping it stops that thread.

    `routers` add front ends of their own (e.g. the visualiser); their handlers find the
    AsyncEngine at `request.app.state.engine`, and may raise ApiError like these do.
    """
    limits = limits or ServerLimits()
    prep = ThreadPoolExecutor(PREP_THREADS, thread_name_prefix="kvlab-prep")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        yield
        await engine.stop()
        prep.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="kvlab", lifespan=lifespan)
    app.state.engine = engine
    serving = Serving(engine)
    app.state.serving = serving
    app.state.limits = limits

    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(as_api_error(exc))

    # the specific ones are answered quietly; a bare Exception is also logged by starlette
    for kind in (ApiError, KvlabError, EngineOverloaded, EngineUnavailable, HTTPException,
                 RequestValidationError, Exception):
        app.add_exception_handler(kind, on_error)
    add_info_routes(app, engine)
    add_generation_routes(app, serving, prep, limits.request_timeout)
    add_tokenize_routes(app, serving, prep)
    for router in routers:
        app.include_router(router)
    app.add_middleware(RequestGuard, limits=limits)
    return app


def add_info_routes(app: FastAPI, engine: AsyncEngine) -> None:
    started = int(time.time())

    @app.get("/health")
    async def health() -> JSONResponse:
        s = engine.stats
        ok = engine.alive and engine.accepting
        return JSONResponse(
            {"status": "ok" if ok else "unavailable", "model": engine.model_name,
             "num_requests": engine.num_live, "num_running": s.num_running,
             "num_waiting": s.num_waiting, "kv_blocks_used": s.kv_blocks_used,
             "kv_blocks_total": s.kv_blocks_total, "kv_usage": s.kv_usage,
             "prefix_queries": s.prefix_queries, "prefix_hits": s.prefix_hits},
            status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": engine.model_name, "object": "model", "created": started,
            "owned_by": "kvlab", "root": engine.model_name,
            "max_model_len": engine.max_model_len}]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(engine.metrics.render(engine.stats), media_type=CONTENT_TYPE)


def add_generation_routes(app: FastAPI, serving: Serving, prep: ThreadPoolExecutor,
                          timeout: float | None) -> None:
    async def answer(request: Request, build: Callable[[Serving, bytes], Call]) -> Response:
        """The HTTP side of a call: its body built in a worker thread, its deadline, and its
        abort when the client hangs up; the call itself submits and renders."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        body = await request.body()
        call = await loop.run_in_executor(prep, partial(build, serving), body)
        await call.submit(deadline)
        if call.stream:
            return EventStream(call)
        try:
            return JSONResponse(await unless_disconnected(request, call.respond()))
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        finally:
            call.close()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await answer(request, Call.completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await answer(request, Call.chat)


def add_tokenize_routes(app: FastAPI, serving: Serving, prep: ThreadPoolExecutor) -> None:
    async def answer(request: Request,
                     handle: Callable[[Serving, bytes], dict[str, Any]]) -> JSONResponse:
        """The body parsed and (de)tokenized in a worker thread, as a call is built."""
        body = await request.body()
        loop = asyncio.get_running_loop()
        return JSONResponse(await loop.run_in_executor(prep, partial(handle, serving), body))

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        return await answer(request, tokenize)

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        return await answer(request, detokenize)


def serve(engine: Engine, host: str = "127.0.0.1", port: int = 8000, max_waiting: int = 128,
          shutdown_timeout: float = 30.0, log_level: str = "info",
          routers: Sequence[APIRouter] = (), limits: ServerLimits | None = None) -> None:
    """Run the server until SIGINT / SIGTERM."""
    async_engine = AsyncEngine(engine, max_waiting)
    app = create_app(async_engine, routers, limits)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=int(shutdown_timeout))
    GracefulServer(config, async_engine).run()


class GracefulServer(uvicorn.Server):
    """uvicorn's server; a second before its grace period ends, unfinished requests end.

    Without this, uvicorn cancels what is still running when the grace period is over and
    a stream is cut mid-chunk; this way every stream ends with a final chunk (finish reason
    "abort") and [DONE], and every whole answer with what it had.
    """

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine) -> None:
        super().__init__(config)
        self.engine = engine

    async def shutdown(self, sockets: list | None = None) -> None:
        grace = float(self.config.timeout_graceful_shutdown or 0)
        timer = asyncio.get_running_loop().call_later(max(0.0, grace - 1.0), self.engine.end_all)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()
