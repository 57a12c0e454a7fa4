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
"""

from __future__ import annotations

import itertools
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


@dataclass
class _Held:
    """One sequence in the draft's cache: its id there and the tokens whose KV it holds."""

    seq_id: str
    tokens: list[int] = field(default_factory=list)


class DraftProposer(CachingProposer):
    def __init__(self, loaded: LoadedModel, num_speculative: int, kv_dtype: str,
                 kv_cache_gib: float, max_num_seqs: int, device: str = "cpu",
                 adaptive: bool = True) -> None:
        self.planner = Planner(num_speculative, adaptive)
        self.max_k = num_speculative
        c = loaded.config
        if c.recurrent is not None:
            raise KvlabError(f"draft model {c.name or c.architecture} has recurrent layers, "
                             "whose state cannot take back rejected proposals")
        budget = CacheBudget(kv_bytes_per_element(kv_dtype), BLOCK_SIZE, kv_cache_gib * 2**30,
                             max_num_seqs, 512)
        blocks = pool_sizes(c, budget, False).num_blocks
        self.vocab_size = c.vocab_size
        self.kv = KVCacheManager(blocks, BLOCK_SIZE, enable_prefix_caching=False)
        quantized = any(t.qtype not in ("F32", "F16", "BF16") for t in loaded.tensors)
        self.runner = ModelRunner(loaded.model, c, blocks, BLOCK_SIZE, kv_dtype, device,
                                  quantized, graphs="off", max_batch=max_num_seqs)
        self.held: dict[int, _Held] = {}  # by id() of the sequence's DraftState
        self._ids = itertools.count()

    def propose(self, candidates: Sequence[Candidate], rows: int) -> list[list[int]]:
        """Up to k greedy draft tokens per candidate, k from the planner."""
        caps = [min(c.cap, self.max_k) for c in candidates]
        ks = self.planner.plan([c.state for c in candidates], caps, rows)
        out: list[list[int]] = [[] for _ in candidates]
        live = [i for i, k in enumerate(ks) if k > 0 and self._sync(candidates[i])]
        feed = {i: list(candidates[i].token_ids[len(self._held(candidates[i].state).tokens):])
                for i in live}  # the tokens each one's next pass computes
        for _ in range(max((ks[i] for i in live), default=0)):
            live = [i for i in live if len(out[i]) < ks[i]]
            if not live:
                break
            nxt = self._pass([(self._held(candidates[i].state), feed[i]) for i in live])
            for i, token in zip(live, nxt):
                out[i].append(token)
                feed[i] = [token]
        return out

    def _held(self, state: DraftState) -> _Held:
        held = self.held.get(id(state))
        if held is None:
            held = self.held[id(state)] = _Held(f"draft-{next(self._ids)}")
        return held

    def _sync(self, c: Candidate) -> bool:
        """Keep the draft cache's longest prefix shared with the sequence; False (no
        proposals) where its pool has no room for the rest."""
        held = self._held(c.state)
        same = 0
        for a, b in zip(held.tokens, c.token_ids):
            if a != b:
                break
            same += 1
        same = min(same, len(c.token_ids) - 1)  # the last token is computed to draft from
        del held.tokens[same:]
        self.kv.truncate(held.seq_id, same)
        if not self.kv.allocate_slots(held.seq_id, len(c.token_ids) + self.max_k - 1):
            self.kv.free(held.seq_id)
            held.tokens.clear()
            return False
        return True

    def _pass(self, work: list[tuple[_Held, list[int]]]) -> list[int]:
        """One draft forward pass: each sequence's tokens past those it holds in, its greedy
        next token out."""
        scheduled = []
        for held, new in work:
            scheduled.append(ScheduledSeq(held.seq_id, len(held.tokens), new,
                                          self.kv.block_table(held.seq_id), True, 0))
            held.tokens.extend(new)
        logits = self.runner.execute(SchedulerOutput(scheduled)).logits
        return fused.argmax(logits.float()).tolist()


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
