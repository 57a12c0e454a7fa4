"""A dense model's decode layers as one C call give bit-identical logits to the per-op path,
on every architecture's tiny model quantized at load (every product then has a C kernel;
Gemma 2's soft-capped scores included) and on the real model. Mixture-of-experts layers
route in C (fp32 router, softmax, top-k) and run a shared expert's sigmoid gate in C: the
same experts, logits equal up to the fp32 rounding of those gates."""

from __future__ import annotations

import pytest
import torch

from kvlab.engine import Engine, EngineConfig
from kvlab.kernels import fused
from kvlab.models import decode_c
from kvlab.models.loader import LoadOptions, load_model
from kvlab.request import SamplingParams
from kvlab.tokenizer import load_gguf_tokenizer
from kvlab.weights.checkpoint import open_checkpoint

from tiny_models import ARCHS, MOE_ARCHS, build, build_gpt_oss

pytestmark = pytest.mark.skipif(not fused.ENABLED, reason="needs kvlab's C extension")


def quantized_engine(out, quant: str, kv_dtype: str = "f32") -> Engine:
    """The tiny HF model quantized at load (its GGUF copy only lends the tokenizer)."""
    loaded = load_model(open_checkpoint(out / "hf"), LoadOptions(quantize=quant))
    tokenizer = load_gguf_tokenizer(open_checkpoint(out / "model.gguf").metadata)
    return Engine(loaded, tokenizer, EngineConfig(block_size=4, kv_dtype=kv_dtype))


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_tiny_quantized_moe_model_in_the_c_layers(tmp_path, arch, monkeypatch):
    """The router's and the shared expert gate's products in C round differently from
    torch's: logprobs within 1e-5."""
    build(arch, tmp_path)
    engine = quantized_engine(tmp_path, "q8_0")
    ran, ids = c_steps(monkeypatch), list(range(3, 40))
    fast, slow = logprobs_both_ways(engine, ids, 5)
    assert ran[1:] == [True] * (len(ids) - 5)  # the prefill per-op, each decode step in C
    assert (fast - slow).abs().max() <= 1e-5


@pytest.mark.parametrize("family, overrides", [
    ("gpt_oss", {}), ("glm4moe", {}), ("glm4moe", {"n_group": 4, "topk_group": 2})])
def test_gpt_oss_and_glm4moe_in_the_c_layers(tmp_path, monkeypatch, family, overrides):
    """gpt-oss (o bias, the biased router's top k then softmax, expert biases, clamped
    SwiGLU, sinks, sliding layers) and GLM-4.5 (its dense first layer, the sigmoid router
    with its correction bias and grouped top k, routed scaling, the ungated shared expert)
    decode in the one C call with the per-op path's logprobs, within 1e-5."""
    if family == "gpt_oss":
        build_gpt_oss(tmp_path)
    else:
        build(family, tmp_path, **overrides)
    engine = quantized_engine(tmp_path, "q8_0")
    model = engine.runner.model
    if family == "glm4moe":
        assert "router" not in model.layers[0] and model.config.moe.routed_scale == 2.5
        assert model.config.moe.groups == overrides.get("n_group", 1)
        assert "shexp_gate_up" in model.layers[1] and "shexp_router" not in model.layers[1]
    else:
        assert "o_bias" in model.layers[0] and model.layers[0]["experts"].gate is not None
    ran, ids = c_steps(monkeypatch), list(range(3, 40))
    fast, slow = logprobs_both_ways(engine, ids, 5)
    assert ran[1:] == [True] * (len(ids) - 5)
    assert (fast - slow).abs().max() <= 1e-5


def c_steps(monkeypatch) -> list[bool]:
    """What each decode_c.run call from now on returns (True: the C layers ran the step)."""
    ran, run = [], decode_c.run
    monkeypatch.setattr(decode_c, "run", lambda *args: ran.append(run(*args)) or ran[-1])
    return ran


def test_a_shared_expert_is_in_the_plan(tmp_path):
    """Qwen2-MoE's shared expert takes the dense MLP's fields and its gate shexp_gate."""
    build("qwen2moe", tmp_path)
    model = quantized_engine(tmp_path, "q8_0").runner.model
    row, layer = model.c_plan.weights[0].tolist(), model.layers[0]
    assert layer["shexp_router"].data_ptr() in row and row[-1] == 0  # gated: shexp_ungated 0
    down = list(layer["shexp_down"].kernel_args)
    assert any(row[i:i + 5] == down for i in range(len(row)))


def logprobs_both_ways(engine: Engine, ids: list[int], prefill: int):
    model = engine.runner.model
    assert model.c_plan is not None
    fast = engine.teacher_forced_logprobs(ids, prefill)
    plan, model.c_plan = model.c_plan, None
    try:
        slow = engine.teacher_forced_logprobs(ids, prefill)
    finally:
        model.c_plan = plan
    return fast, slow


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kv_dtype", ["f32", "f16"])
def test_tiny_quantized_model_is_bit_identical(tmp_path, arch, kv_dtype):
    build(arch, tmp_path)
    check_bit_identical(tmp_path, kv_dtype)


def test_q8_0_kv_in_the_c_layers_is_bit_identical(tmp_path):
    build("llama", tmp_path, num_attention_heads=2)  # q8_0 KV: whole blocks of 32 per head
    check_bit_identical(tmp_path, "q8_0")


def check_bit_identical(tmp_path, kv_dtype):
    engine = quantized_engine(tmp_path, "q8_0", kv_dtype)
    ids = list(range(3, 40))  # past the sliding window of 4 keys
    fast, slow = logprobs_both_ways(engine, ids, 5)
    plan = engine.runner.model.c_plan
    assert plan.caches(engine.runner.kv_caches) is not None  # the C layers took the stores
    assert plan.kv_kind == {"f32": 0, "f16": 1, "q8_0": 2}[kv_dtype]
    assert torch.equal(fast, slow)


@pytest.mark.parametrize("arch", ARCHS + MOE_ARCHS)
def test_batched_greedy_alone_and_together(tmp_path, arch):
    build(arch, tmp_path)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[3, 14, 15, 92, 65], list(range(20, 57)), [7] * 9]

    def run(batch):
        e = quantized_engine(tmp_path, "q8_0")
        assert e.runner.model.c_plan is not None
        for i, p in enumerate(batch):
            e.add_request(str(i), p, params)
        got = {str(i): [] for i in range(len(batch))}
        while e.has_unfinished():
            for out in e.step():
                got[out.request_id].extend(out.new_token_ids)
        return [got[str(i)] for i in range(len(batch))]

    together = run(prompts)
    assert [run([p])[0] for p in prompts] == together


@pytest.mark.slow
def test_default_model_is_bit_identical(default_llm):
    engine = default_llm.engine
    ids = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 12)
    fast, slow = logprobs_both_ways(engine, ids, 8)
    assert torch.equal(fast, slow)
