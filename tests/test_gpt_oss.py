"""gpt-oss on a tiny random config: kvlab's logits against transformers' (fp32, max abs diff
<= 1e-4) for prefill, paged decode past the sliding window, chunked prefill and a batch of
unequal prompts, from the safetensors, the gguf writer's GGUF and llama.cpp's converter's
GGUF; the C attention (sinks in the kernels) against the torch path; routing and the
clamped SwiGLU against transformers' own modules."""

from __future__ import annotations

import pytest
import test_families_2025
import test_models
import torch
from gguf import GGMLQuantizationType as T
from test_models import reference_logits, runner_for, step

from kvlab.models import attention, find_arch, gpt_oss, moe
from kvlab.models.loader import LoadOptions, load_model
from kvlab.scheduler import ScheduledSeq
from kvlab.weights.checkpoint import open_checkpoint

from tiny_models import (
    build_gpt_oss,
    convert_with_llama_cpp,
    mxfp4_rounded,
    save_gpt_oss_mxfp4,
    write_gpt_oss_gguf,
)

TOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpt_oss")
    return build_gpt_oss(out), out


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _prefill_then_decode(runner, hf, ids: list[int], split: int) -> float:
    """Max logit error against transformers: prompt ids[:split], then one token a step."""
    ref = reference_logits(hf, ids)
    table = [9, 3, 17, 0]  # scattered, out-of-order blocks: paging must not matter
    logits = step(runner, ScheduledSeq("a", 0, ids[:split], table, True, split))
    errors = [(logits[0] - ref[split - 1]).abs().max()]
    for pos in range(split, len(ids)):
        logits = step(runner, ScheduledSeq("a", pos, [ids[pos]], table, True, 0))
        errors.append((logits[0] - ref[pos]).abs().max())
    return float(max(errors))


@pytest.mark.parametrize("fmt", ["hf", "model.gguf"])
def test_prefill_then_paged_decode_matches_transformers(tiny, fmt):
    hf, out = tiny
    runner = runner_for(out / fmt)
    assert runner.config.layer_types == ("sliding", "full") * 2
    assert runner.config.sliding_window == 4
    # decode runs past the 4-token window; the decode layers are not one C plan (dense weights)
    assert runner.model.c_plan is None
    assert _prefill_then_decode(runner, hf, _ids(14, 1), 9) <= TOL


def test_torch_attention_path_matches_transformers(tiny, monkeypatch):
    """The sinks in torch (no C attention: the path a GPU takes) give the same logits."""
    hf, out = tiny
    monkeypatch.setattr(attention, "_c_stores", lambda *a: None)
    assert _prefill_then_decode(runner_for(out / "hf"), hf, _ids(14, 2), 6) <= TOL


@pytest.mark.parametrize("fmt", ["hf", "model.gguf"])
def test_chunked_prefill_equals_one_pass(tiny, fmt):
    hf, out = tiny
    ids = _ids(13, 3)
    ref = reference_logits(hf, ids)
    runner = runner_for(out / fmt)
    table = [4, 5, 6, 7]
    step(runner, ScheduledSeq("a", 0, ids[:5], table, False, 5))
    logits = step(runner, ScheduledSeq("a", 5, ids[5:], table, True, 8))
    assert (logits[0] - ref[-1]).abs().max() <= TOL


def test_batch_of_unequal_prompts_matches_transformers(tiny):
    """Every family's test (tests/test_models.py): batched prefill, then a batched decode."""
    test_models.test_batch_of_unequal_prompts_matches_each_alone(("gpt_oss", *tiny))


def test_engine_greedy_equals_transformers_generate(tiny):
    """Through the engine (scheduler, the window layers' own blocks, sampler): greedy tokens
    past the 4-token window equal the argmax of transformers' logits."""
    test_families_2025.test_engine_greedy_equals_transformers_generate(("gpt_oss", *tiny))


def test_both_loaders_give_the_same_logits(tiny):
    test_models.test_both_loaders_give_the_same_logits(("gpt_oss", *tiny))


def test_llama_cpp_converter_gguf_matches_transformers(tiny, tmp_path):
    hf, out = tiny
    path = tmp_path / "converted.gguf"
    reason = convert_with_llama_cpp(out / "hf", path)
    if reason is not None:
        pytest.skip(reason)
    loaded = load_model(open_checkpoint(path), LoadOptions())
    assert loaded.spec.name == "gpt-oss"
    assert loaded.config.layer_types == ("sliding", "full") * 2
    assert _prefill_then_decode(runner_for(path), hf, _ids(14, 5), 9) <= TOL


