"""Ollama's routes: /api/chat, /api/generate, /api/embed, /api/embeddings, /api/tags,
/api/show, /api/ps, /api/version, and `GET /` / `HEAD /`, which clients probe for "Ollama is
running". Errors under /api/ are Ollama's `{"error": "..."}`, which its clients raise as
ResponseError with the status.

Model management (pull, push, create, copy, delete, blobs) has nothing to act on: kvlab serves
the one model it was started with, so those routes answer a 501 that says so.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from kvlab.server.core.app import FrontEnd
from kvlab.server.core.errors import ApiError
from kvlab.server.core.serving import Serving
from kvlab.server.ollama import models
from kvlab.server.ollama.calls import Call
from kvlab.server.ollama.embed import (
    embed_answer,
    embeddings_answer,
    read_embed,
    read_embeddings,
)
from kvlab.server.ollama.protocol import error_body

router = APIRouter()
MANAGEMENT = ("pull", "push", "create", "copy", "delete", "blobs/{digest}")


def _version() -> str:
    try:
        return version("kvlab")
    except PackageNotFoundError:
        return "0.0.0"


@router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
async def running() -> Response:
    return PlainTextResponse("Ollama is running")


def _answering(build: Callable[[Serving, bytes], Call]) -> Callable[[Request],
                                                                   Awaitable[Response]]:
    async def route(request: Request) -> Response:
        return await request.app.state.calls.answer(request, build)
    return route


for _path, _build in (("/api/chat", Call.chat), ("/api/generate", Call.generate)):
    router.add_api_route(_path, _answering(_build), methods=["POST"])


@router.get("/api/tags")
async def tags(request: Request) -> dict[str, Any]:
    return models.tags(request.app.state.serving)


@router.get("/api/ps")
async def ps(request: Request) -> dict[str, Any]:
    return models.running(request.app.state.serving)


@router.post("/api/show")
async def show(request: Request) -> Response:
    return JSONResponse(await request.app.state.calls.blocking(request, models.show))


@router.post("/api/embed")
async def embed(request: Request) -> dict[str, Any]:
    serving = request.app.state.serving
    req, model = await request.app.state.calls.blocking(request, read_embed)
    return await embed_answer(serving, req, model)


@router.post("/api/embeddings")
async def embeddings(request: Request) -> dict[str, Any]:
    req, _ = await request.app.state.calls.blocking(request, read_embeddings)
    return await embeddings_answer(request.app.state.serving, req)


@router.get("/api/version")
async def api_version() -> dict[str, str]:
    return {"version": _version()}


async def _management(request: Request) -> Response:
    raise ApiError(501, f"{request.url.path} is not supported: kvlab serves the one model it "
                        "was started with (kvlab serve --model ...) and manages no others")


for _path in MANAGEMENT:
    router.add_api_route(f"/api/{_path}", _management, include_in_schema=False,
                         methods=["GET", "HEAD", "POST", "DELETE"])

front_end = FrontEnd(router, error_shapes={"/api/": error_body})
