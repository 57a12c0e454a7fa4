"""The KV block pool: ref-counts, an LRU free queue and the prefix-cache hash map.

Plain Python, no torch: a block is an id into the runner's KV tensors; this module only
decides which ids are in use, which are free, and which free ones still hold reusable KV.

Prefix keys and collisions
--------------------------
A full block's key is ``hash_block_tokens(parent_key, token_ids)``: Python's 64-bit hash of
``(parent_key, token_ids)``, so it depends on every token before it. Two different prefixes can
still share a key, so a key is only ever a hint:

* A lookup re-checks that the cached block holds exactly the query's token ids and that its
  parent is exactly the block matched one step earlier. Every cached block gets a fresh
  ``content_id`` when it is registered, and a child records its parent's ``content_id``; matching
  block by block from the first one therefore verifies the whole prefix, never just a key.
* On insert, a key that is already taken keeps its first block. If that block holds the same
  content (same tokens, same parent) the newcomer is a duplicate and the caller links to the
  existing one; if not, it is a true collision and the caller stops caching that sequence.

A collision can cost a cache miss, never wrong KV.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

_ROOT_KEY = 0x6B766C6162  # parent key of a sequence's first block ("kvlab")


def hash_block_tokens(parent_key: int | None, token_ids: tuple[int, ...]) -> int:
    """Prefix key of a full block: depends on its tokens and, via parent_key, on all before."""
    return hash((_ROOT_KEY if parent_key is None else parent_key, token_ids))


@dataclass
class Block:
    """One KV block's bookkeeping. Content fields are set only while it is in the hash map."""

    block_id: int
    ref_count: int = 0
    key: int | None = None  # prefix key, while cached
    token_ids: tuple[int, ...] | None = None  # the block_size tokens its KV was computed for
    content_id: int | None = None  # unique per registration: what children link to
    parent_content_id: int | None = None  # the parent's content_id; None for a first block

    @property
    def is_cached(self) -> bool:
        return self.key is not None

    def matches(self, token_ids: tuple[int, ...], parent_content_id: int | None) -> bool:
        return self.token_ids == token_ids and self.parent_content_id == parent_content_id

    def clear_content(self) -> None:
        self.key = self.token_ids = self.content_id = self.parent_content_id = None


class BlockPool:
    """Fixed set of KV blocks shared by all sequences.

    Free queue order is eviction order (head first). Freed blocks that hold cached KV go to the
    tail, so the least recently used cached block is evicted first; freed blocks with nothing
    worth keeping go to the head, so they are reused before any cached block.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # prefix key -> block id
        self._content_ids = itertools.count()
        self.high_water = 0  # 1 + the highest block id ever handed out: fresh ids start here

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no reference: truly empty ones plus evictable cached ones."""
        return len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self.blocks[block_id].ref_count

    def is_cached(self, block_id: int) -> bool:
        return self.blocks[block_id].is_cached

    def free_queue(self) -> list[int]:
        """Free block ids in eviction order (for tests and debugging)."""
        return list(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take n blocks from the head of the free queue, evicting any cached KV they hold."""
        if n > len(self._free):
            raise ValueError(f"asked for {n} blocks, only {len(self._free)} free")
        ids = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_count = 1
            ids.append(block_id)
            self.high_water = max(self.high_water, block_id + 1)
        return ids

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on each block, reviving cached blocks that sat in the free queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference on each block, in the given order; ref 0 returns it to the queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise ValueError(f"block {block_id} freed more times than it was referenced")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if not block.is_cached:
                    self._free.move_to_end(block_id, last=False)

    def lookup(
        self, key: int, token_ids: tuple[int, ...], parent_content_id: int | None
    ) -> Block | None:
        """The cached block holding exactly these tokens after that parent, or None."""
        block_id = self._cached.get(key)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        return block if block.matches(token_ids, parent_content_id) else None

    def cache_block(
        self, block_id: int, key: int, token_ids: tuple[int, ...], parent_content_id: int | None
    ) -> int | None:
        """Register a full, computed block under key; return the content_id to link children to.

        Returns the existing entry's content_id when the same content is already cached (the
        block stays an uncached duplicate), and None on a true key collision.
        """
        if len(token_ids) != self.block_size:
            raise ValueError(f"only full blocks are cached: {len(token_ids)} != {self.block_size}")
        existing = self._cached.get(key)
        if existing is not None:
            other = self.blocks[existing]
            return other.content_id if other.matches(token_ids, parent_content_id) else None
        block = self.blocks[block_id]
        if block.is_cached:
            raise ValueError(f"block {block_id} is already cached under another key")
        block.key, block.token_ids = key, token_ids
        block.content_id, block.parent_content_id = next(self._content_ids), parent_content_id
        self._cached[key] = block_id
        return block.content_id

    def _evict(self, block: Block) -> None:
        if block.key is not None:
            del self._cached[block.key]
        block.clear_content()
