"""The OpenAI API's routes: /v1/completions, /v1/chat/completions, /v1/embeddings, /v1/models,
vLLM's and llama.cpp's /tokenize and /detokenize, and llama.cpp's /infill. Errors keep the
server's default (OpenAI's) shape."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvlab.server.core.app import FrontEnd
from kvlab.server.openai import embeddings
from kvlab.server.openai.chat import Call
from kvlab.server.openai.infill import InfillCall
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
    calls = request.app.state.calls
    body, model = await calls.blocking(request, embeddings.read_body)
    return JSONResponse(await embeddings.create(calls.serving, body, model))


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


front_end = FrontEnd(router)
