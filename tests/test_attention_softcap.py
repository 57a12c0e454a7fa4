"""Soft-capped scores (Gemma 2: s -> cap * tanh(s / cap)) in both C attentions, decode
(kernels/csrc/qk_attn.c) and prefill (qk_flash.c): against a float64 reference, on both
kernel sets, fp32 and fp16 caches, sliding windows and chunks after a cached prefix; cap 0
is the uncapped kernel; and paged_attention takes the C kernels for a capped model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvlab.kernels import fused, ops
from kvlab.models import attention
from kvlab.models.attention import SeqSpan, build_metadata, paged_attention
from kvlab.models.kv_store import FloatKV
from tests.test_attention_prefill import CASES
from tests.test_kernels import ISAS

pytestmark = pytest.mark.skipif(ops._qk is None, reason="C extension not built")
CPU = torch.device("cpu")
CAP = 2.0  # scores of 3 x randn queries reach well past it: the cap bends them


@pytest.fixture(params=ISAS)
def isa(request):
    ops._qk.set_isa(request.param)
    yield request.param
    ops._qk.set_isa("auto")


def reference(q, k, v, mask, scale, cap):
    """float64: q [B, Q, H, D], k/v [B, C, KVH, D], mask [B, Q, C] -> [B, Q, H, D]."""
    q, k, v = (t.double() for t in (q, k, v))
    rep = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(rep, dim=2).transpose(1, 2) for t in (k, v))
    s = q.transpose(1, 2) @ k.transpose(-1, -2) * scale  # [B, H, Q, C]
    if cap:
        s = torch.tanh(s / cap) * cap
    s = s.masked_fill(~mask[:, None], float("-inf"))
    return (torch.softmax(s, dim=-1) @ v).transpose(1, 2)


def prefill_mask(n, start, first, window):
    q_pos, k_pos = torch.arange(start, start + n), torch.arange(first, start + n)
    mask = k_pos[None] <= q_pos[:, None]
    if window:
        mask &= (q_pos[:, None] - k_pos[None]) < window
    return mask[None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_capped_prefill_matches_the_float_reference(case, dtype, isa):
    n, start, first, heads, kv_heads, dim, window = case
    gen = torch.Generator().manual_seed(n + start)
    keys = start + n - first
    k_store, v_store = (torch.randn(keys + 40, kv_heads, dim, generator=gen).to(dtype)
                        for _ in range(2))
    slots = torch.randperm(keys + 40, generator=gen)[:keys]
    q = torch.randn(n, heads, dim, generator=gen) * 3
    got = fused.attend_prefill(q, k_store, v_store, slots, first, start, window, dim ** -0.5,
                               softcap=CAP)
    mask = prefill_mask(n, start, first, window)
    ref = reference(q[None], k_store[slots][None], v_store[slots][None], mask, dim ** -0.5,
                    CAP)[0]
    uncapped = reference(q[None], k_store[slots][None], v_store[slots][None], mask,
                         dim ** -0.5, 0)[0]
    assert torch.allclose(got.double(), ref, atol=2e-6, rtol=1e-5), (got - ref).abs().max()
    assert (uncapped - ref).abs().max() > 1e-2  # the cap changed the answer


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 1, 256), (4, 2, 64), (6, 1, 24)])
def test_capped_decode_matches_the_float_reference(heads, kv_heads, dim, dtype, isa):
    gen = torch.Generator().manual_seed(heads + dim)
    width, num_slots = 300, 700  # rows past one 256-key chunk, one short one
    q = torch.randn(3, heads, dim, generator=gen) * 3
    k, v = (torch.randn(num_slots, kv_heads, dim, generator=gen).to(dtype) for _ in range(2))
    slots = torch.stack([torch.randperm(num_slots, generator=gen)[:width] for _ in range(3)])
    lengths = torch.tensor([300, 7, 257])
    got = fused.attend_decode(q, k, v, slots, dim ** -0.5, lengths, softcap=CAP)
    mask = (torch.arange(width)[None] < lengths[:, None])[:, None]  # [B, 1, C]
    ref = reference(q[:, None], k[slots], v[slots], mask, dim ** -0.5, CAP)[:, 0]
    assert torch.allclose(got.double(), ref, atol=2e-6, rtol=1e-5), (got - ref).abs().max()


def test_cap_0_is_the_uncapped_kernel(isa):
    """0 skips the cap's step: the same bits as a call that passes none."""
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(40, 4, 64, generator=gen)
    k, v = (torch.randn(100, 2, 64, generator=gen) for _ in range(2))
    slots = torch.randperm(100, generator=gen)
    for window in (0, 12):
        plain = fused.attend_prefill(q[10:], k, v, slots[:40], 0, 10, window, 0.125)
        zero = fused.attend_prefill(q[10:], k, v, slots[:40], 0, 10, window, 0.125,
                                    softcap=0.0)
        assert torch.equal(plain, zero)
    dslots = slots[:60].view(2, 30)
    assert torch.equal(fused.attend_decode(q[:2], k, v, dslots, 0.125),
                       fused.attend_decode(q[:2], k, v, dslots, 0.125, softcap=0.0))


def test_a_negative_cap_is_refused():
    k = torch.randn(8, 1, 16)
    with pytest.raises(ValueError, match="soft-cap"):
        fused.attend_decode(torch.randn(1, 2, 16), k, k, torch.tensor([[0, 1]]), 0.25,
                            softcap=-1.0)


@pytest.mark.parametrize("window", [None, 16])
def test_paged_attention_caps_in_c_as_the_torch_path_does(window):
    """A fresh prompt, a chunk after a cached prefix and a decode in one step, fp32 and fp16
    caches: the C kernels (SDPA and the torch cap never called) against the torch cap."""
    gen = torch.Generator().manual_seed(2)
    spans = [SeqSpan(0, 40, torch.arange(40)), SeqSpan(25, 30, torch.arange(100, 155)),
             SeqSpan(9, 1, torch.arange(200, 210))]
    q = torch.randn(71, 8, 32, generator=gen) * 3
    k, v = (torch.randn(71, 2, 32, generator=gen) for _ in range(2))
    meta = build_metadata(spans, window, CPU)
    for dtype in (torch.float32, torch.float16):
        outs = []
        for c_on in (True, False):
            fill = torch.Generator().manual_seed(3)  # the cached prefixes, same for both
            cache = FloatKV(256, 2, 32, dtype, CPU)
            cache.k.copy_(torch.randn(256, 2, 32, generator=fill))
            cache.v.copy_(torch.randn(256, 2, 32, generator=fill))
            with pytest.MonkeyPatch.context() as mp:
                if c_on:
                    mp.setattr(F, "scaled_dot_product_attention", _refuse)
                    mp.setattr(attention, "_scored", _refuse)
                else:
                    mp.setattr(attention, "_c_stores", lambda *a: None)
                outs.append(paged_attention(q, k, v, cache, meta, window is not None,
                                            scale=0.2, softcap=CAP))
        assert torch.allclose(outs[0], outs[1], atol=2e-6, rtol=1e-5)


def _refuse(*args):
    raise AssertionError("the torch path was asked for")
