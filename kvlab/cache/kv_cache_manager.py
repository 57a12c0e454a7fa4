"""Per-sequence block tables over the block pool: allocation, prefix reuse, slot mapping.

Plain Python, no torch. The scheduler asks it for room; the runner reads block tables and
slot mappings from it to address the paged KV tensors.

Block table and slot mapping (block_size = 4, a sequence of 10 tokens)::

    token position   0 1 2 3 | 4 5 6 7 | 8 9 . .
    logical block       0    |    1    |    2
    block table  [7, 2, 5]:  logical block i lives in physical block table[i]
    physical block      7    |    2    |    5
    slot = table[pos // 4] * 4 + pos % 4
                    28..31   |  8..11  | 20 21

Blocks 0 and 1 are full; once their tokens are computed they can be registered in the prefix
cache. Block 2 is partial and never is: its KV is still being written.

A model with sliding-window layers gets a second table per sequence for those layers
(kvlab.cache.window_blocks): same logical blocks, its own pool, and the blocks behind the
window released as the sequence moves on.

A hybrid model's recurrent layers get one state slot per sequence instead
(kvlab.cache.state_slots): taken with the sequence's first blocks, given back with them.
A prefix hit must not skip tokens whose recurrent state this sequence never computed, so
its prefix cache needs state snapshots (StateSnapshots): a step is cut to end on a snapshot
boundary (every k-th block, and the prompt's last full block), the state there is saved,
as it is at each block boundary a decode step reaches (the sequence's tail snapshot, kept
when it is freed), and a hit is shortened to the deepest block that has one, from which the
sequence resumes. Without snapshots such a model has no prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvlab.cache.block_pool import BlockPool, hash_block_tokens
from kvlab.cache.state_slots import SnapshotSpec, StateSlots, StateSnapshots
from kvlab.cache.window_blocks import WindowBlocks, WindowSpec


@dataclass
class PrefixStats:
    """Prompt tokens looked up in the prefix cache and how many were found."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass
class _SeqBlocks:
    """One sequence's block table and the prefix chain of its cached full blocks."""

    table: list[int] = field(default_factory=list)
    cached_keys: list[int] = field(default_factory=list)  # key of each cached block, in order
    cached_links: list[int] = field(default_factory=list)  # content_id to link the next block to
    chain_broken: bool = False  # a key collision: later blocks of this sequence stay uncached


