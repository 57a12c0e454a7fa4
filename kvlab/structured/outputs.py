"""The engine's seam to structured outputs: one matcher per constrained sequence.

Per step, for the sequences that sample:

    bitmask(seq_ids)      [B, ceil(V / 32)] int32: a constrained row's allowed tokens,
                          all bits set on other rows (the sampler masks logits with it)
    accept(seq_id, tok)   the sampled token moves the matcher on
    forced(seq_id, n)     tokens the structure allows exactly one way: appended without
                          sampling, computed next step as one chunk (at prefill speed)
    finished(seq_id)      only EOS can follow: the output is complete

A sequence whose params carry a ReasoningGate (a thinking model) has a GateState beside its
matcher (or alone, for a reasoning budget without a structure): inside the reasoning block its
row is free and the gate takes the tokens; the matcher starts after the block (gate.py).

A matcher and a gate track the sequence's output tokens only, so preemption (which keeps the
tokens and recomputes their KV) needs nothing from them.
"""

from __future__ import annotations

from concurrent.futures import Future

import llguidance
import numpy as np
import torch

from kvlab.request import ReasoningGate, Structure
from kvlab.structured.compiler import GrammarCompiler, Template
from kvlab.structured.gate import GateState, Phase
from kvlab.tokenizer import Tokenizer


class StructuredOutputs:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.compiler = GrammarCompiler(tokenizer, vocab_size)
        self.words = (vocab_size + 31) // 32
        self._eos = [t for t in tokenizer.eos_ids if t < vocab_size]
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        self._gates: dict[str, GateState] = {}
        self._space: torch.Tensor | None = None  # [words] int32: whitespace-only tokens

    def prepare(self, structure: Structure) -> Future[Template]:
        return self.compiler.submit(structure)

    def start(self, seq_id: str, template: Template | None,
              gate: ReasoningGate | None = None) -> None:
        """Follow a sequence's structure, its reasoning gate or both (neither: a no-op)."""
        if template is not None:
            self._matchers[seq_id] = template.deep_copy()
        if gate is not None:
            self._gates[seq_id] = GateState(gate)

    def release(self, seq_id: str) -> None:
        self._matchers.pop(seq_id, None)
        self._gates.pop(seq_id, None)

    def constrained(self, seq_id: str) -> bool:
        return seq_id in self._matchers or seq_id in self._gates

    def bitmask(self, seq_ids: list[str], ignore_eos: list[bool]) -> torch.Tensor | None:
        """The allowed-token bits of each row, or None when no row is constrained.

        A row that ignores EOS may not end before its structure does (then it ends there)."""
        if not self._matchers and not self._gates:  # nothing to follow: no pass over the rows
            return None
        rows = [r for r, s in enumerate(seq_ids) if self._restricts(s, ignore_eos[r])]
        if not rows:
            return None
        mask = torch.full((len(seq_ids), self.words), -1, dtype=torch.int32)
        for r in rows:
            self._fill(mask[r], seq_ids[r])
            if ignore_eos[r]:
                for t in self._eos:
                    mask[r, t >> 5] &= _int32(~(1 << (t & 31)))
        return mask

    def _restricts(self, seq_id: str, ignore_eos: bool) -> bool:
        gate = self._gates.get(seq_id)
        if gate is None:
            return seq_id in self._matchers
        return ignore_eos or gate.over_budget or (
            seq_id in self._matchers and gate.phase is not Phase.REASONING)

    def _fill(self, row: torch.Tensor, seq_id: str) -> None:
        """A row's bits: the structure's (each fill releases the GIL), the gate's beside them
        before it starts, only the end marker's next token past the budget."""
        gate, matcher = self._gates.get(seq_id), self._matchers.get(seq_id)
        if gate is not None and gate.over_budget:
            row.zero_()
            _allow(row, gate.next_end_token())
            return
        if matcher is None or (gate is not None and gate.phase is Phase.REASONING):
            return
        matcher.unsafe_compute_mask_ptr(row.data_ptr(), self.words * 4)
        if gate is None:
            return
        tokens, whitespace = gate.extras()
        for t in tokens:
            _allow(row, t)
        if whitespace:
            row |= self._space_row()

    def _space_row(self) -> torch.Tensor:
        if self._space is None:  # the compiler's vocabulary exists once a template does
            self._space = torch.zeros(self.words, dtype=torch.int32)
            for t in self.compiler.whitespace:
                _allow(self._space, t)
        return self._space

    @staticmethod
    def allowed_count(mask: torch.Tensor, row: int) -> int:
        """How many tokens a row's structure allowed (for the step's event stream)."""
        return int(np.bitwise_count(mask[row].numpy().view(np.uint32)).sum())

    def accept(self, seq_id: str, token: int) -> bool:
        """Advance on a sampled token; False if the structure refused it."""
        gate = self._gates.get(seq_id)
        if gate is not None and gate.take(token, token in self.compiler.whitespace):
            return True
        matcher = self._matchers.get(seq_id)
        return matcher is None or matcher.consume_token(token)

    def forced(self, seq_id: str, limit: int) -> list[int]:
        """Up to `limit` tokens the gate or the structure forces next, already accepted."""
        gate = self._gates.get(seq_id)
        if gate is not None and gate.phase is not Phase.STRUCTURE:
            return gate.forced(limit)
        matcher = self._matchers.get(seq_id)
        if matcher is None:
            return []
        tokens = matcher.compute_ff_tokens()[:max(0, limit)]
        if tokens and not matcher.consume_tokens(tokens):
            return []
        return tokens

    def finished(self, seq_id: str) -> bool:
        """The structure is complete and only EOS may follow."""
        gate, matcher = self._gates.get(seq_id), self._matchers.get(seq_id)
        if gate is not None and gate.phase is not Phase.STRUCTURE:
            return False
        return matcher is not None and matcher.is_stopped()


def _allow(row: torch.Tensor, token: int) -> None:
    row[token >> 5] |= _int32(1 << (token & 31))


def _int32(value: int) -> int:
    """A 32-bit pattern as the signed value an int32 tensor holds."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value
