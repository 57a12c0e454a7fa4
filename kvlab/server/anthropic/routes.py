"""Anthropic's routes: POST /v1/messages and /v1/messages/count_tokens, and `front_end`, which
mounts them with Anthropic's error shape on every path under /v1/messages (the guard's 401s
and 413s included), so the official client raises its own exceptions."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvlab.server.anthropic.messages import MessagesCall, count_tokens
from kvlab.server.anthropic.protocol import error_body
from kvlab.server.core.app import FrontEnd

router = APIRouter()


@router.post("/v1/messages")
async def messages(request: Request) -> Response:
    return await request.app.state.calls.answer(request, MessagesCall.build)


@router.post("/v1/messages/count_tokens")
async def messages_count_tokens(request: Request) -> Response:
    return JSONResponse(await request.app.state.calls.blocking(request, count_tokens))


front_end = FrontEnd(router, error_shapes={"/v1/messages": error_body})
