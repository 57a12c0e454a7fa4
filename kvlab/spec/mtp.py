"""Multi-token-prediction proposals: the model's own MTP layer (kvlab.models.mtp) guesses
each sequence's next tokens from the main model's last hidden state.

The layer keeps a paged KV cache of its own (one layer; as many blocks as the main pool,
no prefix cache). Its row at position p takes x_p and the main model's state h_{p-1}, so
it follows the main model one position behind, and guesses past it:

    a step computes      x_s .. x_{s+n-1}       -> h_s .. h_{s+n-1}   (the kept rows)
    observe: MTP rows    p = s .. s+n-1 from (x_p, h_{p-1})   (h_{s-1} kept from before;
                         K/V only: their outputs are not needed)
    propose: row e       (x_e, h_{e-1})   -> out_e, guess d1   (x_e: the sampled token)
             row e+1     (d1, out_e)      -> out_{e+1}, guess d2, ... k rows

Row e has only real inputs, so its K/V stays; the guess rows' slots are released after
the guesses and their rows recomputed from the main model's states once verified (as
llama.cpp does). A sequence whose first computed position is past 0 (a prefix-cache hit)
starts its MTP rows there and the layer attends over the positions it has seen:

    positions      0 .. c-1 (cached) | c  c+1 ...
    MTP rows                         |    c+1 ...   local index = position - base, base c+1

On a hybrid model (Qwen3.5) the MTP layer is one of its attention layers: its K/V lives here,
beside the main model's recurrent state slots, which take back rejected guesses from their
backup rows (kvlab.cache); observe only sees the kept rows' states.

Greedy guesses: q is one-hot and kvlab.spec.verify applies unchanged.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvlab.cache import KVCacheManager
from kvlab.errors import KvlabError
from kvlab.kernels import fused
from kvlab.models.attention import SeqSpan, build_metadata
from kvlab.models.kv_store import make_kv
from kvlab.models.loader import LoadedModel
from kvlab.models.mtp import FAMILIES, MtpLayer
from kvlab.spec.adaptive import DraftState, Planner
from kvlab.spec.proposer import CachingProposer, Candidate

BLOCK_SIZE = 16


@dataclass
class _Held:
    """One sequence in the MTP layer's cache: rows at positions base .. end - 1 are there;
    `last` is the main model's state h_{last_at}, kept to feed the row after it."""

    seq_id: str
    base: int = -1  # -1: no rows yet
    end: int = 0
    last: torch.Tensor | None = None  # [hidden]
    last_at: int = -1


@dataclass(frozen=True)
class HiddenSpan:
    """One scheduled sequence's part of a step's hidden states: its proposer state, the
    position of its first row, the tokens computed there that were kept (rejected
    proposals left out), and the index of its first row in the step."""

    state: DraftState
    start: int
    token_ids: list[int]
    row: int


@dataclass
class _Rows:
    """MTP rows of one sequence for one pass: positions first .. first + len(ids) - 1."""

    held: _Held
    first: int
    ids: list[int]
    prev: torch.Tensor  # [len(ids), hidden]: the state each row takes in