def test_config_reads_the_window_pattern_and_yarn(tiny):
    hf, out = tiny
    for fmt in ("hf", "model.gguf"):
        config = load_model(open_checkpoint(out / fmt), LoadOptions()).config
        assert config.rope.yarn is not None and not config.rope.yarn.truncate
        assert config.rope.yarn.factor == 4.0 and config.rope.yarn.original == 64
        assert config.moe.scoring == "topk_softmax" and config.moe.swiglu_clamp == (1.702, 7.0)
    assert find_arch("GptOssForCausalLM").name == find_arch("gpt-oss").name == "gpt-oss"
    meta = dict(open_checkpoint(out / "model.gguf").metadata)
    for pattern, types in (([False, True, True, False], ("full", "sliding", "sliding", "full")),
                           (4, ("sliding", "sliding", "sliding", "full"))):
        meta["gpt-oss.attention.sliding_window_pattern"] = pattern
        assert gpt_oss.config_from_gguf(meta).layer_types == types


def test_routing_and_clamped_swiglu_equal_transformers_modules(tiny):
    """route_topk_softmax is GptOssTopKRouter; ClampedSwiglu on gate | up halves is
    GptOssExperts' gate on interleaved columns, values past the clamp included."""
    hf, _ = tiny
    layer = hf.model.layers[1].mlp
    h = torch.randn(20, 64, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        _, scores, ids = layer.router(h)
        weights, ours = moe.route_topk_softmax(h, layer.router.weight, layer.router.bias, 2)
        assert torch.equal(ours, ids)
        assert torch.allclose(weights, scores, atol=1e-7)
        y = torch.randn(20, 64, generator=torch.Generator().manual_seed(7)) * 6
        theirs = layer.experts._apply_gate(y)
    gate_up = torch.cat([y[:, ::2], y[:, 1::2]], dim=1)
    assert (y.abs() > 7).any()
    assert torch.equal(moe.ClampedSwiglu()(gate_up), theirs)


def test_mxfp4_gguf_experts_match_transformers_on_their_values(tiny, tmp_path):
    """Experts stored as MXFP4 (llama.cpp's type for gpt-oss's experts): read as their
    values they give transformers' logits on the same rounded weights; kept in their
    blocks, the quantized products (8-bit activations) come close."""
    hf, out = tiny
    path = tmp_path / "mxfp4.gguf"
    write_gpt_oss_gguf(hf, path, quantize=T.MXFP4)
    rounded = mxfp4_rounded(hf)
    ids = _ids(14, 8)
    ref = reference_logits(rounded, ids)
    dense = load_model(open_checkpoint(path), LoadOptions(keep_quantized=False))
    assert _prefill_then_decode(_runner(dense), rounded, ids, 9) <= TOL
    blocks = load_model(open_checkpoint(path), LoadOptions(group_rows=False))
    experts = blocks.model.layers[0]["experts"]
    assert {w.qtype for w in experts.down} == {T.MXFP4}
    assert all(p.all_quantized for p in experts.gate_up)
    assert experts.c_table is not None  # biases and clamped SwiGLU in the one C call
    got = step(_runner(blocks), ScheduledSeq("a", 0, ids, [0, 1, 2, 3], True, 14))[0]
    assert torch.nn.functional.cosine_similarity(got, ref[-1], dim=0) > 0.999


def _expert_bytes(loaded) -> list[torch.Tensor]:
    """Every layer's experts' gate|up and down blocks, as loaded."""
    return [w.data for layer in loaded.model.layers for ex in [layer["experts"]]
            for w in (*[p for s in ex.gate_up for p in s.parts], *ex.down)]


def test_mxfp4_safetensors_read_as_the_gguf_blocks(tiny, tmp_path):
    """OpenAI's `_blocks` + `_scales` experts load as the same MXFP4 blocks as the GGUF of
    the same rounding (and as llama.cpp's converter writes from them), and give
    transformers' logits on the rounded weights."""
    hf, out = tiny
    save_gpt_oss_mxfp4(hf, tmp_path / "hf_mxfp4")
    write_gpt_oss_gguf(hf, tmp_path / "mxfp4.gguf", quantize=T.MXFP4)
    ours, gguf_file = (load_model(open_checkpoint(tmp_path / p), LoadOptions(group_rows=False))
                       for p in ("hf_mxfp4", "mxfp4.gguf"))
    assert {w.qtype for w in ours.model.layers[0]["experts"].down} == {T.MXFP4}
    assert all(torch.equal(a, b) for a, b in zip(_expert_bytes(ours), _expert_bytes(gguf_file),
                                                 strict=True))
    dense = load_model(open_checkpoint(tmp_path / "hf_mxfp4"), LoadOptions(keep_quantized=False))
    assert _prefill_then_decode(_runner(dense), mxfp4_rounded(hf), _ids(14, 9), 9) <= TOL
    converted = tmp_path / "converted_mxfp4.gguf"
    reason = convert_with_llama_cpp(tmp_path / "hf_mxfp4", converted)
    if reason is not None:
        pytest.skip(reason)
    theirs = load_model(open_checkpoint(converted), LoadOptions(group_rows=False))
    assert all(torch.equal(a, b) for a, b in zip(_expert_bytes(ours), _expert_bytes(theirs),
                                                 strict=True))


def _runner(loaded) -> test_models.ModelRunner:
    return test_models.ModelRunner(loaded.model, loaded.config, 32, 4)
