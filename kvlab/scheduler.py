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
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from kvlab.cache import KVCacheManager
from kvlab.request import SamplingParams


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

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


@dataclass(frozen=True)
class ScheduledSeq:
    seq_id: str
    start: int  # num_computed_tokens before this step
    token_ids: list[int]  # the tokens computed this step: positions [start, start + len)
    block_table: list[int]
    needs_logits: bool  # this step reaches the end of its known tokens: sample one
    prefill_tokens: int  # how many of token_ids are prompt tokens
    # its blocks in the sliding-window layers' pool, None where released; None without one
    window_table: list[int | None] | None = None
    # its row in the recurrent layers' state tensors; None without such layers
    state_slot: int | None = None


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    preempted: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config, self.kv = config, kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        preempted: list[str] = []
        budget = self._schedule_running(budget, scheduled, preempted)
        if not preempted:
            self._schedule_waiting(budget, scheduled)
        return SchedulerOutput([self._describe(s, n) for s, n in scheduled], preempted)

    def _schedule_running(self, budget: int, scheduled: list[tuple[Sequence, int]],
                          preempted: list[str]) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.kv.allocate_slots(seq.seq_id, seq.num_computed_tokens + n):
                victim = self.running.pop()  # the newest sequence gives its blocks back
                self._preempt(victim)
                preempted.append(victim.seq_id)
                if victim is seq:
                    return budget
            scheduled.append((seq, n))
            budget -= n
            i += 1
        return budget

    def _schedule_waiting(self, budget: int, scheduled: list[tuple[Sequence, int]]) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            blocks, num_cached = self.kv.get_computed_blocks(seq.token_ids)
            n = min(seq.num_tokens - num_cached, budget)
            if not self.kv.allocate_slots(seq.seq_id, num_cached + n, blocks):
                return
            self.waiting.popleft()
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_cached
            seq.num_computed_tokens = num_cached
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            scheduled.append((seq, n))
            budget -= n

    def _describe(self, seq: Sequence, n: int) -> ScheduledSeq:
        start = seq.num_computed_tokens
        end = start + n
        return ScheduledSeq(
            seq.seq_id, start, seq.token_ids[start:end], self.kv.block_table(seq.seq_id),
            needs_logits=end == seq.num_tokens,
            prefill_tokens=max(0, min(end, seq.num_prompt_tokens) - start),
            window_table=self.kv.window_table(seq.seq_id),
            state_slot=self.kv.state_slot(seq.seq_id))

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def update(self, output: SchedulerOutput, seqs: dict[str, Sequence]) -> None:
        """Advance progress counters after the step ran; register newly full blocks."""
        for s in output.scheduled:
            seq = seqs[s.seq_id]
            seq.num_computed_tokens = s.start + len(s.token_ids)
            self.kv.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
            self.kv.release_out_of_window(seq.seq_id, seq.num_computed_tokens)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        self.kv.free(seq.seq_id)