class KVCacheManager:
    """Owns which KV blocks each sequence (by id) uses, and the prefix cache over them."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 window: WindowSpec | None = None, state_slots: int = 0,
                 snapshots: SnapshotSpec | None = None, state_backups: bool = False):
        """state_slots: how many sequences the recurrent layers can hold (0: no such
        layers); with any, the prefix cache needs `snapshots` (rows numbered after the
        slots') and is off without them (see the module docstring). state_backups: each
        slot has a backup row too (after the snapshots' rows), which a speculative verify
        step copies its state into first, to take back rejected proposals."""
        enable_prefix_caching = enable_prefix_caching and (state_slots == 0 or
                                                           snapshots is not None)
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        self.window = (WindowBlocks(window, block_size, enable_prefix_caching)
                       if window is not None else None)
        self.states = StateSlots(state_slots) if state_slots else None
        self.snapshots = (StateSnapshots(snapshots, state_slots, block_size)
                          if state_slots and snapshots is not None and enable_prefix_caching
                          else None)
        # rows: [slots | snapshot rows | backup rows, one per slot]
        rows = state_slots + (snapshots.num_rows if snapshots is not None else 0)
        self.num_state_rows = rows + (state_slots if state_backups else 0)
        self._backup_base = rows if state_backups and state_slots else None
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_stats = PrefixStats()
        self._seqs: dict[str, _SeqBlocks] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def blocks_only(self) -> bool:
        """Sequences hold a block table alone: no window table, state slot or snapshot."""
        return self.window is None and self.states is None and self.snapshots is None

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some sequence (evictable cached ones count as free)."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def high_water(self) -> list[int]:
        """Each pool's high-water mark (BlockPool.high_water): the main pool's, then the
        sliding-window pool's where there is one."""
        window = [self.window.pool.high_water] if self.window is not None else []
        return [self.pool.high_water, *window]

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, token_ids: list[int]) -> tuple[list[int], int]:
        """Longest chain of cached full blocks that starts this prompt, and its token count.

        Never covers the whole prompt: the last token must be computed to produce logits, so at
        most (len - 1) // block_size blocks. Takes no references; pass the blocks straight to
        allocate_slots. Each call counts the prompt in prefix_stats, so call it once per
        admission attempt.
        """
        if not self.enable_prefix_caching:
            return [], 0
        bs = self.block_size
        hit = []
        key: int | None = None
        link: int | None = None
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            key = hash_block_tokens(key, tokens)
            block = self.pool.lookup(key, tokens, link)
            if block is None:
                break
            hit.append(block)
            link = block.content_id
        if self.window is not None:
            hit = hit[:self.window.usable_prefix(hit)]
        if self.snapshots is not None:  # resumable only where a state was saved
            hit = hit[:self.snapshots.usable([b.content_id for b in hit])]
        blocks = [b.block_id for b in hit]
        num_tokens = len(blocks) * bs
        self.prefix_stats.queries += len(token_ids)
        self.prefix_stats.hits += num_tokens
        return blocks, num_tokens

    def allocate_slots(
        self, seq_id: str, num_total_tokens: int, computed_blocks: list[int] | None = None
    ) -> bool:
        """Grow seq_id's block table to cover num_total_tokens tokens.

        On the first call, computed_blocks (from get_computed_blocks) start the table and get a
        reference each, and a model with recurrent layers takes a state slot. Returns False
        and changes nothing when there are not enough free blocks or no free slot.
        """
        seq = self._seqs.get(seq_id)
        if (seq is not None and not computed_blocks
                and len(seq.table) * self.block_size >= num_total_tokens):
            return True  # its blocks hold them already (a decode step, mostly)
        computed = list(computed_blocks or [])
        if seq is not None and computed:
            raise ValueError(f"computed_blocks given for {seq_id!r}, which already has blocks")
        have = len(seq.table) if seq is not None else len(computed)
        num_new = max(0, self.num_blocks_for(num_total_tokens) - have)
        reviving = sum(1 for b in computed if self.pool.ref_count(b) == 0)
        self._check_still_cached(computed)
        if num_new > self.pool.num_free_blocks - reviving:
            return False
        if self.states is not None and not self.states.can_allocate(seq_id):
            return False
        hit = [self.pool.blocks[b] for b in computed]
        if self.window is not None:
            if not self.window.can_allocate(seq_id, have + num_new, hit):
                return False
            self.window.allocate(seq_id, have + num_new, hit)
        if seq is None:
            seq = self._seqs[seq_id] = _SeqBlocks()
            self.pool.touch(computed)  # before allocate, so these are not evicted by it
            seq.table.extend(computed)
            if self.states is not None:
                self.states.allocate(seq_id)
            if self.snapshots is not None and computed:
                self.snapshots.restore(seq_id, self.pool.blocks[computed[-1]].content_id)
        seq.table.extend(self.pool.allocate(num_new))
        return True

    def block_table(self, seq_id: str) -> list[int]:
        seq = self._seqs.get(seq_id)
        return list(seq.table) if seq is not None else []

    def state_slot(self, seq_id: str) -> int | None:
        """seq_id's row in the recurrent layers' state tensors, or None (no such layers)."""
        return self.states.slot(seq_id) if self.states is not None else None

    def state_backup(self, seq_id: str) -> int | None:
        """The backup row of seq_id's state slot, or None (no backups, or no slot)."""
        slot = self.state_slot(seq_id)
        return None if slot is None or self._backup_base is None else self._backup_base + slot

    def step_end(self, start: int, end: int, num_prompt_tokens: int) -> int:
        """Where a step over token positions [start, end) ends: with state snapshots, on the
        last snapshot boundary inside it (a shorter step), so its state can be saved."""
        if self.snapshots is None:
            return end
        return self.snapshots.cut(start, end, num_prompt_tokens)

    def state_copies(self, seq_id: str, end: int, num_prompt_tokens: int
                     ) -> tuple[int | None, int | None]:
        """(the snapshot row seq_id's step resumes from, the row it saves its state to when
        it ends at `end`: taken now, None where `end` is no boundary or no row is free);
        call once the step's blocks are allocated."""
        if self.snapshots is None:
            return None, None
        return (self.snapshots.restoring(seq_id),
                self.snapshots.reserve(seq_id, end, num_prompt_tokens))

    def window_table(self, seq_id: str) -> list[int | None] | None:
        """seq_id's blocks in the sliding-window layers' pool (None: released), or None
        when the model has no such layers."""
        return self.window.table(seq_id) if self.window is not None else None

    def release_out_of_window(self, seq_id: str, num_computed_tokens: int) -> None:
        """Free the window blocks that no query from num_computed_tokens on can see."""
        if self.window is not None:
            self.window.release_before(seq_id, num_computed_tokens)

    def slots(self, seq_id: str, start: int, end: int) -> list[int]:
        """KV slot of each token position in [start, end): block_id * block_size + offset."""
        table = self._seqs[seq_id].table if seq_id in self._seqs else []
        bs = self.block_size
        if not 0 <= start <= end <= len(table) * bs:
            raise IndexError(
                f"positions [{start}, {end}) of {seq_id!r} are outside its "
                f"{len(table)} blocks ({len(table) * bs} slots)"
            )
        return [table[pos // bs] * bs + pos % bs for pos in range(start, end)]

    def cache_full_blocks(self, seq_id: str, token_ids: list[int], num_computed_tokens: int) -> None:
        """Register seq_id's full blocks whose tokens are all computed in the prefix cache.

        token_ids are the sequence's tokens so far (prompt + output); a partial last block is
        never registered. Idempotent: blocks registered earlier are skipped.
        """
        seq = self._seqs.get(seq_id)
        if not self.enable_prefix_caching or seq is None:
            return
        bs = self.block_size
        num_full = min(num_computed_tokens, len(token_ids)) // bs
        if num_full <= len(seq.cached_keys) and self.blocks_only:
            return  # no block filled since the last call (most decode steps)
        self._register(seq_id, seq, token_ids, num_full)
        if self.snapshots is not None:
            self.snapshots.commit(seq_id, seq.cached_links, num_full)

    def _register(self, seq_id: str, seq: _SeqBlocks, token_ids: list[int],
                  num_full: int) -> None:
        if seq.chain_broken:
            return
        bs = self.block_size
        for i in range(len(seq.cached_keys), min(num_full, len(seq.table))):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            parent_key = seq.cached_keys[-1] if seq.cached_keys else None
            parent_link = seq.cached_links[-1] if seq.cached_links else None
            key = hash_block_tokens(parent_key, tokens)
            link = self.pool.cache_block(seq.table[i], key, tokens, parent_link)
            if link is None:
                seq.chain_broken = True
                break
            seq.cached_keys.append(key)
            seq.cached_links.append(link)
        if self.window is not None:
            self.window.register(seq_id, seq.cached_keys, seq.cached_links, token_ids)

    def truncate(self, seq_id: str, num_tokens: int) -> None:
        """Release seq_id's blocks past the first num_tokens tokens (rejected proposals'
        slots). Those blocks were never registered: only computed, verified tokens are."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            return
        keep = max(self.num_blocks_for(num_tokens), len(seq.cached_keys))
        if keep < len(seq.table):
            self.pool.free(list(reversed(seq.table[keep:])))
            del seq.table[keep:]
        if self.window is not None:
            self.window.truncate(seq_id, keep)

    def free(self, seq_id: str) -> None:
        """Release all of seq_id's blocks, tail first so its tail is evicted before its head."""
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self.pool.free(list(reversed(seq.table)))
        if self.window is not None:
            self.window.free(seq_id)
        if self.states is not None:
            self.states.free(seq_id)
        if self.snapshots is not None:  # after its last step: its blocks are registered
            self.snapshots.release(seq_id, seq.cached_links if seq is not None else [])

    def _check_still_cached(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            if not self.pool.is_cached(block_id):
                raise ValueError(
                    f"computed block {block_id} is no longer cached: call allocate_slots right "
                    "after get_computed_blocks, before any other allocation"
                )
