"""Speculative decoding with the model's own multi-token-prediction layer (kvlab.spec.mtp,
kvlab.models.mtp) on a tiny random GLM-4.5 whose checkpoint carries one MTP layer:

- the MTP layer's logits equal a hand-written reference of the published formula
  (transformers' GLM-4.5 decoder layer as the block), and the proposer's guesses, recursion
  included, equal the reference's greedy ones;
- greedy text with --speculative mtp equals plain decoding, alone and batched, from the
  safetensors and from llama.cpp's converter's GGUF (which keeps the nextn layer);
- a model without MTP layers refuses --speculative mtp, naming the families that have them.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvlab.cache import KVCacheManager
from kvlab.engine import Engine, EngineConfig
from kvlab.errors import KvlabError, ModelLoadError
from kvlab.models.attention import SeqSpan, build_metadata
from kvlab.models.kv_store import make_kv
from kvlab.models.loader import LoadOptions, load_model
from kvlab.request import SamplingParams, Structure
from kvlab.runner import ModelRunner
from kvlab.scheduler import ScheduledSeq, SchedulerOutput, Sequence
from kvlab.spec.adaptive import DraftState
from kvlab.spec.mtp import HiddenSpan, MtpProposer
from kvlab.spec.proposer import Candidate
from kvlab.tokenizer import load_gguf_tokenizer
from kvlab.weights.checkpoint import open_checkpoint

from tiny_models import _CONVERT, LLAMA_CPP, build, build_deepseek, byte_tokenizer_metadata

LAYERS = 3  # main layers; the MTP layer is layer 3
GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
PROMPTS = [[5, 17, 33, 2, 61, 9, 40], [70, 3, 3, 12], [8, 90, 44, 1, 27, 27, 50, 6, 11, 64]]


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@pytest.fixture(scope="module", params=["glm4moe", "deepseek2"])
def mtp_model(request, tmp_path_factory):
    """A GLM-4.5 or DeepSeek-V3 (latent attention) of LAYERS + 1 layers saved as LAYERS main
    layers and one MTP layer: the last decoder layer (an MoE layer) is the MTP block, with
    random eh_proj, enorm, hnorm and shared_head.norm / shared_head.head beside it (no
    embed_tokens: the main one serves). Returns (the directory, the full transformers
    model, the MTP tensors, the family)."""
    out = tmp_path_factory.mktemp(f"{request.param}_mtp")
    model = (build("glm4moe", out, num_hidden_layers=LAYERS + 1) if request.param == "glm4moe"
             else build_deepseek(out, num_hidden_layers=LAYERS + 1))
    cfg = model.config
    hidden, prefix = cfg.hidden_size, f"model.layers.{LAYERS}."
    nextn = {"eh_proj.weight": torch.randn(hidden, 2 * hidden) * 0.2,
             "enorm.weight": torch.randn(hidden) * 0.1 + 1.0,
             "hnorm.weight": torch.randn(hidden) * 0.1 + 1.0,
             "shared_head.norm.weight": torch.randn(hidden) * 0.1 + 1.0,
             "shared_head.head.weight": torch.randn(cfg.vocab_size, hidden) * 0.5}
    files = sorted((out / "hf").glob("*.safetensors"))
    assert len(files) == 1
    tensors = load_file(files[0])
    tensors.update({prefix + k: v.contiguous() for k, v in nextn.items()})
    save_file(tensors, files[0], metadata={"format": "pt"})
    config = json.loads((out / "hf" / "config.json").read_text())
    config.update(num_hidden_layers=LAYERS, num_nextn_predict_layers=1)
    (out / "hf" / "config.json").write_text(json.dumps(config))
    return out, model, nextn, request.param


def _reference(model, nextn: dict, prompt: list[int], token: int, k: int, start: int = 1
               ) -> tuple[torch.Tensor, list[int]]:
    """The formula by hand: main hidden states h (after the final norm) of the LAYERS main
    layers over the prompt; MTP rows p = 1 .. P from (x_p, h_{p-1}) and then its own output,
    x = eh_proj([enorm(embed(x_p)) | hnorm(h)]) through the family's decoder layer
    (transformers' own), out =
    shared_head.norm(x), logits = shared_head.head(out); `start`: the first row's position
    (past a prefix-cache hit). Returns the first guess's logits [vocab] and k greedy
    guesses."""
    cfg = model.config
    eps = cfg.rms_norm_eps
    config_cls, model_cls = type(cfg), type(model.model)
    main = model_cls(config_cls(**{**cfg.to_dict(), "num_hidden_layers": LAYERS})).eval()
    main.load_state_dict(model.model.state_dict(), strict=False)  # all but layer LAYERS
    block = model_cls(config_cls(**{**cfg.to_dict(), "num_hidden_layers": 1,
                                    "first_k_dense_replace": 0})).eval()
    block.layers[0].load_state_dict(model.model.layers[LAYERS].state_dict())
    block.norm.weight.data.copy_(nextn["shared_head.norm.weight"])
    with torch.no_grad():
        h = main(torch.tensor([prompt])).last_hidden_state[0]  # [P, hidden], normed
        return recursion(h, block, prompt, token, k, start, MtpRef(
            model.model.embed_tokens.weight, nextn["enorm.weight"], nextn["hnorm.weight"],
            nextn["eh_proj.weight"], nextn["shared_head.head.weight"], eps))


@dataclass(frozen=True)
class MtpRef:
    """The reference's MTP tensors beside its block (norm weights as they multiply)."""

    embed: torch.Tensor
    enorm: torch.Tensor
    hnorm: torch.Tensor
    eh_proj: torch.Tensor
    head: torch.Tensor
    eps: float


def recursion(h: torch.Tensor, block, prompt: list[int], token: int, k: int, start: int,
              ref: MtpRef) -> tuple[torch.Tensor, list[int]]:
    """The reference's MTP rows p = start .. P, from (x_p, h_{p-1}) (h: the main hidden
    states [P, hidden], normed) and then from its own output: x = eh_proj([enorm(embed(x_p))
    | hnorm(h)]) through `block`, a transformers model of the one decoder layer (its final
    norm the MTP layer's), logits = head(out). The first guess's logits [vocab] and k greedy
    guesses."""
    ids, prev, guesses, first = prompt[start:] + [token], list(h[start - 1:]), [], None
    for _ in range(k):
        e = _rms(ref.embed[torch.tensor(ids)], ref.enorm, ref.eps)
        x = torch.cat([e, _rms(torch.stack(prev), ref.hnorm, ref.eps)], dim=-1) @ ref.eh_proj.T
        positions = torch.arange(start, start + len(ids))[None]
        out = block(inputs_embeds=x[None], position_ids=positions).last_hidden_state[0]
        logits = out[-1] @ ref.head.T
        first = logits if first is None else first
        guesses.append(int(logits.argmax()))
        ids.append(guesses[-1])
        prev.append(out[-1])
    return first, guesses


def _mtp_logits(loaded, prompt: list[int], token: int) -> torch.Tensor:
    """kvlab's MTP layer over rows 1 .. P (main hidden states from kvlab's runner): the
    logits [vocab] of the last row."""
    c = loaded.config
    kv = KVCacheManager(8, 16, enable_prefix_caching=False)
    kv.allocate_slots("s", len(prompt))
    runner = ModelRunner(loaded.model, c, 8, 16, "f32", graphs="off")
    step = runner.execute(SchedulerOutput([ScheduledSeq("s", 0, prompt, kv.block_table("s"),
                                                        True, len(prompt))]), hidden=True)
    mtp = loaded.mtp
    rows = len(prompt)
    cache = make_kv("f32", 64, mtp.config.num_kv_heads, mtp.config.head_dim,
                    torch.device("cpu"), mtp.config.mla)
    meta = build_metadata([SeqSpan(0, rows, torch.arange(rows))], None, torch.device("cpu"))
    with torch.inference_mode():
        out = mtp.forward(torch.tensor(prompt[1:] + [token]), mtp.main_hidden(step.hidden),
                          torch.arange(1, rows + 1), cache, meta)
        return mtp.logits(out[-1:])[0]


def test_mtp_logits_equal_the_reference_formula(mtp_model):
    out, model, nextn, _ = mtp_model
    loaded = load_model(open_checkpoint(out / "hf"), LoadOptions(mtp=True))
    assert loaded.mtp is not None
    for prompt in PROMPTS:
        want, _ = _reference(model, nextn, prompt, 7, 1)
        got = _mtp_logits(loaded, prompt, 7)
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()


def test_proposer_guesses_equal_the_reference_recursion(mtp_model):
    """After the prompt's step, the proposer's k guesses (row P, then the layer on its own
    output) equal the reference's greedy ones."""
    out, model, nextn, _ = mtp_model
    loaded = load_model(open_checkpoint(out / "hf"), LoadOptions(mtp=True))
    for prompt in PROMPTS:
        proposer = MtpProposer(loaded.mtp, 3, "f32", 8, adaptive=False)
        kv = KVCacheManager(8, 16, enable_prefix_caching=False)
        kv.allocate_slots("s", len(prompt))
        runner = ModelRunner(loaded.model, loaded.config, 8, 16, "f32", graphs="off")
        step = runner.execute(SchedulerOutput([ScheduledSeq(
            "s", 0, prompt, kv.block_table("s"), True, len(prompt))]), hidden=True)
        state = DraftState()
        proposer.observe([HiddenSpan(state, 0, prompt, 0)], step.hidden)
        guesses = proposer.propose([Candidate(state, prompt + [7], 10)], 1)[0]
        _, want = _reference(model, nextn, prompt, 7, 3)
        assert guesses == want
        proposer.forget(state)
        assert proposer.kv.num_free_blocks == 8


def _engine(path: Path, **config) -> Engine:
    """An engine over a GGUF file, or over an HF directory with the byte vocabulary the
    tiny models use (their directories have no tokenizer.json)."""
    config = EngineConfig(**{"block_size": 4, **config})
    if path.suffix == ".gguf":
        return Engine.from_model(str(path), config)
    loaded = load_model(open_checkpoint(path), LoadOptions(mtp=config.speculative == "mtp"))
    return Engine(loaded, load_gguf_tokenizer(byte_tokenizer_metadata(96)), config)


def _generate(path: Path, prompts: list[list[int]], **config
              ) -> tuple[list[list[int]], Engine, list[Sequence]]:
    """Greedy tokens per prompt, all submitted at once; the engine; the sequences."""
    engine = _engine(path, **config)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY)
    seqs = [engine.requests[str(i)].seq for i in range(len(prompts))]
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return [tokens[str(i)] for i in range(len(prompts))], engine, seqs


