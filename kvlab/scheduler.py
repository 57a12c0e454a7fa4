"""Who runs this step and how many tokens: continuous batching with chunked prefill.

Plain Python, no torch. Each sequence carries one progress counter, `num_computed_tokens`,
that catches up with its token count. Prefill, a prefill chunk, a prefix-cache hit and a
decode step are all the same catch-up in different sizes:

    tokens:    [p0 p1 p2 p3 p4 p5 | o0]        num_tokens = 7
    computed:  [ cached | computed ]           num_computed_tokens = 6
    this step: schedule 7 - 6 = 1 token (decode), within the step's token budget

Running sequences go first (oldest first), then waiting ones, under `max_num_batched_tokens`
and `max_num_seqs`. When KV blocks run out, the newest running sequence is preempted: its
blocks are freed and it goes back to the front of the queue to be recomputed later.

Speculative decoding is one more size of the same catch-up. A proposer (kvlab.spec) guesses
a decoding sequence's next tokens; they are appended as tokens it has not computed, so the
step computes the last sampled token and the guesses together and asks for logits at each:

    tokens:    [prompt ... o3 | d1 d2 d3]      num_draft_tokens = 3
    computed:  [prompt ...]|                   num_computed_tokens = num_tokens - 4
    this step: o3 d1 d2 d3, 4 logits rows      (guesses past the token budget are dropped)

The engine verifies them; `settle` drops the rejected guesses and truncates the block table,
and only then does `update` advance the counter and register full blocks, so the prefix
cache never holds an unverified token.

A recurrent layer's state cannot drop a token it has taken in, so a hybrid model's verify
step first copies the sequence's state to its backup row (`state_backup`). When a guess is
rejected, the sequence is rewound: its counter stays where the step began, and its next
step restores the backup and computes the kept tokens again with the new ones:

    step n:    o3 d1 d2 d3        d1 kept, d2 rejected, s sampled in its place
    step n+1:  o3 d1 s e1 e2      from the state before o3; e1 e2 the next guesses

A verify step saves no snapshot: its state may hold a rejected token.

Async scheduling schedules a decode step while the one before still runs (schedule_ahead):
each decoding sequence is assumed to gain exactly the one token that step samples, so its
next position gets its slot before the host knows the token:

    tokens:    [prompt ... o3]                 o4 sampled on the device, not read yet
    computed:  [prompt ... o3]                 num_computed_tokens = num_tokens
    ahead:     start = num_tokens, 1 token     its id comes from the device, not the host

After the ahead step is launched the counter runs one past the known tokens until o4 is
appended; a sequence that o4 ends is freed then, and the ahead step's row for it dropped.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

from kvlab.cache import KVCacheManager
from kvlab.request import SamplingParams
from kvlab.spec.adaptive import DraftState
from kvlab.spec.proposer import Candidate, Proposer


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: str
    token_ids: list[int]  # prompt followed by generated tokens
    num_prompt_tokens: int
    params: SamplingParams
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served at first schedule
    status: SeqStatus = SeqStatus.WAITING
    num_preemptions: int = 0
    num_draft_tokens: int = 0  # the last tokens of token_ids are proposals, not yet verified
    draft: DraftState | None = None  # the proposer's state, once it was asked

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


# a ScheduledSeq from a tuple of all its fields, without the named tuple's keyword layer
_new = tuple.__new__

# the token ids of a step scheduled ahead (schedule_ahead): the host does not know them yet
_STAND_IN: list[int] = [0]


class ScheduledSeq(NamedTuple):
    """One sequence's part of a step. A named tuple: made for every running sequence at
    every step, it costs a third of a frozen dataclass to build."""

    seq_id: str
    start: int  # num_computed_tokens before this step
    # the tokens computed this step: positions [start, start + len); in a step scheduled
    # ahead, a stand-in for the one token the step before samples (schedule_ahead)
    token_ids: list[int]
    block_table: list[int]
    needs_logits: bool  # this step reaches the end of its known tokens: sample one
    prefill_tokens: int  # how many of token_ids are prompt tokens
    # its blocks in the sliding-window layers' pool, None where released; None without one
    window_table: list[int | None] | None = None
    # its row in the recurrent layers' state tensors; None without such layers
    state_slot: int | None = None
    # prefix cache of a hybrid model: the snapshot row its state resumes from before this
    # step (a prefix hit's first step), and the row its state is saved to after it
    state_restore: int | None = None
    state_save: int | None = None
    # logits rows it needs when needs_logits: its last num_logits positions (the last
    # sampled token and each proposed one)
    num_logits: int = 1
    # a hybrid model's verify step: the row its state is copied to before the step (after
    # any restore), restored from if a proposal is rejected
    state_backup: int | None = None


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    preempted: list[str] = field(default_factory=list)
    # every row is one token of a decoding sequence and needs logits (num_tokens rows)
    decode: bool = False
    # the steady state, for the runner to follow its last step cheaply: `follows` is the
    # serial of the step this one repeats (the same sequences in the same order, each one
    # position on), and `grown` the rows whose block table gained a block since
    serial: int | None = None
    follows: int | None = None
    grown: tuple[int, ...] = ()

    @cached_property
    def num_tokens(self) -> int:
        if self.decode:
            return len(self.scheduled)
        return sum(len(s.token_ids) for s in self.scheduled)


@dataclass(frozen=True)
class _Steady:
    """The last step scheduled ahead, for the next one to follow it cheaply."""

    output: SchedulerOutput
    steps_left: int  # steps its sequences can all take before the first of them ends
    changes: int  # Scheduler._running_changes when it was made


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 proposer: Proposer | None = None) -> None:
        self.config, self.kv, self.proposer = config, kv, proposer
        self._blocks_only = kv.blocks_only  # a sequence's step needs its block table alone
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # hybrid sequences whose verify step rejected a guess: their counter stays at the
        # step's start, and their next step restores the state from the backup row
        self._rewound: set[str] = set()
        self._running_changes = 0  # sequences joined or left the running set
        self._steady: _Steady | None = None  # the last step scheduled ahead
        self._last_decode: SchedulerOutput | None = None  # the last all-decode schedule()
        self._serial = 0  # of the last decode step made by the paths above (SchedulerOutput)

    def add(self, seq: Sequence) -> None:
        if self.proposer is not None:  # from the start: an MTP proposer follows its prefill
            seq.draft = DraftState.of(seq.params)
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        decode = self._same_decode_batch()
        if decode is not None:
            return decode
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        preempted: list[str] = []
        if self.proposer is not None:
            self._propose()
        budget = self._schedule_running(budget, scheduled, preempted)
        if not preempted:
            self._schedule_waiting(budget, scheduled)
        out = SchedulerOutput([self._describe(s, n) for s, n in scheduled], preempted)
        if not self._all_decode(out):
            return out
        self._serial += 1
        self._last_decode = out = SchedulerOutput(out.scheduled, [], True, self._serial)
        return out

    def _all_decode(self, out: SchedulerOutput) -> bool:
        """`out` is one decode row of every running sequence, in running order."""
        return (self.proposer is None and self._blocks_only and not out.preempted
                and len(out.scheduled) == len(self.running) == out.num_tokens
                and all(s.needs_logits for s in out.scheduled))

    def _same_decode_batch(self) -> SchedulerOutput | None:
        """schedule() where the last step was one decode row of every running sequence and
        each has gained exactly one token since (the steady state): each one position
        further, a new block only where a position starts one. None: the general pass."""
        last, running, c = self._last_decode, self.running, self.config
        self._last_decode = None
        if (last is None or len(last.scheduled) != len(running)
                or len(running) > c.max_num_batched_tokens
                or (self.waiting and len(running) < c.max_num_seqs)):
            return None
        pairs = list(zip(last.scheduled, running))
        if any(s.seq_id != seq.seq_id or seq.num_computed_tokens != s.start + 1
               or len(seq.token_ids) != s.start + 2 for s, seq in pairs):
            return None
        scheduled = [_new(ScheduledSeq, (s[0], s[1] + 1, seq.token_ids[-1:], s[3], True, 0,
                                         None, None, None, None, 1, None))
                     for s, seq in pairs]
        grown = self._grow_tables(scheduled)
        if grown is None:
            return None  # the general pass preempts (the blocks taken are its own)
        out = self._following(last, scheduled, grown)
        self._last_decode = out
        return out

    def _following(self, last: SchedulerOutput, scheduled: list[ScheduledSeq],
                   grown: tuple[int, ...]) -> SchedulerOutput:
        """The decode step that repeats `last` one position on (see SchedulerOutput)."""
        self._serial += 1
        follows = last.serial if last.decode else None
        return SchedulerOutput(scheduled, [], True, self._serial, follows, grown)

    def _grow_tables(self, scheduled: list[ScheduledSeq]) -> tuple[int, ...] | None:
        """Give a block to each one-token step whose position starts one, in place; the rows
        that got one, or None where the pool has none left."""
        bs, kv = self.kv.block_size, self.kv
        grown = tuple([i for i, s in enumerate(scheduled) if s[1] % bs == 0])
        for i in grown:
            s = scheduled[i]
            if not kv.allocate_slots(s.seq_id, s.start + 1):
                return None
            scheduled[i] = s._replace(block_table=kv.block_table(s.seq_id))
        return grown

    def schedule_ahead(self, last: SchedulerOutput, max_len: int) -> SchedulerOutput | None:
        """The step after `last`, scheduled while `last` still runs: each of its decoding
        sequences gains exactly the one token `last` samples, which the host does not know
        yet (async scheduling, see the module docstring). Its position gets a slot now; the
        step's token ids are stand-ins, the runner takes the ids `last` sampled instead. A
        sequence that token certainly ends (max_tokens, the context `max_len`) is left out.

        None where the host must decide first (the synchronous path does): speculation,
        recurrent states, a sequence still in prefill or not in `last`, a seat that a waiting
        sequence could take, a block that is not free."""
        if self.proposer is not None or self.kv.states is not None:
            return None
        steady = self._steady
        if (steady is not None and steady.output is last and steady.steps_left > 1
                and steady.changes == self._running_changes and self._blocks_only):
            scheduled, grown = self._advance(last)  # the same batch as last step: fast
            steps_left = steady.steps_left - 1
        else:
            (scheduled, steps_left), grown = self._ahead(last, max_len), None
        if (scheduled is None or not scheduled
                or len(scheduled) > self.config.max_num_batched_tokens
                or (self.waiting and len(scheduled) < self.config.max_num_seqs)):
            self._steady = None
            return None
        if grown is None:
            self._serial += 1
            out = SchedulerOutput(scheduled, [], True, self._serial)
        else:
            out = self._following(last, scheduled, grown)
        self._steady = _Steady(out, steps_left, self._running_changes)
        return out

    def _ahead(self, last: SchedulerOutput, max_len: int
               ) -> tuple[list[ScheduledSeq] | None, int]:
        """schedule_ahead's steps for any running set, and how many more steps this set can
        take before one of its sequences ends (the fast path's steps)."""
        kv, prev = self.kv, {s.seq_id: s for s in last.scheduled}
        bs, windowed = kv.block_size, not self._blocks_only
        scheduled: list[ScheduledSeq] = []
        steps_left = 1 << 62
        for seq in self.running:
            s, start = prev.get(seq.seq_id), seq.num_computed_tokens
            if s is None or start != len(seq.token_ids) or s.start + 1 != start:
                return None, 0
            # tokens it may hold: after `limit` tokens it has ended
            limit = min(seq.num_prompt_tokens + seq.params.max_tokens, max_len)
            if start + 1 >= limit:
                continue  # its token from `last` ends it
            steps_left = min(steps_left, limit - start - 1)
            # a new block only where the position starts one; else the table is last step's
            table = s.block_table
            if start % bs == 0 or windowed:
                if not kv.allocate_slots(seq.seq_id, start + 1):
                    return None, 0
                table = kv.block_table(seq.seq_id)
            window = kv.window_table(seq.seq_id) if windowed else None
            scheduled.append(ScheduledSeq(seq.seq_id, start, _STAND_IN, table, True, 0, window))
        return scheduled, steps_left

    def _advance(self, last: SchedulerOutput
                 ) -> tuple[list[ScheduledSeq] | None, tuple[int, ...]]:
        """The step after a step scheduled ahead, of the same sequences, none of which can
        end before it: each one position further, a new block where a position starts one
        (and the rows that got one)."""
        scheduled = [_new(ScheduledSeq, (s[0], s[1] + 1, _STAND_IN, s[3], True, 0,
                                         None, None, None, None, 1, None))
                     for s in last.scheduled]
        grown = self._grow_tables(scheduled)
        return (None, ()) if grown is None else (scheduled, grown)

    def update_ahead(self, output: SchedulerOutput, seqs: list[Sequence]) -> None:
        """update() of a step from schedule_ahead (seqs: its sequences, in order): each has
        computed one more position than it has known tokens until the step's token is read."""
        kv, bs = self.kv, self.kv.block_size
        caching, blocks_only = kv.enable_prefix_caching, self._blocks_only
        for s, seq in zip(output.scheduled, seqs):
            seq.num_computed_tokens = done = s.start + 1
            # a block fills with known tokens only where the step's position starts one
            if caching and (s.start % bs == 0 or not blocks_only):
                kv.cache_full_blocks(seq.seq_id, seq.token_ids, done)  # known tokens only
            if not blocks_only:
                kv.release_out_of_window(seq.seq_id, done)

    def _schedule_running(self, budget: int, scheduled: list[tuple[Sequence, int]],
                          preempted: list[str]) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            done = seq.num_computed_tokens
            over = len(seq.token_ids) - done - budget
            if over > 0 and seq.num_draft_tokens:  # guesses past the budget are dropped
                self._drop_drafts(seq, min(over, seq.num_draft_tokens))
            n = min(len(seq.token_ids) - done, budget)
            if not self._blocks_only:  # a hybrid's step may end on a snapshot boundary
                n = self._step_end(seq, n)
            while not self.kv.allocate_slots(seq.seq_id, done + n):
                if seq.num_draft_tokens:  # its guesses go before anyone's blocks do
                    n -= seq.num_draft_tokens
                    self._drop_drafts(seq, seq.num_draft_tokens)
                    continue
                victim = self.running.pop()  # the newest sequence gives its blocks back
                self._running_changes += 1
                self._preempt(victim)
                preempted.append(victim.seq_id)
                if victim is seq:
                    return budget
            scheduled.append((seq, n))
            budget -= n
            i += 1
        return budget

    def _step_end(self, seq: Sequence, n: int) -> int:
        """How many of seq's next n tokens its step runs, ending on a snapshot boundary.
        A boundary among its guesses drops them all: the state saved there must be verified,
        and plain steps reach it."""
        done, prompt = seq.num_computed_tokens, seq.num_prompt_tokens
        end = self.kv.step_end(done, done + n, prompt)
        if end < done + n and seq.num_draft_tokens:
            n -= seq.num_draft_tokens
            self._drop_drafts(seq, seq.num_draft_tokens)
            end = self.kv.step_end(done, done + n, prompt)
        return end - done

    def _schedule_waiting(self, budget: int, scheduled: list[tuple[Sequence, int]]) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            blocks, num_cached = self.kv.get_computed_blocks(seq.token_ids)
            n = min(seq.num_tokens - num_cached, budget)
            n = self.kv.step_end(num_cached, num_cached + n,
                                 seq.num_prompt_tokens) - num_cached
            if not self.kv.allocate_slots(seq.seq_id, num_cached + n, blocks):
                return
            self.waiting.popleft()
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_cached
            seq.num_computed_tokens = num_cached
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self._running_changes += 1
            scheduled.append((seq, n))
            budget -= n

    def _describe(self, seq: Sequence, n: int) -> ScheduledSeq:
        start, seq_id, kv = seq.num_computed_tokens, seq.seq_id, self.kv
        end = start + n
        if self._blocks_only:
            return ScheduledSeq(seq_id, start, seq.token_ids[start:end], kv.block_table(seq_id),
                                end == len(seq.token_ids),
                                max(0, min(end, seq.num_prompt_tokens) - start),
                                num_logits=1 + seq.num_draft_tokens)
        backup = kv.state_backup(seq_id) if seq.num_draft_tokens else None
        # a verify step saves no snapshot: its state may hold a rejected token
        restore, save = (None, None) if backup is not None else kv.state_copies(
            seq_id, end, seq.num_prompt_tokens)
        if seq_id in self._rewound:  # from the state before its last verify step
            self._rewound.discard(seq_id)
            restore = kv.state_backup(seq_id)
        return ScheduledSeq(  # positional: needs_logits, prefill_tokens, window_table, ...
            seq_id, start, seq.token_ids[start:end], kv.block_table(seq_id),
            end == len(seq.token_ids), max(0, min(end, seq.num_prompt_tokens) - start),
            kv.window_table(seq_id), kv.state_slot(seq_id), restore, save,
            1 + seq.num_draft_tokens, backup)

    def _propose(self) -> None:
        """Ask the proposer for each decoding sequence's next tokens and append them."""
        assert self.proposer is not None
        seqs, candidates = [], []
        for seq in self.running:
            left = seq.params.max_tokens - len(seq.output_ids) - 1  # after the next token
            # decoding: its prompt computed, its known outputs (a sampled token and any its
            # structure forced) not yet, and no proposals pending
            if seq.num_computed_tokens < seq.num_prompt_tokens or seq.num_draft_tokens:
                continue
            if seq.draft is None:
                seq.draft = DraftState.of(seq.params)
            seqs.append(seq)
            candidates.append(Candidate(seq.draft, seq.token_ids, left))
        if not candidates:
            return
        rows = sum(s.num_tokens - s.num_computed_tokens for s in self.running)
        for seq, tokens in zip(seqs, self.proposer.propose(candidates, rows)):
            seq.token_ids.extend(tokens)
            seq.num_draft_tokens = len(tokens)

    def _drop_drafts(self, seq: Sequence, n: int) -> None:
        """Remove the last n proposed tokens (not computed: no KV to release)."""
        del seq.token_ids[len(seq.token_ids) - n:]
        seq.num_draft_tokens -= n

    def settle(self, seq: Sequence, num_accepted: int) -> None:
        """After a verify step: keep the first num_accepted proposals (now computed), drop
        the rest and release the KV blocks past the kept tokens. Call before update. A
        hybrid sequence with a rejected guess is rewound (see the module docstring)."""
        proposed = seq.num_draft_tokens
        if num_accepted < proposed and self.kv.state_backup(seq.seq_id) is not None:
            self._rewound.add(seq.seq_id)
        if seq.draft is not None:
            seq.draft.acceptance.record(proposed, num_accepted)
        self._drop_drafts(seq, proposed - num_accepted)
        seq.num_draft_tokens = 0
        self.kv.truncate(seq.seq_id, seq.num_tokens)

    def _preempt(self, seq: Sequence) -> None:
        self._drop_drafts(seq, seq.num_draft_tokens)
        self._rewound.discard(seq.seq_id)  # recomputed from token 0 or a snapshot
        self.kv.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def update(self, output: SchedulerOutput, seqs: dict[str, Sequence]) -> None:
        """Advance progress counters after the step ran; register newly full blocks."""
        kv = self.kv
        for s in output.scheduled:
            seq = seqs[s.seq_id]
            # min: rejected proposals were computed but are no longer tokens (settle)
            done = min(s.start + len(s.token_ids), len(seq.token_ids))
            seq.num_computed_tokens = done = s.start if s.seq_id in self._rewound else done
            kv.cache_full_blocks(seq.seq_id, seq.token_ids, done)
            if not self._blocks_only:
                kv.release_out_of_window(seq.seq_id, done)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
            self._running_changes += 1
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        self._rewound.discard(seq.seq_id)
        self.kv.free(seq.seq_id)
        if self.proposer is not None and seq.draft is not None:
            self.proposer.forget(seq.draft)
