"""What a request must pass before any handler sees it: the API key and the body size.

`RequestGuard` is plain ASGI middleware in front of the FastAPI app, so a refused request
costs no parsing at all:

    request -> key check (401) -> Content-Length above the limit (413, body never read)
            -> body counted as it streams in (413 once past the limit) -> the app

Keys are checked on every API route (/v1/*, /api/*, /tokenize, /detokenize, /infill and the
visualiser's API), sent as `Authorization: Bearer KEY` (OpenAI's clients, vLLM, llama-server)
or `x-api-key: KEY` (Anthropic's clients); /health and /metrics stay open unless
`protect_metrics`. Refusals are written in the shape of the API whose path was called.

Browsers (CORS) are let in only from `allowed_origins`; a wildcard is refused unless a key is
set, since it would let any web page a user visits drive the model on their machine.
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvlab.errors import KvlabError
from kvlab.server.core.errors import ApiError, ErrorShapes

_PROTECTED = ("/v1/", "/api/", "/viz/api/", "/tokenize", "/detokenize", "/infill")
DRAIN_LIMIT = 64 << 20  # a refused body up to this size is read and dropped before the 413


@dataclass(frozen=True)
class ServerLimits:
    """The server's front-door settings (`kvlab serve` flags)."""

    max_request_bytes: int = 4 << 20  # body size; 413 above it
    api_key: str | None = None  # when set, /v1/* needs `Authorization: Bearer <key>`
    protect_metrics: bool = False  # also require the key on /health and /metrics
    request_timeout: float | None = None  # seconds from arrival; then choices end ("length")
    allowed_origins: tuple[str, ...] = ()  # browser origins (CORS); none by default
    served_model_names: tuple[str, ...] = ()  # names the model answers to; the first is shown
    any_model_name: bool = False  # answer whatever model name a client sends
    responses_max_stored: int = 512  # Responses API: stored responses kept, oldest dropped
    responses_max_age_s: float = 3600.0  # ... and for at most this long
    instance: str = ""  # this server among replicas: ids of state it keeps (stored responses)
    # carry it, so the ingress routes requests for that state back here
    reasoning_budget: int | None = None  # thinking models: reasoning tokens before `</think>`

    def __post_init__(self) -> None:
        if "*" in self.allowed_origins and self.api_key is None:
            raise KvlabError("--allowed-origins '*' lets any web page use the model; it needs "
                             "--api-key (or list the origins, e.g. http://localhost:3000)")
        if self.responses_max_stored < 1 or not self.responses_max_age_s > 0:
            raise KvlabError(f"--responses-max-stored must be >= 1 and --responses-max-age > 0, "
                             f"got {self.responses_max_stored} and {self.responses_max_age_s}")
        bad = [o for o in self.allowed_origins if o != "*" and "://" not in o]
        if bad:
            raise KvlabError(f"--allowed-origins takes origins such as https://app.example.com "
                             f"or '*', got {bad[0]!r}")
        if self.max_request_bytes < 1024:
            raise KvlabError(f"--max-request-bytes must be >= 1024, got {self.max_request_bytes}")
        if self.reasoning_budget is not None and self.reasoning_budget < 0:
            raise KvlabError(f"--reasoning-budget must be >= 0 tokens, got "
                             f"{self.reasoning_budget}")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise KvlabError(f"--request-timeout must be > 0 seconds, got {self.request_timeout}")


class RequestGuard:
    """ASGI middleware: API key (401) and body size (413) before the app runs."""

    def __init__(self, app: ASGIApp, limits: ServerLimits, shapes: ErrorShapes) -> None:
        self.app = app
        self.limits = limits
        self.shapes = shapes
        self._key = limits.api_key.encode() if limits.api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        path = scope["path"]
        if self._needs_key(path) and not self._authorized(headers):
            await self._send_error(send, path, ApiError(
                401, "missing or wrong API key: send the header 'Authorization: Bearer <key>' "
                     "or 'x-api-key: <key>'", type_="authentication_error",
                code="invalid_api_key"))
            return
        limit = self.limits.max_request_bytes
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            if declared.isdigit() and int(declared) <= DRAIN_LIMIT:
                await _drain(receive)  # so the client reads the 413 instead of a reset
            await self._send_error(send, path, _too_large(limit, declared.decode("latin-1")))
            return
        await self.app(scope, _counting(receive, limit), send)

    def _needs_key(self, path: str) -> bool:
        if self._key is None:
            return False
        if path in ("/health", "/metrics"):
            return self.limits.protect_metrics
        return path.startswith(_PROTECTED)

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        if self._key is None:
            return False
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key):
            return True
        return hmac.compare_digest(headers.get(b"x-api-key", b"").strip(), self._key)

    async def _send_error(self, send: Send, path: str, err: ApiError) -> None:
        body = json.dumps(self.shapes.body(path, err)).encode()
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
        if err.status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        await send({"type": "http.response.start", "status": err.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


async def _drain(receive: Receive) -> None:
    """Read a body we refuse to the end, discarding it chunk by chunk."""
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return


def _counting(receive: Receive, limit: int) -> Receive:
    """`receive` that raises a 413 once a chunked body passes `limit` bytes."""
    seen = 0

    async def wrapped() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise _too_large(limit, f"more than {limit}")
        return message
    return wrapped


def _too_large(limit: int, got: str) -> ApiError:
    return ApiError(413, f"the request body is too large: {got} bytes; the limit is {limit} "
                         "bytes (kvlab serve --max-request-bytes)", code="request_too_large")
