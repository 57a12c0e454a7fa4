"""Hybrid models (recurrent layers beside attention) on tiny random configs: kvlab's logits
against transformers' on the same weights (fp32, max abs diff <= 1e-4) for prefill, decode
through the paged cache and the state slots, chunked prefill (the state carried from chunk
to chunk), a batch of unequal prompts; the checkpoint converted by llama.cpp's
convert_hf_to_gguf.py gives the same logits; the engine's greedy output is the same alone,
batched, chunked and after preemption."""

from __future__ import annotations

import pytest
import torch

from kvlab.engine import Engine, EngineConfig
from kvlab.errors import ModelLoadError
from kvlab.models import nemotron_h
from kvlab.models.loader import LoadOptions, load_model, read_config
from kvlab.request import SamplingParams
from kvlab.runner import ModelRunner
from kvlab.scheduler import ScheduledSeq, SchedulerOutput
from kvlab.tokenizer import load_gguf_tokenizer
from kvlab.weights.checkpoint import open_checkpoint

from tiny_models import (
    HYBRID_ARCHS,
    build_hybrid,
    byte_tokenizer_metadata,
    convert_with_llama_cpp,
    hybrid_config,
)

TOL = 1e-4


@pytest.fixture(scope="module", params=HYBRID_ARCHS)
def tiny(request, tmp_path_factory):
    arch = request.param
    out = tmp_path_factory.mktemp(arch)
    hf = build_hybrid(arch, out)
    no_gguf = convert_with_llama_cpp(out / "hf", out / "model.gguf")
    return arch, hf, out, no_gguf


def path_of(tiny, fmt: str):
    arch, hf, out, no_gguf = tiny
    if fmt == "model.gguf" and no_gguf:
        pytest.skip(no_gguf)
    return out / fmt


def reference_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def runner_for(path, num_blocks: int = 32, block_size: int = 4, slots: int = 4) -> ModelRunner:
    loaded = load_model(open_checkpoint(path), LoadOptions())
    return ModelRunner(loaded.model, loaded.config, num_blocks, block_size,
                       num_state_slots=slots)


def seq(seq_id: str, start: int, ids: list[int], table: list[int], slot: int,
        logits: bool = True) -> ScheduledSeq:
    return ScheduledSeq(seq_id, start, ids, table, logits, len(ids) if start == 0 else 0,
                        state_slot=slot)


def step(runner: ModelRunner, *seqs: ScheduledSeq) -> torch.Tensor:
    return runner.execute(SchedulerOutput(list(seqs))).logits


