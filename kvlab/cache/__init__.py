"""Paged KV cache bookkeeping: the block pool, prefix hashing and per-sequence block tables.

Plain Python, no torch: the runner owns the KV tensors; this package owns which block ids
each sequence uses and which free blocks still hold reusable prefix KV.
"""

from kvlab.cache.block_pool import Block, BlockPool, hash_block_tokens
from kvlab.cache.kv_cache_manager import KVCacheManager, PrefixStats

__all__ = ["Block", "BlockPool", "KVCacheManager", "PrefixStats", "hash_block_tokens"]
