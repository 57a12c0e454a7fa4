"""The `Tokenizer` every other module sees: text <-> ids, token bytes, chat prompts.

It is built by `load_gguf_tokenizer` or `load_hf_tokenizer`, which supply the encoding function
for their format; decoding is the same for both: every token has a byte string (`token_bytes`),
and text is the UTF-8 decoding of their concatenation. A tokenizer is immutable once built.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

from kvlab.errors import RequestError
from kvlab.tokenizer.chat import render_chat_template
from kvlab.tokenizer.fim import FimTokens


class Tokenizer:
    """Text <-> token ids for one model.

    `eos_ids` holds every id that ends generation (eos, end-of-turn, ...). When `add_bos`,
    `encode(..., add_special_tokens=True)` puts `bos_id` first, and `suffix_id` (when set)
    last: BERT's [SEP], or the EOS an embedding model's tokenizer appends (GGUF's
    add_eos_token, a tokenizer.json post-processor's trailing token, as Qwen3-Embedding's);
    chat prompts get no suffix (the reply follows them). Special tokens written in the
    text (`<start_of_turn>`) always encode to their ids. `fim`: the fill-in-the-middle
    markers of a code model (None when the model has none).
    """

    def __init__(self, *, encode_text: Callable[[str], list[int]], pieces: Sequence[bytes],
                 special: Sequence[bool], bos_id: int | None, eos_ids: Sequence[int],
                 add_bos: bool, chat_template: str | None, strip_leading_space: bool = False,
                 template_tokens: dict[str, str] | None = None,
                 fim: FimTokens | None = None, suffix_id: int | None = None) -> None:
        self._encode_text = encode_text
        self._pieces = tuple(pieces)
        self._special = bytes(bool(s) for s in special)  # compact: one byte per token
        self.vocab_size: int = len(self._pieces)
        self.bos_id = bos_id
        self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_ids))
        self.add_bos = add_bos
        self.chat_template = chat_template
        # SentencePiece vocabularies with a space prefix drop the first decoded token's space.
        self.strip_leading_space = strip_leading_space
        self._template_tokens = dict(template_tokens or {})
        self.fim = fim
        self.suffix_id = suffix_id

    def with_chat_template(self, template: str) -> Tokenizer:
        """The same tokenizer with another chat template (a Jinja text)."""
        other = copy.copy(self)
        other.chat_template = template
        return other

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._with_bos(text, add_special_tokens)
        return [*ids, self.suffix_id] if add_special_tokens and self.suffix_id is not None else ids

    def _with_bos(self, text: str, add_bos: bool) -> list[int]:
        ids = self._encode_text(text)
        if add_bos and self.add_bos and self.bos_id is not None:
            return [self.bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; ids outside the vocabulary (padded embedding rows) decode to nothing."""
        n, special, pieces = self.vocab_size, self._special, self._pieces
        chunks = [pieces[i] for i in ids
                  if 0 <= i < n and pieces[i] and not (skip_special_tokens and special[i])]
        if chunks and self.strip_leading_space and chunks[0].startswith(b" "):
            chunks[0] = chunks[0][1:]
        return b"".join(chunks).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes this token stands for, before any leading-space stripping."""
        return self._pieces[token_id] if 0 <= token_id < self.vocab_size else b""

    def is_special(self, token_id: int) -> bool:
        """Control tokens (bos, eos, turn markers): hidden when decoding skips specials."""
        return 0 <= token_id < self.vocab_size and bool(self._special[token_id])

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, **template_vars: Any) -> str:
        """The prompt text for a conversation, rendered as transformers renders it.

        The text may begin with the BOS token (most templates write it); encode it with
        `add_special_tokens=False`, or use `encode_chat`, to avoid a second BOS.
        """
        if self.chat_template is None:
            raise RequestError("this model has no chat template; send a plain text prompt")
        variables = {**self._template_tokens, **template_vars}
        return render_chat_template(self.chat_template, messages,
                                    add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message, **variables)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, **template_vars: Any) -> list[int]:
        """Token ids of the chat prompt with one BOS when the model wants one.

        As llama.cpp does: a BOS the template writes is dropped from the text and `encode`
        adds it back when `add_bos`, so the prompt never starts with two.
        """
        text = self.apply_chat_template(messages, add_generation_prompt, continue_final_message,
                                        **template_vars)
        bos_text = self._template_tokens.get("bos_token")
        if self.add_bos and bos_text and text.startswith(bos_text):
            text = text[len(bos_text):]
        return self._with_bos(text, add_bos=True)
