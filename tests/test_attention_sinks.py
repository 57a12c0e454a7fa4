"""Attention sinks (gpt-oss: a learned logit per head in each softmax's denominator, with no
value) in both C attentions, decode (kernels/csrc/qk_attn.c) and prefill (qk_flash.c), and
in paged_attention's torch path: against a plain float64 torch reference, on both kernel
sets (and the emulated AVX-512 tile, tests/test_kernels_emu512.py), fp32 and fp16 caches,
sliding windows, chunks after a cached prefix and rows of several key chunks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_decode_c import c_steps, logprobs_both_ways, quantized_engine

from kvlab.kernels import fused, ops
from kvlab.models import attention, decode_c
from kvlab.models.attention import SeqSpan, build_metadata, paged_attention
from kvlab.models.kv_store import FloatKV
from tests.test_attention_prefill import CASES
from tests.test_attention_softcap import isa, prefill_mask  # noqa: F401  (a fixture)

from tiny_models import build

pytestmark = pytest.mark.skipif(ops._qk is None, reason="C extension not built")
CPU = torch.device("cpu")


def reference(q, k, v, mask, scale, sinks):
    """float64: q [B, Q, H, D], k/v [B, C, KVH, D], mask [B, Q, C], sinks [H] or None ->
    [B, Q, H, D]: softmax over the scores and the head's sink, the sink's share dropped."""
    q, k, v = (t.double() for t in (q, k, v))
    rep = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(rep, dim=2).transpose(1, 2) for t in (k, v))
    s = (q.transpose(1, 2) @ k.transpose(-1, -2) * scale).masked_fill(~mask[:, None], -torch.inf)
    if sinks is not None:
        sink = sinks.double()[None, :, None, None].expand(*s.shape[:-1], 1)
        s = torch.cat([s, sink], dim=-1)
    p = torch.softmax(s, dim=-1)[..., :k.shape[2]]
    return (p @ v).transpose(1, 2)


def _stores(gen: torch.Generator, rows: int, kv_heads: int, dim: int,
            dtype: torch.dtype) -> list[torch.Tensor]:
    """A random K store and V store [rows, kv_heads, dim]."""
    return [torch.randn(rows, kv_heads, dim, generator=gen).to(dtype) for _ in range(2)]


def _sinks(heads: int, gen: torch.Generator) -> torch.Tensor:
    """Sink logits around the scores' own size, one far above them (that head attends to
    almost nothing) and one far below (the plain softmax)."""
    sinks = torch.randn(heads, generator=gen) * 2
    sinks[0] = 12.0
    sinks[-1] = -30.0 if heads > 1 else sinks[-1]
    return sinks


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.usefixtures("isa")
def test_prefill_with_sinks_matches_the_float_reference(case, dtype):
    n, start, first, heads, kv_heads, dim, window = case
    gen = torch.Generator().manual_seed(n + start)
    sinks = _sinks(heads, gen)
    keys = start + n - first
    k_store, v_store = _stores(gen, keys + 40, kv_heads, dim, dtype)
    slots = torch.randperm(keys + 40, generator=gen)[:keys]
    q = torch.randn(n, heads, dim, generator=gen) * 2
    got = fused.attend_prefill(q, k_store, v_store, slots, first, start, window, dim ** -0.5,
                               sinks=sinks)
    args = (q[None], k_store[slots][None], v_store[slots][None],
            prefill_mask(n, start, first, window), dim ** -0.5)
    ref, plain = reference(*args, sinks)[0], reference(*args, None)[0]
    assert torch.allclose(got.double(), ref, atol=1e-5, rtol=1e-5), (got - ref).abs().max()
    assert (plain - ref).abs().max() > 1e-2  # the sinks changed the answer


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 1, 256), (4, 2, 64), (6, 3, 24)])
@pytest.mark.usefixtures("isa")
def test_decode_with_sinks_matches_the_float_reference(heads, kv_heads, dim, dtype):
    """Rows of one, two and a partial 256-key chunk: the sink joins the chunks' merge."""
    gen = torch.Generator().manual_seed(heads + dim)
    sinks = _sinks(heads, gen)
    lengths = torch.tensor([600, 7, 257])
    width, num_slots = 600, 900
    k, v = _stores(gen, num_slots, kv_heads, dim, dtype)
    slots = torch.stack([torch.randperm(num_slots, generator=gen)[:width] for _ in range(3)])
    q = torch.randn(3, heads, dim, generator=gen) * 2
    got = fused.attend_decode(q, k, v, slots, dim ** -0.5, lengths, sinks=sinks)
    mask = (torch.arange(width)[None] < lengths[:, None])[:, None]  # [B, 1, C]
    ref = reference(q[:, None], k[slots], v[slots], mask, dim ** -0.5, sinks)[:, 0]
    assert torch.allclose(got.double(), ref, atol=1e-5, rtol=1e-5), (got - ref).abs().max()


