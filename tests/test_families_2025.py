"""SmolLM3, OLMo 2, Ministral 3 and GLM-4.5 on tiny random configs: kvlab's logits against
transformers' (fp32, max abs diff <= 1e-4) for prefill, paged decode, chunked prefill and a
batch of unequal prompts, from the safetensors and from a GGUF copy (llama.cpp's names and
metadata); the one-call C decode layers where a family has them (SmolLM3's layers without
RoPE through an identity rotation); Mistral 3's multimodal checkpoint's text decoder; GLM's
grouped routing and its MTP layers skipped; and each tiny model converted by llama.cpp's own
convert_hf_to_gguf.py giving kvlab the same logits."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.multiprocessing as mp
from test_models import (  # collected here too, on this module's `tiny`
    TOL,
    reference_logits,
    runner_for,
    step,
    test_batch_of_unequal_prompts_matches_each_alone,
    test_both_loaders_give_the_same_logits,
    test_chunked_prefill_equals_one_pass,
    test_prefill_then_paged_decode_matches_transformers,
)
from test_tensor_parallel import _rank, logits_of

from kvlab.engine import Engine, EngineConfig
from kvlab.models import decode_c, find_arch
from kvlab.models.loader import LoadOptions, load_model
from kvlab.models.sharding import SINGLE
from kvlab.request import SamplingParams
from kvlab.runner import ModelRunner
from kvlab.scheduler import ScheduledSeq
from kvlab.weights.checkpoint import open_checkpoint

from tiny_models import FAMILIES_2025, build, convert_with_llama_cpp, multimodal_mistral3

__all__ = ["test_batch_of_unequal_prompts_matches_each_alone",
           "test_both_loaders_give_the_same_logits", "test_chunked_prefill_equals_one_pass",
           "test_prefill_then_paged_decode_matches_transformers"]
@pytest.fixture(scope="module", params=FAMILIES_2025)
def tiny(request, tmp_path_factory):
    """(family, its transformers model, a folder with hf/ and model.gguf)."""
    out = tmp_path_factory.mktemp(request.param)
    return request.param, build(request.param, out), out


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _prefill_then_decode(runner: ModelRunner, ids: list[int], split: int) -> list[torch.Tensor]:
    """Logits at positions split - 1 .. len(ids) - 1: a prefill, then one token a step."""
    table = [9, 3, 17, 0]  # scattered, out-of-order blocks
    out = [step(runner, ScheduledSeq("a", 0, ids[:split], table, True, split))[0]]
    for pos in range(split, len(ids)):
        out.append(step(runner, ScheduledSeq("a", pos, [ids[pos]], table, True, 0))[0])
    return out


def test_quantized_decode_in_the_c_layers_equals_the_per_op_path(tiny, monkeypatch):
    """Q8_0 weights: the one-call C decode layers (where the family has them: SmolLM3 with
    an identity rotation on its layers without RoPE, OLMo 2 without norms before attention
    and MLP, OLMo 3's sliding layers with their own RoPE, Ministral 3 below the
    temperature's original context, GLM-4.5's grouped sigmoid router and ungated shared expert)
    give the per-op path's logits."""
    arch, hf, out = tiny
    ran: list[bool] = []
    real_run = decode_c.run
    monkeypatch.setattr(decode_c, "run", lambda *a: ran.append(real_run(*a)) or ran[-1])
    logits = []
    for use_plan in (True, False):
        loaded = load_model(open_checkpoint(out / "hf"), LoadOptions(quantize="q8_0"))
        assert loaded.model.c_plan is not None
        if not use_plan:
            loaded.model.c_plan = None
        runner = ModelRunner(loaded.model, loaded.config, 32, 4)
        logits.append(torch.stack(_prefill_then_decode(runner, _ids(14, 3), 5)))
    assert any(ran)
    assert (logits[0] - logits[1]).abs().max() <= 1e-4
    ref = reference_logits(hf, _ids(14, 3))[4:]
    assert torch.nn.functional.cosine_similarity(logits[0], ref, dim=-1).min() > 0.99


def test_two_tensor_parallel_ranks_match_one(tiny, tmp_path):
    """Split over two ranks (heads, MLP and expert columns; GLM's rows permuted for its
    half rotary before the split, OLMo 2's whole-vector QK-norm over both ranks' heads)."""
    from kvlab.runner.ranks import _free_port

    arch, hf, out = tiny
    path = out / "model.gguf"
    mp.start_processes(_rank, args=(_free_port(), [(arch, str(path), None)], str(tmp_path)),
                       nprocs=2, join=True)
    one = logits_of(path, None, SINGLE)
    assert (one - torch.load(tmp_path / f"{arch}.pt")).abs().max() <= TOL


def test_llama_cpp_converter_gives_the_same_logits(tiny, tmp_path):
    """The tiny checkpoint converted by llama.cpp's convert_hf_to_gguf.py (f32) loads in
    kvlab with transformers' logits: kvlab reads the metadata and names llama.cpp writes."""
    arch, hf, out = tiny
    path = tmp_path / "converted.gguf"
    why = convert_with_llama_cpp(out / "hf", path)
    if why is not None:
        pytest.skip(why)
    ids = _ids(14, 5)
    ref = reference_logits(hf, ids)
    for i, logits in enumerate(_prefill_then_decode(runner_for(path), ids, 9)):
        assert (logits - ref[8 + i]).abs().max() <= TOL, f"{arch} at position {8 + i}"


