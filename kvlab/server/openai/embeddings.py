"""OpenAI's /v1/embeddings: the body's inputs through the shared embedding path
(kvlab.server.core.embedding), answered in OpenAI's shape.

    {"input": str | [str] | [int] | [[int]], "model"?, "encoding_format"?: "float" | "base64",
     "dimensions"?, "user"?}
    -> {"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model",
        "usage": {"prompt_tokens", "total_tokens"}}

Vectors are L2-normalized as OpenAI's are; "base64" is the little-endian float32 bytes of
each vector, which the official client decodes. As on api.openai.com, an input longer than
the context is a 400 (nothing is cut silently).
"""

from __future__ import annotations

import base64
from typing import Any, Literal

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvlab.server.core.app import CLIENT_CLOSED, ClientGone, unless_disconnected
from kvlab.server.core.bodies import Strict, parse, parse_json_body
from kvlab.server.core.embedding import embed
from kvlab.server.core.serving import Serving


class EmbeddingsBody(Strict):
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None  # accepted as OpenAI accepts it: an end-user id, not acted on

    def inputs(self) -> list[str | list[int]]:
        """The inputs as a list: one text, texts, one id list, or id lists."""
        if isinstance(self.input, str):
            return [self.input]
        if self.input and isinstance(self.input[0], int):
            return [list(self.input)]  # type: ignore[arg-type]
        return list(self.input)  # type: ignore[arg-type]


async def answer(request: Request) -> Response:
    """The route: the body parsed off the loop, then the vectors; a client that hangs up
    stops the call before its next batch reaches the engine."""
    calls = request.app.state.calls
    body, model = await calls.blocking(request, read_body)
    try:
        return JSONResponse(await unless_disconnected(request,
                                                      create(calls.serving, body, model)))
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)


def read_body(serving: Serving, body: bytes) -> tuple[EmbeddingsBody, str]:
    """The parsed body and the model name to answer with (blocking: a worker thread)."""
    request = parse(EmbeddingsBody, parse_json_body(body))
    return request, serving.check_model(request.model)


async def create(serving: Serving, request: EmbeddingsBody, model: str) -> dict[str, Any]:
    result = await embed(serving, request.inputs(), truncate=False,
                         dimensions=request.dimensions)
    rows: list[Any] = result.vectors
    if request.encoding_format == "base64":
        rows = [base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode("ascii")
                for v in rows]
    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": v}
                     for i, v in enumerate(rows)],
            "usage": {"prompt_tokens": result.prompt_tokens,
                      "total_tokens": result.prompt_tokens}}
