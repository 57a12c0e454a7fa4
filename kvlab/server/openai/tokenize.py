"""/tokenize and /detokenize: text <-> token ids with the served model's tokenizer, in the two
shapes clients send.

    vLLM       /tokenize   {"model"?, "prompt", "add_special_tokens"?, "return_token_strs"?}
                           {"model"?, "messages", "add_generation_prompt"?,
                            "continue_final_message"?, "add_special_tokens"?, "return_token_strs"?}
                           -> {"count", "max_model_len", "tokens", "token_strs"}
    llama.cpp  /tokenize   {"content", "add_special"?, "with_pieces"?} -> {"tokens"}
    both       /detokenize {"model"?, "tokens"} -> {"prompt", "content"}

The shape is told by its fields (`content` is llama.cpp's; `prompt` / `messages` vLLM's);
/detokenize bodies are the same in both, so the answer carries both names. Messages are
rendered as /v1/chat/completions renders them, so their ids are that route's prompt. Unknown
fields are refused rather than ignored. Building an answer is blocking work: the app runs
`tokenize` / `detokenize` in a worker thread.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from kvlab.server.core.bodies import Strict, parse, parse_json_body
from kvlab.server.core.errors import ApiError
from kvlab.server.core.serving import Serving
from kvlab.server.core.tools import template_messages
from kvlab.server.openai.protocol import ChatMessage


class TokenizePrompt(Strict):
    """vLLM's completion form."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeMessages(Strict):
    """vLLM's chat form; add_special_tokens adds the tokenizer's specials on top of what the
    template writes, as vLLM does (false: exactly the chat route's prompt)."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False


class TokenizeContent(Strict):
    """llama.cpp's form (it always parses special tokens written in the text, as kvlab does)."""

    content: str
    add_special: bool = False
    with_pieces: bool = False


class Detokenize(Strict):
    model: str | None = None
    tokens: list[int]


def tokenize(serving: Serving, body: bytes) -> dict[str, Any]:
    """The /tokenize answer for a body of either shape."""
    data = parse_json_body(body)
    kind = _tokenize_shape(data)
    req = parse(kind, data)
    if isinstance(req, TokenizeContent):
        ids = serving.tokenizer.encode(req.content, add_special_tokens=req.add_special)
        if req.with_pieces:
            return {"tokens": [{"id": i, "piece": _piece(serving, i)} for i in ids]}
        return {"tokens": ids}
    serving.check_model(req.model)
    ids = (_message_ids(serving, req) if isinstance(req, TokenizeMessages)
           else serving.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
    strs = [_text(serving, i) for i in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": serving.engine.max_model_len, "tokens": ids,
            "token_strs": strs}


def detokenize(serving: Serving, body: bytes) -> dict[str, Any]:
    """The /detokenize answer: the text of the ids, special tokens written out (as vLLM and
    llama.cpp decode them)."""
    req = parse(Detokenize, parse_json_body(body))
    serving.check_model(req.model)
    vocab = serving.tokenizer.vocab_size
    bad = [(k, i) for k, i in enumerate(req.tokens) if not 0 <= i < vocab]
    if bad:
        k, i = bad[0]
        raise ApiError(400, f"tokens[{k}] is {i}, outside the vocabulary: ids are in "
                            f"[0, {vocab - 1}]", param="tokens")
    text = serving.tokenizer.decode(req.tokens, skip_special_tokens=False)
    return {"prompt": text, "content": text}


def _tokenize_shape(data: Any) -> type[Strict]:
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    given = [k for k in ("content", "prompt", "messages") if k in data]
    if len(given) != 1:
        got = " and ".join(given) if given else "none of them"
        raise ApiError(400, "give exactly one of content (llama.cpp), prompt or messages "
                            f"(vLLM); got {got}", param=given[1] if len(given) > 1 else None)
    return {"content": TokenizeContent, "prompt": TokenizePrompt,
            "messages": TokenizeMessages}[given[0]]


def _message_ids(serving: Serving, req: TokenizeMessages) -> list[int]:
    if req.continue_final_message and req.add_generation_prompt:
        raise ApiError(400, "continue_final_message needs add_generation_prompt false: the "
                            "prompt cannot both continue the last message and open a new one",
                       param="continue_final_message")
    messages, extra = template_messages([m.as_template_dict() for m in req.messages], None,
                                        serving.native_tools)
    tok = serving.tokenizer
    if not req.add_special_tokens:
        return tok.encode_chat(messages, req.add_generation_prompt, req.continue_final_message,
                               **extra)
    text = tok.apply_chat_template(messages, req.add_generation_prompt,
                                   req.continue_final_message, **extra)
    return tok.encode(text, add_special_tokens=True)


def _text(serving: Serving, token_id: int) -> str:
    return serving.tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")


def _piece(serving: Serving, token_id: int) -> str | list[int]:
    """llama.cpp's piece: the token's text, or its bytes when they are not valid UTF-8."""
    raw = serving.tokenizer.token_bytes(token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)
