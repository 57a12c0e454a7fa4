"""Embeddings for every API that serves them (OpenAI's /v1/embeddings, Ollama's /api/embed):
inputs -> token ids -> one vector each, with the checks they share.

    embed(serving, inputs, truncate=, dimensions=, normalize=) -> Embeddings
        inputs: texts (tokenized with the model's special tokens, in a worker thread) or
        token id lists (taken as given); the forward passes run on the engine thread between
        two steps (`AsyncEngine.call`), one batch of at most EMBED_BATCH_TOKENS tokens per
        call, so embeddings and generation share one engine, generation steps go on between
        the batches of a large call, and the event loop never waits on either.

A bad call is an ApiError 400 naming the field: no input, more than MAX_INPUTS, an empty
input, ids outside the vocabulary, an input longer than the context when `truncate` is off
(on, it keeps the first tokens that fit, and the text's closing [SEP] / EOS),
`dimensions` outside [1, hidden size]. The API's own module renders the vectors (floats,
base64) and names its fields through `param`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch

from kvlab.engine import EMBED_BATCH_TOKENS, token_batches
from kvlab.errors import RequestError
from kvlab.server.core.errors import ApiError
from kvlab.server.core.serving import Serving

MAX_INPUTS = 2048  # inputs of one call, as OpenAI bounds them


@dataclass
class Embeddings:
    vectors: list[list[float]]
    prompt_tokens: int  # tokens embedded, after truncation


async def embed(serving: Serving, inputs: list[str | list[int]], *, truncate: bool = True,
                dimensions: int | None = None, normalize: bool = True,
                param: str = "input") -> Embeddings:
    """One vector per input, in input order; `param` names the inputs' field in errors."""
    check_inputs(serving, inputs, dimensions, param)
    prompts = await asyncio.to_thread(token_ids, serving, inputs, truncate, param)
    rows: list[list[float]] = []
    for batch in token_batches(prompts, EMBED_BATCH_TOKENS):  # engine steps run between
        try:
            vectors = await serving.engine.call(
                lambda engine, b=batch: engine.embed(b, normalize=normalize,
                                                     dimensions=dimensions))
        except RequestError as e:
            raise ApiError(400, str(e), param=param) from None
        rows += await asyncio.to_thread(_as_lists, vectors)
    return Embeddings(rows, sum(map(len, prompts)))


def check_inputs(serving: Serving, inputs: list[str | list[int]], dimensions: int | None,
                 param: str = "input") -> None:
    """The checks that need no tokenizer: how many inputs, and `dimensions`."""
    if not inputs:
        raise ApiError(400, f"'{param}' is empty; send at least one text or token id list",
                       param=param)
    if len(inputs) > MAX_INPUTS:
        raise ApiError(400, f"'{param}' has {len(inputs)} inputs; at most {MAX_INPUTS} are "
                            "embedded in one call", param=param)
    width = serving.engine.snapshot().hidden_size
    if dimensions is not None and not 1 <= dimensions <= width:
        raise ApiError(400, f"dimensions must be in [1, {width}] (the hidden size of "
                            f"{serving.public_name}), got {dimensions}", param="dimensions")


def token_ids(serving: Serving, inputs: list[str | list[int]], truncate: bool,
              param: str = "input") -> list[list[int]]:
    """Each input's ids (blocking: tokenizes), cut to the context or refused when longer."""
    vocab, limit = serving.tokenizer.vocab_size, serving.engine.max_model_len
    out = []
    for i, item in enumerate(inputs):
        where = f"{param}[{i}]" if len(inputs) > 1 else param
        if isinstance(item, str) and not item:
            raise ApiError(400, f"'{where}' is an empty string; send some text", param=param)
        if isinstance(item, str):  # truncation takes any text; else it must be able to fit
            ids = serving.tokenizer.encode(item) if truncate else serving.encode(item, param)
        else:
            ids = list(item)
        if not ids:
            raise ApiError(400, f"'{where}' has no tokens; send at least one", param=param)
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"'{where}' holds token id {bad}; ids must be in [0, {vocab})",
                           param=param)
        if len(ids) > limit and not truncate:
            raise ApiError(400, f"'{where}' has {len(ids)} tokens; the context holds {limit} "
                                "(truncation is off)", param=param,
                           code="context_length_exceeded")
        out.append(_cut(ids, limit, serving.tokenizer.suffix_id))
    return out


def _cut(ids: list[int], limit: int, suffix: int | None) -> list[int]:
    """The first `limit` ids; a text's closing token ([SEP], an embedding model's EOS, which
    last-token pooling reads) stays last."""
    if len(ids) <= limit:
        return ids
    if suffix is not None and ids[-1] == suffix:
        return [*ids[:limit - 1], suffix]
    return ids[:limit]


def _as_lists(vectors: torch.Tensor) -> list[list[float]]:
    return vectors.tolist()
