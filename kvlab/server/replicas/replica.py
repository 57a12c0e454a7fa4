"""One engine replica: the single-server app (`create_app`), called through a Serve handle.

The ingress forwards each HTTP request as a `Forwarded` record; `EngineReplica.respond`
plays it through the same FastAPI app a lone `kvlab serve` runs, in process, and yields the
ASGI response back as it is produced:

    Forwarded -> scope + receive (the body, then a disconnect when the caller goes away)
              -> create_app(AsyncEngine(engine), front_ends()) -> send -> queue
              -> yields ResponseStart, then body chunks (each what the app has sent so far:
                 one server-sent event, or several that queued up meanwhile)

So validation, OpenAI-shaped errors, streaming, timeouts and the KV freed on a disconnect
behave exactly as without Ray. The replica also reports its own /health and /metrics to the
ingress every second (see board), and fails Serve's health check when its engine thread is
gone, so Serve replaces it. On shutdown Serve lets requests in flight finish for
`graceful_shutdown_timeout_s`, then ends the process (the engine thread with it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ray import serve

from kvlab.engine import Engine
from kvlab.server.apis import front_ends
from kvlab.server.core.app import create_app
from kvlab.server.core.async_engine import AsyncEngine
from kvlab.server.replicas.board import REPORT_PERIOD_S, ReplicaReport
from kvlab.server.replicas.settings import AppSettings

log = logging.getLogger("kvlab.server")
Headers = list[tuple[bytes, bytes]]


@dataclass(frozen=True)
class Forwarded:
    """An HTTP request as the ingress received it, body read."""

    method: str
    path: str
    query: bytes
    headers: Headers
    body: bytes


@dataclass(frozen=True)
class ResponseStart:
    status: int
    headers: Headers
    replica: str


class EngineReplica:
    """A Serve deployment class; `ingress` is the name of the deployment it reports to."""

    async def __init__(self, settings: AppSettings, ingress: str) -> None:
        def load() -> Engine:
            engine = Engine.from_model(settings.model, settings.engine)
            if settings.reserve_kv:
                engine.reserve_kv_memory()
            return engine

        self.engine = AsyncEngine(await asyncio.to_thread(load), settings.max_waiting)
        # the ingress already checked the key and the origin; the body size and timeout are
        # checked again
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        limits = dataclasses.replace(settings.limits, api_key=None, allowed_origins=(),
                                     instance=self.replica_id)
        self.app = create_app(self.engine, front_ends(), limits=limits)
        self.lifespan = contextlib.AsyncExitStack()
        await self.lifespan.enter_async_context(self.app.router.lifespan_context(self.app))
        self.ingress = serve.get_deployment_handle(ingress, app_name=context.app_name)
        self.reporter = asyncio.create_task(self._report_forever())

    async def respond(self, req: Forwarded, prefix_key: str | None = None,
                     ) -> AsyncIterator[ResponseStart | bytes]:
        """The app's response to `req`; `prefix_key` is for the router and unused here."""
        sent: asyncio.Queue[dict] = asyncio.Queue()
        gone = asyncio.Event()
        task = asyncio.create_task(self.app(_scope(req), _receiver(req.body, gone), sent.put))
        try:
            while (message := await _next_message(sent, task)) is not None:
                if message["type"] == "http.response.start":
                    yield ResponseStart(message["status"], list(message.get("headers", [])),
                                        self.replica_id)
                elif message["type"] == "http.response.body":
                    body, more = _with_queued_bodies(message, sent)
                    if body:
                        yield body
                    if not more:
                        return
        finally:
            gone.set()  # the app sees a disconnect: an unfinished request is aborted
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(task, 5.0)

    async def local(self, path: str) -> tuple[int, bytes]:
        """GET `path` from the app itself (its /health or /metrics): status and body."""
        status, body = 0, b""
        async for part in self.respond(Forwarded("GET", path, b"", [], b"")):
            if isinstance(part, ResponseStart):
                status = part.status
            else:
                body += part
        return status, body

    async def report(self) -> ReplicaReport:
        import json

        _, health = await self.local("/health")
        _, metrics = await self.local("/metrics")
        return ReplicaReport(self.replica_id, json.loads(health), metrics.decode())

    async def _report_forever(self) -> None:
        while True:
            try:
                await self.ingress.report.remote(await self.report())
            except Exception as e:  # noqa: BLE001 - the ingress restarting: report again
                log.warning("replica %s could not report: %s", self.replica_id, e)
            await asyncio.sleep(REPORT_PERIOD_S)

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine thread died is replaced."""
        if not self.engine.alive:
            raise RuntimeError("the engine thread has stopped")


async def _next_message(sent: asyncio.Queue[dict], app: asyncio.Task) -> dict | None:
    """The app's next ASGI message; None once it has ended (raising what it raised)."""
    while sent.empty():
        if app.done():
            app.result()
            return None
        getter = asyncio.ensure_future(sent.get())
        await asyncio.wait({getter, app}, return_when=asyncio.FIRST_COMPLETED)
        if getter.done():
            return getter.result()
        getter.cancel()
    return sent.get_nowait()


def _with_queued_bodies(message: dict, sent: asyncio.Queue[dict]) -> tuple[bytes, bool]:
    """A body message's bytes joined with those of the body messages already queued behind
    it, and whether more is to come. Nothing is waited for: a stream's events that piled up
    while the replica was busy travel as one chunk (one Serve item), a lone one at once."""
    parts, more = [message.get("body", b"")], message.get("more_body", False)
    while more and not sent.empty():  # after the start, an HTTP response is body messages
        message = sent.get_nowait()
        parts.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(parts), more


def _scope(req: Forwarded) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": req.method, "scheme": "http", "path": req.path, "raw_path":
            req.path.encode(), "query_string": req.query, "headers": req.headers,
            "root_path": "", "client": None, "server": None}


def _receiver(body: bytes, gone: asyncio.Event):
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}
    return receive
