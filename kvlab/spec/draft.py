"""A draft model's proposals: a smaller model of the same vocabulary decodes each sequence's
next k tokens greedily, and the target verifies them as it does prompt lookup's.

The draft keeps a paged KV cache of its own (one pool, no prefix cache). Per sequence it
remembers which tokens its cache holds; each step it keeps the longest prefix those share
with the sequence's tokens (the accepted proposals among them), releases the rest, computes
the tokens it lacks in one chunk and then one token per pass, all sequences batched:

    sequence:  p0 .. p9 o0 o1 o2        draft holds p0 .. p9 o0 d1 d2 (d1 kept, d2 not)
    kept:      p0 .. p9 o0 o1           o1 == d1; d2's slot released
    this step: o2 -> e1, e1 -> e2, ...  k passes, e1 .. ek proposed

Greedy, so its q is one-hot and kvlab.spec.verify applies unchanged.

A draft with recurrent layers (the target itself, say) cannot release a token from its
state, so its first proposal pass backs the state up (the state after the catch-up, at the
sequence's last token); when a later step keeps fewer tokens than it holds, the draft goes
back there, restores the backup and computes the kept proposals again in its catch-up.

Each pass's rows before the last predict tokens the sequence already has; those the draft
did not propose are shadow trials of its acceptance rate (kvlab.spec.adaptive), scored
against what the target produced, and so is the last row's guess of a sequence that takes
no proposal this step, once its token comes. A sequence the planner declines still catches
up every CATCH_UP_EVERY tokens (one chunked pass, a fraction of one draft pass per step), so
its rate stays current while it proposes nothing. A catch-up whose guesses all missed doubles
the wait before the next (to CATCH_UP_MOST tokens), and any hit brings it back: where the
draft never agrees, its fixed pass and vocabulary-head rows are paid ever more seldom:

    held:   .. o4                 guess g5 (not proposed)
    now:    .. o4 o5 o6 o7 o8     catch-up o5 .. o8: g5 vs o5, rows o5 o6 o7 -> vs o6 o7 o8,
                                  row o8 -> the next guess
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvlab.cache import KVCacheManager
from kvlab.cache.pool_sizes import CacheBudget, pool_sizes
from kvlab.errors import KvlabError
from kvlab.kernels import fused
from kvlab.models.kv_store import kv_bytes_per_element
from kvlab.models.loader import LoadedModel, LoadOptions, load_model
from kvlab.models.sharding import SINGLE
from kvlab.runner import ModelRunner
from kvlab.scheduler import ScheduledSeq, SchedulerOutput
from kvlab.spec.adaptive import DraftState, Planner
from kvlab.spec.proposer import CachingProposer, Candidate
from kvlab.weights.checkpoint import open_checkpoint

BLOCK_SIZE = 16
CATCH_UP_EVERY = 8  # tokens a declined sequence's draft falls behind before it catches up
CATCH_UP_MOST = 128  # the longest wait, after catch-ups that guessed nothing right
# most rows of one catch-up whose guesses are scored: each logits row costs the draft's whole
# vocabulary head, which a batch that declines proposals for being compute-bound feels
SCORED_ROWS = 4


@dataclass
class _Held:
    """One sequence in the draft's cache: its id there and the tokens whose KV it holds."""

    seq_id: str
    state: DraftState  # the sequence's: its acceptance rate takes the shadow trials
    scored_to: int  # positions before this one are not scored (the prompt, scored ones)
    tokens: list[int] = field(default_factory=list)
    guess: int | None = None  # its unproposed next token after `tokens`
    every: int = CATCH_UP_EVERY  # tokens it may fall behind while declined
    scored: int = 0  # guesses scored since its last catch-up
    hits: int = 0  # of which right
    # recurrent layers: how many tokens the state in its backup row has taken in (None:
    # no backup), and whether its next pass starts from that backup
    backed_up: int | None = None
    restore: bool = False


