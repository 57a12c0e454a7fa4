"""Speculative decoding with Qwen3.5's own multi-token-prediction layer (kvlab.models.mtp,
kvlab.spec.mtp) on tiny random Qwen3.5 and Qwen3.5-MoE hybrids whose checkpoints carry an
MTP layer under mtp.* (tiny_models.build_qwen35_mtp):

- the layer's logits equal a hand-written reference of the formula with transformers' own
  Qwen3.5 decoder layer as the block, and the proposer's guesses, recursion included, equal
  the reference's greedy ones;
- greedy text with --speculative mtp equals plain decoding alone, batched, after preemption
  and with a prefix hit (the MTP layer's K/V beside the hybrid's state slots and backups;
  every slot and block free afterwards), from the safetensors and from llama.cpp's
  converter's GGUF (which keeps the layer as blk.4.nextn.*);
- a Qwen3.5 checkpoint without an MTP layer refuses --speculative mtp.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_spec_mtp import (
    MTP,
    PROMPTS,
    MtpRef,
    _engine,
    _generate,
    _gguf,
    _one,
    _recorded_run,
    check_equal_to_plain,
    mtp_free,
    proposals_after_a_hit,
    recursion,
)

from kvlab.engine import Engine
from kvlab.errors import KvlabError
from kvlab.models.attention import SeqSpan, build_metadata
from kvlab.models.kv_store import make_kv
from kvlab.models.loader import LoadedModel, LoadOptions, load_model
from kvlab.runner import ModelRunner
from kvlab.scheduler import ScheduledSeq, SchedulerOutput
from kvlab.spec.adaptive import DraftState
from kvlab.spec.mtp import HiddenSpan, MtpProposer
from kvlab.spec.proposer import Candidate
from kvlab.weights.checkpoint import open_checkpoint

from tiny_models import build_hybrid, build_qwen35_mtp, convert_with_llama_cpp

LAYERS = 4  # main layers; the checkpoint's mtp.layers.0 was built as layer 4


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def qwen(request, tmp_path_factory):
    """(the directory, the five-layer transformers model, the mtp.* tensors beside the
    layer's)."""
    out = tmp_path_factory.mktemp(f"{request.param}_mtp")
    model, own = build_qwen35_mtp(request.param, out)
    return out, model, own


def _reference(model, own: dict, prompt: list[int], token: int, k: int, start: int = 1
               ) -> tuple[torch.Tensor, list[int]]:
    """The formula by hand: main hidden states h (after the final norm) of the LAYERS main
    layers over the prompt; MTP rows p = start .. P from (x_p, h_{p-1}) and then its own
    output, x = fc([pre_fc_norm_embedding(embed(x_p)) | pre_fc_norm_hidden(h)]) through
    transformers' Qwen3.5 decoder layer (the fifth, a full-attention one), out =
    mtp.norm(x), logits = lm_head(out). Returns the first guess's logits [vocab] and k
    greedy guesses."""
    cfg = model.config
    eps = cfg.rms_norm_eps
    config_cls, model_cls = type(cfg), type(model.model)
    main = model_cls(config_cls(**{**cfg.to_dict(), "num_hidden_layers": LAYERS,
                                   "layer_types": cfg.layer_types[:LAYERS]})).eval()
    main.load_state_dict(model.model.state_dict(), strict=False)  # all but layer LAYERS
    block = model_cls(config_cls(**{**cfg.to_dict(), "num_hidden_layers": 1,
                                    "layer_types": ["full_attention"]})).eval()
    block.layers[0].load_state_dict(model.model.layers[LAYERS].state_dict())
    block.norm.weight.data.copy_(own["mtp.norm.weight"])
    with torch.no_grad():
        h = main(torch.tensor([prompt])).last_hidden_state[0]  # [P, hidden], normed
        return recursion(h, block, prompt, token, k, start, MtpRef(
            model.model.embed_tokens.weight, 1 + own["mtp.pre_fc_norm_embedding.weight"],
            1 + own["mtp.pre_fc_norm_hidden.weight"], own["mtp.fc.weight"],
            model.lm_head.weight, eps))


def _load(path: Path) -> LoadedModel:
    return load_model(open_checkpoint(path), LoadOptions(mtp=True))


def _prompt_hidden(loaded: LoadedModel, prompt: list[int]) -> torch.Tensor:
    """kvlab's main hidden states [P, hidden] over a prompt (before the final norm), its
    recurrent states in slot 0."""
    runner = ModelRunner(loaded.model, loaded.config, 8, 16, "f32", graphs="off",
                         num_state_slots=1)
    step = runner.execute(SchedulerOutput([ScheduledSeq(
        "s", 0, prompt, list(range(-(-len(prompt) // 16))), True, len(prompt),
        state_slot=0)]), hidden=True)
    return step.hidden


def _mtp_logits(loaded: LoadedModel, prompt: list[int], token: int) -> torch.Tensor:
    """kvlab's MTP layer over rows 1 .. P: the logits [vocab] of the last row."""
    mtp, rows = loaded.mtp, len(prompt)
    cache = make_kv("f32", 64, mtp.config.num_kv_heads, mtp.config.head_dim,
                    torch.device("cpu"), None)
    meta = build_metadata([SeqSpan(0, rows, torch.arange(rows))], None, torch.device("cpu"))
    with torch.inference_mode():
        out = mtp.forward(torch.tensor(prompt[1:] + [token]),
                          mtp.main_hidden(_prompt_hidden(loaded, prompt)),
                          torch.arange(1, rows + 1), cache, meta)
        return mtp.logits(out[-1:])[0]


def test_mtp_logits_equal_the_reference_formula(qwen):
    out, model, own = qwen
    loaded = _load(out / "hf")
    assert loaded.config.num_layers == LAYERS and loaded.mtp is not None
    # loaded only when asked
    assert load_model(open_checkpoint(out / "hf"), LoadOptions()).mtp is None
    for prompt in PROMPTS:
        want, _ = _reference(model, own, prompt, 7, 1)
        got = _mtp_logits(loaded, prompt, 7)
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()


def test_proposer_guesses_equal_the_reference_recursion(qwen):
    out, model, own = qwen
    loaded = _load(out / "hf")
    for prompt in PROMPTS:
        proposer = MtpProposer(loaded.mtp, 3, "f32", 8, adaptive=False)
        state = DraftState()
        proposer.observe([HiddenSpan(state, 0, prompt, 0)], _prompt_hidden(loaded, prompt))
        guesses = proposer.propose([Candidate(state, prompt + [7], 10)], 1)[0]
        assert guesses == _reference(model, own, prompt, 7, 3)[1]
        proposer.forget(state)
        assert proposer.kv.num_free_blocks == 8


def all_free(e: Engine) -> bool:
    """Every block and state slot of the engine and every block of its MTP layer free."""
    states = e.kv.states
    assert states is not None and e.mtp is not None
    return (e.kv.num_free_blocks == e.kv.num_blocks and states.num_free == states.num_slots
            and mtp_free(e))


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_greedy_text_with_mtp_equals_plain_decoding(qwen, source):
    out = qwen[0]
    check_equal_to_plain(out / "hf" if source == "hf" else _gguf(out, "qwen35"), all_free)


def test_gguf_keeps_the_mtp_layer(qwen):
    """The converter writes blk.4.nextn.* and the block's tensors as layer 4: kvlab's main
    model has 4 layers and the MTP layer from the GGUF equals the safetensors' one."""
    out = qwen[0]
    gguf, hf = _load(_gguf(out, "qwen35")), _load(out / "hf")
    assert gguf.config.num_layers == LAYERS and gguf.mtp is not None
    for name in ("enorm", "hnorm", "head_norm"):  # 1 + w in both
        assert torch.allclose(getattr(gguf.mtp, name), getattr(hf.mtp, name))
    assert torch.equal(gguf.mtp.eh_proj, hf.mtp.eh_proj)
    got, want = (_mtp_logits(m, PROMPTS[0], 7) for m in (gguf, hf))
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


def test_multimodal_checkpoint_loads_its_mtp_layer(qwen, tmp_path):
    """Qwen3_5(Moe)ForConditionalGeneration checkpoints keep mtp.* at the top beside the
    text model's model.language_model.*: renamed so, the checkpoint loads the same MTP
    layer (the same logits)."""
    out = qwen[0]
    (src,) = (out / "hf").glob("*.safetensors")
    (tmp_path / "hf").mkdir()
    save_file({("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in load_file(src).items()}, tmp_path / "hf" / src.name,
              metadata={"format": "pt"})
    text = json.loads((out / "hf" / "config.json").read_text())
    wrapper = text["architectures"][0].replace("ForCausalLM", "ForConditionalGeneration")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(
        {"architectures": [wrapper], "text_config": text, "tie_word_embeddings": False}))
    multimodal, plain = _load(tmp_path / "hf"), _load(out / "hf")
    assert multimodal.spec.name.endswith("_multimodal") and multimodal.mtp is not None
    got, want = (_mtp_logits(m, PROMPTS[0], 7) for m in (multimodal, plain))
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


def test_preempted_sequences_keep_greedy_text(qwen):
    """A pool too small for all three requests preempts some; they recompute from token 0
    (their states from scratch) while the MTP layer keeps its rows: plain decoding's text."""
    path = qwen[0] / "hf"
    plain, _, _ = _generate(path, PROMPTS, kv_dtype="f32")
    c = _engine(path).loaded.config
    gib = (32 * c.state_bytes_per_seq() + 10 * 4 * c.kv_bytes_per_token(4)) / 2**30
    texts, small, seqs = _generate(path, PROMPTS, kv_dtype="f32", kv_cache_gib=gib,
                                   enable_prefix_caching=False, **MTP)
    assert small.kv.num_blocks == 10
    assert texts == plain
    assert any(s.num_preemptions for s in seqs)
    assert all_free(small)


def test_prefix_hit_keeps_greedy_text(qwen):
    """Prompts cut into chunks of 16 (each chunk's end state saved: snapshots every 2
    blocks), and a later request whose prompt the prefix cache serves from the one at 32:
    its MTP rows start past the cached tokens, and its text equals plain decoding's."""
    path = qwen[0] / "hf"
    long = [(i * 7 + 3) % 90 for i in range(40)]
    prompts = [long, long[:36] + [1, 2]]
    texts, engines = [], []
    for config in ({}, MTP):
        engine = _engine(path, state_snapshot_blocks=2, max_num_batched_tokens=16, **config)
        texts.append([_one(engine, p) for p in prompts])  # one after the other
        engines.append(engine)
    assert texts[0] == texts[1]
    assert engines[1].stats().prefix_hits >= 32
    assert engines[1].stats().speculative.drafted > 0
    assert all_free(engines[1])


def test_guesses_follow_the_reference_through_accepted_runs(qwen, tmp_path):
    """Every proposal of a whole engine run equals the reference's greedy guesses over the
    tokens so far, through steps that accept guesses and steps that rewind the recurrent
    states. To have guesses accepted, the main model's final norm is zeroed (1 + w = 0: it
    always emits token 0) and row 0 of the head the MTP layer shares is a fixed random
    vector times 3 (its first guess is mostly 0, its second mostly not)."""
    out, model, own = qwen
    model = copy.deepcopy(model)
    model.model.norm.weight.data.fill_(-1.0)
    model.lm_head.weight.data[0] = 3 * torch.randn(
        model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    shutil.copytree(out / "hf", tmp_path / "hf")
    (path,) = (tmp_path / "hf").glob("*.safetensors")
    tensors = load_file(path)
    tensors["model.norm.weight"] = model.model.norm.weight.detach().clone()
    tensors["lm_head.weight"] = model.lm_head.weight.detach().clone()
    save_file(tensors, path, metadata={"format": "pt"})

    engine, proposals = _recorded_run(tmp_path / "hf")
    for tokens, guesses in proposals:
        assert guesses == _reference(model, own, tokens[:-1], tokens[-1], len(guesses))[1]
    assert all_free(engine)


def test_guesses_after_a_prefix_hit_follow_the_reference_from_there(qwen):
    """A request whose prompt the prefix cache serves up to position c (a chunk's end state
    saved there): its MTP rows start at c + 1, and each of its proposals equals the
    reference whose rows start there."""
    out, model, own = qwen
    engine = _engine(out / "hf", state_snapshot_blocks=2, max_num_batched_tokens=16, **MTP)
    cached, proposals = proposals_after_a_hit(engine)
    assert cached == 16
    for tokens, guesses in proposals:
        want = _reference(model, own, tokens[:-1], tokens[-1], len(guesses), start=cached + 1)
        assert guesses == want[1]
    assert all_free(engine)


def test_a_qwen35_checkpoint_without_mtp_refuses_mtp(tmp_path):
    """transformers writes no mtp.* tensors, and llama.cpp's converter told --no-mtp no
    nextn ones: both refuse, saying the checkpoint ships no MTP layer."""
    build_hybrid("qwen3_5", tmp_path)
    paths = [tmp_path / "hf"]
    if convert_with_llama_cpp(tmp_path / "hf", tmp_path / "no_mtp.gguf") is None:
        paths.append(tmp_path / "no_mtp.gguf")
    for path in paths:
        assert load_model(open_checkpoint(path), LoadOptions(mtp=True)).mtp is None
        with pytest.raises(KvlabError, match=r"this Qwen3\.5 checkpoint ships no "
                                             "multi-token-prediction layer"):
            _engine(path, speculative="mtp")