class MtpProposer(CachingProposer):
    """The MTP layer as a proposer: follows each sequence's hidden states (observe), then
    guesses (propose); one record per sequence in `held`, its rows in `kv` / `cache`."""

    def __init__(self, layer: MtpLayer, num_speculative: int, kv_dtype: str,
                 num_blocks: int, device: str = "cpu", adaptive: bool = True) -> None:
        self.layer = layer
        self.planner = Planner(num_speculative, adaptive)
        self.max_k = num_speculative
        c = layer.config
        self.kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=False)
        # [num_blocks * BLOCK_SIZE slots] of the one layer's K/V (or latent)
        self.cache = make_kv(kv_dtype, num_blocks * BLOCK_SIZE, c.layer_kv_heads(0),
                             c.layer_head_dim(0), torch.device(device), c.mla)
        self.device = torch.device(device)
        self.held: dict[int, _Held] = {}  # by id() of the sequence's DraftState
        self._ids = itertools.count()
        self._offsets = torch.arange(BLOCK_SIZE)

    # ---- the Proposer interface ------------------------------------------------------------

    def propose(self, candidates: Sequence[Candidate], rows: int) -> list[list[int]]:
        """Up to k greedy guesses per candidate, k from the planner: row e from the sampled
        token, then the layer on its own output."""
        caps = [min(c.cap, self.max_k) for c in candidates]
        ks = self.planner.plan([c.state for c in candidates], caps, rows)
        out: list[list[int]] = [[] for _ in candidates]
        live = [i for i, k in enumerate(ks) if k > 0 and self._ready(candidates[i], k)]
        feed = {}  # i -> the row its next pass computes
        for i in live:
            held, ids = self._held(candidates[i].state), candidates[i].token_ids
            feed[i] = _Rows(held, len(ids) - 1, [ids[-1]], held.last[None])
        with torch.inference_mode():
            for _ in range(max((ks[i] for i in live), default=0)):
                live = [i for i in live if len(out[i]) < ks[i]]
                if not live:
                    break
                outs = self._run([feed[i] for i in live], want_out=True)
                guesses = fused.argmax(self.layer.logits(outs)).tolist()
                for i, token, o in zip(live, guesses, outs):
                    out[i].append(token)
                    feed[i] = _Rows(feed[i].held, feed[i].first + 1, [token], o[None])
        for i in feed:  # row e stays; the guess rows' slots go
            held = self._held(candidates[i].state)
            held.end = len(candidates[i].token_ids)
            self.kv.truncate(held.seq_id, held.end - held.base)
        return out

    # ---- following the main model ----------------------------------------------------------

    def observe(self, spans: Sequence[HiddenSpan], hidden: torch.Tensor) -> None:
        """A step's hidden states [step tokens, hidden] (the runner's, before the final
        norm): compute the MTP rows they complete, all sequences in one pass."""
        spans = [s for s in spans if s.token_ids]
        if not spans:
            return
        with torch.inference_mode():
            states = self.layer.main_hidden(hidden)
            work = [w for w in (self._catch_up(s, states[s.row:s.row + len(s.token_ids)])
                                for s in spans) if w is not None]
            if work:
                self._run(work, want_out=False)

    def _catch_up(self, s: HiddenSpan, states: torch.Tensor) -> _Rows | None:
        """The rows a span completes, from its states [n, hidden]; keeps the state the next
        row takes. A gap (a prefix hit, a row whose state is gone) starts the rows anew."""
        held, n = self._held(s.state), len(s.token_ids)
        end = s.start + n
        resumes = held.end == s.start and held.last_at == s.start - 1
        if held.base < 0 or held.end < s.start or (held.end == s.start and not resumes):
            self._restart(held, s.start + 1)
        first = held.end  # s.start <= first: rows before it are in the cache
        work = None
        if first < end:
            prev = states[max(first - 1 - s.start, 0):n - 1]
            if first == s.start:
                prev = torch.cat([held.last[None], prev])
            if self.kv.allocate_slots(held.seq_id, end - held.base):
                work = _Rows(held, first, s.token_ids[first - s.start:], prev)
                held.end = end
            else:  # no room: it proposes nothing until its rows can start again
                self._restart(held, -1)
                return None
        if s.start <= held.end - 1 < end:
            held.last, held.last_at = states[held.end - 1 - s.start].clone(), held.end - 1
        return work

    def _ready(self, c: Candidate, k: int) -> bool:
        """Whether the sequence's rows reach its sampled token's position and its cache
        has room for k more."""
        held, e = self._held(c.state), len(c.token_ids) - 1
        if held.base < 0 or held.end != e or held.last_at != e - 1 or held.last is None:
            return False
        return self.kv.allocate_slots(held.seq_id, e + k - held.base)

    def _restart(self, held: _Held, base: int) -> None:
        self.kv.free(held.seq_id)
        held.base = held.end = base
        held.last, held.last_at = None, -1

    def _held(self, state: DraftState) -> _Held:
        held = self.held.get(id(state))
        if held is None:
            held = self.held[id(state)] = _Held(f"mtp-{next(self._ids)}")
        return held

    # ---- one pass --------------------------------------------------------------------------

    def _run(self, work: list[_Rows], want_out: bool) -> torch.Tensor:
        """One MTP pass over the rows of several sequences; with want_out, the output
        [len(work), hidden] of each one's last row (else K/V only)."""
        spans, ids, positions, last = [], [], [], []
        for w in work:
            local = w.first - w.held.base
            end = local + len(w.ids)
            slots = self._slots(self.kv.block_table(w.held.seq_id), end)
            spans.append(SeqSpan(local, len(w.ids), slots))  # causal among its rows
            ids.extend(w.ids)
            positions.extend(range(w.first, w.first + len(w.ids)))
            last.append(len(ids) - 1)
        meta = build_metadata(spans, None, self.device)
        out_rows = torch.tensor(last if want_out else [], dtype=torch.long, device=self.device)
        return self.layer.forward(
            torch.tensor(ids, dtype=torch.long, device=self.device),
            torch.cat([w.prev for w in work]).to(self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device), self.cache, meta,
            out_rows)

    def _slots(self, block_table: list[int], end: int) -> torch.Tensor:
        """[end] slot of each local row 0..end-1: table[i // bs] * bs + i % bs."""
        table = torch.tensor(block_table, dtype=torch.long)
        return (table[:, None] * BLOCK_SIZE + self._offsets[None, :]).flatten()[:end]


def mtp_proposer(loaded: LoadedModel, num_speculative: int, kv_dtype: str, num_blocks: int,
                 device: str, adaptive: bool = True) -> MtpProposer:
    """The proposer over a loaded model's MTP layer (loaded with LoadOptions.mtp)."""
    c = loaded.config
    if loaded.mtp is None or c.architecture not in FAMILIES:
        families = ", ".join(f"{v} ({k})" for k, v in FAMILIES.items())
        what = (f"this {FAMILIES[c.architecture]} checkpoint ships no multi-token-prediction "
                "layer" if c.architecture in FAMILIES else "has no multi-token-prediction layers")
        raise KvlabError(
            f"{c.name or c.architecture} ({c.architecture}): {what}: --speculative mtp needs "
            f"a checkpoint that ships them ({families}; a GGUF converted with its nextn layers "
            "kept), loaded with LoadOptions(mtp=True); use --speculative ngram or draft")
    return MtpProposer(loaded.mtp, num_speculative, kv_dtype, num_blocks, device, adaptive)
