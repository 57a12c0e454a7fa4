"""The model's vocabulary as llguidance sees it: every token's bytes, specials kept apart.

Control tokens (`<bos>`, `<start_of_turn>`, ...) get a 0xFF prefix, which llguidance reads as
"special": their text is never matched by a grammar, so a schema's string cannot end up
containing `<eos>`. Ids beyond the tokenizer's (padded embedding rows) are empty tokens.

llguidance tokenizes the text a grammar forces through `_Vocab.__call__`, and that text
continues a reply: a SentencePiece vocabulary's space prefix (`▁` put before a prompt's first
word) must not be added to it, or the forced tokens spell ` {"` where the grammar wants `{"`,
the matcher refuses them and the reply ends there; nor may a special token's text in it
(a schema's `"const": "<|im_end|>"`) become that token, which the grammar never allows.
"""

from __future__ import annotations

import llguidance

from kvlab.tokenizer import Tokenizer

_SPECIAL = b"\xff"


class _Vocab:
    """The duck-typed tokenizer wrapper `llguidance.LLTokenizer` accepts."""

    is_tokenizer_wrapper = True

    def __init__(self, tokenizer: Tokenizer, n_vocab: int) -> None:
        special = [tokenizer.is_special(i) for i in range(tokenizer.vocab_size)]
        self.tokens = [_SPECIAL + tokenizer.token_bytes(i) if s else tokenizer.token_bytes(i)
                       for i, s in enumerate(special)]
        self.tokens += [b""] * (n_vocab - len(self.tokens))
        self.special_token_ids = [i for i, s in enumerate(special) if s]
        self.eos_token_id = tokenizer.eos_ids[0] if tokenizer.eos_ids else None
        self.bos_token_id = tokenizer.bos_id
        self._tokenizer = tokenizer
        # bytes -> id of the plain tokens, for re-spelling a first token without its prefix
        self._ids = {b: i for i, (b, s) in enumerate(zip(self.tokens, special)) if b and not s}
        self._longest = max(map(len, self._ids), default=1)

    def __call__(self, text: str | bytes) -> list[int]:
        """Tokenize text llguidance forces (bytes may end inside a character), as the
        continuation of a reply: without a SentencePiece space prefix."""
        data = text if isinstance(text, bytes) else text.encode("utf-8", errors="surrogateescape")
        ids = self._tokenizer.encode(data.decode("utf-8", errors="surrogateescape"),
                                     add_special_tokens=False)
        head = self._tokenizer.token_bytes(ids[0]) if ids else b""
        if self._tokenizer.strip_leading_space and head.startswith(b" "):
            ids = self._greedy(head[1:]) + ids[1:]  # the first token without its prefix
        # a special token's text is text here (its token's bytes carry the 0xFF mark)
        spelled = b"".join(self.tokens[i] for i in ids)
        return ids if spelled == data else self._greedy(data)

    def _greedy(self, data: bytes) -> list[int]:
        """Longest-match tokens spelling `data` exactly (byte tokens cover the rest)."""
        out, at = [], 0
        while at < len(data):
            for n in range(min(self._longest, len(data) - at), 0, -1):
                token = self._ids.get(data[at:at + n])
                if token is not None:
                    out.append(token)
                    at += n
                    break
            else:
                raise ValueError(f"no token spells byte {data[at]:#04x}")
        return out


def ll_tokenizer(tokenizer: Tokenizer,
                 n_vocab: int) -> tuple[llguidance.LLTokenizer, frozenset[int]]:
    """(the vocabulary, its whitespace-only tokens); ~1 s for a 262k vocabulary: build it
    once per model."""
    vocab = _Vocab(tokenizer, n_vocab)
    whitespace = frozenset(i for i, b in enumerate(vocab.tokens) if b and not b.strip())
    return llguidance.LLTokenizer(vocab, n_vocab=n_vocab,
                                  eos_token=list(tokenizer.eos_ids)), whitespace
