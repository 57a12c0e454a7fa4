"""The HTTP front door of a replicated app: one Serve deployment in front of the replicas.

    client -> Serve proxy -> Ingress (key and body size checked, body read)
           -> routing key -> replicas handle (PrefixRouter picks one) -> EngineReplica
           <- ResponseStart, body chunks <- relayed as they come (server-sent events stream)

/health and /metrics are answered here from the board the replicas report to: /health says
how many replicas are healthy of how many, with each one's stats; /metrics is every
replica's metrics, labelled by replica. Every other path goes to a replica, whose answer
carries an `x-kvlab-replica` header naming it.

When a replica dies under a request that has sent the client nothing yet (a whole answer, or
a stream before its first event), the request goes to another replica, up to RETRIES times:
generation starts over there and the client sees one answer. Past that, or once a stream has
begun, it ends cleanly: a 503 in OpenAI's error shape, or an error event and `[DONE]`. Serve
starts a replacement; requests on the other replicas go on.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from kvlab.server.apis import front_ends
from kvlab.server.core.app import add_cors, shapes_of
from kvlab.server.core.errors import ApiError
from kvlab.server.core.guard import RequestGuard
from kvlab.server.core.prom import CONTENT_TYPE
from kvlab.server.replicas.board import ReplicaBoard, ReplicaReport
from kvlab.server.replicas.merge import merge_metrics
from kvlab.server.replicas.replica import Forwarded, ResponseStart
from kvlab.server.replicas.router import routing_key
from kvlab.server.replicas.settings import AppSettings

# answers relayed chunk by chunk: server-sent events, and Ollama's NDJSON
STREAMED_TYPES = ("text/event-stream", "application/x-ndjson")
log = logging.getLogger("kvlab.server")
REPLICA_HEADER = "x-kvlab-replica"
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection"}
RETRIES = 2  # other replicas a request tries when its replica dies before answering
RETRY_WAIT_S = 0.5  # times the attempt: Serve needs a moment to drop a dead replica


def replica_failed(exc: BaseException) -> ApiError:
    return ApiError(503, f"the replica serving this request failed ({type(exc).__name__}); "
                         "it is being replaced, retry", type_="service_unavailable_error")


@serve.ingress()
class Ingress:
    """A Serve deployment class: HTTP in, a replica's answer out."""

    def __init__(self, replicas: DeploymentHandle, settings: AppSettings) -> None:
        self.replicas = replicas.options(method_name="respond", stream=True)
        self.settings = settings
        self.board = ReplicaBoard()

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = FastAPI(title="kvlab replicas")
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/metrics", self.metrics, methods=["GET"])
        app.add_api_route("/{path:path}", self.forward,
                          methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
        limits = self.settings.limits
        app.add_middleware(RequestGuard, limits=limits, shapes=shapes_of(front_ends()))
        add_cors(app, limits)
        return app

    def report(self, report: ReplicaReport) -> None:
        """Called by each replica every second."""
        self.board.update(report)

    async def health(self) -> JSONResponse:
        body = self.board.health()
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    async def metrics(self) -> Response:
        current = self.board.current()
        text = merge_metrics({rep.replica: rep.metrics for rep, _ in current},
                             healthy=sum(ok for _, ok in current))
        return Response(text, media_type=CONTENT_TYPE)

    async def forward(self, request: Request) -> Response:
        body = await request.body()
        fwd = Forwarded(request.method, request.url.path, request.scope.get("query_string", b""),
                        list(request.scope.get("headers", [])), body)
        s = self.settings
        key = await asyncio.to_thread(routing_key, fwd.path, body, s.block_chars,
                                      s.prefix_blocks)
        try:
            return await self._answer(fwd, key)
        except Exception as e:  # noqa: BLE001 - a dead replica raises any Ray error
            log.warning("request to a replica failed: %r", e)
            err = replica_failed(e)
            return JSONResponse(err.body(), status_code=err.status)

    async def _answer(self, fwd: Forwarded, key: str | None) -> Response:
        """The replica's answer; one that dies before any of it is sent is retried."""
        for attempt in itertools.count():
            stream, start = await self._open(fwd, key)
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start.headers
                       if k.decode("latin-1").lower() not in _HOP_HEADERS}
            headers[REPLICA_HEADER] = start.replica
            if headers.get("content-type", "").startswith(STREAMED_TYPES):
                return StreamingResponse(_relay(stream, lambda: self._open(fwd, key)),
                                         start.status, headers)
            try:
                content = b"".join([chunk async for chunk in stream])
            except Exception as e:  # a dead replica raises any Ray error
                stream.cancel()
                if attempt >= RETRIES:
                    raise
                await _before_retry(e, attempt)
                continue
            except BaseException:  # the client went away: let the replica abort its request
                stream.cancel()
                raise
            return Response(content, start.status, headers)
        raise AssertionError("unreachable")

    async def _open(self, fwd: Forwarded, key: str | None
                    ) -> tuple[DeploymentResponseGenerator, ResponseStart]:
        """A replica's stream and its ResponseStart, on another replica if one dies first."""
        for attempt in itertools.count():
            stream: DeploymentResponseGenerator = self.replicas.remote(fwd, prefix_key=key)
            try:
                start = await stream.__anext__()
                assert isinstance(start, ResponseStart)
                return stream, start
            except Exception as e:  # a dead replica raises any Ray error
                stream.cancel()
                if attempt >= RETRIES:
                    raise
                await _before_retry(e, attempt)
            except BaseException:
                stream.cancel()
                raise
        raise AssertionError("unreachable")


async def _before_retry(e: BaseException, attempt: int) -> None:
    """A short wait, so that Serve has dropped the dead replica from the candidates."""
    log.warning("a replica failed before answering (%r); retrying on another", e)
    await asyncio.sleep(RETRY_WAIT_S * (attempt + 1))


async def _relay(stream: DeploymentResponseGenerator,
                 reopen: Callable[[], Awaitable[tuple[DeploymentResponseGenerator,
                                                       ResponseStart]]]
                 ) -> AsyncIterator[bytes]:
    """A stream's body chunks. A replica that dies before the first chunk is replaced by
    another's stream (reopen); one that dies later ends it with an error event."""
    sent, retries = False, 0
    try:
        while True:
            try:
                async for chunk in stream:
                    sent = True
                    yield chunk
                return
            except Exception as e:  # noqa: BLE001 - a dead replica raises any Ray error
                stream.cancel()
                if sent or retries >= RETRIES:
                    log.warning("stream from a replica failed: %r", e)
                    yield f"data: {json.dumps(replica_failed(e).body())}\n\n".encode()
                    yield b"data: [DONE]\n\n"
                    return
                await _before_retry(e, retries)
                retries += 1
                try:
                    stream, _ = await reopen()
                except Exception as again:  # noqa: BLE001
                    yield f"data: {json.dumps(replica_failed(again).body())}\n\n".encode()
                    yield b"data: [DONE]\n\n"
                    return
    finally:
        stream.cancel()
