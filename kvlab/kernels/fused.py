"""Fused fp32 decode ops in C (kvlab.kernels._qk): one ~1 µs call instead of several torch
kernels of 2-12 µs each, which is most of a small model's step outside the products.

    fits(*tensors)                            True when the C path may take these tensors
    cache_fits(*stores)                       ... these KV stores (fp32 or fp16)
    rms_norm(x, w, eps) -> [T, D]             x * rsqrt(mean(x^2) + eps) * w
    add_rms_norm_(x, h, w, eps) -> x          x += rms_norm(h, w), in place
    norm_rope_(x, w, cos, sin, eps) -> x      per head: RMSNorm (w may be None), then RoPE
    geglu(y) -> [T, I]                        gelu_tanh(y[:, :I]) * y[:, I:]
    swiglu(y) -> [T, I]                       silu(y[:, :I]) * y[:, I:]
    scatter_rows_(store, slots, x)            store[slots] = x, the paged KV write (fp32/fp16)
    scatter_rows_q8_(store, scales, slots, x) ... into a q8_0 store, quantized as it goes
    attend_decode(q, k, v, slots, scale)      one query per row against its cache slots
    attend_prefill(q, k, v, slots, ...)       a prefill chunk against its cache slots, causally
    moe_experts(h, ids, weights, experts)     a layer's routed experts, each read once a step
                                              (gpt-oss: with bias rows, clamped SwiGLU)

Callers check `fits` first (fp32, on the CPU, the extension built) and otherwise use the
torch ops, which these match to fp32 rounding (tests/test_kernels.py).
"""

from __future__ import annotations

import torch

from kvlab.kernels.ops import _qk

ENABLED = _qk is not None
MOE_GELU = 2  # KV_MOE_GELU in csrc/qk_moe.h: the experts' gelu_tanh(gate) * up
MOE_RELU2 = 3  # KV_MOE_RELU2: relu(up)^2 of experts without a gate product


def fits(*tensors: torch.Tensor) -> bool:
    """True when every tensor is fp32 on the CPU and the C extension is built."""
    if not ENABLED:
        return False
    for t in tensors:  # a plain loop: this runs ~500 times a step
        if t.dtype != torch.float32 or not t.is_cpu:
            return False
    return True


def cache_fits(*stores: torch.Tensor) -> bool:
    """True when the KV stores are contiguous CPU tensors of one dtype the C attention reads
    (fp32, or fp16 widened as it loads) and the C extension is built."""
    if not ENABLED or not stores:
        return False
    dtype = stores[0].dtype
    return dtype in (torch.float32, torch.float16) and all(
        s.dtype == dtype and s.is_cpu and s.is_contiguous() for s in stores)


def q8_cache_fits(*stores: torch.Tensor) -> bool:
    """True when q8_0 stores (int8 values, fp16 scales) are contiguous CPU tensors the C
    attention reads and the extension is built."""
    return ENABLED and bool(stores) and all(
        s.dtype in (torch.int8, torch.float16) and s.is_cpu and s.is_contiguous()
        for s in stores)


def _f16(store: torch.Tensor) -> int:
    return int(store.dtype == torch.float16)


def _c(t: torch.Tensor) -> torch.Tensor:
    """t as a contiguous tensor (a no-op call costs ~0.3 µs; skipped when it is one)."""
    return t if t.is_contiguous() else t.contiguous()


def _i64(t: torch.Tensor) -> torch.Tensor:
    """Slot ids as contiguous int64, as the C side reads them."""
    return _c(t if t.dtype == torch.int64 else t.to(torch.int64))


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., D] contiguous, w: [D] -> a new tensor like x."""
    x, w = _c(x), _c(w)
    out = torch.empty_like(x)
    dim = w.shape[0]
    _qk.rms_norm(x.data_ptr(), w.data_ptr(), out.data_ptr(), x.numel() // dim, dim, eps)
    return out


def add_rms_norm_(x: torch.Tensor, h: torch.Tensor, w: torch.Tensor,
                  eps: float) -> torch.Tensor:
    """x += rms_norm(h) * w in place (x, h: [T, D] contiguous, w: [D]); returns x."""
    h, w = _c(h), _c(w)
    dim = w.shape[0]
    _qk.add_rms_norm(x.data_ptr(), h.data_ptr(), w.data_ptr(), x.numel() // dim, dim, eps)
    return x


def norm_rope_(x: torch.Tensor, w: torch.Tensor | None, cos: torch.Tensor,
               sin: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, heads, D] with heads packed (strides [any, D, 1]), rotated in place.

    Each head is first RMS-normed by w [D] when w is given; cos/sin: [T, 1, D] contiguous.
    """
    tokens, heads, dim = x.shape
    w_ptr = 0 if w is None else _c(w).data_ptr()
    cos, sin = _c(cos), _c(sin)
    _qk.norm_rope(x.data_ptr(), tokens, x.stride(0), heads, dim, w_ptr, cos.data_ptr(),
                  sin.data_ptr(), eps)
    return x


