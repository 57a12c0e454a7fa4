"""Paged decode attention as one Triton kernel over the block table.

Each decode row has one query per head and reads its keys straight from the paged store
[num_slots, kv_heads, head_dim]: key j of row b lives at slot
table[b, j // page] * page + j % page, so the block table itself (page = block size) or the
slot table the runner builds (page = 1, one slot per key) both serve as `table`:

    table[b] = [7, 2, 9]   page 4:  keys 0-3 -> slots 28-31, 4-7 -> 8-11, 8-11 -> 36-39

A program takes one (row, KV head) and all the query heads of its group (GQA), so each key
is read once per group; scores, soft-cap, the online softmax and the value sum stay in
registers (fp32). A row's visible keys are its first lengths[b] (within the last `window`
of them), or those a per-key mask marks. Few rows (batch 1) leave most of the GPU idle, so
the keys are then split across programs (flash-decoding) and a second kernel merges the
splits' partial softmaxes, with each head's sink logit (gpt-oss) in the denominator.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# keys per program below which a split does not pay for its share of the merge: one tile of
# 64 keys is a few dependent loads (table, then K and V), about the merge kernel's cost
KEYS_PER_SPLIT = 64


@triton.jit
def _softcap(s, cap):
    """cap * tanh(s / cap), tanh from the sigmoid."""
    return cap * (2.0 * tl.sigmoid(2.0 * s / cap) - 1.0)


@triton.jit
def _dot(a, b, EXACT: tl.constexpr):
    """a @ b with fp32 accumulation; EXACT: in fp32 without TF32 (fp32 stores, and the
    interpreter, whose bf16 dot is wrong: the same rounded operands, as exact products)."""
    if EXACT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, table_ptr, table_stride, len_ptr, len_stride, mask_ptr,
                   mask_stride, sink_ptr, out_ptr, part_ml_ptr, part_acc_ptr,
                   width, window, scale, cap,
                   KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                   D: tl.constexpr, D_PAD: tl.constexpr, PAGE: tl.constexpr,
                   BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, HAS_LEN: tl.constexpr,
                   HAS_MASK: tl.constexpr, HAS_CAP: tl.constexpr, HAS_SINK: tl.constexpr,
                   EXACT: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    heads = kvh * GROUP + tl.arange(0, GROUP_PAD)  # this group's query heads
    head_ok = tl.arange(0, GROUP_PAD) < GROUP
    dims = tl.arange(0, D_PAD)
    dim_ok = dims < D
    q = tl.load(q_ptr + (b * KV_HEADS * GROUP + heads[:, None]) * D + dims[None, :],
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0)
    q = q.to(k_ptr.dtype.element_ty)  # attend in the store's dtype, as the torch path
    end = width
    if HAS_LEN:
        end = tl.load(len_ptr + b * len_stride).to(tl.int32)
    begin = tl.where(window > 0, tl.maximum(end - window, 0), 0)
    per_split = tl.cdiv(tl.cdiv(end - begin, SPLITS), BLOCK_N) * BLOCK_N
    lo = begin + split * per_split
    hi = tl.minimum(lo + per_split, end)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        seen = keys < hi
        if HAS_MASK:
            seen = seen & (tl.load(mask_ptr + b * mask_stride + keys, mask=seen, other=0) != 0)
        if tl.sum(seen.to(tl.int32), axis=0) > 0:  # a masked-out tile reads no K/V
            block = tl.load(table_ptr + b * table_stride + keys // PAGE, mask=seen, other=0)
            slots = block.to(tl.int64) * PAGE + keys % PAGE
            rows = (slots * KV_HEADS + kvh) * D
            kv_ok = seen[:, None] & dim_ok[None, :]
            k = tl.load(k_ptr + rows[:, None] + dims[None, :], mask=kv_ok, other=0.0)
            s = _dot(q, tl.trans(k), EXACT) * scale
            if HAS_CAP:
                s = _softcap(s, cap)
            s = tl.where(seen[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + rows[:, None] + dims[None, :], mask=kv_ok, other=0.0)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, EXACT)
            m_i = m_new
    out_rows = b * KV_HEADS * GROUP + heads
    if SPLITS == 1:
        if HAS_SINK:  # the sink joins the denominator and adds no value
            sink = tl.load(sink_ptr + heads, mask=head_ok, other=0.0).to(tl.float32)
            m_new = tl.maximum(m_i, sink)
            l_i = l_i * tl.exp(m_i - m_new) + tl.exp(sink - m_new)
            acc = acc * tl.exp(m_i - m_new)[:, None]
        o = acc / l_i[:, None]
        tl.store(out_ptr + out_rows[:, None] * D + dims[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & dim_ok[None, :])
    else:
        part = out_rows * SPLITS + split
        tl.store(part_ml_ptr + part * 2, m_i, mask=head_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=head_ok)
        tl.store(part_acc_ptr + part[:, None] * D + dims[None, :], acc,
                 mask=head_ok[:, None] & dim_ok[None, :])


@triton.jit
def _merge_kernel(part_ml_ptr, part_acc_ptr, sink_ptr, out_ptr, heads,
                  D: tl.constexpr, D_PAD: tl.constexpr, SPLITS: tl.constexpr,
                  SPLITS_PAD: tl.constexpr, HAS_SINK: tl.constexpr):
    """Program (row, head): the splits' (max, sum, unnormalised values) as one softmax."""
    row = tl.program_id(0)
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < SPLITS
    dims = tl.arange(0, D_PAD)
    part = row * SPLITS + splits
    m = tl.load(part_ml_ptr + part * 2, mask=split_ok, other=float("-inf"))
    l_s = tl.load(part_ml_ptr + part * 2 + 1, mask=split_ok, other=0.0)
    m_all = tl.max(m, axis=0)
    if HAS_SINK:
        sink = tl.load(sink_ptr + row % heads).to(tl.float32)
        m_all = tl.maximum(m_all, sink)
    w = tl.where(m > float("-inf"), tl.exp(m - m_all), 0.0)  # an empty split weighs 0
    acc = tl.load(part_acc_ptr + part[:, None] * D + dims[None, :],
                  mask=split_ok[:, None] & (dims < D)[None, :], other=0.0)
    total = tl.sum(l_s * w, axis=0)
    if HAS_SINK:
        total += tl.exp(sink - m_all)
    o = tl.sum(acc * w[:, None], axis=0) / total
    tl.store(out_ptr + row * D + dims, o.to(out_ptr.dtype.element_ty), mask=dims < D)


