"""Blocks of the sliding-window layers: each sequence holds only the blocks a query still sees.

Plain Python, no torch. Sliding-window layers (Gemma 3's local layers, Mistral's) attend to
the last `window` keys only, so once a sequence has moved on, its older blocks in those
layers are dead weight. They live in a pool of their own, beside the full-attention pool
that KVCacheManager keeps; a sequence's window table has the same logical blocks as its
full table, but the ones out of every future query's reach are released (None).

    window 8, block_size 4; the next query is at position 14, so it sees keys 7..14
    position         0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13 14
    full table       [  3    ,    9    ,     4     ,    1    ]
    window table     [ None  ,    6    ,     2     ,    8    ]   block 0 released

Released blocks keep their prefix key (the full block's key, so one prefix hash serves both
pools) and sit in the pool's free queue like any cached block until they are reused. A
prefix hit of N tokens is only usable when the window blocks of positions
[N - window + 1, N) are still cached: the first query computed after the hit reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.cache.block_pool import Block, BlockPool


@dataclass(frozen=True)
class WindowSpec:
    """How many positions a sliding layer's query sees (itself included) and the pool size."""

    window: int
    num_blocks: int


class WindowBlocks:
    """Per-sequence window tables over their own block pool."""

    def __init__(self, spec: WindowSpec, block_size: int, enable_prefix_caching: bool) -> None:
        if spec.window < 1:
            raise ValueError(f"a sliding window of {spec.window} positions (need >= 1)")
        self.pool = BlockPool(spec.num_blocks, block_size, enable_prefix_caching)
        self.window, self.block_size = spec.window, block_size
        self._tables: dict[str, list[int | None]] = {}
        self._registered: dict[str, int] = {}  # seq -> how many leading blocks were cached

    def first_block(self, position: int) -> int:
        """Logical block holding the oldest key a query at `position` can see."""
        return max(0, position - self.window + 1) // self.block_size

    def usable_prefix(self, hit: list[Block]) -> int:
        """How many of a prefix hit's full blocks can be used: the longest k such that the
        window blocks a query at position k * block_size reads are all still cached."""
        cached = [self._lookup(b) is not None for b in hit]
        for k in range(len(hit), 0, -1):
            if all(cached[self.first_block(k * self.block_size):k]):
                return k
        return 0

    def _lookup(self, full_block: Block) -> Block | None:
        """The window block cached beside this cached full block, or None."""
        if full_block.key is None or full_block.token_ids is None:
            return None
        return self.pool.lookup(full_block.key, full_block.token_ids, full_block.content_id)

    def _hits(self, hit: list[Block]) -> list[int]:
        """The window blocks a hit reuses: those from the first block its next query sees."""
        blocks = [self._lookup(b) for b in hit[self.first_block(len(hit) * self.block_size):]]
        if None in blocks:
            raise ValueError("a computed block's window KV is no longer cached: call "
                             "allocate_slots right after get_computed_blocks")
        return [b.block_id for b in blocks if b is not None]

    def can_allocate(self, seq_id: str, num_blocks: int, hit: list[Block]) -> bool:
        """Room to grow seq_id's table to num_blocks (a new sequence starts after `hit`)."""
        table = self._tables.get(seq_id)
        if table is not None:
            return num_blocks - len(table) <= self.pool.num_free_blocks
        reviving = sum(1 for b in self._hits(hit) if self.pool.ref_count(b) == 0)
        return num_blocks - len(hit) <= self.pool.num_free_blocks - reviving

    def allocate(self, seq_id: str, num_blocks: int, hit: list[Block]) -> None:
        """Grow seq_id's window table to num_blocks; call can_allocate first."""
        table = self._tables.get(seq_id)
        if table is None:
            hits = self._hits(hit)
            self.pool.touch(hits)  # before allocate, so these are not evicted by it
            table = self._tables[seq_id] = [None] * (len(hit) - len(hits)) + hits
            self._registered[seq_id] = len(hit)  # the hit's blocks are cached already
        table.extend(self.pool.allocate(max(0, num_blocks - len(table))))

    def table(self, seq_id: str) -> list[int | None] | None:
        table = self._tables.get(seq_id)
        return list(table) if table is not None else None

    def register(self, seq_id: str, keys: list[int], links: list[int],
                 token_ids: list[int]) -> None:
        """Cache seq_id's window blocks beside its cached full blocks: block i under the
        full block's prefix key keys[i], linked to that block's content_id links[i]."""
        table = self._tables.get(seq_id)
        if table is None:
            return
        bs, done = self.block_size, min(len(keys), len(table))
        for i in range(self._registered[seq_id], done):
            if table[i] is not None:
                tokens = tuple(token_ids[i * bs:(i + 1) * bs])
                self.pool.cache_block(table[i], keys[i], tokens, links[i])
        self._registered[seq_id] = max(self._registered[seq_id], done)

    def release_before(self, seq_id: str, position: int) -> None:
        """Release the blocks no query from `position` on can see."""
        table = self._tables.get(seq_id)
        if table is None:
            return
        for i in range(min(self.first_block(position), len(table))):
            if table[i] is not None:
                self.pool.free([table[i]])
                table[i] = None

    def truncate(self, seq_id: str, num_blocks: int) -> None:
        """Release seq_id's window blocks from logical block num_blocks on, tail first."""
        table = self._tables.get(seq_id)
        if table is not None and num_blocks < len(table):
            self.pool.free([b for b in reversed(table[num_blocks:]) if b is not None])
            del table[num_blocks:]

    def free(self, seq_id: str) -> None:
        """Release all of seq_id's window blocks, tail first."""
        table = self._tables.pop(seq_id, None)
        self._registered.pop(seq_id, None)
        if table is not None:
            self.pool.free([b for b in reversed(table) if b is not None])
