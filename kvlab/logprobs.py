"""Generated tokens' log-probabilities in OpenAI's completions shape: parallel lists of each
token's text, its logprob, a map of the top alternatives (and itself) to theirs, and where
the token starts in the text. The server's completions route and `kvlab run --json` both
write it; here so the command line writes it without loading the server."""

from __future__ import annotations

from typing import Any

from kvlab.request import TokenLogprob
from kvlab.tokenizer import Tokenizer

MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps the same way


def clamped(value: float) -> float:
    return max(value, MIN_LOGPROB)


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")


def completion_logprobs(tokenizer: Tokenizer, items: list[TokenLogprob], k: int,
                        offset: int = 0) -> dict[str, Any]:
    """`items` with their top `k` alternatives; text offsets count from `offset`."""
    tokens, offsets = [], []
    for item in items:
        tokens.append(token_text(tokenizer, item.token_id))
        offsets.append(offset)
        offset += len(tokens[-1])
    top = [{token_text(tokenizer, i): clamped(lp) for i, lp in
            [*item.top[:k], (item.token_id, item.logprob)]} for item in items]
    return {"tokens": tokens, "token_logprobs": [clamped(i.logprob) for i in items],
            "top_logprobs": top, "text_offset": offsets}