@pytest.mark.parametrize("fmt", ["hf", "model.gguf"])
def test_prefill_then_decode_matches_transformers(tiny, fmt):
    arch, hf, *_ = tiny
    ids = torch.randint(0, 96, (14,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = reference_logits(hf, ids)
    runner = runner_for(path_of(tiny, fmt))
    table = [9, 3, 17, 0]
    logits = step(runner, seq("a", 0, ids[:9], table, slot=2))
    assert (logits[0] - ref[8]).abs().max() <= TOL
    for pos in range(9, 14):  # each decode step reads and advances the slot's state
        logits = step(runner, seq("a", pos, [ids[pos]], table, slot=2))
        assert (logits[0] - ref[pos]).abs().max() <= TOL, f"{arch} decode at {pos}"


def test_chunked_prefill_carries_the_state(tiny):
    arch, hf, out, _ = tiny
    ids = list(range(2, 15))
    ref = reference_logits(hf, ids)
    runner = runner_for(out / "hf")
    table = [4, 5, 6, 7]
    step(runner, seq("a", 0, ids[:5], table, slot=1, logits=False))
    logits = step(runner, seq("a", 5, ids[5:8], table, slot=1))
    assert (logits[0] - ref[7]).abs().max() <= TOL
    logits = step(runner, seq("a", 8, ids[8:], table, slot=1))
    assert (logits[0] - ref[-1]).abs().max() <= TOL


def test_batch_of_unequal_prompts_matches_each_alone(tiny):
    arch, hf, out, _ = tiny
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (3, 11, 7)]
    runner = runner_for(out / "hf")
    tables, slots = [[0, 1, 2], [3, 4, 5, 6], [7, 8, 9]], [3, 0, 2]
    logits = step(runner, *(seq(str(i), 0, p, t, s)
                            for i, (p, t, s) in enumerate(zip(prompts, tables, slots))))
    for i, p in enumerate(prompts):
        assert (logits[i] - reference_logits(hf, p)[-1]).abs().max() <= TOL
    nxt = [5, 6, 7]  # one batched decode step: three states, three depths
    logits = step(runner, *(seq(str(i), len(p), [n], t, s)
                            for i, (p, n, t, s) in enumerate(zip(prompts, nxt, tables, slots))))
    for i, (p, n) in enumerate(zip(prompts, nxt)):
        assert (logits[i] - reference_logits(hf, p + [n])[-1]).abs().max() <= TOL


def test_a_slot_reused_from_token_zero_starts_from_a_zero_state(tiny):
    arch, hf, out, _ = tiny
    runner = runner_for(out / "hf", slots=1)
    step(runner, seq("a", 0, [5, 6, 7, 8, 9], [0, 1], slot=0))  # leaves a state behind
    ids = [11, 12, 13]
    logits = step(runner, seq("b", 0, ids, [2], slot=0))
    assert (logits[0] - reference_logits(hf, ids)[-1]).abs().max() <= TOL


def test_both_loaders_give_the_same_logits(tiny):
    ids = [1, 5, 9, 13, 17, 21]
    gguf = path_of(tiny, "model.gguf")
    a = step(runner_for(tiny[2] / "hf"), seq("a", 0, ids, [0, 1], slot=0))
    b = step(runner_for(gguf), seq("a", 0, ids, [0, 1], slot=0))
    assert (a - b).abs().max() <= 1e-5


@pytest.mark.parametrize("fmt", ["hf", "model.gguf"])
def test_quantized_at_load_stays_close(tiny, fmt):
    """Q8_0 weights (8-row groups where they fit) through the recurrent and attention
    layers: close to transformers, not equal."""
    arch, hf, *_ = tiny
    ids = list(range(3, 19))
    loaded = load_model(open_checkpoint(path_of(tiny, fmt)), LoadOptions(quantize="q8_0"))
    assert {t.qtype for t in loaded.tensors} & {"Q8_0", "Q8_0x8"}
    runner = ModelRunner(loaded.model, loaded.config, 32, 4, num_state_slots=1)
    got = step(runner, seq("a", 0, ids, [0, 1, 2, 3], slot=0))[0]
    ref = reference_logits(hf, ids)[-1]
    assert torch.nn.functional.cosine_similarity(got, ref, dim=0) > 0.99


# ---- the engine: scheduler, slots and runner together --------------------------------------

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = [[3, 14, 15, 92, 65], list(range(20, 45)), [7] * 9, list(range(60, 80))]


def engine(tiny, **kw) -> Engine:
    loaded = load_model(open_checkpoint(tiny[2] / "hf"), LoadOptions())
    tokenizer = load_gguf_tokenizer(byte_tokenizer_metadata(96))
    return Engine(loaded, tokenizer, EngineConfig(**{"block_size": 4, "kv_dtype": "f32", **kw}))


def run_all(e: Engine, prompts, seqs: list | None = None) -> list[list[int]]:
    """Greedy output of each prompt; `seqs` collects the engine's sequences."""
    for i, p in enumerate(prompts):
        e.add_request(str(i), p, GREEDY)
        if seqs is not None:
            seqs.append(e.requests[str(i)].seq)
    got: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while e.has_unfinished():
        for out in e.step():
            got[out.request_id].extend(out.new_token_ids)
    return [got[str(i)] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def alone(tiny):
    return [run_all(engine(tiny), [p])[0] for p in PROMPTS]


def test_greedy_equals_transformers_generate(tiny, alone):
    hf = tiny[1]
    for p, ours in zip(PROMPTS, alone):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False,
                          min_new_tokens=8)
        assert ref[0, len(p):].tolist() == ours


def test_batched_and_chunked_equal_alone(tiny, alone):
    assert run_all(engine(tiny), PROMPTS) == alone
    assert run_all(engine(tiny, max_num_batched_tokens=6), PROMPTS) == alone


def test_preemption_loses_nothing(tiny, alone):
    e = engine(tiny)
    c = e.loaded.config
    # room for 12 blocks of 4 tokens beside 16 sequences' states: the first three requests
    # alone grow to 15 blocks, so some are preempted and recomputed from token 0, each time
    # in whichever slot is free
    gib = (16 * c.state_bytes_per_seq() + 12 * 4 * c.kv_bytes_per_token(4)) / 2**30
    e = engine(tiny, kv_cache_gib=gib)
    assert e.kv.num_blocks == 12 and e.kv.states is not None
    seqs: list = []
    assert run_all(e, PROMPTS, seqs) == alone
    assert sum(s.num_preemptions for s in seqs) > 0
    assert e.kv.num_free_blocks == e.kv.num_blocks and e.kv.states.num_free == 16


def run_one(e: Engine, request_id: str, prompt: list[int]) -> tuple[list[int], int]:
    """Greedy output of one request and how many of its prompt tokens the cache served."""
    e.add_request(request_id, prompt, GREEDY)
    outs = []
    while e.has_unfinished():
        outs.extend(e.step())
    return [t for o in outs for t in o.new_token_ids], outs[-1].cached_tokens


def test_a_prefix_hit_resumes_from_the_deepest_state_snapshot(tiny, alone):
    """Snapshots every 2 blocks of 4 tokens, prefill chunks of at most 10 tokens: the
    25-token prompt's chunks end on boundaries (8, 16, 24, then 25), each saving its state;
    run again, the prompt resumes at 24; a prompt sharing its first 18 tokens resumes at 16.
    Greedy output is what each prompt gives alone."""
    e = engine(tiny, state_snapshot_blocks=2, max_num_batched_tokens=10)
    assert e.snapshot().enable_prefix_caching and e.kv.snapshots is not None
    prompt = PROMPTS[1]
    assert run_one(e, "first", prompt) == (alone[1], 0)
    assert run_one(e, "again", prompt) == (alone[1], 24)
    other = prompt[:18] + [5, 6, 7, 8, 9]
    expected = run_all(engine(tiny, enable_prefix_caching=False), [other])[0]
    assert run_one(e, "other", other) == (expected, 16)


def test_a_hit_between_snapshots_is_computed_again(tiny, alone):
    """Every 16 blocks (64 tokens) and the prompt's last full block (24): a prompt that
    shares 4 of the 25-token prompt's blocks reaches no snapshot."""
    e = engine(tiny, state_snapshot_blocks=16)
    run_one(e, "first", PROMPTS[1])
    other = PROMPTS[1][:18] + [5, 6, 7, 8, 9]
    expected = run_all(engine(tiny, enable_prefix_caching=False), [other])[0]
    assert run_one(e, "other", other) == (expected, 0)


TURN = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True, logprobs=20)


