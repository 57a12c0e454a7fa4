"""One layer's paged KV storage: write new tokens' K/V into slots, gather slots back.

Float stores keep `[num_slots, kv_heads, head_dim]` tensors in f32, bf16 or f16. The latent
store (multi-head latent attention) keeps one row per token, the latent then its rotary key
part, and reads values as the row's first `value_dim` columns: no V tensor at all. The q8_0
store keeps int8 values with one scale per 32 elements of a head (GGUF's Q8_0 layout:
34 bytes per 32 values, about half of f16), quantized on write, dequantized on gather.
"""

from __future__ import annotations

import torch

from kvlab.config import MlaConfig
from kvlab.cost import KV_BYTES_PER_ELEMENT
from kvlab.errors import KvlabError
from kvlab.kernels import fused, hugepages

FLOAT_KV = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
KV_DTYPES = (*FLOAT_KV, "q8_0")
Q8_BLOCK = 32


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A store's tensor; on the CPU in huge pages, as the weights (attention reads a head's
    row from every slot each step, across far more 4 KiB pages than the TLB holds)."""
    if torch.device(device).type == "cpu":
        return hugepages.empty(shape, dtype)
    return torch.empty(shape, dtype=dtype, device=device)


def _zero_rows(t: torch.Tensor, first: int | None, last: int) -> None:
    """Zero all of t's slot rows, or its first `first` and last `last`: writing is what makes
    a page resident, and a fresh 2 MiB page can take milliseconds to fault in."""
    if first is None:
        t.zero_()
        return
    t[:first].zero_()
    if last > 0:
        t[-last:].zero_()


class FloatKV:
    def __init__(self, slots: int, heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        # empty, not zeros: pages become resident only when written, and attention only
        # reads slots that were written (padding repeats a sequence's own slot)
        self.k = _empty((slots, heads, head_dim), dtype, device)
        self.v = _empty((slots, heads, head_dim), dtype, device)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.k, self.v

    def reserve(self, first: int | None = None, last: int = 0) -> None:
        """Make pages resident now: every slot's (a server's memory then stays flat under
        load), or those of the first `first` slots and the last `last` (_zero_rows)."""
        for t in (self.k, self.v):
            _zero_rows(t, first, last)

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if self._c_writes(slots, k, v):
            fused.scatter_rows_(self.k, slots, k)
            fused.scatter_rows_(self.v, slots, v)
            return
        self.k.index_copy_(0, slots, k.to(self.k.dtype))
        self.v.index_copy_(0, slots, v.to(self.v.dtype))

    def _c_writes(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        """fp32 rows into an fp32 or fp16 store: one pass per token instead of index_copy_."""
        return (fused.fits(k, v) and fused.cache_fits(self.k, self.v) and fused.heads_packed(k)
                and fused.heads_packed(v)
                and k.shape[1:] == self.k.shape[1:] and v.shape[1:] == self.v.shape[1:]
                and k.shape[0] == v.shape[0] == slots.numel() and slots.is_cpu)

    def c_stores(self) -> tuple[torch.Tensor, torch.Tensor, None, None] | None:
        """(k, v, scales) as the C attention reads them, or None where it cannot."""
        return (self.k, self.v, None, None) if fused.cache_fits(self.k, self.v) else None

    def gather(self, slots: torch.Tensor, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """slots: [B, C] -> k, v: [B, C, heads, head_dim]."""
        return _rows(self.k, slots, dtype), _rows(self.v, slots, dtype)


class LatentKV:
    """Multi-head latent attention's store: k [num_slots, 1, latent + rope] holds the latent
    (kv_lora_rank values after its norm) then the rotated key part; the values are the
    latent, a view of k's first `value_dim` columns, so a token costs latent + rope values."""

    def __init__(self, slots: int, width: int, value_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.k = _empty((slots, 1, width), dtype, device)
        self.value_dim = value_dim

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.k,)

    def reserve(self, first: int | None = None, last: int = 0) -> None:
        _zero_rows(self.k, first, last)

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None:
        """k: [T, 1, width] the new tokens' latent | rope rows; v is k's latent (unused)."""
        if (fused.fits(k) and fused.cache_fits(self.k) and fused.heads_packed(k)
                and k.shape[1:] == self.k.shape[1:] and k.shape[0] == slots.numel()
                and slots.is_cpu):
            fused.scatter_rows_(self.k, slots, k)
            return
        self.k.index_copy_(0, slots, k.to(self.k.dtype))

    def c_stores(self) -> tuple[torch.Tensor, torch.Tensor, None, None] | None:
        """The C attention takes K and V of one width: k as both, so each head's result
        is a whole row, latent then rope, of which the caller keeps the latent."""
        return (self.k, self.k, None, None) if fused.cache_fits(self.k) else None

    def gather(self, slots: torch.Tensor, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """slots: [B, C] -> keys [B, C, 1, width] and values [B, C, 1, value_dim] (a view)."""
        k = _rows(self.k, slots, dtype)
        return k, k[..., :self.value_dim]


class Q8KV:
    def __init__(self, slots: int, heads: int, head_dim: int, device: torch.device) -> None:
        if head_dim % Q8_BLOCK:
            raise KvlabError(f"--kv-dtype q8_0 needs head_dim divisible by {Q8_BLOCK}, the "
                             f"model has {head_dim}; use f16 or bf16")
        blocks = head_dim // Q8_BLOCK
        self.k = _empty((slots, heads, head_dim), torch.int8, device)
        self.v = _empty((slots, heads, head_dim), torch.int8, device)
        self.k_scale = _empty((slots, heads, blocks, 1), torch.float16, device)
        self.v_scale = _empty((slots, heads, blocks, 1), torch.float16, device)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.k, self.v, self.k_scale, self.v_scale

    def reserve(self, first: int | None = None, last: int = 0) -> None:
        for t in (self.k, self.v, self.k_scale, self.v_scale):
            _zero_rows(t, first, last)

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if self._c_writes(slots, k, v):  # one pass per token instead of a dozen torch ops
            fused.scatter_rows_q8_(self.k, self.k_scale, slots, k)
            fused.scatter_rows_q8_(self.v, self.v_scale, slots, v)
            return
        for store, scale, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            q, s = quantize_q8(x)
            store.index_copy_(0, slots, q)
            scale.index_copy_(0, slots, s)

    def _c_writes(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        return (fused.fits(k, v) and fused.heads_packed(k) and fused.heads_packed(v)
                and self.c_stores() is not None and k.shape[1:] == self.k.shape[1:]
                and v.shape[1:] == self.v.shape[1:] and k.shape[0] == v.shape[0] == slots.numel()
                and slots.is_cpu)

    def c_stores(self) -> tuple[torch.Tensor, ...] | None:
        """(k, v, k_scale, v_scale) as the C attention reads them, or None where it cannot."""
        stores = (self.k, self.v, self.k_scale, self.v_scale)
        return stores if fused.q8_cache_fits(*stores) else None

    def gather(self, slots: torch.Tensor, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
        return (dequantize_q8(_rows(self.k, slots, torch.int8),
                              _rows(self.k_scale, slots, torch.float16), dtype),
                dequantize_q8(_rows(self.v, slots, torch.int8),
                              _rows(self.v_scale, slots, torch.float16), dtype))


def _rows(store: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """store[slots] as `dtype`; index_select on the flat slots is ~4x faster than indexing."""
    out = store.index_select(0, slots.reshape(-1)).view(*slots.shape, *store.shape[1:])
    return out if out.dtype == dtype else out.to(dtype)


def quantize_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] float -> int8 [..., D] and fp16 scales [..., D/32, 1] (round to nearest)."""
    blocks = x.float().unflatten(-1, (-1, Q8_BLOCK))
    scale = (blocks.abs().amax(-1, keepdim=True) / 127).to(torch.float16)
    inv = torch.where(scale > 0, 1.0 / scale.float(), torch.zeros_like(scale, dtype=torch.float))
    q = torch.round(blocks * inv).clamp_(-127, 127).to(torch.int8)
    return q.flatten(-2), scale


def dequantize_q8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.unflatten(-1, (-1, Q8_BLOCK)).to(dtype) * scale.to(dtype)).flatten(-2)


def make_kv(kind: str, slots: int, heads: int, head_dim: int, device: torch.device,
            latent: MlaConfig | None = None) -> FloatKV | Q8KV | LatentKV:
    """One layer's store; with `latent` (multi-head latent attention) the latent store, whose
    width comes from it instead of heads x head_dim."""
    if latent is not None:
        if kind not in FLOAT_KV:
            raise KvlabError(f"--kv-dtype {kind} is not available for latent attention "
                             f"(valid: {', '.join(FLOAT_KV)})")
        return LatentKV(slots, latent.latent_width, latent.kv_lora_rank, FLOAT_KV[kind], device)
    if kind == "q8_0":
        return Q8KV(slots, heads, head_dim, device)
    return FloatKV(slots, heads, head_dim, FLOAT_KV[kind], device)


def kv_bytes_per_element(kind: str) -> float:
    """Bytes one cached K or V value takes in a store of `kind` (kvlab.cost's one table)."""
    return KV_BYTES_PER_ELEMENT[kind]
