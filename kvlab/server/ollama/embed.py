"""Ollama's /api/embed and the legacy /api/embeddings on the shared embedding path
(kvlab.server.core.embedding).

    /api/embed        {"model", "input": str | [str], "truncate"?, "dimensions"?}
                      -> {"model", "embeddings": [[...]], "total_duration", "load_duration",
                          "prompt_eval_count"}; vectors L2-normalized, as Ollama's are
    /api/embeddings   {"model", "prompt"} -> {"embedding": [...]}, not normalized, as Ollama
                      answers it; a prompt longer than the context is a 400

An empty input (or prompt) loads the model in Ollama and answers no vectors; kvlab's model is
always loaded, so it answers the same at once. Sampling `options` have nothing to act on in
an embedding and are refused; `keep_alive` is accepted (the model stays loaded anyway).
"""

from __future__ import annotations

import time
from typing import Any

from kvlab.server.core.bodies import parse, parse_json_body
from kvlab.server.core.embedding import embed
from kvlab.server.core.errors import ApiError
from kvlab.server.core.serving import Serving
from kvlab.server.ollama.protocol import (
    EmbeddingsRequest,
    EmbedRequest,
    Options,
    check_model,
)


def _no_options(options: Options | None) -> None:
    given = sorted(options.model_dump(exclude_none=True)) if options is not None else []
    if given:
        raise ApiError(400, f"options {', '.join(given)} have no effect on an embedding; send "
                            "the request without them (truncate and dimensions act)",
                       param="options")


def read_embed(serving: Serving, body: bytes) -> tuple[EmbedRequest, str]:
    """The parsed /api/embed body and the name to answer with (a worker thread)."""
    req = parse(EmbedRequest, parse_json_body(body))
    model = check_model(serving, req.model)
    _no_options(req.options)
    return req, model


def read_embeddings(serving: Serving, body: bytes) -> tuple[EmbeddingsRequest, str]:
    req = parse(EmbeddingsRequest, parse_json_body(body))
    model = check_model(serving, req.model)
    _no_options(req.options)
    return req, model


async def embed_answer(serving: Serving, req: EmbedRequest, model: str) -> dict[str, Any]:
    started = time.perf_counter()
    inputs: list[str | list[int]] = [req.input] if isinstance(req.input, str) else \
        list(req.input)
    if inputs in ([], [""]):
        return {"model": model, "embeddings": []}
    result = await embed(serving, inputs, truncate=req.truncate, dimensions=req.dimensions)
    return {"model": model, "embeddings": result.vectors,
            "total_duration": round((time.perf_counter() - started) * 1e9),
            "load_duration": 0, "prompt_eval_count": result.prompt_tokens}


async def embeddings_answer(serving: Serving, req: EmbeddingsRequest) -> dict[str, Any]:
    if not req.prompt:
        return {"embedding": []}
    result = await embed(serving, [req.prompt], truncate=False, normalize=False,
                         param="prompt")
    return {"embedding": result.vectors[0]}
