"""How many KV blocks each pool gets from the cache's memory budget.

Plain Python, no torch. Without sliding-window layers there is one pool, as large as the
budget allows (and no larger than max_num_seqs full-length sequences could use). With them,
the window pool is sized first, by what running sequences can hold at once, and the full
pool gets the rest:

    per running sequence   ceil((window - 1) / block_size) + 2 blocks (the window, the
                           block being written, one more for a window that straddles)
    the step's new tokens  ceil(max_num_batched_tokens / block_size) + 1 blocks
    prefix-cache reserve   as much again, for window blocks a later prompt may reuse

but never more blocks than one shared pool would have had.

A hybrid model's recurrent states come off the budget first: one state slot per sequence
that may run at once (max_num_seqs), each the recurrent layers' fixed-size state, and the
prefix cache's state snapshots where asked for, as long as slots and snapshots together
take at most half the budget (else no snapshots: no prefix cache); the pools share what is
left.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvlab.cache.state_slots import SnapshotSpec
from kvlab.cache.window_blocks import WindowSpec
from kvlab.config import ModelConfig
from kvlab.errors import KvlabError


@dataclass(frozen=True)
class PoolSizes:
    num_blocks: int  # the full-attention layers' pool (every layer's, without a window pool)
    window: WindowSpec | None  # the sliding-window layers' pool; None: they share the above
    state_slots: int = 0  # sequences the recurrent layers hold a state for (0: none)
    snapshots: SnapshotSpec | None = None  # their prefix cache's saved states, if any


@dataclass(frozen=True)
class CacheBudget:
    bytes_per_element: float
    block_size: int
    memory_bytes: float
    max_num_seqs: int
    max_num_batched_tokens: int
    state_snapshots: int = 0  # hybrid models: snapshot rows wanted for the prefix cache
    snapshot_every_blocks: int = 16  # and how far apart, in full blocks
    state_backups: bool = False  # speculation: a backup row per slot (KVCacheManager)


def pool_sizes(config: ModelConfig, budget: CacheBudget, windowed: bool) -> PoolSizes:
    """Blocks per pool and state slots; windowed=False keeps one pool for all attention
    layers. The window pool never has more blocks than one shared pool would, so the full
    pool never has fewer."""
    slots = budget.max_num_seqs if config.recurrent is not None else 0
    per_seq = config.state_bytes_per_seq()
    snaps = budget.state_snapshots if slots else 0
    if (slots + snaps) * per_seq > budget.memory_bytes / 2:
        snaps = 0
    spec = SnapshotSpec(snaps, budget.snapshot_every_blocks) if snaps else None
    backups = slots if budget.state_backups else 0
    state_bytes = (slots + snaps + backups) * per_seq
    if state_bytes >= budget.memory_bytes:
        raise KvlabError(
            f"the recurrent states of {slots} sequences take {state_bytes / 2**30:.3f} GiB, "
            f"more than the {budget.memory_bytes / 2**30:.3f} GiB cache budget: raise the KV "
            "cache size or lower max sequences")
    rest = dataclasses.replace(budget, memory_bytes=budget.memory_bytes - state_bytes)
    return dataclasses.replace(_block_pools(config, rest, windowed), state_slots=slots,
                               snapshots=spec)


def _block_pools(config: ModelConfig, budget: CacheBudget, windowed: bool) -> PoolSizes:
    bs = budget.block_size
    by_need = -(-config.max_position_embeddings * budget.max_num_seqs // bs)
    shared_block = config.kv_bytes_per_token(budget.bytes_per_element) * bs
    shared = max(1, min(int(budget.memory_bytes / shared_block), by_need))
    if not windowed or config.num_sliding_layers == 0:
        return PoolSizes(shared, None)
    window = config.sliding_window
    assert window is not None  # num_sliding_layers > 0
    running = (budget.max_num_seqs * (-(-(window - 1) // bs) + 2)
               + -(-budget.max_num_batched_tokens // bs) + 1)
    num_window = min(2 * running, shared)
    rest = (budget.memory_bytes
            - num_window * config.kv_bytes_per_token(budget.bytes_per_element, sliding=True) * bs)
    full_block = config.kv_bytes_per_token(budget.bytes_per_element, sliding=False) * bs
    num_blocks = by_need if full_block == 0 else min(int(rest / full_block), by_need)
    return PoolSizes(max(shared, num_blocks), WindowSpec(window, num_window))
