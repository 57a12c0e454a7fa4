"""Prefill attention in C from the paged cache (kernels/csrc/qk_flash.c): against SDPA with
an explicit mask, chunk-invariant to the bit, and the engine's path for prefill chunks; and
both C attentions reading a q8_0 cache as stored."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_paths import outputs_on_every_path

from kvlab.kernels import fused, ops
from kvlab.models.attention import SeqSpan, build_metadata, paged_attention
from kvlab.models.kv_store import Q8KV, FloatKV, dequantize_q8, quantize_q8
from tests.test_kernels import ISAS

pytestmark = pytest.mark.skipif(ops._qk is None, reason="C extension not built")
CPU = torch.device("cpu")


def reference(q, k, v, first, start, window, scale):
    """q [n, H, D] at positions start.., k/v [C, KVH, D] at positions first.."""
    n, c = q.shape[0], k.shape[0]
    q_pos, k_pos = torch.arange(start, start + n), torch.arange(first, first + c)
    mask = k_pos[None] <= q_pos[:, None]
    if window:
        mask &= (q_pos[:, None] - k_pos[None]) < window
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                       v.transpose(0, 1)[None], attn_mask=mask[None, None],
                                       scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


@pytest.fixture(params=ISAS)
def isa(request):
    ops._qk.set_isa(request.param)
    yield request.param
    ops._qk.set_isa("auto")


# (tokens, start, first, heads, kv heads, head dim, window): offsets off the 16-key tiles,
# GQA and MHA, head dims the AVX2 path takes (multiples of 16) and one it leaves to C (24)
CASES = [(37, 0, 0, 4, 1, 256, 0), (50, 30, 0, 8, 2, 64, 0), (64, 100, 60, 4, 4, 128, 41),
         (5, 3, 0, 2, 1, 32, 0), (300, 500, 489, 4, 1, 256, 12), (19, 7, 0, 6, 3, 24, 5),
         (2, 0, 0, 1, 1, 16, 0)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_prefill_matches_sdpa_from_shuffled_slots(case, dtype, isa):
    n, start, first, heads, kv_heads, dim, window = case
    gen = torch.Generator().manual_seed(n + start)
    keys = start + n - first
    k_store, v_store = (torch.randn(keys + 40, kv_heads, dim, generator=gen).to(dtype)
                        for _ in range(2))
    slots = torch.randperm(keys + 40, generator=gen)[:keys]
    q = torch.randn(n, heads, dim, generator=gen)
    got = fused.attend_prefill(q, k_store, v_store, slots, first, start, window, dim ** -0.5)
    ref = reference(q, k_store[slots].float(), v_store[slots].float(), first, start, window,
                    dim ** -0.5)
    assert torch.allclose(got, ref, atol=2e-6, rtol=1e-5), (got - ref).abs().max()


@pytest.mark.parametrize("window", [0, 24])
def test_a_query_gets_the_same_bits_however_the_prompt_is_chunked(window, isa):
    gen = torch.Generator().manual_seed(1)
    total, heads, kv_heads, dim = 90, 4, 2, 64
    q = torch.randn(total, heads, dim, generator=gen)
    k_store, v_store = (torch.randn(total, kv_heads, dim, generator=gen) for _ in range(2))
    slots = torch.randperm(total, generator=gen)
    whole = fused.attend_prefill(q, k_store, v_store, slots, 0, 0, window, 0.125)
    start = 0
    for chunk in (37, 2, 29, 22):
        first = max(0, start - window + 1) if window else 0
        part = fused.attend_prefill(q[start:start + chunk], k_store, v_store,
                                    slots[first:start + chunk], first, start, window, 0.125)
        assert torch.equal(part, whole[start:start + chunk])
        start += chunk


def test_engine_prefill_chunks_take_the_c_path_and_match_the_torch_one():
    """paged_attention on a batch of a fresh prompt and a chunk after a cached prefix, over
    fp32 and fp16 caches: C (the default on CPUs) against torch's gather + SDPA."""
    gen = torch.Generator().manual_seed(2)
    spans = [SeqSpan(0, 40, torch.arange(40)), SeqSpan(25, 30, torch.arange(100, 155)),
             SeqSpan(9, 1, torch.arange(200, 210))]
    q = torch.randn(71, 8, 32, generator=gen)
    k, v = (torch.randn(71, 2, 32, generator=gen) for _ in range(2))
    for dtype in (torch.float32, torch.float16):
        for window in (None, 16):
            meta = build_metadata(spans, window, CPU)
            outs = []
            for c_on in (True, False):
                fill = torch.Generator().manual_seed(3)  # the cached prefixes, same for both
                cache = FloatKV(256, 2, 32, dtype, CPU)
                cache.k.copy_(torch.randn(256, 2, 32, generator=fill))
                cache.v.copy_(torch.randn(256, 2, 32, generator=fill))
                with pytest.MonkeyPatch.context() as mp:
                    if c_on:  # C for every group: SDPA is never called
                        mp.setattr(F, "scaled_dot_product_attention", _refuse)
                    else:
                        mp.setattr("kvlab.models.attention._prefill_in_c", lambda *a: False)
                    outs.append(paged_attention(q, k, v, cache, meta, window is not None,
                                                scale=0.2))
            assert torch.allclose(outs[0], outs[1], atol=2e-6, rtol=1e-5)