def test_engine_greedy_equals_transformers_generate(tiny):
    """Through the engine (scheduler, paged cache with 4-token blocks, sampler): greedy
    tokens past OLMo 3's window and Ministral 3's original context equal the argmax of
    transformers' logits."""
    arch, hf, out = tiny
    prompt = _ids(7, 10)
    engine = Engine.from_model(str(out / "model.gguf"), EngineConfig(block_size=4))
    engine.add_request("a", prompt, SamplingParams(max_tokens=8, temperature=0,
                                                   ignore_eos=True))
    tokens = []
    while engine.has_unfinished():
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    ids = list(prompt)
    for _ in range(8):  # transformers' forward on the whole sequence each time
        ids.append(int(reference_logits(hf, ids)[-1].argmax()))
    assert ids[len(prompt):] == tokens


def test_smollm3_layers_without_rope(tmp_path):
    """Layer 3 of 4 has no RoPE (HF's no_rope_layers, llama.cpp's every 4th); a model that
    rotated it would differ from transformers."""
    build("smollm3", tmp_path)
    for fmt in ("hf", "model.gguf"):
        config = load_model(open_checkpoint(tmp_path / fmt), LoadOptions()).config
        assert config.no_rope_layers == (False, False, False, True)


def test_olmo3_sliding_layers_and_their_own_rope_from_both_files(tmp_path):
    """Layers 0-2 slide over 4 tokens with plain RoPE, layer 3 attends to all with YaRN."""
    build("olmo3", tmp_path)
    for fmt in ("hf", "model.gguf"):
        config = load_model(open_checkpoint(tmp_path / fmt), LoadOptions()).config
        assert config.layer_types == ("sliding",) * 3 + ("full",)
        assert config.sliding_window == 4 and config.rope.yarn.factor == 4.0
        assert config.local_rope.yarn is None and config.local_rope.theta == 5e5


def test_mistral3_yarn_and_query_temperature_from_both_files(tmp_path):
    build("mistral3", tmp_path)
    configs = [load_model(open_checkpoint(tmp_path / f), LoadOptions()).config
               for f in ("hf", "model.gguf")]
    assert configs[0].rope == configs[1].rope and configs[0].rope.yarn.factor == 4.0
    assert configs[0].rope.yarn.attention_factor != 1.0  # mscale_all_dim 0.5
    assert configs[0].query_temperature == (0.1, 8)
    assert configs[1].query_temperature == pytest.approx((0.1, 8))  # GGUF: an f32 beta


def test_mistral3_multimodal_checkpoint_loads_its_text_decoder(tmp_path, caplog):
    model = multimodal_mistral3(tmp_path)
    ids = _ids(12, 6)
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids])).logits[0].float()
    with caplog.at_level(logging.WARNING, logger="kvlab.models"):
        runner = runner_for(tmp_path / "hf")
    assert "vision tower" in caplog.text and "not loaded" in caplog.text
    assert find_arch("Mistral3ForConditionalGeneration").name == "mistral3_multimodal"
    for i, logits in enumerate(_prefill_then_decode(runner, ids, 8)):
        assert (logits - ref[7 + i]).abs().max() <= TOL


def test_mistral3_multimodal_checkpoint_through_llama_cpp_converter(tmp_path):
    """llama.cpp's converter writes the multimodal checkpoint's text decoder as `mistral3`."""
    model = multimodal_mistral3(tmp_path)
    why = convert_with_llama_cpp(tmp_path / "hf", tmp_path / "converted.gguf")
    if why is not None:
        pytest.skip(why)
    ids = _ids(12, 9)
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids])).logits[0].float()
    runner = runner_for(tmp_path / "converted.gguf")
    assert runner.config.architecture == "mistral3"
    for i, logits in enumerate(_prefill_then_decode(runner, ids, 8)):
        assert (logits - ref[7 + i]).abs().max() <= TOL


def test_glm4moe_grouped_routing_matches_transformers(tmp_path):
    """Eight experts in four groups, the best two groups kept: the choice is made inside
    them (transformers' noaux_tc), so a router that ignored groups would pick others."""
    hf = build("glm4moe", tmp_path, n_group=4, topk_group=2)
    ids = _ids(12, 7)
    ref = reference_logits(hf, ids)
    runner = runner_for(tmp_path / "hf")
    assert (runner.config.moe.groups, runner.config.moe.top_groups) == (4, 2)
    for i, logits in enumerate(_prefill_then_decode(runner, ids, 8)):
        assert (logits - ref[7 + i]).abs().max() <= TOL


@pytest.mark.parametrize("fmt", ["hf", "model.gguf"])
def test_glm4moe_without_qk_norm(tmp_path, fmt):
    """GLM-4.5 (355B) has no QK-norm: its GGUF says nothing, the layers just lack the
    weights."""
    hf = build("glm4moe", tmp_path, use_qk_norm=False)
    ids = _ids(10, 8)
    runner = runner_for(tmp_path / fmt)
    assert "q_norm" not in runner.model.layers[0]
    logits = step(runner, ScheduledSeq("a", 0, ids, [0, 1, 2], True, 10))
    assert (logits[0] - reference_logits(hf, ids)[-1]).abs().max() <= TOL


def test_glm4moe_mtp_layers_are_not_run_but_stay_readable(tmp_path):
    """The GGUF's block_count counts the MTP block (nextn_predict_layers 1): kvlab runs the
    three decoder layers and leaves the MTP tensors in the file, readable by name."""
    build("glm4moe", tmp_path)
    ckpt = open_checkpoint(tmp_path / "model.gguf")
    loaded = load_model(ckpt, LoadOptions())
    assert loaded.config.num_layers == 3 and len(loaded.model.layers) == 3
    assert "router" not in loaded.model.layers[0] and "router" in loaded.model.layers[1]
    assert not any(t.name.startswith("layers.3.") for t in loaded.tensors)
    assert ckpt.read("blk.3.nextn.eh_proj.weight").shape == (64, 128)
