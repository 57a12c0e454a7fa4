"""The proposer the scheduler asks for tokens: prompt lookup (kvlab.spec.ngram), each
sequence's guess cut to the length the planner (kvlab.spec.adaptive) gives it this step.

Plain Python, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvlab.spec.adaptive import DraftState, Planner

# prompt lookup; a draft model (kvlab.spec.draft); the model's own multi-token-prediction
# layer (kvlab.spec.mtp)
METHODS = ("ngram", "draft", "mtp")


@dataclass(frozen=True)
class Candidate:
    """A sequence that could take proposals this step: its state, its tokens (all computed
    but the last), and the most it may take (max_tokens left after the next one)."""

    state: DraftState
    token_ids: Sequence[int]
    cap: int


class Proposer(Protocol):
    """What the scheduler asks of a proposer."""

    def propose(self, candidates: Sequence[Candidate], rows: int) -> list[list[int]]: ...

    def observe_step(self, rows: int, multi: bool, seconds: float) -> None: ...

    def forget(self, state: DraftState) -> None: ...


class CachingProposer:
    """What the proposers that keep a KV cache of their own share (a draft model's, an MTP
    layer's): the planner's step-cost fit, and a record per sequence (`held`, by id() of its
    DraftState, each with the `seq_id` of its blocks in `kv`) released when it finishes."""

    planner: Planner
    held: dict
    kv: Any  # kvlab.cache.KVCacheManager
    drafting = 0.0  # seconds the last propose spent in passes timed apart (a draft model's)

    def observe_step(self, rows: int, multi: bool, seconds: float) -> None:
        """A timed decode step, less the passes the planner times apart."""
        self.planner.cost.observe(rows, multi, max(seconds - self.drafting, 0.0))
        self.drafting = 0.0

    def forget(self, state: DraftState) -> None:
        """A sequence finished: release its cache."""
        held = self.held.pop(id(state), None)
        if held is not None:
            self.kv.free(held.seq_id)


class NgramProposer:
    def __init__(self, num_speculative: int, adaptive: bool = True) -> None:
        self.planner = Planner(num_speculative, adaptive)
        self.max_k = num_speculative

    def propose(self, candidates: Sequence[Candidate], rows: int) -> list[list[int]]:
        """Proposed tokens per candidate, for a step of `rows` rows without them."""
        guesses = []
        for c in candidates:
            c.state.check_shadow(c.token_ids)
            guesses.append(c.state.index.propose(c.token_ids, min(c.cap, self.max_k)))
        ks = self.planner.plan([c.state for c in candidates], [len(g) for g in guesses], rows)
        for c, guess, k in zip(candidates, guesses, ks):
            if k == 0 and guess:  # scored against what comes instead
                c.state.shadow, c.state.shadow_at = guess, len(c.token_ids)
        return [guess[:k] for guess, k in zip(guesses, ks)]

    def observe_step(self, rows: int, multi: bool, seconds: float) -> None:
        """A timed decode step: rows computed, whether any sequence computed several."""
        self.planner.cost.observe(rows, multi, seconds)

    def forget(self, state: DraftState) -> None:
        """A sequence finished (its index goes with its state)."""