MTP = {"speculative": "mtp", "num_speculative": 3, "speculative_adaptive": False}


def _gguf(out: Path, family: str) -> Path:
    """llama.cpp's converter's GGUF of the checkpoint, its nextn layer kept."""
    if family == "deepseek2":
        pytest.skip("llama.cpp's converter writes no nextn layer for DeepSeek-V3")
    path = out / "mtp.gguf"
    if not path.exists():
        if not (LLAMA_CPP / "convert_hf_to_gguf.py").exists():
            pytest.skip(f"llama.cpp's converter is not at {LLAMA_CPP}")
        script = _CONVERT.replace("cls.no_mtp = True", "cls.no_mtp = False")
        run = subprocess.run([sys.executable, "-c", script, str(LLAMA_CPP), str(out / "hf"),
                              str(path)], check=False, capture_output=True, text=True,
                             timeout=600)
        assert run.returncode == 0, run.stderr[-2000:]
    return path


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_greedy_text_with_mtp_equals_plain_decoding(mtp_model, source):
    out = mtp_model[0]
    path = out / "hf" if source == "hf" else _gguf(out, mtp_model[3])
    check_equal_to_plain(path, mtp_free)


def mtp_free(engine: Engine) -> bool:
    """The MTP proposer holds no sequence and its layer's blocks are free."""
    return engine.mtp.held == {} and engine.mtp.kv.num_free_blocks == engine.mtp.kv.num_blocks