def run_turn(e: Engine, request_id: str, prompt: list[int]):
    """(output tokens, cached prompt tokens, each output token's top-20 log-probabilities)
    of one greedy request."""
    e.add_request(request_id, prompt, TURN)
    outs = []
    while e.has_unfinished():
        outs.extend(e.step())
    logprobs = torch.tensor([[lp for _, lp in t.top] for o in outs for t in o.logprobs])
    return [t for o in outs for t in o.new_token_ids], outs[-1].cached_tokens, logprobs


def test_a_second_chat_turn_resumes_from_a_snapshot_at_the_last_turns_deepest_block(tiny):
    """A 22-token first turn (5 full blocks of 4) and its 7-token answer, with snapshots
    every 16 blocks (never reached): the prompt's last full block (20) is saved, and each
    block boundary its decode reaches overwrites the sequence's tail snapshot, kept under the
    deepest block it computed (28 of 22 + 7 tokens; the last sampled token is not computed).
    The next turn (first turn + answer + question) resumes there; a prompt sharing the whole
    first prompt resumes from the prompt's snapshot. Logits are a fresh engine's."""
    e = engine(tiny, state_snapshot_blocks=16)
    fresh = engine(tiny, enable_prefix_caching=False)
    first = list(range(30, 52))
    answer, cached, _ = run_turn(e, "turn1", first)
    assert cached == 0 and len(answer) == 7
    for request_id, prompt, expect_cached in (
            ("turn2", first + answer + [5, 6, 7], 28),
            ("edit", first + [9] * 6, 20)):
        got, cached, logprobs = run_turn(e, request_id, prompt)
        ref, _, ref_logprobs = run_turn(fresh, request_id, prompt)
        assert cached == expect_cached and got == ref
        assert logprobs.shape == ref_logprobs.shape == (7, 20)
        assert (logprobs - ref_logprobs).abs().max() <= TOL
    snaps, states = e.kv.snapshots, e.kv.states
    assert snaps is not None and states is not None
    assert e.kv.num_free_blocks == e.kv.num_blocks and states.num_free == states.num_slots
    assert snaps.num_used == snaps.num_saved == 6  # prompt end and tail of each request