def heads_packed(x: torch.Tensor) -> bool:
    """x: [T, heads, D] whose heads lie one after another in memory (norm_rope_ takes it)."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


def geglu(y: torch.Tensor) -> torch.Tensor:
    """y: [T, 2 * I] contiguous (gate | up) -> gelu_tanh(gate) * up: [T, I]."""
    return _gated(_qk.gelu_mul if _qk else None, y)


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """y: [T, 2 * I] contiguous (gate | up) -> silu(gate) * up: [T, I]."""
    return _gated(_qk.silu_mul if _qk else None, y)


def _gated(fn, y: torch.Tensor) -> torch.Tensor:
    y = _c(y)
    inter = y.shape[-1] // 2
    out = y.new_empty(*y.shape[:-1], inter)
    if out.numel():
        fn(y.data_ptr(), out.data_ptr(), out.numel() // inter, inter)
    return out


def scatter_rows_(store: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """store[slots] = x: store [num_slots, H, D] contiguous fp32 or fp16 (rounded to nearest
    even, as .to(torch.float16)), x [T, H, D] fp32 heads packed, slots [T] (checked)."""
    slots = _i64(slots)
    _qk.scatter_rows(store.data_ptr(), store.shape[0], x.data_ptr(), x.stride(0),
                     slots.data_ptr(), slots.numel(), store[0].numel(), _f16(store))


def scatter_rows_q8_(store: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor,
                     x: torch.Tensor) -> None:
    """The q8_0 paged write: store [num_slots, H, D] int8 and scales [num_slots, H, D / 32]
    fp16 (contiguous) get x [T, H, D] fp32 heads packed at slots [T] (checked), quantized as
    kv_store.quantize_q8 does."""
    slots = _i64(slots)
    _qk.scatter_rows_q8(store.data_ptr(), scales.data_ptr(), store.shape[0], x.data_ptr(),
                        x.stride(0), slots.data_ptr(), slots.numel(), store[0].numel())


def _cache(k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor | None,
           v_scale: torch.Tensor | None) -> tuple[int, int, int, int, int]:
    """The cache arguments of the C attention: pointers, kind (0 fp32, 1 fp16, 2 q8_0), and
    q8_0's fp16 scales [num_slots, KVH, D / 32] (contiguous) when k holds int8."""
    if k.dtype == torch.int8:
        return k.data_ptr(), v.data_ptr(), 2, k_scale.data_ptr(), v_scale.data_ptr()
    return k.data_ptr(), v.data_ptr(), _f16(k), 0, 0


def attend_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                  scale: float, lengths: torch.Tensor | None = None,
                  k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None, softcap: float = 0.0,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v read straight from the paged cache, no gather.

    q: [B, H, D] fp32 heads packed; k, v: [num_slots, KVH, D] contiguous, both fp32, both
    fp16, or both int8 with their q8_0 scales (see cache_fits); slots: [B, C] -> the
    keys of row b are k[slots[b, :lengths[b]]] (all C when lengths is None); the padding
    after them is never read, so each row's result does not depend on the others.
    softcap > 0 (Gemma 2) bounds each scaled score s to cap * tanh(s / cap) before the
    softmax; 0 leaves the scores as they are. sinks (gpt-oss): fp32 [H] contiguous, one
    logit per head in its softmax's denominator with no value. Returns [B, H, D].
    """
    batch, heads, dim = q.shape
    slots = _i64(slots)
    lens = _i64(lengths) if lengths is not None else None
    out = q.new_empty(batch, heads, dim)
    _qk.attend_decode(q.data_ptr(), q.stride(0), *_cache(k, v, k_scale, v_scale), k.shape[0],
                      slots.data_ptr(), batch, slots.shape[1], heads, k.shape[1], dim, scale,
                      out.data_ptr(), lens.data_ptr() if lens is not None else 0, softcap,
                      _sinks(sinks, heads))
    return out


def attend_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                   first: int, start: int, window: int | None, scale: float,
                   k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None, softcap: float = 0.0,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence's prefill chunk against its cached keys, causally, read from the pages.

    q: [n, H, D] fp32 heads packed, token i at position start + i; k, v (and q8_0's scales)
    as for attend_decode; slots: [start + n - first] -> slots[c] holds key position
    first + c. Query i sees positions first .. start + i, the last `window` of them when
    set; softcap and sinks as for attend_decode. Returns [n, H, D].
    """
    n, heads, dim = q.shape
    slots = _i64(slots)
    out = q.new_empty(n, heads, dim)
    _qk.attend_prefill(q.data_ptr(), q.stride(0), *_cache(k, v, k_scale, v_scale), k.shape[0],
                       slots.data_ptr(), first, start, n, heads, k.shape[1], dim, window or 0,
                       scale, out.data_ptr(), softcap, _sinks(sinks, heads))
    return out