def check_equal_to_plain(path: Path, free: Callable[[Engine], bool]) -> None:
    """Greedy text with MTP proposals equals plain decoding's, alone and batched with other
    sequences, with proposals made; `free`: everything is released after each run."""
    plain, _, _ = _generate(path, PROMPTS)
    for batch in ([PROMPTS[0]], PROMPTS):
        spec, engine, _ = _generate(path, batch, **MTP)
        assert spec == plain[:len(batch)]
        counts = engine.stats().speculative
        assert counts.drafted > 0 and counts.accepted <= counts.drafted
        assert free(engine)


def test_gguf_keeps_the_nextn_layer(mtp_model):
    """The converter writes blk.3.nextn.* and block_count 4; kvlab's main model has 3
    layers and the MTP layer loads from the nextn tensors (its own head included)."""
    out, model, nextn, family = mtp_model
    loaded = load_model(open_checkpoint(_gguf(out, family)),
                        LoadOptions(mtp=True))
    assert loaded.config.num_layers == LAYERS
    assert loaded.mtp is not None
    assert torch.equal(loaded.mtp.head, nextn["shared_head.head.weight"])


def test_chunked_prefill_and_prefix_hits_keep_greedy_text(mtp_model):
    """Prompts cut into chunks, and a later request whose prompt the prefix cache serves
    (its MTP rows start past the cached blocks): the same text as plain decoding."""
    path = mtp_model[0] / "hf"
    long = [(i * 7 + 3) % 90 for i in range(40)]
    prompts = [long, long[:36] + [1, 2]]
    texts = []
    for config in ({}, MTP):
        engine = _engine(path, max_num_batched_tokens=16, **config)
        texts.append([_one(engine, p) for p in prompts])  # one after the other
    assert texts[0] == texts[1]
    assert engine.stats().prefix_hits >= 32
    assert engine.stats().speculative.drafted > 0


