"""SchedulerOutput -> tensors -> logits. Owns the paged KV tensors.

The KV pool is one store per layer (kvlab.models.kv_store) of num_blocks * block_size slots,
plus one block of scratch slots for padding rows, allocated once; its pages only become
resident when written. Given a window pool (num_window_blocks), the sliding-window layers'
stores have that many blocks instead, addressed through each sequence's window table. On CUDA, pure decode steps replay captured graphs (decode_graph).

A hybrid model's recurrent layers have no KV store (None in kv_caches); the runner holds
their states (kvlab.models.state_store) with num_state_slots rows (the sequences' slots, then
the prefix cache's snapshots, then with speculation a backup row per slot), zeroes a
sequence's row when it starts from token 0, copies a snapshot or backup in or out where the
step says, and passes the step's rows to the model.

A step's input tensors come from the persistent batch (persistent_batch): block-table rows
kept across steps, so a decode step's host work does not grow with each sequence's context.
A sequence with proposed tokens (speculative decoding) gets a logits row at each of them
(ScheduledSeq.num_logits, StepLogits.counts), and each is one decode row there.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kvlab.config import ModelConfig
from kvlab.models.attention import SeqSpan, build_metadata
from kvlab.models.kv_store import kv_bytes_per_element, make_kv
from kvlab.models.layers import rms_norm
from kvlab.models.state_store import RecurrentStates, StateBatch
from kvlab.runner.decode_graph import GRAPH_MODES, DecodeGraphs
from kvlab.runner.kv_pager import KVPager
from kvlab.runner.persistent_batch import PersistentBatch
from kvlab.scheduler import SchedulerOutput

WIDE_STEP_TOKENS = 64  # steps this large give torch all threads (prefill attention)


@dataclass(frozen=True)
class StepLogits:
    seq_ids: list[str]  # the sequences that need a next token, in row order
    logits: torch.Tensor  # [len(seq_ids), vocab] fp32
    # asked for with record_experts on an MoE model: [len(seq_ids), moe layers, k], the
    # experts each logits row's token was routed to; else None
    experts: torch.Tensor | None = None
    # rows per sequence, in seq_ids order, where some sequence has several (a verify step:
    # ScheduledSeq.num_logits); None: one row each
    counts: list[int] | None = None
    # asked for (a multi-token-prediction proposer reads them): [step tokens, hidden], every
    # row's final hidden state before the final norm, in the step's token order; else None
    hidden: torch.Tensor | None = None


class ModelRunner:
    def __init__(self, model: object, config: ModelConfig, num_blocks: int, block_size: int,
                 kv_dtype: str = "f32", device: str = "cpu", quantized: bool = False,
                 graphs: str = "auto", max_batch: int = 16,
                 num_window_blocks: int | None = None, num_state_slots: int = 0) -> None:
        self.model, self.config = model, config
        self.block_size, self.num_blocks = block_size, num_blocks
        self.num_window_blocks = num_window_blocks
        self.device = torch.device(device)
        self.kv_dtype = kv_dtype
        # no store for recurrent layers, nor for layers that read another layer's KV
        self.kv_caches = [make_kv(kv_dtype, self._num_slots(i), config.layer_kv_heads(i),
                                  config.layer_head_dim(i), self.device, config.mla)
                          if config.owns_kv(i) else None for i in range(config.num_layers)]
        if config.recurrent is not None and num_state_slots < 1:
            raise ValueError(f"{config.architecture} has recurrent layers: give the runner "
                             "state slots (num_state_slots >= 1)")
        self.states = (RecurrentStates(config, num_state_slots, self.device)
                       if config.recurrent is not None else None)
        self.batch = PersistentBatch(block_size, config.sliding_window, num_window_blocks,
                                     self.device)
        self.input_seconds = 0.0  # host time all steps so far spent building their inputs
        self.kernel_decode = self.device.type == "cpu" and quantized
        self.threads = torch.get_num_threads()
        if self.kernel_decode:
            torch.set_num_threads(1)
        self.graphs = self._decode_graphs(graphs, max_batch)
        self.pager = self._pager() if self.device.type == "cpu" else None
        if self.pager is not None:  # its thread holds the KV tensors until it stops
            weakref.finalize(self, self.pager.close)

    def _pager(self) -> KVPager:
        """The KV pager over this runner's stores, grouped by pool as high_water lists them:
        the main pool's layers, then the sliding-window pool's, if any."""
        own = [self.num_window_blocks is not None and self.config.is_sliding(i)
               for i in range(self.config.num_layers)]
        pools = [[t for c, w in zip(self.kv_caches, own) if w == win and c is not None
                  for t in c.tensors()]
                 for win in ((False, True) if any(own) else (False,))]
        slots = [self.num_blocks * self.block_size]
        if any(own):
            slots.append(self.num_window_blocks * self.block_size)
        return KVPager(pools, slots, self.block_size)

    def page_ahead(self, high_water: list[int]) -> None:
        """Have the pager fault in KV pages past each pool's high-water mark (kv_pager)."""
        if self.pager is not None:
            self.pager.follow(high_water)

    def _num_slots(self, layer: int) -> int:
        """Slots of one layer's store: its pool's blocks plus a scratch block (the last) for
        padding rows and positions behind a window."""
        own = self.num_window_blocks is not None and self.config.is_sliding(layer)
        return ((self.num_window_blocks if own else self.num_blocks) + 1) * self.block_size

    def _decode_graphs(self, mode: str, max_batch: int) -> DecodeGraphs | None:
        if mode not in GRAPH_MODES:
            raise ValueError(f"graphs={mode!r} (valid: {', '.join(GRAPH_MODES)})")
        # MoE layers choose their experts on the host (.tolist()): no graph can capture that;
        # graphs replay attention-only steps, with no recurrent states
        capture = self.device.type == "cuda" and self.config.moe is None
        if mode == "off" or (mode == "auto" and not capture) or self.states is not None:
            return None
        width = min(self.num_blocks * self.block_size, self.config.max_position_embeddings)
        return DecodeGraphs(self.model, self.config, self.kv_caches,
                            self.num_blocks * self.block_size, self.device, max_batch, width,
                            capture=capture and mode == "auto")

    def reserve_kv(self, tokens: int | None = None) -> None:
        """Touch the whole KV pool, as llama.cpp clears its cache buffer at start; or, with
        `tokens`, the slots a first sequence of that many tokens gets (a pool hands out its
        blocks from the front) and the scratch block (the last: padding rows)."""
        if tokens is None:
            first, last = None, 0
        else:
            first, last = -(-tokens // self.block_size) * self.block_size, self.block_size
        for cache in self.kv_caches:
            if cache is not None:
                cache.reserve(first, last)

    @property
    def kv_bytes_per_token(self) -> int:
        return int(self.config.kv_bytes_per_token(kv_bytes_per_element(self.kv_dtype)))

    def execute(self, out: SchedulerOutput, record_experts: bool = False,
                logits: bool = True, hidden: bool = False,
                input_ids: torch.Tensor | None = None) -> StepLogits:
        """Run one step. With quantized weights, torch stays on one thread between wide
        steps: the C kernels bring their own threads, and torch's OpenMP workers would
        otherwise compete with them for the same cores. Wide (prefill) steps give torch all
        threads for their attention products. logits=False stops at the hidden states (a
        tensor-parallel rank other than 0): the result then has no rows. hidden=True also
        returns every row's hidden state (StepLogits.hidden). input_ids: [T] on the device,
        the step's token ids in place of its ScheduledSeqs' (a step scheduled ahead)."""
        record = record_experts and self.config.moe is not None
        with self._torch_threads(out.num_tokens):
            return self._execute(out, record, logits, hidden, input_ids)

    @contextmanager
    def _torch_threads(self, num_tokens: int) -> Iterator[None]:
        """All threads for torch while a wide step runs (see execute), one otherwise; on
        CUDA the runner's device is made current (Triton launches on the current device,
        which need not be this runner's)."""
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                yield
            return
        if not self.kernel_decode or num_tokens < WIDE_STEP_TOKENS:
            yield
            return
        torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            torch.set_num_threads(1)

    def final_hidden(self, prompts: list[list[int]]) -> torch.Tensor:
        """Whole prompts in one pass -> final hidden states [sum(len), hidden] fp32 (after
        the final norm), for embeddings. A decoder attends causally over a K/V store of its
        own, fp32 and sized to these tokens, dropped on return: the paged pool and its
        blocks are untouched. Every layer shares that one store: a layer reads only the K/V
        it has just written, before the next layer overwrites them. An encoder
        (config.causal False) attends bidirectionally."""
        lengths = [len(p) for p in prompts]
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(n) for n in lengths]).to(self.device)
        with self._torch_threads(len(ids)), torch.inference_mode():
            if not self.config.causal:
                return self.model.forward(ids, positions, lengths)
            c, offset, spans = self.config, 0, []
            for n in lengths:  # each sequence's slots: the next n of the store
                spans.append(SeqSpan(0, n, torch.arange(offset, offset + n)))
                offset += n
            stores = [make_kv("f32", offset, c.num_kv_heads, c.head_dim, self.device, c.mla)]
            stores *= c.num_layers
            meta = build_metadata(spans, c.sliding_window, self.device)
            if c.recurrent is None:
                hidden = self.model.forward(ids, positions, stores, meta)
            else:  # states of their own too, fresh: row i for prompt i
                states = RecurrentStates(c, len(prompts), self.device)
                hidden = self.model.forward(ids, positions, stores, meta,
                                            states=states.batch(list(range(len(prompts))),
                                                                lengths))
            return rms_norm(hidden, self.model.weights["norm"], c.rms_norm_eps).float()

    def close(self) -> None:
        """Stop the KV pager; a tensor-parallel runner also stops its group."""
        if self.pager is not None:
            self.pager.close()

    def _execute(self, out: SchedulerOutput, record_experts: bool,
                 want_logits: bool = True, want_hidden: bool = False,
                 input_ids: torch.Tensor | None = None) -> StepLogits:
        if self.graphs is not None and not want_hidden and self.graphs.accepts(out):
            logits = self.graphs.run(out, self.block_size, self.batch.tables(out), input_ids)
            return StepLogits([s.seq_id for s in out.scheduled], logits)
        began = time.perf_counter()
        step = self.batch.inputs(out, input_ids)
        self.input_seconds += time.perf_counter() - began
        ids_t, pos_t, meta = step.ids, step.positions, step.meta
        trace: list[torch.Tensor] | None = [] if record_experts else None
        extra = {} if self.states is None else {"states": self._step_states(out)}
        with torch.inference_mode():
            if trace is None:
                hidden = self.model.forward(ids_t, pos_t, self.kv_caches, meta, **extra)
            else:
                hidden = self.model.forward(ids_t, pos_t, self.kv_caches, meta, trace, **extra)
            if self.states is not None:  # the states at snapshot boundaries, for prefix hits
                saved = [s for s in out.scheduled if s.state_save is not None]
                self.states.copy([s.state_slot for s in saved], [s.state_save for s in saved])
            rows, seq_ids, counts = (_logit_rows(out, step.seq_ids) if want_logits
                                     else ([], [], []))
            kept = hidden if want_hidden else None
            if not seq_ids:
                return StepLogits([], hidden.new_empty(0, self.config.vocab_size), hidden=kept)
            index = None if rows is None else torch.tensor(rows, dtype=torch.long,
                                                           device=self.device)
            logits = self.model.logits(hidden if index is None else
                                       hidden.index_select(0, index))
        experts = None
        if trace:
            experts = torch.stack(trace, dim=1)
            experts = experts if index is None else experts[index.cpu()]
        several = rows is not None and len(rows) > len(seq_ids)
        return StepLogits(seq_ids, logits, experts, counts if several else None, kept)

    def _step_states(self, out: SchedulerOutput) -> StateBatch:
        """The step's rows of the recurrent states; a sequence that starts from token 0
        starts from a zero state, a prefix hit from its snapshot, a rewound sequence from
        its backup; a verify step backs its state up first."""
        assert self.states is not None
        missing = [s.seq_id for s in out.scheduled if s.state_slot is None]
        if missing:
            raise ValueError(f"{missing[0]!r} has no state slot: {self.config.architecture} "
                             "has recurrent layers (KVCacheManager with state_slots)")
        self.states.zero([s.state_slot for s in out.scheduled if s.start == 0])
        restored = [s for s in out.scheduled if s.state_restore is not None]
        self.states.copy([s.state_restore for s in restored], [s.state_slot for s in restored])
        verifying = [s for s in out.scheduled if s.state_backup is not None]
        self.states.copy([s.state_slot for s in verifying], [s.state_backup for s in verifying])
        return self.states.batch([s.state_slot for s in out.scheduled],
                                 [len(s.token_ids) for s in out.scheduled])


def _logit_rows(out: SchedulerOutput, seq_ids: list[str] | None = None
                ) -> tuple[list[int] | None, list[str], list[int]]:
    """The packed rows that need logits (None: every row, one per sequence, as in a
    decode step), the sequences they belong to and how many rows each has. `seq_ids`: the
    scheduled sequences' ids in order, where the caller has them."""
    if out.decode or (out.num_tokens == len(out.scheduled)
                       and all(s.needs_logits for s in out.scheduled)):
        return None, seq_ids or [s.seq_id for s in out.scheduled], []
    rows, seq_ids, counts, row = [], [], [], 0
    for s in out.scheduled:
        row += len(s.token_ids)
        if s.needs_logits:
            rows.extend(range(row - s.num_logits, row))
            seq_ids.append(s.seq_id)
            counts.append(s.num_logits)
    return rows, seq_ids, counts
