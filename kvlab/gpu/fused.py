"""Fused Triton kernels for a decode layer's elementwise work on CUDA.

Each replaces several torch kernels of the per-op path (kvlab.models.layers) with one, at
that path's numerics: statistics and products in fp32, results rounded once to the dtype
the next product reads. A decode layer then launches, besides its products and attention:

    residual_norm   x += h (or + rms_norm(h) with a post norm), then rms_norm(x) -> next input
    qkv_rope_write  per-head QK-norm, RoPE on q and k, k and v written into their KV slots
    gated           silu(gate) * up (SwiGLU) or gelu_tanh(gate) * up (GeGLU)

Norm weights are full multipliers (Gemma's 1 + w is folded at load). RoPE is the
rotate-half convention of layers.apply_rope over cos/sin tables [T, 1, head_dim]; partial
rotary is already in the tables (cos 1, sin 0 past the rotary pairs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GATES = ("silu", "gelu_tanh")


@triton.jit
def _tanh(x):
    """tanh from the sigmoid (tl has no tanh of its own): exact to fp32 rounding."""
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _residual_norm_kernel(x_ptr, h_ptr, post_ptr, w_ptr, out_ptr, n_cols, eps,
                          HAS_H: tl.constexpr, HAS_POST: tl.constexpr, HAS_OUT: tl.constexpr,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=inside, other=0.0).to(tl.float32)
    if HAS_H:
        h_raw = tl.load(h_ptr + row * n_cols + cols, mask=inside, other=0.0)
        h = h_raw.to(tl.float32)
        if HAS_POST:  # the per-op path rounds rms_norm(h) to h's dtype before the add
            post = tl.load(post_ptr + cols, mask=inside, other=0.0).to(tl.float32)
            rms = tl.rsqrt(tl.sum(h * h, axis=0) / n_cols + eps)
            h = (h * rms * post).to(h_raw.dtype).to(tl.float32)
        x = x + h
        tl.store(x_ptr + row * n_cols + cols, x.to(x_ptr.dtype.element_ty), mask=inside)
    if HAS_OUT:
        w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        rms = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
        tl.store(out_ptr + row * n_cols + cols, (x * rms * w).to(out_ptr.dtype.element_ty),
                 mask=inside)


def residual_norm(x: torch.Tensor, h: torch.Tensor | None, post: torch.Tensor | None,
                  weight: torch.Tensor | None, eps: float,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """x [T, hidden] (the residual stream, updated in place) += h, or += rms_norm(h, post)
    where the layer norms its outputs (Gemma); then rms_norm(x, weight) in out_dtype (the
    next product's input), or None without a weight. h None: the norm alone."""
    rows, cols = x.shape
    out = None if weight is None else x.new_empty(rows, cols, dtype=out_dtype or x.dtype)
    _residual_norm_kernel[(rows,)](
        x, x if h is None else h, x if post is None else post, x if weight is None else weight,
        x if out is None else out, cols, eps, HAS_H=h is not None, HAS_POST=post is not None,
        HAS_OUT=out is not None, BLOCK=triton.next_power_of_2(cols))
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """rms_norm(x, weight) [T, hidden] in out_dtype (x's by default); x is not changed."""
    out = residual_norm(x, None, None, weight, eps, out_dtype)
    assert out is not None
    return out


@triton.jit
def _rotate(x1, x2, cos_ptr, sin_ptr, half: tl.constexpr, cols, inside):
    """Both halves of one head rotated (rotate-half): (x1 cos - x2 sin, x2 cos + x1 sin)."""
    c1 = tl.load(cos_ptr + cols, mask=inside, other=1.0).to(tl.float32)
    c2 = tl.load(cos_ptr + half + cols, mask=inside, other=1.0).to(tl.float32)
    s1 = tl.load(sin_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + half + cols, mask=inside, other=0.0).to(tl.float32)
    return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2


@triton.jit
def _norm_halves(x1, x2, w_ptr, half: tl.constexpr, cols, inside, eps):
    """One head's RMSNorm (QK-norm), on its two halves, rounded as the per-op path rounds
    the norm's result to the product's dtype before RoPE."""
    n = 2 * half
    rms = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / n + eps)
    w1 = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + half + cols, mask=inside, other=0.0).to(tl.float32)
    return x1 * rms * w1, x2 * rms * w2