def _one(engine: Engine, prompt: list[int]) -> list[int]:
    engine.add_request("r", prompt, GREEDY)
    tokens = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


def test_a_model_without_mtp_layers_refuses_mtp(tmp_path):
    build("glm4moe", tmp_path)  # no MTP tensors in its safetensors
    with pytest.raises(KvlabError, match="GLM-4.5.*DeepSeek-V3"):
        _engine(tmp_path / "hf", speculative="mtp")
    # its GGUF carries only the nextn layer's own tensors and attn_norm
    with pytest.raises(ModelLoadError, match="layer 3.* lacks o, mlp_norm"):
        _engine(tmp_path / "model.gguf", speculative="mtp")
    build("llama", tmp_path / "llama")
    with pytest.raises(KvlabError, match="no multi-token-prediction layers"):
        _engine(tmp_path / "llama" / "model.gguf", speculative="mtp")


def test_mtp_with_tensor_parallel_is_refused():
    with pytest.raises(KvlabError, match="one rank"):
        EngineConfig(speculative="mtp", tensor_parallel_size=2)


def _kvlab(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvlab.cli.main", *args], check=False,
                          capture_output=True, text=True, timeout=600)


def test_run_json_and_bench_report_mtp_proposals(mtp_model):
    out, _, _, family = mtp_model
    gguf = str(_gguf(out, family))
    proc = _kvlab("run", "-m", gguf, "--max-tokens", "16", "--temperature", "0",
                  "--ignore-eos", "--json", "--speculative", "mtp", "hello")
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout)["speculative"]
    assert record["drafted_tokens"] > 0 and record["accepted_tokens"] <= record["drafted_tokens"]
    proc = _kvlab("bench", "-m", gguf, "-p", "8", "-n", "8", "-r", "1", "--speculative", "mtp",
                  "--num-speculative", "2")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"tg8: speculative mtp \(up to 2 per step\): \d+ of \d+ proposed "
                     r"tokens accepted", proc.stdout), proc.stdout


def test_preempted_sequences_keep_greedy_text(mtp_model):
    """A pool too small for all three requests preempts some; they recompute from token 0
    while the MTP layer keeps its rows (its own cache): the same text as plain decoding."""
    path = mtp_model[0] / "hf"
    plain, _, _ = _generate(path, PROMPTS)
    per_token = _engine(path, kv_dtype="f32").cost.kv_bytes_per_token
    texts, small, seqs = _generate(path, PROMPTS, kv_dtype="f32",
                                   kv_cache_gib=40 * per_token / 2**30, **MTP)
    assert texts == plain
    assert any(s.num_preemptions for s in seqs)
    assert small.mtp.held == {} and small.mtp.kv.num_free_blocks == small.mtp.kv.num_blocks


def test_sampled_decoding_with_mtp_runs_to_its_length(mtp_model):
    """Sampled rows verify the MTP layer's greedy guesses by rejection sampling: each
    request ends at max_tokens with its proposals counted."""
    path = mtp_model[0] / "hf"
    engine = _engine(path, **MTP)
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.95, seed=3,
                            ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, params)
    finished = []
    while engine.has_unfinished():
        finished += [o for o in engine.step() if o.finished]
    assert sorted(o.output_tokens for o in finished) == [12] * len(PROMPTS)
    assert all(o.accepted_tokens <= o.draft_tokens for o in finished)
    assert engine.stats().speculative.drafted > 0


