"""The model's vocabulary as llguidance sees it: every token's bytes, specials kept apart.

Control tokens (`<bos>`, `<start_of_turn>`, ...) get a 0xFF prefix, which llguidance reads as
"special": their text is never matched by a grammar, so a schema's string cannot end up
containing `<eos>`. Ids beyond the tokenizer's (padded embedding rows) are empty tokens.
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

    def __call__(self, text: str | bytes) -> list[int]:
        """Tokenize text llguidance forces (bytes may end inside a character)."""
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="surrogateescape")
        return self._tokenizer.encode(text, add_special_tokens=False)


def ll_tokenizer(tokenizer: Tokenizer,
                 n_vocab: int) -> tuple[llguidance.LLTokenizer, frozenset[int]]:
    """(the vocabulary, its whitespace-only tokens); ~1 s for a 262k vocabulary: build it
    once per model."""
    vocab = _Vocab(tokenizer, n_vocab)
    whitespace = frozenset(i for i, b in enumerate(vocab.tokens) if b and not b.strip())
    return llguidance.LLTokenizer(vocab, n_vocab=n_vocab,
                                  eos_token=list(tokenizer.eos_ids)), whitespace