def mla_decode(q: torch.Tensor, latent: torch.Tensor, w_uk: torch.Tensor,
               w_uv_t: torch.Tensor, slots: torch.Tensor, scale: float,
               lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Multi-head latent attention, absorbed, read straight from the latent store.

    q: [B, H, nope + rope] fp32 heads packed, the rope part rotated; latent: [num_slots, 1,
    rank + rope] fp32 or fp16 (kv_store.LatentKV's k); w_uk: fp32 [H, nope, rank]; w_uv_t:
    fp32 [H, rank, vdim]; slots and lengths as for attend_decode. Head h scores
    [q_nope W_UK_h | q_rope] against each row and maps the softmax-weighted sum of the rows'
    latents through W_UV_h. Returns [B, H * vdim].
    """
    batch, heads, _ = q.shape
    slots = _i64(slots)
    lens = _i64(lengths) if lengths is not None else None
    out = q.new_empty(batch, heads * w_uv_t.shape[2])
    _qk.mla_decode(q.data_ptr(), q.stride(0), *_latent(latent), slots.data_ptr(), batch,
                   slots.shape[1], *_mla_heads(q, latent, w_uk, w_uv_t), scale, out.data_ptr(),
                   lens.data_ptr() if lens is not None else 0)
    return out


def mla_prefill(q: torch.Tensor, latent: torch.Tensor, w_uk: torch.Tensor,
                w_uv_t: torch.Tensor, slots: torch.Tensor, first: int, start: int,
                scale: float) -> torch.Tensor:
    """One sequence's prefill chunk q: [n, H, nope + rope] (token i at position start + i)
    against its cached latent rows, causally: slots as for attend_prefill, the rest as for
    mla_decode. Returns [n, H * vdim]."""
    n, heads, _ = q.shape
    slots = _i64(slots)
    out = q.new_empty(n, heads * w_uv_t.shape[2])
    _qk.mla_prefill(q.data_ptr(), q.stride(0), *_latent(latent), slots.data_ptr(), first,
                    start, n, *_mla_heads(q, latent, w_uk, w_uv_t), scale, out.data_ptr())
    return out


def _latent(latent: torch.Tensor) -> tuple[int, int, int]:
    """(address, kind, num_slots) of a latent store the C attention reads."""
    if not (cache_fits(latent) and latent.dim() == 3 and latent.shape[1] == 1):
        raise ValueError(f"the latent store must be fp32 or fp16 [slots, 1, width] contiguous "
                         f"on the CPU, got {latent.dtype} {tuple(latent.shape)}")
    return latent.data_ptr(), int(latent.dtype == torch.float16), latent.shape[0]


def _mla_heads(q: torch.Tensor, latent: torch.Tensor, w_uk: torch.Tensor,
               w_uv_t: torch.Tensor) -> tuple[int, ...]:
    """(H, nope, rope, rank, vdim, w_uk, w_uv_t) as the C latent attention takes them,
    the shapes checked against each other."""
    heads, nope, rank = w_uk.shape
    rope = latent.shape[2] - rank
    ok = (fits(q, w_uk, w_uv_t) and heads_packed(q) and w_uk.is_contiguous()
          and w_uv_t.is_contiguous() and q.shape[1:] == (heads, nope + rope) and rope >= 0
          and w_uv_t.dim() == 3 and w_uv_t.shape[:2] == (heads, rank))
    if not ok:
        raise ValueError(f"latent attention shapes do not agree: q {tuple(q.shape)}, latent "
                         f"{tuple(latent.shape)}, w_uk {tuple(w_uk.shape)}, w_uv_t "
                         f"{tuple(w_uv_t.shape)} (fp32, contiguous)")
    return heads, nope, rope, rank, w_uv_t.shape[2], w_uk.data_ptr(), w_uv_t.data_ptr()


def _sinks(sinks: torch.Tensor | None, heads: int) -> int:
    """The address of the attention sinks the C kernels read (fp32 [heads]), 0 for none."""
    if sinks is None:
        return 0
    if not (sinks.dtype == torch.float32 and sinks.is_cpu and sinks.is_contiguous()
            and sinks.shape == (heads,)):
        raise ValueError(f"attention sinks must be fp32 CPU [{heads}] contiguous, got "
                         f"{sinks.dtype} {tuple(sinks.shape)} on {sinks.device}")
    return sinks.data_ptr()


def moe_experts(h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                experts: torch.Tensor, gate_up_bias: torch.Tensor | None = None,
                down_bias: torch.Tensor | None = None,
                clamp: tuple[float, float] | None = None, gelu: bool = False,
                relu2: bool = False) -> torch.Tensor:
    """sum over each token's k slots of weight * down_e(silu(gate_e) * up_e)(h): [T, hidden].

    h: [T, hidden] fp32; ids: [T, k] expert ids (checked); weights: [T, k] fp32; experts:
    int64 [E, 3, 5], each expert's gate|up in one or two parts (the second all zeros when
    one) and down, as QuantizedWeight.kernel_args. The tokens are grouped by expert in C,
    so each chosen expert's weights are read once for all its tokens. gpt-oss's options:
    bias rows fp32 [E, 2 * inter] (gate | up) and [E, hidden] added to the products, and
    clamp = (alpha, limit) for its clamped SwiGLU in place of silu(gate) * up; gelu for
    Gemma 4's gelu_tanh(gate) * up; relu2 for Nemotron-H's relu(up)^2, its experts' up
    alone in the table's first part (no gate)."""
    h, ids, weights = _c(h), _i64(ids), _c(weights)
    e, inter = experts.shape[0], int(experts[0, 2, 3])  # down's columns
    act = MOE_RELU2 if relu2 else MOE_GELU if gelu else int(clamp is not None)
    out = torch.empty_like(h)
    alpha, limit = clamp if clamp is not None else (0.0, 0.0)
    _qk.moe_experts(experts.data_ptr(), e, h.data_ptr(), h.shape[0], h.shape[1],
                    ids.data_ptr(), weights.data_ptr(), ids.shape[1], out.data_ptr(),
                    _rows(gate_up_bias, e, 2 * inter), _rows(down_bias, e, h.shape[1]),
                    act, alpha, limit)
    return out


def _rows(bias: torch.Tensor | None, count: int, width: int) -> int:
    """The address of fp32 bias rows [count, width] the C experts read, 0 for none."""
    if bias is None:
        return 0
    ok = (bias.dtype == torch.float32 and bias.is_cpu and bias.is_contiguous()
          and tuple(bias.shape) == (count, width))
    if not ok:
        raise ValueError(f"expert biases must be fp32 CPU [{count}, {width}] contiguous, "
                         f"got {bias.dtype} {tuple(bias.shape)} on {bias.device}")
    return bias.data_ptr()


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of fp32 CPU rows [B, V] in one C pass per row (torch's
    index-tracking reduction is ~20x slower than a max over the same bytes)."""
    if not (fits(x) and x.dim() == 2 and x.is_contiguous() and x.shape[1] > 0):
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _qk.argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
    return out


def mask_logits_(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """In place: x[r, c] = -inf where bit c of mask row r is 0 (x: fp32 [B, V], mask: int32
    [B, ceil(V / 32)], bit j of word w is token 32w + j). A plain loop in C: ~30 us for a
    262k-token row, where torch's unpack-and-select takes ~0.5 ms."""
    mask = mask.contiguous()
    if not (fits(x) and x.dim() == 2 and x.is_contiguous() and mask.dtype == torch.int32
            and mask.shape[0] == x.shape[0]):
        shifts = torch.arange(32, dtype=torch.int32, device=mask.device)
        bits = ((mask[:, :, None] >> shifts) & 1).bool().flatten(1)  # [B, 32 * words]
        allowed = torch.zeros(x.shape, dtype=torch.bool, device=x.device)
        n = min(x.shape[1], bits.shape[1])
        allowed[:, :n] = bits[:, :n]
        return x.masked_fill_(~allowed, float("-inf"))
    _qk.mask_logits_rows(x.data_ptr(), x.shape[0], x.shape[1], mask.data_ptr(), mask.shape[1])
    return x