def test_a_snapshot_is_skipped_when_no_row_is_free(tiny):
    """Two rows (max_num_seqs=2), snapshots every 2 blocks: two 17-token prompts decode side
    by side, each holding a row as its tail from 20 on, so neither can save its state at 24
    (a stride boundary): it is skipped, both requests give what they give without a cache,
    and a later prompt over either's 24 computed tokens resumes from its tail at 20."""
    e = engine(tiny, state_snapshot_blocks=2, max_num_seqs=2)
    snaps = e.kv.snapshots
    assert snaps is not None and snaps.num_rows == 2
    prompts = [list(range(30, 47)), list(range(50, 67))]
    outputs = run_all(e, prompts)
    assert outputs == run_all(engine(tiny, enable_prefix_caching=False), prompts)
    assert snaps.num_used == snaps.num_saved == 2
    assert e.kv.num_free_blocks == e.kv.num_blocks
    again = prompts[0] + outputs[0] + [1]
    expected = run_all(engine(tiny, enable_prefix_caching=False), [again])[0]
    assert run_one(e, "again", again) == (expected, 20)


def test_embeddings_run_the_prompts_with_states_of_their_own(tiny):
    """Engine.embed: whole prompts in one pass, fresh states, nothing of the slots touched;
    the last token's final hidden state is transformers'."""
    e = engine(tiny)
    prompts = [[3, 14, 15, 92, 65], list(range(20, 31))]
    got = e.embed(prompts, normalize=False)
    for p, vector in zip(prompts, got):
        with torch.no_grad():
            ref = tiny[1].model(torch.tensor([p])).last_hidden_state[0, -1]
        assert (vector - ref).abs().max() <= TOL


def test_teacher_forced_logprobs_follow_transformers(tiny):
    """Outside the scheduler: a prefill, then one decode step per token in a state slot of
    its own, given back after."""
    e = engine(tiny)
    ids = list(range(30, 44))
    got = e.teacher_forced_logprobs(ids, prefill=6)
    ref = torch.log_softmax(reference_logits(tiny[1], ids)[5:], dim=-1)
    assert got.shape == ref.shape and (got - ref).abs().max() <= TOL
    assert e.kv.states is not None and e.kv.states.num_free == e.kv.states.num_slots


# ---- checkpoints: multimodal wrappers, GGUF state dimensions ---------------------------------

def _multimodal(arch: str):
    """A tiny multimodal checkpoint around the hybrid text model (a one-layer vision tower)."""
    import transformers as tf

    text = hybrid_config(arch).to_dict()
    vision = {"hidden_size": 32, "intermediate_size": 32}
    if arch == "lfm2":
        cfg = tf.Lfm2VlConfig(text_config=text, projector_hidden_size=32, vision_config={
            **vision, "num_hidden_layers": 1, "num_attention_heads": 2})
        return tf.Lfm2VlForConditionalGeneration(cfg)
    cfg = tf.Qwen3_5Config(text_config=text, vision_config={
        **vision, "depth": 1, "num_heads": 2, "out_hidden_size": 64})
    return tf.Qwen3_5ForConditionalGeneration(cfg)


