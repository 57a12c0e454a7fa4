"""KV stores: float dtypes round-trip, q8_0 matches GGUF's Q8_0 numerics, and paged
attention through each store stays close to the f32 cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from kvlab.cost import KV_BYTES_PER_ELEMENT
from kvlab.models.kv_store import (
    KV_DTYPES,
    Q8KV,
    dequantize_q8,
    kv_bytes_per_element,
    make_kv,
    quantize_q8,
)


def test_q8_matches_gguf_reference_dequantization():
    x = torch.randn(64, 4, 64) * 5
    q, scale = quantize_q8(x)
    ours = dequantize_q8(q, scale, torch.float32)
    ref = dequantize(quantize(x.numpy().reshape(-1, 64), GGMLQuantizationType.Q8_0),
                     GGMLQuantizationType.Q8_0).reshape(x.shape)
    # same block layout and rounding: at most one quantization step apart, mostly equal
    step = scale.float().expand(-1, -1, -1, 32).flatten(-2)
    diff = (ours - torch.from_numpy(np.ascontiguousarray(ref))).abs()
    assert (diff <= step * 1.01).all()
    assert (diff < 1e-6).float().mean() > 0.99


def test_q8_store_writes_in_c_what_quantize_q8_gives():
    pytest.importorskip("kvlab.kernels._qk")
    x = torch.randn(7, 2, 64) * 3
    x[0, 0, :32] = 0.0  # a block of zeros: scale 0
    x[1, 1, :32] = torch.arange(32) - 15.5  # ties at .5 steps after scaling
    x[2] = x[2].to(torch.float16).float()  # values an fp16 scale divides evenly
    slots = torch.tensor([5, 0, 9, 3, 11, 2, 7])
    store = Q8KV(12, 2, 64, torch.device("cpu"))
    assert store._c_writes(slots, x, -x)  # the C write, not quantize_q8 itself
    store.write(slots, x, -x)
    q, scale = quantize_q8(x)
    assert torch.equal(store.k[slots], q) and torch.equal(store.k_scale[slots], scale)
    q, scale = quantize_q8(-x)
    assert torch.equal(store.v[slots], q) and torch.equal(store.v_scale[slots], scale)


def test_q8_store_write_gather_and_size():
    store = make_kv("q8_0", 32, 2, 64, torch.device("cpu"))
    assert isinstance(store, Q8KV)
    k, v = torch.randn(5, 2, 64), torch.randn(5, 2, 64)
    slots = torch.tensor([3, 9, 10, 20, 31])
    store.write(slots, k, v)
    kg, vg = store.gather(slots[None], torch.float32)
    assert kg.shape == (1, 5, 2, 64)
    assert (kg[0] - k).abs().max() <= k.abs().max() / 127
    assert (vg[0] - v).abs().max() <= v.abs().max() / 127
    assert kv_bytes_per_element("q8_0") == 34 / 32  # half of f16 and a little more


@pytest.mark.parametrize("kind", ["f16", "bf16", "q8_0"])
def test_engine_runs_with_each_kv_dtype(tmp_path, kind):
    from kvlab.engine import Engine, EngineConfig

    from tiny_models import build

    build("llama", tmp_path, num_attention_heads=2)  # head_dim 32: one q8_0 block
    ref = Engine.from_model(str(tmp_path / "model.gguf"), EngineConfig(block_size=4,
                                                                       kv_dtype="f32"))
    other = Engine.from_model(str(tmp_path / "model.gguf"),
                              EngineConfig(block_size=4, kv_dtype=kind))
    ids = list(range(1, 40))
    a = ref.teacher_forced_logprobs(ids, 8)
    b = other.teacher_forced_logprobs(ids, 8)
    kl = (a.exp() * (a - b)).sum(-1)
    assert kl.max() < 1e-2
    assert other.cost.kv_bytes_per_token < ref.cost.kv_bytes_per_token


def test_q8_kv_needs_head_dim_in_blocks_of_32(tmp_path):
    from kvlab.engine import Engine, EngineConfig
    from kvlab.errors import KvlabError

    from tiny_models import build

    build("qwen2", tmp_path)  # head_dim 16
    with pytest.raises(KvlabError, match="head_dim divisible by 32"):
        Engine.from_model(str(tmp_path / "model.gguf"), EngineConfig(kv_dtype="q8_0"))


@pytest.mark.parametrize("kind", ["f16", "q8_0"])
def test_reserve_zeroes_the_first_and_last_slots_only(kind):
    store = make_kv(kind, 40, 2, 64, torch.device("cpu"))
    tensors = [t for t in vars(store).values() if isinstance(t, torch.Tensor)]
    for t in tensors:
        t.fill_(7)
    store.reserve(first=16, last=8)  # what a 10-token sequence with 8-token blocks writes
    for t in tensors:
        assert (t[:16] == 0).all() and (t[32:] == 0).all()
        assert (t[16:32] == 7).all()  # the rest is left for when it is written
    store.reserve()
    assert all((t == 0).all() for t in tensors)


def test_engine_reserve_covers_the_first_sequence(tmp_path):
    from kvlab.engine import Engine, EngineConfig
    from kvlab.request import SamplingParams

    from tiny_models import build

    build("llama", tmp_path)
    engine = Engine.from_model(str(tmp_path / "model.gguf"),
                               EngineConfig(block_size=4, kv_dtype="f32", kv_cache_gib=0.01))
    for cache in engine.runner.kv_caches:
        cache.k.fill_(float("nan"))
    engine.reserve_kv_memory(tokens=7)  # two blocks of 4
    for cache in engine.runner.kv_caches:
        assert (cache.k[:8] == 0).all() and (cache.k[-4:] == 0).all()
        assert cache.k[8:-4].isnan().all()
    engine.add_request("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=2, temperature=0))
    while engine.has_unfinished():
        engine.step()  # its 6 written positions are in the reserved slots, at the front
    for cache in engine.runner.kv_caches:
        assert not cache.k[:6].isnan().any() and cache.k[8:-4].isnan().all()


@pytest.mark.parametrize("kind", KV_DTYPES)
def test_kv_bytes_table_is_what_a_store_holds(kind):
    """kvlab.cost's table (read by pool sizing and the estimator) against the store's
    own tensors: bytes held per cached value."""
    store = make_kv(kind, 4, 2, 64, torch.device("cpu"))
    held = sum(t.numel() * t.element_size() for t in store.tensors())
    assert held / 2 / (4 * 2 * 64) == kv_bytes_per_element(kind)


def test_the_kv_table_names_every_store():
    assert set(KV_BYTES_PER_ELEMENT) == set(KV_DTYPES)