class DraftProposer(CachingProposer):
    def __init__(self, loaded: LoadedModel, num_speculative: int, kv_dtype: str,
                 kv_cache_gib: float, max_num_seqs: int, device: str = "cpu",
                 adaptive: bool = True) -> None:
        self.planner = Planner(num_speculative, adaptive, draft=True)
        self.max_k = num_speculative
        c = loaded.config
        budget = CacheBudget(kv_bytes_per_element(kv_dtype), BLOCK_SIZE, kv_cache_gib * 2**30,
                             max_num_seqs, 512, state_backups=True)
        pools = pool_sizes(c, budget, False)
        blocks = pools.num_blocks
        self.vocab_size = c.vocab_size
        self.kv = KVCacheManager(blocks, BLOCK_SIZE, enable_prefix_caching=False,
                                 state_slots=pools.state_slots, state_backups=True)
        quantized = any(t.qtype not in ("F32", "F16", "BF16") for t in loaded.tensors)
        self.runner = ModelRunner(loaded.model, c, blocks, BLOCK_SIZE, kv_dtype, device,
                                  quantized, graphs="off", max_batch=max_num_seqs,
                                  num_state_slots=self.kv.num_state_rows)
        self.held: dict[int, _Held] = {}  # by id() of the sequence's DraftState
        self._ids = itertools.count()

    def propose(self, candidates: Sequence[Candidate], rows: int) -> list[list[int]]:
        """Up to k greedy draft tokens per candidate, k from the planner; a declined
        candidate far enough behind catches up instead (scoring its guesses)."""
        began = time.perf_counter()
        caps = [min(c.cap, self.max_k) for c in candidates]
        ks = self.planner.plan([c.state for c in candidates], caps, rows)
        out: list[list[int]] = [[] for _ in candidates]
        live = [i for i, k in enumerate(ks)
                if (k > 0 or self._behind(candidates[i])) and self._sync(candidates[i], k)]
        firsts = self._pass([self._catch_up(candidates[i]) for i in live])
        for i, first in zip(live, firsts):
            held = self.held[id(candidates[i].state)]
            if ks[i]:
                out[i].append(first)
                held.every = CATCH_UP_EVERY
            else:  # scored once its token comes
                held.guess = first
                held.every = self._wait(held)
            held.scored = held.hits = 0
        for n in range(1, max((ks[i] for i in live), default=0)):
            live = [i for i in live if len(out[i]) < ks[i]]
            work = [(self.held[id(candidates[i].state)], [out[i][-1]], 1) for i in live]
            for i, token in zip(live, self._pass(work, back_up=n == 1)):
                out[i].append(token)
        self.drafting = time.perf_counter() - began
        return out

    def _behind(self, c: Candidate) -> bool:
        """Whether a declined candidate's draft catches up this step."""
        held = self.held.get(id(c.state))
        done, every = (0, CATCH_UP_EVERY) if held is None else (len(held.tokens), held.every)
        return self.planner.adaptive and len(c.token_ids) - done >= every

    @staticmethod
    def _wait(held: _Held) -> int:
        """Tokens a declined sequence's draft may fall behind before its next catch-up:
        twice as many as last time after guesses that all missed, back to CATCH_UP_EVERY
        after a hit."""
        if held.hits:
            return CATCH_UP_EVERY
        return min(2 * held.every, CATCH_UP_MOST) if held.scored else held.every

    def _sync(self, c: Candidate, k: int) -> bool:
        """Keep the draft cache's longest prefix shared with the sequence, scoring its
        pending guess; False (no pass) where its pool has no room for the rest."""
        held = self.held.get(id(c.state))
        if held is None:  # from its first output token on
            held = self.held[id(c.state)] = _Held(f"draft-{next(self._ids)}", c.state,
                                                  len(c.token_ids) - 1)
        same = 0
        for a, b in zip(held.tokens, c.token_ids):
            if a != b:
                break
            same += 1
        if held.guess is not None and same == len(held.tokens) < len(c.token_ids):
            self._score(held, held.guess, c.token_ids[same])
        held.guess = None
        same = min(same, len(c.token_ids) - 1)  # the last token is computed to draft from
        same = self._rewind(held, same)
        del held.tokens[same:]
        self.kv.truncate(held.seq_id, same)
        if not self.kv.allocate_slots(held.seq_id, len(c.token_ids) + max(k - 1, 0)):
            self.kv.free(held.seq_id)
            held.tokens.clear()
            held.backed_up, held.restore = None, False
            return False
        return True

    def _rewind(self, held: _Held, same: int) -> int:
        """How many tokens the draft keeps: `same`, or with recurrent layers, where it
        drops any, as many as its backup holds (restored at its next pass), or none."""
        if self.kv.states is None or same >= len(held.tokens):
            return same
        if held.backed_up is not None and held.backed_up <= same:
            held.restore = True
            return held.backed_up
        held.backed_up, held.restore = None, False
        return 0  # from a zero state

    def _catch_up(self, c: Candidate) -> tuple[_Held, list[int], int]:
        """A synced candidate's first pass: the tokens its draft lacks, and how many of
        their rows give logits (those that predict an unscored token, and the last)."""
        held = self.held[id(c.state)]
        new = list(c.token_ids[len(held.tokens):])
        end = len(c.token_ids)
        first = max(held.scored_to - 1, len(held.tokens), end - 1 - SCORED_ROWS)
        held.scored_to = max(held.scored_to, end)  # the pass scores up to here
        return held, new, end - min(first, end - 1)

    def _pass(self, work: list[tuple[_Held, list[int], int]], back_up: bool = False
              ) -> list[int]:
        """One draft forward pass, timed: each sequence's tokens past those it holds in,
        the greedy token after them out. Rows with logits before the last are guesses of
        tokens the sequence has: each one scores its acceptance rate. back_up: recurrent
        states are backed up first (a first proposal pass)."""
        if not work:
            return []
        scheduled = [self._scheduled(held, new, rows, back_up) for held, new, rows in work]
        began = time.perf_counter()
        logits = self.runner.execute(SchedulerOutput(scheduled)).logits
        guesses = fused.argmax(logits.float()).tolist()
        self.planner.draft_cost.observe(sum(len(new) for _, new, _ in work),
                                        time.perf_counter() - began)
        nexts, at = [], 0
        for held, _, rows in work:
            at += rows
            came = held.tokens[len(held.tokens) - rows + 1:]
            for guess, token in zip(guesses[at - rows:at - 1], came):
                self._score(held, guess, token)
            nexts.append(guesses[at - 1])
        return nexts

    @staticmethod
    def _score(held: _Held, guess: int, token: int) -> None:
        """One shadow trial: the draft's unproposed guess against the token that came."""
        held.state.acceptance.record(1, int(guess == token))
        held.scored += 1
        held.hits += guess == token

    def _scheduled(self, held: _Held, new: list[int], rows: int, back_up: bool
                   ) -> ScheduledSeq:
        """One sequence's part of a pass; its tokens are held from now on."""
        kv, seq_id = self.kv, held.seq_id
        backup = kv.state_backup(seq_id)
        restore = backup if held.restore else None
        held.restore = False
        if back_up and backup is not None:
            held.backed_up = len(held.tokens)
        else:
            backup = None
        s = ScheduledSeq(seq_id, len(held.tokens), new, kv.block_table(seq_id), True, 0,
                         None, kv.state_slot(seq_id), restore, None, rows, backup)
        held.tokens.extend(new)
        return s


def load_draft(path: str, num_speculative: int, target_vocab: int, kv_dtype: str,
               kv_cache_gib: float, max_num_seqs: int, device: str, dtype: torch.dtype,
               adaptive: bool = True) -> DraftProposer:
    """The draft proposer over the model at `path`, which must share the target's
    vocabulary (the same token ids)."""
    loaded = load_model(open_checkpoint(path), LoadOptions(dtype=dtype, device=device),
                        SINGLE)
    if loaded.config.vocab_size != target_vocab:
        raise KvlabError(f"draft model {path} has {loaded.config.vocab_size} tokens, the "
                         f"target {target_vocab}: a draft must share the target's vocabulary")
    return DraftProposer(loaded, num_speculative, kv_dtype, kv_cache_gib / 4, max_num_seqs,
                         device, adaptive)