@pytest.mark.parametrize("arch", ["lfm2", "qwen3_5"])
def test_multimodal_checkpoint_loads_its_text_model_and_says_so(tmp_path, caplog, arch):
    torch.manual_seed(3)
    hf = _multimodal(arch).float().eval()
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    with caplog.at_level("WARNING", logger="kvlab.models"):
        runner = runner_for(tmp_path / "hf")
    assert "vision tower is not loaded" in caplog.text
    ids = [4, 8, 15, 16, 23, 42]
    logits = step(runner, seq("a", 0, ids, [0, 1], slot=0))
    assert (logits[0] - reference_logits(hf, ids)[-1]).abs().max() <= TOL


# per family: a GGUF key changed, and what the load error says
MISMATCHES = {
    "lfm2": [("lfm2.shortconv.l_cache", 4, r"convolution weight is \[64, 3\]")],
    "lfm2_moe": [("lfm2moe.shortconv.l_cache", 4, r"convolution weight is \[64, 3\]")],
    "qwen3_5": [("qwen35.ssm.state_size", 16, "state dimensions say"),
                ("qwen35.ssm.conv_kernel", 3, "state dimensions say")],
    "qwen3_5_moe": [("qwen35moe.ssm.time_step_rank", 2, "state dimensions say")],
    "granitehybrid": [("granitehybrid.ssm.state_size", 8, "state dimensions say"),
                      ("granitehybrid.ssm.conv_kernel", 3, "state dimensions say")],
    "granitehybrid_moe": [("granitehybrid.ssm.time_step_rank", 4, "state dimensions say"),
                          ("granitehybrid.ssm.group_count", 1, "state dimensions say")],
    "nemotron_h": [("nemotron_h.ssm.state_size", 8, "state dimensions say"),
                   ("nemotron_h.ssm.group_count", 1, "state dimensions say"),
                   ("nemotron_h.ssm.conv_kernel", 3, "state dimensions say")],
    "nemotron_h_moe": [("nemotron_h_moe.ssm.time_step_rank", 4, "state dimensions say"),
                       ("nemotron_h_moe.ssm.inner_size", 64, "state dimensions say")],
}


def test_gguf_state_dimensions_that_disagree_with_the_tensors_are_a_load_error(tiny):
    path = path_of(tiny, "model.gguf")
    for key, value, message in MISMATCHES[tiny[0]]:
        ckpt = open_checkpoint(path)
        ckpt.metadata[key] = value
        with pytest.raises(ModelLoadError, match=message):
            load_model(ckpt, LoadOptions())


def test_gguf_nextn_layers_at_the_end_are_not_run(tiny):
    """llama.cpp counts Qwen3.5's multi-token-prediction layers in block_count and says how
    many in nextn_predict_layers: the model is the layers before them."""
    if not tiny[0].startswith("qwen3_5"):
        pytest.skip(f"{tiny[0]} has no nextn layers")
    arch = "qwen35" if tiny[0] == "qwen3_5" else "qwen35moe"
    ckpt = open_checkpoint(path_of(tiny, "model.gguf"))
    meta = ckpt.metadata
    meta[f"{arch}.block_count"] += 1
    meta[f"{arch}.nextn_predict_layers"] = 1
    meta[f"{arch}.attention.recurrent_layers"] = [*meta[f"{arch}.attention.recurrent_layers"],
                                                  False]
    loaded = load_model(ckpt, LoadOptions())
    assert loaded.config.num_layers == 4
    runner = ModelRunner(loaded.model, loaded.config, 32, 4, num_state_slots=1)
    ids = [2, 7, 1, 8, 2, 8]
    logits = step(runner, seq("a", 0, ids, [0, 1], slot=0))
    assert (logits[0] - reference_logits(tiny[1], ids)[-1]).abs().max() <= TOL