def _refuse(*args):
    raise AssertionError("the torch path was asked for")


def q8_store(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int8 values and fp16 scales as Q8KV holds them, and what they stand for in fp32."""
    q, scale = quantize_q8(values)
    return q, scale.contiguous(), dequantize_q8(q, scale, torch.float32)


@pytest.mark.parametrize("case", [c for c in CASES if c[5] % 32 == 0])
def test_prefill_reads_q8_0_as_the_values_it_stands_for(case, isa):
    n, start, first, heads, kv_heads, dim, window = case
    gen = torch.Generator().manual_seed(n + 7)
    keys = start + n - first
    (kq, ks, kf), (vq, vs, vf) = (q8_store(torch.randn(keys + 9, kv_heads, dim, generator=gen))
                                  for _ in range(2))
    slots = torch.randperm(keys + 9, generator=gen)[:keys]
    q = torch.randn(n, heads, dim, generator=gen)
    got = fused.attend_prefill(q, kq, vq, slots, first, start, window, 0.1, ks, vs)
    want = fused.attend_prefill(q, kf, vf, slots, first, start, window, 0.1)
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-5)


def test_decode_reads_q8_0_as_the_values_it_stands_for(isa):
    gen = torch.Generator().manual_seed(4)
    (kq, ks, kf), (vq, vs, vf) = (q8_store(torch.randn(700, 2, 64, generator=gen))
                                  for _ in range(2))
    slots = torch.randperm(700, generator=gen)[:600].view(2, 300)
    q = torch.randn(2, 8, 64, generator=gen)
    lengths = torch.tensor([300, 123])
    got = fused.attend_decode(q, kq, vq, slots, 0.125, lengths, ks, vs)
    want = fused.attend_decode(q, kf, vf, slots, 0.125, lengths)
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-5)


def test_a_q8_0_cache_takes_the_c_paths_and_matches_its_gather():
    gen = torch.Generator().manual_seed(5)
    spans = [SeqSpan(0, 40, torch.arange(40)), SeqSpan(25, 30, torch.arange(100, 155)),
             SeqSpan(9, 1, torch.arange(200, 210))]
    q = torch.randn(71, 8, 32, generator=gen)
    k, v = (torch.randn(71, 2, 32, generator=gen) for _ in range(2))
    meta = build_metadata(spans, 16, CPU)
    outs = []
    for c_on in (True, False):
        cache = Q8KV(256, 2, 32, CPU)
        cache.write(torch.arange(256), *(torch.randn(256, 2, 32, generator=torch.Generator()
                                                     .manual_seed(6)) for _ in range(2)))
        with pytest.MonkeyPatch.context() as mp:
            if c_on:
                mp.setattr(F, "scaled_dot_product_attention", _refuse)
            else:
                mp.setattr(Q8KV, "c_stores", lambda self: None)
            outs.append(paged_attention(q, k, v, cache, meta, True, scale=0.2))
    assert torch.allclose(outs[0], outs[1], atol=2e-6, rtol=1e-5)


def test_the_avx512_tile_gives_the_avx2_tiles_bits(tmp_path):
    """Where AVX-512 runs, prefill takes 8 query rows a tile in zmm; with KVLAB_NO_VNNI=1 the
    4-row AVX2 tile runs instead (and the zmm tile emulated, where `make emu512` built it).
    All must give the same bits, for every cache kind."""

    script = (
        "import sys, torch\n"
        "from kvlab.kernels import fused\n"
        "from kvlab.models.kv_store import quantize_q8\n"
        f"cases = {[c for c in CASES if c[5] % 32 == 0]!r}\n"
        "outs = []\n"
        "for n, start, first, heads, kvh, dim, window in cases:\n"
        "    g = torch.Generator().manual_seed(n)\n"
        "    keys = start + n - first\n"
        "    k, v = (torch.randn(keys + 5, kvh, dim, generator=g) for _ in range(2))\n"
        "    slots = torch.randperm(keys + 5, generator=g)[:keys]\n"
        "    q = torch.randn(n, heads, dim, generator=g)\n"
        "    for kk, vv, sc in ((k, v, ()), (k.half(), v.half(), ()),\n"
        "                       (quantize_q8(k)[0], quantize_q8(v)[0],\n"
        "                        (quantize_q8(k)[1].contiguous(), quantize_q8(v)[1].contiguous()))):\n"
        "        outs.append(fused.attend_prefill(q, kk, vv, slots, first, start, window, 0.1,\n"
        "                                         *sc, softcap=30.0 if window else 0.0))\n"
        "torch.save(outs, sys.argv[1])\n")
    outs = outputs_on_every_path(script, tmp_path)
    for out in outs[1:]:
        assert len(out) == len(outs[0]) > 0
        for a, b in zip(outs[0], out):
            assert torch.equal(a, b)
