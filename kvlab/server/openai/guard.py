"""What a request must pass before any handler sees it: the API key and the body size.

`RequestGuard` is plain ASGI middleware in front of the FastAPI app, so a refused request
costs no parsing at all:

    request -> key check (401) -> Content-Length above the limit (413, body never read)
            -> body counted as it streams in (413 once past the limit) -> the app

Keys are checked as `Authorization: Bearer KEY` on /v1/*, /tokenize, /detokenize and the
visualiser's API, as vLLM and llama-server check them; /health and /metrics stay open unless
`protect_metrics`.
`parse_json_body` bounds the nesting depth before `json.loads` recurses into it.
"""

from __future__ import annotations

import hmac
import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvlab.errors import KvlabError
from kvlab.server.openai.protocol import ApiError

MAX_JSON_DEPTH = 64  # objects and arrays inside each other; OpenAI bodies need about 6
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # runs, not chars: fast
_PROTECTED = ("/v1/", "/viz/api/", "/tokenize", "/detokenize")
DRAIN_LIMIT = 64 << 20  # a refused body up to this size is read and dropped before the 413


@dataclass(frozen=True)
class ServerLimits:
    """The server's front-door settings (`kvlab serve` flags)."""

    max_request_bytes: int = 4 << 20  # body size; 413 above it
    api_key: str | None = None  # when set, /v1/* needs `Authorization: Bearer <key>`
    protect_metrics: bool = False  # also require the key on /health and /metrics
    request_timeout: float | None = None  # seconds from arrival; then choices end ("length")

    def __post_init__(self) -> None:
        if self.max_request_bytes < 1024:
            raise KvlabError(f"--max-request-bytes must be >= 1024, got {self.max_request_bytes}")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise KvlabError(f"--request-timeout must be > 0 seconds, got {self.request_timeout}")


class RequestGuard:
    """ASGI middleware: API key (401) and body size (413) before the app runs."""

    def __init__(self, app: ASGIApp, limits: ServerLimits) -> None:
        self.app = app
        self.limits = limits
        self._key = limits.api_key.encode() if limits.api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self._needs_key(scope["path"]) and not self._authorized(headers):
            await _send_error(send, ApiError(
                401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                type_="authentication_error", code="invalid_api_key"))
            return
        limit = self.limits.max_request_bytes
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            if declared.isdigit() and int(declared) <= DRAIN_LIMIT:
                await _drain(receive)  # so the client reads the 413 instead of a reset
            await _send_error(send, _too_large(limit, declared.decode("latin-1")))
            return
        await self.app(scope, _counting(receive, limit), send)

    def _needs_key(self, path: str) -> bool:
        if self._key is None:
            return False
        if path in ("/health", "/metrics"):
            return self.limits.protect_metrics
        return path.startswith(_PROTECTED)

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        return (scheme.lower() == b"bearer" and self._key is not None
                and hmac.compare_digest(token.strip(), self._key))


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


async def _send_error(send: Send, err: ApiError) -> None:
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close")]
    if err.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def json_depth(body: bytes) -> int:
    """The deepest nesting of objects and arrays in a JSON text (strings skipped)."""
    skeleton = np.frombuffer(_JSON_STRING.sub(b"", body), dtype=np.uint8)
    step = (np.isin(skeleton, (ord("["), ord("{"))).astype(np.int32)
            - np.isin(skeleton, (ord("]"), ord("}"))))
    return int(np.cumsum(step).max(initial=0))


def parse_json_body(body: bytes) -> Any:
    """The decoded body; a 400 naming the problem for bad JSON or nesting past the bound."""
    depth = json_depth(body)
    if depth > MAX_JSON_DEPTH:
        raise ApiError(400, f"the JSON body nests {depth} levels deep; at most {MAX_JSON_DEPTH} "
                            "are accepted")
    try:
        value = json.loads(body, parse_constant=_no_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"could not parse the JSON body: {e}") from None
    _check_unicode(value)
    return value


def _check_unicode(value: Any) -> None:
    """Refuse lone UTF-16 surrogates ("\\ud800" escapes): JSON allows them, text cannot hold them."""
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ApiError(400, f"the body holds a lone UTF-16 surrogate "
                                    f"({value[e.start]!a}), which is not a Unicode character; "
                                    "send valid text") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key)
            _check_unicode(item)
    elif isinstance(value, list):
        for item in value:
            _check_unicode(item)


def _no_constant(name: str) -> Any:
    """NaN and Infinity are not JSON (Python's decoder accepts them by default)."""
    raise json.JSONDecodeError(f"{name} is not a JSON value", name, 0)