@functools.cache
def _programs_wanted(device: torch.device) -> int:
    """Programs that keep every SM busy: two per SM on a GPU; a few under the interpreter."""
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def num_splits(rows: int, kv_heads: int, width: int, device: torch.device) -> int:
    """Key splits per (row, KV head): enough programs for the device, at least
    KEYS_PER_SPLIT keys each. A function of shapes only, so a captured graph keeps it."""
    wanted = triton.cdiv(_programs_wanted(device), rows * kv_heads)
    return max(1, min(wanted, triton.cdiv(width, KEYS_PER_SPLIT)))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           table: torch.Tensor, scale: float,
                           lengths: torch.Tensor | None = None,
                           mask: torch.Tensor | None = None, page: int = 1, window: int = 0,
                           softcap: float = 0.0, sinks: torch.Tensor | None = None,
                           splits: int | None = None) -> torch.Tensor:
    """q: [B, H, D], one query per row; k_cache, v_cache: [slots, KVH, D]; table: [B, N]
    block ids (page = block size) or slots (page = 1). Keys 0..lengths[b]-1 of each row, the
    last `window` of them (0: all); or, without lengths, keys 0..N*page-1 where mask [B, N *
    page] is true. softcap 0: none; sinks: fp32 [H] or None. -> [B, H, D] in the store's
    dtype."""
    rows, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    _check(q, k_cache, v_cache, table, lengths, mask)
    width = table.shape[1] * page
    splits = splits or num_splits(rows, kv_heads, width, q.device)
    group = num_heads // kv_heads
    out = torch.empty(rows, num_heads, head_dim, dtype=k_cache.dtype, device=q.device)
    part_ml = part_acc = out
    if splits > 1:  # fp32 partials per (row, head, split): (max, sum) and values
        part_ml = torch.empty(rows * num_heads * splits, 2, dtype=torch.float32,
                              device=q.device)
        part_acc = torch.empty(rows * num_heads * splits, head_dim, dtype=torch.float32,
                               device=q.device)
    mask_u8 = None if mask is None else mask.reshape(rows, -1).view(torch.uint8)
    d_pad = max(16, triton.next_power_of_2(head_dim))
    _decode_kernel[(rows, kv_heads, splits)](
        q, k_cache, v_cache, table, table.stride(0), q if lengths is None else lengths,
        0 if lengths is None else lengths.stride(0),
        q if mask_u8 is None else mask_u8, 0 if mask_u8 is None else mask_u8.stride(0),
        q if sinks is None else sinks, out, part_ml, part_acc, width, window, scale,
        softcap or 1.0, KV_HEADS=kv_heads, GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)), D=head_dim, D_PAD=d_pad, PAGE=page,
        BLOCK_N=64 if d_pad <= 128 else 32, SPLITS=splits, HAS_LEN=lengths is not None,
        HAS_MASK=mask_u8 is not None, HAS_CAP=bool(softcap), HAS_SINK=sinks is not None,
        EXACT=k_cache.dtype == torch.float32 or q.device.type != "cuda")
    if splits > 1:
        _merge_kernel[(rows * num_heads,)](
            part_ml, part_acc, q if sinks is None else sinks, out, num_heads, D=head_dim,
            D_PAD=d_pad, SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits),
            HAS_SINK=sinks is not None)
    return out


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
           lengths: torch.Tensor | None, mask: torch.Tensor | None) -> None:
    """Shapes the kernel reads by raw strides: packed heads, one table row per query row."""
    rows, num_heads, head_dim = q.shape
    if k_cache.shape != v_cache.shape or k_cache.shape[2] != head_dim:
        raise ValueError(f"K/V stores {tuple(k_cache.shape)}, {tuple(v_cache.shape)} do not "
                         f"match queries of head_dim {head_dim}")
    if num_heads % k_cache.shape[1]:
        raise ValueError(f"{num_heads} query heads are not a multiple of "
                         f"{k_cache.shape[1]} KV heads")
    if not (q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
            and table.stride(1) == 1 and table.shape[0] == rows):
        raise ValueError("queries and stores must be contiguous, and the table [B, N] with "
                         f"B = {rows} rows of packed entries")
    if (lengths is None) == (mask is None):
        raise ValueError("give either lengths or a mask of the visible keys")