@pytest.mark.usefixtures("isa")
def test_no_sinks_is_the_plain_kernel():
    """sinks=None passes a null pointer: the same bits as before sinks existed (softmax
    with no extra logit), and a sink of -inf is that too."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(40, 4, 64, generator=gen)
    k, v = (torch.randn(100, 2, 64, generator=gen) for _ in range(2))
    slots = torch.randperm(100, generator=gen)
    minus_inf = torch.full((4,), -torch.inf)
    for window in (0, 12):
        plain = fused.attend_prefill(q[10:], k, v, slots[:40], 0, 10, window, 0.125)
        ref = reference(q[None, 10:], k[slots[:40]][None], v[slots[:40]][None],
                        prefill_mask(30, 10, 0, window), 0.125, None)[0]
        assert torch.allclose(plain.double(), ref, atol=1e-5, rtol=1e-5)
        assert torch.equal(plain, fused.attend_prefill(q[10:], k, v, slots[:40], 0, 10, window,
                                                       0.125, sinks=minus_inf))
    dslots = slots[:60].view(2, 30)
    assert torch.equal(fused.attend_decode(q[:2], k, v, dslots, 0.125),
                       fused.attend_decode(q[:2], k, v, dslots, 0.125, sinks=minus_inf))


def test_sinks_of_the_wrong_shape_are_refused():
    k = torch.randn(8, 1, 16)
    with pytest.raises(ValueError, match=r"sinks must be fp32 CPU \[2\]"):
        fused.attend_decode(torch.randn(1, 2, 16), k, k, torch.tensor([[0, 1]]), 0.25,
                            sinks=torch.zeros(3))


def _mixed_step(window):
    """A fresh prompt, a chunk after a cached prefix and a decode in one step."""
    spans = [SeqSpan(0, 40, torch.arange(40)), SeqSpan(25, 30, torch.arange(100, 155)),
             SeqSpan(9, 1, torch.arange(200, 210))]
    return spans, build_metadata(spans, window, CPU)


@pytest.mark.parametrize("window", [None, 16])
def test_paged_attention_with_sinks_c_and_torch_paths_match_the_reference(window):
    gen = torch.Generator().manual_seed(2)
    spans, meta = _mixed_step(window)
    q = torch.randn(71, 8, 32, generator=gen) * 2
    k, v = (torch.randn(71, 2, 32, generator=gen) for _ in range(2))
    sinks = _sinks(8, gen)
    outs = []
    for c_on in (True, False):
        fill = torch.Generator().manual_seed(3)  # the cached prefixes, same for both
        cache = FloatKV(256, 2, 32, torch.float32, CPU)
        cache.k.copy_(torch.randn(256, 2, 32, generator=fill))
        cache.v.copy_(torch.randn(256, 2, 32, generator=fill))
        with pytest.MonkeyPatch.context() as mp:
            if c_on:  # neither SDPA nor the torch scores may run
                mp.setattr(F, "scaled_dot_product_attention", _refuse)
                mp.setattr(attention, "_scored", _refuse)
            else:
                mp.setattr(attention, "_c_stores", lambda *a: None)
            outs.append(paged_attention(q, k, v, cache, meta, window is not None, scale=0.2,
                                        sinks=sinks).view(71, 8, 32))
    row = 0
    for s in spans:  # each sequence against the reference over its cached + new keys
        n, end = s.num_new, s.end
        first = 0 if window is None else max(0, s.start - window + 1)
        keys, values = cache.k[s.slots[first:end]][None], cache.v[s.slots[first:end]][None]
        mask = prefill_mask(n, s.start, first, window or 0)
        ref = reference(q[None, row:row + n], keys, values, mask, 0.2, sinks)[0]
        for out in outs:
            assert torch.allclose(out[row:row + n].double(), ref, atol=1e-5, rtol=1e-5)
        row += n


def test_the_one_call_decode_layers_fold_the_sinks(tmp_path, monkeypatch):
    """A layer's sinks in the C decode plan (qk_decode.c) give the per-op path's bits: a
    tiny Llama quantized at load, given sinks, decoded both ways past its prompt."""
    build("llama", tmp_path)
    engine = quantized_engine(tmp_path, "q8_0")
    model = engine.runner.model
    gen = torch.Generator().manual_seed(8)
    for layer in model.layers:
        layer["sinks"] = _sinks(model.config.num_heads, gen)
    model.c_plan = decode_c.build_plan(model.config, model.layers, "silu")
    ran, ids = c_steps(monkeypatch), list(range(3, 30))
    fast, slow = logprobs_both_ways(engine, ids, 5)
    assert ran[1:] == [True] * (len(ids) - 5)  # each decode step in the C layers
    assert torch.equal(fast, slow)


def _refuse(*args, **kwargs):
    raise AssertionError("the torch path was asked for")
