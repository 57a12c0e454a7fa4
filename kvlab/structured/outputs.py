"""The engine's seam to structured outputs: one matcher per constrained sequence.

Per step, for the sequences that sample:

    bitmask(seq_ids)      [B, ceil(V / 32)] int32: a constrained row's allowed tokens,
                          all bits set on other rows (the sampler masks logits with it)
    accept(seq_id, tok)   the sampled token moves the matcher on
    forced(seq_id, n)     tokens the structure allows exactly one way: appended without
                          sampling, computed next step as one chunk (at prefill speed)
    finished(seq_id)      only EOS can follow: the output is complete

A matcher tracks the sequence's output tokens only, so preemption (which keeps the tokens and
recomputes their KV) needs nothing from it.
"""

from __future__ import annotations

from concurrent.futures import Future

import llguidance
import numpy as np
import torch

from kvlab.request import Structure
from kvlab.structured.compiler import GrammarCompiler, Template
from kvlab.tokenizer import Tokenizer


class StructuredOutputs:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.compiler = GrammarCompiler(tokenizer, vocab_size)
        self.words = (vocab_size + 31) // 32
        self._eos = [t for t in tokenizer.eos_ids if t < vocab_size]
        self._matchers: dict[str, llguidance.LLMatcher] = {}

    def prepare(self, structure: Structure) -> Future[Template]:
        return self.compiler.submit(structure)

    def start(self, seq_id: str, template: Template) -> None:
        self._matchers[seq_id] = template.deep_copy()

    def release(self, seq_id: str) -> None:
        self._matchers.pop(seq_id, None)

    def constrained(self, seq_id: str) -> bool:
        return seq_id in self._matchers

    def bitmask(self, seq_ids: list[str], ignore_eos: list[bool]) -> torch.Tensor | None:
        """The allowed-token bits of each row, or None when no row is constrained.

        A row that ignores EOS may not end before its structure does (then it ends there)."""
        rows = [(r, self._matchers[s]) for r, s in enumerate(seq_ids) if s in self._matchers]
        if not rows:
            return None
        mask = torch.full((len(seq_ids), self.words), -1, dtype=torch.int32)
        for r, matcher in rows:  # each fill releases the GIL
            matcher.unsafe_compute_mask_ptr(mask[r].data_ptr(), self.words * 4)
            if ignore_eos[r]:
                for t in self._eos:
                    mask[r, t >> 5] &= _int32(~(1 << (t & 31)))
        return mask

    @staticmethod
    def allowed_count(mask: torch.Tensor, row: int) -> int:
        """How many tokens a row's structure allowed (for the step's event stream)."""
        return int(np.bitwise_count(mask[row].numpy().view(np.uint32)).sum())

    def accept(self, seq_id: str, token: int) -> bool:
        """Advance on a sampled token; False if the structure refused it."""
        return self._matchers[seq_id].consume_token(token)

    def forced(self, seq_id: str, limit: int) -> list[int]:
        """Up to `limit` tokens the structure forces next, already accepted."""
        matcher = self._matchers[seq_id]
        tokens = matcher.compute_ff_tokens()[:max(0, limit)]
        if tokens and not matcher.consume_tokens(tokens):
            return []
        return tokens

    def finished(self, seq_id: str) -> bool:
        """The structure is complete and only EOS may follow."""
        return self._matchers[seq_id].is_stopped()


def _int32(value: int) -> int:
    """A 32-bit pattern as the signed value an int32 tensor holds."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value
