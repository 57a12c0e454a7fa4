"""The OpenAI API's routes: /v1/completions, /v1/chat/completions, /v1/embeddings, /v1/models,
the Responses API (/v1/responses and the responses it stored), vLLM's and llama.cpp's
/tokenize and /detokenize, and llama.cpp's /infill. Errors keep the
server's default (OpenAI's) shape."""

from __future__ import annotations

import time
from functools import partial
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvlab.server.core.app import FrontEnd
from kvlab.server.core.errors import ApiError
from kvlab.server.openai import embeddings
from kvlab.server.openai.chat import Call
from kvlab.server.openai.infill import InfillCall
from kvlab.server.openai.responses import ResponseCall, input_items, response_store, stored
from kvlab.server.openai.tokenize import detokenize, tokenize

router = APIRouter()
_STARTED = int(time.time())


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await request.app.state.calls.answer(request, Call.completion)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await request.app.state.calls.answer(request, Call.chat)


@router.post("/v1/embeddings")
async def embeddings_route(request: Request) -> Response:
    return await embeddings.answer(request)


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    serving = request.app.state.serving
    names = dict.fromkeys([serving.public_name, *serving.aliases])
    return {"object": "list", "data": [{
        "id": name, "object": "model", "created": _STARTED, "owned_by": "kvlab",
        "root": serving.engine.model_name, "max_model_len": serving.engine.max_model_len}
        for name in names]}


@router.post("/infill")
async def infill(request: Request) -> Response:
    return await request.app.state.calls.answer(request, InfillCall.build)


@router.post("/tokenize")
async def tokenize_route(request: Request) -> Response:
    return JSONResponse(await request.app.state.calls.blocking(request, tokenize))


@router.post("/detokenize")
async def detokenize_route(request: Request) -> Response:
    return JSONResponse(await request.app.state.calls.blocking(request, detokenize))


# ---- the Responses API: a call, and the responses it stored ----------------------------------


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    build = partial(ResponseCall.create, store=response_store(request.app))
    return await request.app.state.calls.answer(request, build)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(request: Request, response_id: str) -> Response:
    _only_query(request, set())
    return JSONResponse(stored(response_store(request.app), response_id).response)


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> Response:
    if not response_store(request.app).delete(response_id):
        stored(response_store(request.app), response_id)  # the 404
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(request: Request, response_id: str, after: str | None = None,
                           limit: int = 20,
                           order: Literal["asc", "desc"] = "desc") -> Response:
    _only_query(request, {"after", "limit", "order"})
    entry = stored(response_store(request.app), response_id)
    return JSONResponse(input_items(entry, after, limit, order))


def _only_query(request: Request, known: set[str]) -> None:
    """A query parameter the route does not act on (include, stream, ...) is refused."""
    unknown = sorted(set(request.query_params) - known)
    if unknown:
        raise ApiError(400, f"query parameter {unknown[0]!r} is not supported here; this "
                            f"route acts on: {', '.join(sorted(known)) or 'none'}",
                       param=unknown[0])


front_end = FrontEnd(router)