def test_granite_hybrid_with_rope_matches_transformers(tmp_path):
    """Granite hybrids whose attention rotates (position_embedding_type "rope", as Bamba-style
    checkpoints have): prefill then decode steps equal transformers'."""
    hf = build_hybrid("granitehybrid", tmp_path, position_embedding_type="rope")
    _prefill_then_decode_match(hf, tmp_path / "hf", seed=4, table=[2, 0, 1], slot=1)


def _prefill_then_decode_match(hf, path, seed: int, table: list[int], slot: int) -> None:
    """8 tokens of prefill, then 4 decode steps, each row equal to transformers' logits."""
    ids = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(seed)).tolist()
    ref = reference_logits(hf, ids)
    runner = runner_for(path)
    logits = step(runner, seq("a", 0, ids[:8], table, slot=slot))
    assert (logits[0] - ref[7]).abs().max() <= TOL
    for pos in range(8, 12):
        logits = step(runner, seq("a", pos, [ids[pos]], table, slot=slot))
        assert (logits[0] - ref[pos]).abs().max() <= TOL


def test_nemotron_h_experts_in_a_latent_match_transformers(tmp_path):
    """Nemotron-3 Super's layout: the routed experts run in a latent narrower than the hidden
    size (fc1_latent_proj in, fc2_latent_proj out), the router and shared expert on the
    hidden state; prefill then decode steps equal transformers'."""
    hf = build_hybrid("nemotron_h_moe", tmp_path, moe_latent_size=16)
    _prefill_then_decode_match(hf, tmp_path / "hf", seed=5, table=[1, 2, 0], slot=0)


def test_nemotron_h_mlp_layers_keep_neither_kv_nor_state(tiny):
    """Layer kinds "recurrent", "full" and "mlp": KV stores for the attention layers only,
    state rows for the Mamba-2 layers only, nothing for the MLP-only layers; the bytes per
    token and per sequence count the same layers."""
    if not tiny[0].startswith("nemotron_h"):
        pytest.skip(f"{tiny[0]} has no MLP-only layers")
    for fmt in ("hf", "model.gguf"):
        c = read_config(open_checkpoint(path_of(tiny, fmt)))[1]
        assert c.layer_types == ("recurrent", "full", "recurrent", "mlp")
        assert [c.owns_kv(i) for i in range(4)] == [False, True, False, False]
        assert [c.has_mlp(i) for i in range(4)] == [False, False, False, True]
        assert c.kv_bytes_per_token(4) == 4 * 2 * c.num_kv_heads * c.head_dim
        assert c.state_bytes_per_seq() == 4 * 2 * c.recurrent.state_elements
    runner = runner_for(tiny[2] / "hf")
    assert [kv is not None for kv in runner.kv_caches] == [False, True, False, False]
    assert [s is not None for s in runner.states.layers] == [True, False, True, False]


def test_nemotron_h_layer_pattern_in_each_spelling():
    """NVIDIA's hybrid_override_pattern, transformers' layers_block_type and the legacy
    names give the same layers; an unknown character is a load error naming the valid ones."""
    base = hybrid_config("nemotron_h_moe").to_dict()
    base.pop("layers_block_type")
    spellings = ["M*ME", ["linear_attention", "full_attention", "linear_attention", "moe"],
                 ["mamba", "attention", "mamba", "moe"]]
    configs = [nemotron_h.config_from_hf({**base, ("hybrid_override_pattern" if isinstance(p, str)
                                        else "layers_block_type"): p}) for p in spellings]
    assert all(c == configs[0] for c in configs)
    assert configs[0].layer_types == ("recurrent", "full", "recurrent", "mlp")
    assert configs[0].moe is not None and configs[0].moe.scoring == "sigmoid"
    assert nemotron_h.config_from_hf({**base, "hybrid_override_pattern": "M*M-"}).moe is None
    with pytest.raises(ModelLoadError, match=r"\['X'\]; valid"):
        nemotron_h.config_from_hf({**base, "hybrid_override_pattern": "M*MX"})