def test_structured_output_with_forced_tokens_keeps_greedy_text(mtp_model):
    """A regex whose fixed parts are forced (appended without sampling, computed as a
    chunk: several known tokens in one step): the MTP layer follows them, and the text
    equals plain decoding's."""
    path = mtp_model[0] / "hf"
    params = SamplingParams(max_tokens=30, temperature=0, structured=Structure(
        "regex", '[{]"name": "[a-z]{1,5}", "n": [0-9]{1,3}[}]'))
    texts = []
    for config in ({}, MTP):
        engine = _engine(path, **config)
        for i, p in enumerate(["abc", "hello there", "x"]):
            engine.add_request(str(i), p, params)
        got: dict[str, str] = {}
        while engine.has_unfinished():
            for out in engine.step():
                got[out.request_id] = got.get(out.request_id, "") + out.text_delta
        texts.append(got)
    assert texts[0] == texts[1]
    assert all(t.startswith('{"name": "') for t in texts[0].values())


def _recorded(engine: Engine) -> list[tuple[list[int], list[int]]]:
    """From now on, each proposal the engine's MTP proposer makes: (the sequence's tokens
    then, its guesses)."""
    proposals, propose = [], engine.mtp.propose

    def recorded(candidates, rows):
        guesses = propose(candidates, rows)
        proposals.extend((list(c.token_ids), g) for c, g in zip(candidates, guesses) if g)
        return guesses

    engine.mtp.propose = recorded
    return proposals


def _recorded_run(path: Path) -> tuple[Engine, list[tuple[list[int], list[int]]]]:
    """An MTP engine's greedy run of PROMPTS, with some guesses accepted and some rejected,
    and every proposal it made (_recorded)."""
    engine = _engine(path, **MTP)
    proposals = _recorded(engine)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, GREEDY)
    while engine.has_unfinished():
        engine.step()
    counts = engine.stats().speculative
    assert 0 < counts.accepted < counts.drafted
    assert len(proposals) > 10
    return engine, proposals


def test_guesses_follow_the_reference_through_accepted_runs(mtp_model, tmp_path):
    """Every proposal of a whole engine run equals the reference's greedy guesses over the
    tokens so far, through steps that accept guesses (the rows the MTP layer then catches up
    on are several verified tokens). To have guesses accepted, the checkpoint's final norm
    is zeroed (the model always emits token 0) and the MTP head favours token 0 wherever
    its output sums below 0 (about half the rows)."""
    out, model, nextn, _ = mtp_model
    model = copy.deepcopy(model)
    model.model.norm.weight.data.zero_()
    head = nextn["shared_head.head.weight"].clone()
    head[0] = -3.0
    nextn = {**nextn, "shared_head.head.weight": head}
    shutil.copytree(out / "hf", tmp_path / "hf")
    (path,) = (tmp_path / "hf").glob("*.safetensors")
    tensors = load_file(path)
    tensors["model.norm.weight"] = torch.zeros_like(tensors["model.norm.weight"])
    tensors[f"model.layers.{LAYERS}.shared_head.head.weight"] = head
    save_file(tensors, path, metadata={"format": "pt"})

    for tokens, guesses in _recorded_run(tmp_path / "hf")[1]:
        assert guesses == _reference(model, nextn, tokens[:-1], tokens[-1], len(guesses))[1]


def test_guesses_after_a_prefix_hit_follow_the_reference_from_there(mtp_model):
    """A request whose prompt the prefix cache serves up to position c: its MTP rows start
    at c + 1, and each of its proposals equals the reference whose rows start there."""
    out, model, nextn, _ = mtp_model
    cached, proposals = proposals_after_a_hit(_engine(out / "hf", **MTP))
    assert cached >= 24
    for tokens, guesses in proposals:
        want = _reference(model, nextn, tokens[:-1], tokens[-1], len(guesses),
                          start=cached + 1)[1]
        assert guesses == want


def proposals_after_a_hit(engine: Engine) -> tuple[int, list[tuple[list[int], list[int]]]]:
    """A 30-token prompt run to its end, then a request whose first 26 tokens are the
    same: how many tokens of its prompt the prefix cache served, and its proposals."""
    long = [(i * 7 + 3) % 90 for i in range(30)]
    _one(engine, long)
    proposals = _recorded(engine)
    engine.add_request("hit", long[:26] + [1, 2], GREEDY)
    seq = engine.requests["hit"].seq
    while engine.has_unfinished():
        engine.step()
    assert len(proposals) > 3
    return seq.num_cached_tokens, proposals
