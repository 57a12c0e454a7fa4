"""The HTTP server every API shares: FastAPI under uvicorn, one engine thread, front ends
mounted as routers.

    create_app(engine, front_ends, limits)
        CORS (browsers, from --allowed-origins) -> RequestGuard (key, body size)
        -> /health, /metrics, and each front end's routes (OpenAI, Responses, Anthropic,
           Ollama, the visualiser), which find `Calls` at `request.app.state.calls`

An API call is built from its body in a worker thread (decoding, validation, template,
tokenizing; the native tokenizer releases the GIL), so a huge prompt never delays /health,
other clients' streams or the engine's steps; it is then submitted on the event loop and
answered as one JSON object or as a stream (server-sent events, or NDJSON for Ollama). A
client that hangs up, mid-stream or while waiting for a whole answer, has its requests aborted
at once, which frees their KV blocks. On shutdown uvicorn lets requests in flight finish for
`shutdown_timeout` seconds, then cancels them; the engine then aborts whatever is left.

Errors are written in the shape of the API whose path was called (`ErrorShapes`), so each
official client raises its own exception types unchanged.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol, TypeVar

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import Receive, Scope, Send

from kvlab.engine import Engine
from kvlab.errors import KvlabError
from kvlab.server.core.async_engine import AsyncEngine, EngineOverloaded, EngineUnavailable
from kvlab.server.core.errors import ApiError, ErrorShape, ErrorShapes
from kvlab.server.core.guard import RequestGuard, ServerLimits
from kvlab.server.core.prom import CONTENT_TYPE
from kvlab.server.core.serving import Serving

log = logging.getLogger("kvlab.server")
T = TypeVar("T")
CLIENT_CLOSED = 499  # nginx's code for "the client closed the connection"
PREP_THREADS = 4  # bodies decoded and tokenized at once, off the event loop


@dataclass(frozen=True)
class FrontEnd:
    """One API mounted on the server: its routes and the error shape of its paths."""

    router: APIRouter
    error_shapes: dict[str, ErrorShape] = field(default_factory=dict)  # path prefix -> shape


class ApiCall(Protocol):
    """One API call, built from its body (worker thread), then submitted and answered."""

    stream: bool
    media_type: str  # of the stream: text/event-stream, application/x-ndjson

    async def submit(self, deadline: float | None = None) -> None: ...
    async def respond(self) -> dict[str, Any]: ...
    def events(self) -> AsyncIterator[str]: ...
    def close(self) -> None: ...


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


class CallStream(StreamingResponse):
    """A call's streamed answer; the call is closed however the response ends."""

    def __init__(self, call: ApiCall) -> None:
        super().__init__(call.events(), media_type=call.media_type,
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.call = call

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.call.close()


class Calls:
    """How a route answers: build off the loop, submit with the deadline, stream or wait."""

    def __init__(self, serving: Serving, prep: ThreadPoolExecutor,
                 timeout: float | None) -> None:
        self.serving = serving
        self.prep = prep
        self.timeout = timeout

    async def answer(self, request: Request,
                     build: Callable[[Serving, bytes], ApiCall]) -> Response:
        """The HTTP side of a call: its body built in a worker thread, its deadline, and its
        abort when the client hangs up; the call itself submits and renders."""
        loop = asyncio.get_running_loop()
        deadline = None if self.timeout is None else loop.time() + self.timeout
        call = await self.blocking(request, build)
        await call.submit(deadline)
        if call.stream:
            return CallStream(call)
        try:
            return JSONResponse(await unless_disconnected(request, call.respond()))
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        finally:
            call.close()

    async def blocking(self, request: Request, handle: Callable[[Serving, bytes], T]) -> T:
        """handle(serving, body) in a worker thread (parsing, templates, tokenizing)."""
        body = await request.body()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.prep, partial(handle, self.serving), body)


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
        kind = ("not_found_error" if exc.status_code == 404 else "invalid_request_error"
                if exc.status_code < 500 else "internal_server_error")
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


def create_app(engine: AsyncEngine, front_ends: Sequence[FrontEnd] = (),
               limits: ServerLimits | None = None) -> FastAPI:
    """The FastAPI app; starting it starts the engine thread, stopping it stops that thread.

    Handlers find the AsyncEngine at `request.app.state.engine`, the shared `Serving` at
    `.serving` and `Calls` at `.calls`, and may raise ApiError.
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
    serving = Serving(engine, limits.served_model_names, limits.any_model_name,
                      limits.instance, limits.reasoning_budget)
    app.state.engine, app.state.serving, app.state.limits = engine, serving, limits
    app.state.calls = Calls(serving, prep, limits.request_timeout)
    shapes = shapes_of(front_ends)

    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        err = as_api_error(exc)
        return JSONResponse(shapes.body(request.url.path, err), status_code=err.status)

    # the specific ones are answered quietly; a bare Exception is also logged by starlette
    for kind in (ApiError, KvlabError, EngineOverloaded, EngineUnavailable, HTTPException,
                 RequestValidationError, Exception):
        app.add_exception_handler(kind, on_error)
    add_info_routes(app, engine)
    for front in front_ends:
        app.include_router(front.router)
    app.add_middleware(RequestGuard, limits=limits, shapes=shapes)
    add_cors(app, limits)
    return app


def add_cors(app: FastAPI, limits: ServerLimits) -> None:
    """Browsers from `limits.allowed_origins` (none: no CORS at all). Added last, so it is
    outermost: preflights and the guard's refusals carry CORS headers too."""
    if limits.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(limits.allowed_origins),
                           allow_methods=["*"], allow_headers=["*"],
                           expose_headers=["*"], max_age=600)


def shapes_of(front_ends: Sequence[FrontEnd]) -> ErrorShapes:
    """The error shape of every path the front ends registered."""
    shapes = ErrorShapes()
    for front in front_ends:
        for prefix, shape in front.error_shapes.items():
            shapes.add(prefix, shape)
    return shapes


def add_info_routes(app: FastAPI, engine: AsyncEngine) -> None:
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

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(engine.metrics.render(engine.stats), media_type=CONTENT_TYPE)


def serve(engine: Engine, host: str = "127.0.0.1", port: int = 8000, max_waiting: int = 128,
          shutdown_timeout: float = 30.0, log_level: str = "info",
          front_ends: Sequence[FrontEnd] = (), limits: ServerLimits | None = None) -> None:
    """Run the server until SIGINT / SIGTERM."""
    async_engine = AsyncEngine(engine, max_waiting)
    app = create_app(async_engine, front_ends, limits)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=int(shutdown_timeout))
    GracefulServer(config, async_engine).run()


class GracefulServer(uvicorn.Server):
    """uvicorn's server; a second before its grace period ends, unfinished requests end.

    Without this, uvicorn cancels what is still running when the grace period is over and
    a stream is cut mid-chunk; this way every stream ends with its final event (finish
    reason "abort") and every whole answer with what it had.
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