@triton.jit
def _qkv_rope_write_kernel(qkv_ptr, qkv_stride, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr,
                           slot_ptr, slot_stride, q_out_ptr, k_cache_ptr, v_cache_ptr, eps,
                           HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                           BLOCK: tl.constexpr, Q_NORM: tl.constexpr, K_NORM: tl.constexpr):
    """Program (token t, head h): h < HEADS a query head into q_out [T, HEADS, D]; else
    key/value head h - HEADS into the caches [slots, KV_HEADS, D] at the token's slot (the
    grid has these heads only where there is a cache to write)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    d = 2 * HALF
    cols = tl.arange(0, BLOCK)
    inside = cols < HALF
    src = qkv_ptr + t * qkv_stride + h * d  # q heads, then k heads, then v heads
    raw1 = tl.load(src + cols, mask=inside, other=0.0)
    x1 = raw1.to(tl.float32)
    x2 = tl.load(src + HALF + cols, mask=inside, other=0.0).to(tl.float32)
    rounding = raw1.dtype
    if h < HEADS:
        if Q_NORM:
            x1, x2 = _norm_halves(x1, x2, q_norm_ptr, HALF, cols, inside, eps)
            x1, x2 = x1.to(rounding).to(tl.float32), x2.to(rounding).to(tl.float32)
        y1, y2 = _rotate(x1, x2, cos_ptr + t * d, sin_ptr + t * d, HALF, cols, inside)
        dst = q_out_ptr + (t * HEADS + h) * d
        tl.store(dst + cols, y1.to(q_out_ptr.dtype.element_ty), mask=inside)
        tl.store(dst + HALF + cols, y2.to(q_out_ptr.dtype.element_ty), mask=inside)
    else:
        kv = h - HEADS
        if K_NORM:
            x1, x2 = _norm_halves(x1, x2, k_norm_ptr, HALF, cols, inside, eps)
            x1, x2 = x1.to(rounding).to(tl.float32), x2.to(rounding).to(tl.float32)
        y1, y2 = _rotate(x1, x2, cos_ptr + t * d, sin_ptr + t * d, HALF, cols, inside)
        slot = tl.load(slot_ptr + t * slot_stride)
        dst = k_cache_ptr + (slot * KV_HEADS + kv) * d
        # rounded to the product's dtype first: the per-op path ropes in it, then casts
        tl.store(dst + cols, y1.to(rounding).to(k_cache_ptr.dtype.element_ty), mask=inside)
        tl.store(dst + HALF + cols, y2.to(rounding).to(k_cache_ptr.dtype.element_ty),
                 mask=inside)
        v_src = qkv_ptr + t * qkv_stride + (HEADS + KV_HEADS + kv) * d
        v_dst = v_cache_ptr + (slot * KV_HEADS + kv) * d
        for part in tl.static_range(2):
            v = tl.load(v_src + part * HALF + cols, mask=inside, other=0.0)
            tl.store(v_dst + part * HALF + cols, v.to(v_cache_ptr.dtype.element_ty),
                     mask=inside)


def qkv_rope_write(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
                   q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                   cos: torch.Tensor, sin: torch.Tensor, eps: float,
                   slot_mapping: torch.Tensor | None, k_cache: torch.Tensor | None,
                   v_cache: torch.Tensor | None) -> torch.Tensor:
    """One layer's attention inputs in one kernel.

    qkv: [T, (heads + 2 kv_heads) * head_dim] the stacked product's output (bias added),
    rows of the q heads, then k, then v; cos, sin: [T, 1, head_dim]; slot_mapping: [T];
    k_cache, v_cache: [slots, kv_heads, head_dim] (slot_mapping may be a strided column, as
    the decode graph's packed inputs hold it). Returns q [T, heads, head_dim] in qkv's
    dtype: rms_norm (where q_norm is given) and RoPE, as layers.norm_rope. k gets the same
    with k_norm and goes, with v, into the caches at slot_mapping (in the caches' dtype).
    slot_mapping None: q alone (no cache write).
    """
    tokens = qkv.shape[0]
    if head_dim % 2 or qkv.shape[1] != (heads + 2 * kv_heads) * head_dim or qkv.stride(1) != 1:
        raise ValueError(f"qkv {tuple(qkv.shape)} is not [T, ({heads} + 2 x {kv_heads}) x "
                         f"{head_dim}] with packed rows")
    q = qkv.new_empty(tokens, heads, head_dim)
    write = slot_mapping is not None
    cos, sin = cos.reshape(tokens, head_dim), sin.reshape(tokens, head_dim)
    _qkv_rope_write_kernel[(tokens, heads + (kv_heads if write else 0))](
        qkv, qkv.stride(0), q if q_norm is None else q_norm, q if k_norm is None else k_norm,
        cos.contiguous(), sin.contiguous(), slot_mapping if write else q,
        slot_mapping.stride(0) if write else 0, q,
        k_cache if write else q, v_cache if write else q, eps, HEADS=heads, KV_HEADS=kv_heads,
        HALF=head_dim // 2, BLOCK=triton.next_power_of_2(head_dim // 2),
        Q_NORM=q_norm is not None, K_NORM=k_norm is not None)
    return q


@triton.jit
def _gated_kernel(y_ptr, out_ptr, inter, GELU_TANH: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < inter
    gate = tl.load(y_ptr + row * 2 * inter + cols, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(y_ptr + row * 2 * inter + inter + cols, mask=inside, other=0.0).to(tl.float32)
    if GELU_TANH:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = 0.5 * gate * (1.0 + _tanh(inner))
    else:
        act = gate * tl.sigmoid(gate)
    tl.store(out_ptr + row * inter + cols, (act * up).to(out_ptr.dtype.element_ty), mask=inside)


def gated(y: torch.Tensor, gate: str) -> torch.Tensor:
    """[T, 2 * inter] (gate | up, one stacked product) -> act(gate) * up [T, inter] in y's
    dtype; act is silu (SwiGLU) or gelu_tanh (GeGLU, as Gemma)."""
    if gate not in GATES:
        raise ValueError(f"gate {gate!r} (valid: {', '.join(GATES)})")
    rows, width = y.shape
    if width % 2 or not y.is_contiguous():
        raise ValueError(f"gated takes contiguous [T, 2 * inter] rows, got {tuple(y.shape)}")
    inter, block = width // 2, 1024
    out = y.new_empty(rows, inter)
    _gated_kernel[(rows, triton.cdiv(inter, block))](y, out, inter,
                                                     GELU_TANH=gate == "gelu_tanh", BLOCK=block)
    return out
