"""Paged attention over a flat slot pool, and the per-step metadata it reads.

Every sequence's keys and values live in `[num_slots, kv_heads, head_dim]` tensors, one
pair per layer; slot = block_id * block_size + offset. A step's new tokens from all
sequences are packed into one `[T, ...]` batch; the metadata says where each token's K/V
is written (slot_mapping) and which slots each sequence attends to.

    packed queries:  | seq0: 5 prompt tokens | seq1: 1 | seq2: 1 |
    seq0 keys:       slots of positions 0..4   (prefill: causal mask inside the chunk)
    seq1 keys:       slots of positions 0..n1  (decode: one query, all earlier keys)

Prefill sequences run one by one (one big product each); decode sequences run as one
padded batch so a step with many users costs one call per layer, not one per user.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from kvlab.kernels import fused
from kvlab.models.kv_store import Q8KV, FloatKV, LatentKV

KVStore = FloatKV | Q8KV | LatentKV


@dataclass(frozen=True)
class AttentionGroup:
    """Queries that share one attention call.

    rows:    [n] indices into the packed token batch
    slots:   [B, C] slot of each attended key (padding repeats a real slot, masked out)
    mask:    [B, Q, C] True where the query may attend to the key; None when every query
             sees every key (decode without padding), and for a prefill or a `padded`
             decode until `key_mask` builds it (the C path needs none)
    lengths: [B] keys each decode row sees (its first lengths[b] slots); None for prefill
    padded:  a decode group whose slots have columns some row must not see (rows of unequal
             lengths, or spare columns past the longest row), without a mask: `key_mask`
             builds it from the lengths
    fresh:   a prefill whose keys are exactly its own new tokens, causally (no cached
             prefix, the window wider than the chunk): attention may read them as computed
    prefill: a prefill chunk of one sequence (queries causal among themselves)
    start, first, window: a prefill's first query position, first key position (slots[0, 0])
             and sliding window (None: causal over everything before)
    """

    rows: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor | None
    num_seqs: int
    queries_per_seq: int
    lengths: torch.Tensor | None = None
    fresh: bool = False
    prefill: bool = False
    start: int = 0
    first: int = 0
    window: int | None = None
    padded: bool = False

    @cached_property
    def key_mask(self) -> torch.Tensor | None:
        """`mask`, built on first use for a prefill group (causal, inside the window) and a
        padded decode group (each row's first lengths[b] keys)."""
        if self.padded and self.lengths is not None:
            keys = torch.arange(self.slots.shape[1], device=self.lengths.device)
            return (keys[None, :] < self.lengths[:, None])[:, None].to(self.slots.device)
        if not self.prefill:
            return self.mask
        k_pos = torch.arange(self.first, self.start + self.queries_per_seq)
        q_pos = torch.arange(self.start, self.start + self.queries_per_seq)
        mask = k_pos[None, :] <= q_pos[:, None]
        if self.window is not None:
            mask &= (q_pos[:, None] - k_pos[None, :]) < self.window
        return mask[None].to(self.slots.device)


@dataclass(frozen=True)
class SeqSpan:
    """One sequence's part of a step: tokens [start, start + num_new) of its context."""

    start: int  # tokens already in the cache before this step
    num_new: int
    slots: torch.Tensor  # [start + num_new] slot of every position so far
    # [start + num_new] the same in the sliding-window layers' own pool (positions behind
    # the window point at its scratch block); None when those layers share `slots`
    window_slots: torch.Tensor | None = None

    @property
    def end(self) -> int:
        return self.start + self.num_new


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    groups_full: tuple[AttentionGroup, ...]
    groups_sliding: tuple[AttentionGroup, ...]
    # [T] the same for sliding-window layers with a pool of their own; None: slot_mapping
    slot_mapping_sliding: torch.Tensor | None = None

    def groups(self, sliding: bool) -> tuple[AttentionGroup, ...]:
        return self.groups_sliding if sliding else self.groups_full

    def write_slots(self, sliding: bool) -> torch.Tensor:
        """[T] where a layer of this kind writes the step's new K/V."""
        if sliding and self.slot_mapping_sliding is not None:
            return self.slot_mapping_sliding
        return self.slot_mapping


@dataclass(frozen=True)
class DecodeRows:
    """A step's one-token rows, laid out as whole-batch tensors by the caller (the runner's
    persistent batch) instead of one SeqSpan each. B rows; W, W' keys at most per row.

    rows:          [B] their offsets in the packed token batch, ascending
    write:         [B] slot where each row's new K/V go
    slots:         [B, W] slot of each key a row attends to, in position order; past
                   lengths[b], repeats the row's first key slot (masked, never NaN);
                   W >= width (the caller may keep spare columns, contiguous for C)
    lengths:       [B] keys each row sees
    width:         max(lengths): the columns any row reads
    window_*:      the same for sliding-window layers (their keys inside the window, and
                   their own pool's slots where they have one); None without such layers
    window_write:  [B] where those layers write, in their own pool; None: `write`
    uniform:       every row sees all `width` keys (lengths all equal): no padding, no mask
    """

    rows: torch.Tensor
    write: torch.Tensor
    slots: torch.Tensor
    lengths: torch.Tensor
    width: int
    window_slots: torch.Tensor | None = None
    window_lengths: torch.Tensor | None = None
    window_write: torch.Tensor | None = None
    uniform: bool = False


def step_metadata(spans: list[SeqSpan], offsets: list[int], decode: DecodeRows | None,
                  num_tokens: int, window: int | None, device: torch.device
                  ) -> AttentionMetadata:
    """build_metadata for a step whose one-token rows come as DecodeRows and whose other
    sequences come as spans starting at `offsets` in the packed batch (T = num_tokens)."""
    own = [s.window_slots is not None for s in spans]
    own_pool = decode.window_write is not None if decode is not None else any(own)
    if spans and (any(own) != all(own) or all(own) != own_pool):
        raise ValueError("either every row has window slots or none has")
    mapping = on_device(_packed_mapping(spans, offsets, decode, None, num_tokens), device)
    full = tuple(_prefill_group(s, o, None, device) for s, o in zip(spans, offsets))
    if decode is not None:
        full += (_full_rows_group(decode, device),)
    if not window:
        return AttentionMetadata(mapping, full, full)
    wspans = [dataclasses.replace(s, slots=s.window_slots) for s in spans] if own_pool else spans
    sliding = tuple(_prefill_group(s, o, window, device) for s, o in zip(wspans, offsets))
    if decode is not None:
        assert decode.window_slots is not None and decode.window_lengths is not None
        sliding += (_rows_group(decode.rows, decode.window_slots, decode.window_lengths,
                                device, False if decode.uniform else None),)
    window_mapping = (_packed_mapping(wspans, offsets, decode, decode and decode.window_write,
                                      num_tokens).to(device) if own_pool else None)
    return AttentionMetadata(mapping, full, sliding, window_mapping)


def _packed_mapping(spans: list[SeqSpan], offsets: list[int], decode: DecodeRows | None,
                    write: torch.Tensor | None, num_tokens: int) -> torch.Tensor:
    """[T] slot of each packed token: the spans' new positions and the decode rows' writes
    (`write`, or decode.write) at their offsets."""
    write = write if write is not None else (decode.write if decode is not None else None)
    if not spans and write is not None:  # rows ascend: all T rows are decode rows, in order
        return write
    mapping = torch.empty(num_tokens, dtype=torch.long)
    for s, o in zip(spans, offsets):
        mapping[o:o + s.num_new] = s.slots[s.start:s.end]
    if decode is not None and write is not None:
        mapping[decode.rows] = write
    return mapping


def _full_rows_group(decode: DecodeRows, device: torch.device) -> AttentionGroup:
    """The decode group of the full-attention layers. The C attention reads each row's
    lengths over the whole contiguous table (spare columns included, never read); the torch
    and Triton paths read every column they are given, so they get the first `width` only
    (padded only where some row sees fewer)."""
    slots = decode.slots
    if slots.shape[1] > decode.width and not _c_reads_lengths(device):
        slots = slots[:, :decode.width]
    padded = not decode.uniform or slots.shape[1] > decode.width
    return _rows_group(decode.rows, slots, decode.lengths, device, padded)


def _c_reads_lengths(device: torch.device) -> bool:
    """A decode step on `device` runs the C attention, which reads each row's lengths (the
    torch and Triton paths read a key table's every column instead)."""
    return device.type == "cpu" and fused.ENABLED


def _rows_group(rows: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
                device: torch.device, padded: bool | None) -> AttentionGroup:
    """The decode group over laid-out rows; its mask (where some row sees fewer than all W
    keys: `padded`, None to find out) is built where it is read: the C attention reads the
    lengths instead."""
    if padded is None:
        padded = not bool((lengths == slots.shape[1]).all())
    return AttentionGroup(on_device(rows, device), on_device(slots, device), None, len(rows),
                          1, on_device(lengths, device), padded=padded)


def on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t on `device`: itself where it is there already (a no-op .to still costs a dispatch,
    several per step)."""
    return t if t.device == device else t.to(device)


def build_metadata(spans: list[SeqSpan], window: int | None, device: torch.device
                   ) -> AttentionMetadata:
    """Pack spans (in batch order) into slot mapping and attention groups."""
    offsets, row = [], 0
    for s in spans:
        offsets.append(row)
        row += s.num_new
    slot_mapping = torch.cat([s.slots[s.start:s.end] for s in spans]).to(device)
    full = _groups(spans, offsets, None, device)
    own = [s.window_slots is not None for s in spans]
    if any(own) != all(own):
        raise ValueError("either every span has window slots or none has")
    if not window or not any(own):
        sliding = _groups(spans, offsets, window, device) if window else full
        return AttentionMetadata(slot_mapping, full, sliding)
    spans = [dataclasses.replace(s, slots=s.window_slots) for s in spans]
    sliding_mapping = torch.cat([s.slots[s.start:s.end] for s in spans]).to(device)
    return AttentionMetadata(slot_mapping, full, _groups(spans, offsets, window, device),
                             sliding_mapping)


def _groups(spans: list[SeqSpan], offsets: list[int], window: int | None,
            device: torch.device) -> tuple[AttentionGroup, ...]:
    decode = [i for i, s in enumerate(spans) if s.num_new == 1]
    groups = [_prefill_group(s, offsets[i], window, device)
              for i, s in enumerate(spans) if s.num_new > 1]
    if decode:
        groups.append(_decode_group([spans[i] for i in decode], [offsets[i] for i in decode],
                                    window, device))
    return tuple(groups)


def _key_range(span: SeqSpan, window: int | None) -> int:
    """First key position any query of this span can see (older keys are outside the window)."""
    if window is None:
        return 0
    return max(0, span.start - window + 1)


def _prefill_group(span: SeqSpan, offset: int, window: int | None,
                   device: torch.device) -> AttentionGroup:
    first = _key_range(span, window)
    rows = torch.arange(offset, offset + span.num_new)
    fresh = span.start == 0 and (window is None or span.num_new <= window)
    return AttentionGroup(rows.to(device), span.slots[first:span.end][None].to(device),
                          None, 1, span.num_new, fresh=fresh, prefill=True,
                          start=span.start, first=first, window=window)


def _decode_group(spans: list[SeqSpan], offsets: list[int], window: int | None,
                  device: torch.device) -> AttentionGroup:
    firsts = [_key_range(s, window) for s in spans]
    width = max(s.end - f for s, f in zip(spans, firsts))
    slots = torch.empty(len(spans), width, dtype=torch.long)
    mask = torch.zeros(len(spans), 1, width, dtype=torch.bool)
    for b, (s, f) in enumerate(zip(spans, firsts)):
        n = s.end - f
        slots[b, :n] = s.slots[f:s.end]
        slots[b, n:] = s.slots[f]  # padding reads a written slot: masked, but never NaN
        mask[b, 0, :n] = True
    rows = torch.tensor(offsets, dtype=torch.long)
    lengths = torch.tensor([s.end - f for s, f in zip(spans, firsts)], dtype=torch.long)
    unpadded = bool((lengths == width).all())
    return AttentionGroup(rows.to(device), slots.to(device),
                          None if unpadded else mask.to(device), len(spans), 1, lengths)


def paged_attention(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                    cache: KVStore,
                    meta: AttentionMetadata, sliding: bool, scale: float,
                    softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, H, D], k/v: [T, KVH, D] for the new tokens -> [T, H * D].

    Writes the new K/V into the cache first, then reads every attended key from it.
    `softcap` (Gemma 2) bounds each score to (-cap, cap) by cap * tanh(score / cap).
    `sinks` (gpt-oss): fp32 [H], one learned logit per head that joins its softmax's
    denominator and carries no value, so a head may attend to nothing.
    k, v None: the step's K/V are in the cache already, written by the layer this one
    shares them with (Gemma 4); attention only reads.
    """
    if k is not None:
        cache.write(meta.write_slots(sliding), k, v)
    num_tokens, num_heads, head_dim = q.shape
    if isinstance(cache, LatentKV):  # values: the latent, narrower than the keys
        head_dim = cache.value_dim  # (the C kernels return whole rows: cut below)
    groups = meta.groups(sliding)
    if len(groups) == 1 and groups[0].rows.numel() == num_tokens:
        # rows ascend within a group, so one group of T rows is 0..T-1: no gather/scatter
        g = groups[0]
        out = (_attend_fresh(q, k, v, scale) if _reads_fresh(g, cache, q, k, softcap, sinks)
               else _attend(q, cache, g, scale, softcap, sinks))
        if out.shape[-1] != head_dim:
            out = out[..., :head_dim]
        return out.reshape(num_tokens, num_heads * head_dim)
    out = q.new_empty(num_tokens, num_heads, head_dim)
    for g in groups:
        qg = q.index_select(0, g.rows)
        og = (_attend_fresh(qg, k.index_select(0, g.rows), v.index_select(0, g.rows), scale)
              if _reads_fresh(g, cache, q, k, softcap, sinks)
              else _attend(qg, cache, g, scale, softcap, sinks))
        out.index_copy_(0, g.rows, og[..., :head_dim].to(out.dtype))
    return out.reshape(num_tokens, num_heads * head_dim)


def _reads_fresh(g: AttentionGroup, cache: KVStore, q: torch.Tensor, k: torch.Tensor | None,
                 softcap: float | None, sinks: torch.Tensor | None) -> bool:
    """A fresh prefill over an fp32 cache that C attention does not take (CUDA) reads the
    new K/V as computed (the values the cache holds): no gather, no mask tensor. SDPA has
    no soft-cap and no sinks, so a capped or sunk one is not read that way."""
    return (softcap is None and sinks is None and g.fresh and isinstance(cache, FloatKV)
            and k is not None
            and cache.k.dtype == torch.float32
            and not _prefill_in_c(g, _c_stores(q, cache, g)))


def _attend_fresh(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """One sequence's chunk q: [n, H, D] against its own k/v: [n, KVH, D], causally."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                       v.transpose(0, 1)[None], is_causal=True, scale=scale,
                                       enable_gqa=True)
    return o[0].transpose(0, 1)


def _attend(q: torch.Tensor, cache: KVStore, g: AttentionGroup, scale: float,
            softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One group's queries q: [n, H, D] (in group row order) -> outputs [n, H, D]."""
    stores = _c_stores(q, cache, g)
    cap = softcap or 0.0  # the C kernels' "no cap"
    if _decode_in_c(g, stores):  # sinks: fp32 on the CPU, as the loader keeps vectors
        k, v, ks, vs = stores
        return fused.attend_decode(q, k, v, g.slots, scale, g.lengths, ks, vs, softcap=cap,
                                   sinks=sinks)
    if _prefill_in_c(g, stores):
        k, v, ks, vs = stores
        return fused.attend_prefill(q, k, v, g.slots[0], g.first, g.start, g.window, scale,
                                    ks, vs, softcap=cap, sinks=sinks)
    if softcap is not None or sinks is not None:
        return _scored(q, cache, g, scale, softcap, sinks)
    num_heads, head_dim = q.shape[1:]
    if q.is_cuda and isinstance(cache, FloatKV):
        q = q.to(cache.k.dtype)  # attend in the cache's dtype on GPUs: no K/V conversion
    qg = q.reshape(g.num_seqs, g.queries_per_seq, num_heads, head_dim)
    kg, vg = cache.gather(g.slots, q.dtype)  # [B, C, KVH, D] each
    og = F.scaled_dot_product_attention(
        qg.transpose(1, 2), kg.transpose(1, 2), vg.transpose(1, 2),
        attn_mask=None if g.key_mask is None else g.key_mask[:, None], scale=scale, enable_gqa=True)
    return og.transpose(1, 2).reshape(-1, num_heads, og.shape[-1])  # V's width


def _c_stores(q: torch.Tensor, cache: KVStore, g: AttentionGroup) -> tuple | None:
    """The cache's stores as the C attention reads them (fp32, fp16 or q8_0), when it can
    take these queries (fp32 CPU rows, heads packed); else None."""
    if fused.fits(q) and fused.heads_packed(q) and g.slots.device.type == "cpu":
        return cache.c_stores()
    return None


def _decode_in_c(g: AttentionGroup, stores: tuple | None) -> bool:
    """Decode groups run in C, each row over its own keys only, so a sequence's attention is
    the same whether it decodes alone or beside longer ones."""
    return stores is not None and g.lengths is not None and g.queries_per_seq == 1


def _prefill_in_c(g: AttentionGroup, stores: tuple | None) -> bool:
    """A prefill chunk runs in C, tile by tile from the pages: no scores matrix, no mask
    tensor, and a sliding window reads only the keys inside it."""
    return stores is not None and g.prefill and g.num_seqs == 1


def _scored(q: torch.Tensor, cache: KVStore, g: AttentionGroup, scale: float,
            cap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """One group's attention with soft-capped scores or sinks, written out in torch where
    the C kernels do not apply (SDPA has neither): scores, cap * tanh(scores / cap), mask,
    softmax (over the keys and each head's sink logit, whose share is dropped), values.
    q: [n, H, D] in group row order -> [n, H, D]."""
    qg = q.reshape(g.num_seqs, g.queries_per_seq, *q.shape[1:])
    kg, vg = cache.gather(g.slots, q.dtype)  # [B, C, KVH, D] each
    rep = q.shape[1] // kg.shape[2]
    kg, vg = (t.repeat_interleave(rep, dim=2).transpose(1, 2) for t in (kg, vg))
    scores = qg.transpose(1, 2) @ kg.transpose(-1, -2) * scale  # [B, H, Q, C]
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    if g.key_mask is not None:  # None: an unpadded decode, every key is seen
        scores = scores.masked_fill(~g.key_mask[:, None], float("-inf"))
    if sinks is None:
        return (torch.softmax(scores, dim=-1) @ vg).transpose(1, 2).reshape(-1, *q.shape[1:])
    sink = sinks.to(scores)[None, :, None, None].expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return (probs @ vg).transpose(1, 2).reshape(-1, *q.shape[1:])  # [n, H, D]
