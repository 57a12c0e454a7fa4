"""The C latent attention (fused.mla_decode / mla_prefill: absorbed W_UK, one pass over the
latent rows for all heads, W_UV after) against attention over the expanded per-head keys and
values (transformers' form) in float64: decode over several sequences of unequal lengths
on scattered slots, prefill after a cached prefix, fp32 and fp16 stores; every SIMD path
(AVX2, AVX-512) gives the same bits."""

from __future__ import annotations

import pytest
import torch
from kernel_paths import outputs_on_every_path

from kvlab.kernels import fused

pytestmark = pytest.mark.skipif(not fused.ENABLED, reason="needs kvlab's C extension")

# (heads, nope, rope, rank, vdim): widths a multiple of 16, of 8 only, and of neither
SHAPES = [(4, 16, 16, 64, 32), (3, 8, 8, 40, 24), (2, 12, 6, 21, 10)]


def _heads(h: int, nope: int, rank: int, vdim: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w_uk = torch.randn(h, nope, rank, generator=g) / rank ** 0.5
    w_uv_t = torch.randn(h, rank, vdim, generator=g) / rank ** 0.5
    return w_uk, w_uv_t


def _store(slots: int, rank: int, rope: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(slots, 1, rank + rope, generator=g).to(dtype)


def expanded(q, rows, w_uk, w_uv_t, scale, causal_from=None):
    """q [n, H, nope + rope] against rows [C, rank + rope]: each head's keys [latent W_UK_h^T
    | k_rope] and values latent W_UV_h^T, softmax attention in float64 -> [n, H * vdim].
    causal_from: query i sees rows [0, causal_from + i]."""
    q, rows, w_uk, w_uv_t = (t.double() for t in (q, rows.float(), w_uk, w_uv_t))
    rank = w_uk.shape[2]
    nope = w_uk.shape[1]
    latent, k_rope = rows[:, :rank], rows[:, rank:]
    keys = torch.cat([torch.einsum("cr,hnr->hcn", latent, w_uk),
                      k_rope.expand(w_uk.shape[0], -1, -1)], dim=-1)  # [H, C, nope + rope]
    values = torch.einsum("cr,hrv->hcv", latent, w_uv_t)  # [H, C, vdim]
    s = torch.einsum("ihd,hcd->hic", q, keys) * scale
    if causal_from is not None:
        seen = torch.arange(rows.shape[0])[None] <= causal_from + torch.arange(q.shape[0])[:, None]
        s = s.masked_fill(~seen, float("-inf"))
    assert keys.shape[-1] == nope + k_rope.shape[1]
    out = torch.einsum("hic,hcv->ihv", s.softmax(-1), values)
    return out.reshape(q.shape[0], -1)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_equals_the_expanded_heads(shape, dtype):
    h, nope, rope, rank, vdim = shape
    w_uk, w_uv_t = _heads(h, nope, rank, vdim, 1)
    store = _store(64, rank, rope, dtype, 2)
    lengths = torch.tensor([5, 17, 1])
    slots = torch.randperm(64, generator=torch.Generator().manual_seed(3))[:3 * 17].view(3, 17)
    q = torch.randn(3, h, nope + rope, generator=torch.Generator().manual_seed(4))
    scale = (nope + rope) ** -0.5 * 1.3  # the YaRN mscale^2 factor rides on the scale
    out = fused.mla_decode(q, store, w_uk, w_uv_t, slots, scale, lengths)
    for b, n in enumerate(lengths.tolist()):
        ref = expanded(q[b:b + 1], store[slots[b, :n], 0], w_uk, w_uv_t, scale)
        assert torch.allclose(out[b:b + 1].double(), ref, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("shape", SHAPES)
def test_prefill_after_a_cached_prefix_equals_the_expanded_heads(shape):
    h, nope, rope, rank, vdim = shape
    w_uk, w_uv_t = _heads(h, nope, rank, vdim, 5)
    store = _store(80, rank, rope, torch.float32, 6)
    start, n = 23, 19  # tiles of 16 keys: a chunk across two tile edges
    slots = torch.randperm(80, generator=torch.Generator().manual_seed(7))[:start + n]
    q = torch.randn(n, h, nope + rope, generator=torch.Generator().manual_seed(8))
    scale = (nope + rope) ** -0.5
    out = fused.mla_prefill(q, store, w_uk, w_uv_t, slots, 0, start, scale)
    ref = expanded(q, store[slots, 0], w_uk, w_uv_t, scale, causal_from=start)
    assert torch.allclose(out.double(), ref, atol=2e-6, rtol=1e-5)


def test_many_heads_split_over_the_thread_pool_give_the_same_rows():
    """Enough weight bytes for the absorb and expand passes to use the pool: each (token,
    head) row is computed alone, so a batch's rows equal each row's own call."""
    h, nope, rope, rank, vdim = 16, 32, 16, 128, 64
    w_uk, w_uv_t = _heads(h, nope, rank, vdim, 9)
    store = _store(96, rank, rope, torch.float32, 10)
    slots = torch.randperm(96, generator=torch.Generator().manual_seed(11))[:4 * 24].view(4, 24)
    q = torch.randn(4, h, nope + rope, generator=torch.Generator().manual_seed(12))
    out = fused.mla_decode(q, store, w_uk, w_uv_t, slots, 0.1)
    for b in range(4):
        alone = fused.mla_decode(q[b:b + 1], store, w_uk, w_uv_t, slots[b:b + 1], 0.1)
        assert torch.equal(out[b:b + 1], alone)


def test_shapes_that_disagree_are_refused():
    w_uk, w_uv_t = _heads(2, 8, 16, 8, 0)
    store = _store(8, 16, 8, torch.float32, 0)
    with pytest.raises(ValueError, match="latent attention shapes do not agree"):
        fused.mla_decode(torch.randn(1, 2, 12), store, w_uk, w_uv_t, torch.zeros(1, 2), 1.0)


def test_every_simd_path_gives_the_same_bits(tmp_path):
    """Portable C aside, this CPU's best path, AVX2 without VNNI and (where `make emu512`
    built it) the emulated AVX-512 path: the same bits, decode and prefill, for widths that
    are multiples of 16, of 8 only, and of neither."""
    script = (
        "import sys, torch\n"
        "from kvlab.kernels import fused\n"
        "outs = []\n"
        f"for h, nope, rope, rank, vdim in {SHAPES!r}:\n"
        "    g = torch.Generator().manual_seed(rank)\n"
        "    w_uk = torch.randn(h, nope, rank, generator=g)\n"
        "    w_uv_t = torch.randn(h, rank, vdim, generator=g)\n"
        "    store = torch.randn(48, 1, rank + rope, generator=g)\n"
        "    slots = torch.randperm(48, generator=g)[:40]\n"
        "    q = torch.randn(21, h, nope + rope, generator=g)\n"
        "    outs.append(fused.mla_decode(q[:2], store, w_uk, w_uv_t, slots.view(2, 20), 0.1))\n"
        "    outs.append(fused.mla_prefill(q, store, w_uk, w_uv_t, slots, 0, 19, 0.1))\n"
        "torch.save(outs, sys.argv[1])\n")
    outs = outputs_on_every_path(script, tmp_path)
    for out in outs[1:]:
        assert len(out) == len(outs[0]) == 2 * len(SHAPES)
        assert all(torch.equal(a, b) for a, b in zip(outs[0], out))
