"""Hybrid models (tiny random LFM2, LFM2-MoE, Qwen3.5, Qwen3.5-MoE, Granite 4 hybrid dense
and MoE, Nemotron-H dense and MoE, weights quantized at load) decode in the one C call:
LFM2's short-convolution layers (in-projection, the C short conv on each sequence's state
row, out-projection) beside QK-norm attention; Qwen3.5's Gated DeltaNet layers (the conv,
the C delta rule on the recurrent state row, the gated norm) beside its gated attention
with partial RoPE; Mamba-2 layers (in_proj, the conv with its bias, the C SSD step, the
grouped gated norm, out_proj) beside attention without RoPE, with Granite's residual
multiplier and Nemotron-H's one-sublayer layers (relu2 MLP layers, mixer layers without
an MLP); SwiGLU or relu2 MLPs, or routed experts (softmax, sigmoid with a choice bias)
with a shared expert. Every product and recurrent step is the per-op path's own C call in
the same order, so the dense LFM2, Granite and Nemotron-H logits are equal bit for bit
(their few element-wise ops round alike), the others within fp32 rounding (_tolerance):
alone, batched at unequal depths, through the engine with preemption, and after a prefix
hit that restores a state snapshot. A step of several tokens of one sequence (a
speculative verify) stays per op."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_hybrid import byte_tokenizer_metadata

from kvlab.engine import Engine, EngineConfig
from kvlab.kernels import fused
from kvlab.models import decode_c
from kvlab.models.loader import LoadOptions, load_model
from kvlab.models.state_store import StateBatch
from kvlab.request import SamplingParams
from kvlab.runner import ModelRunner
from kvlab.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from kvlab.tokenizer import load_gguf_tokenizer
from kvlab.weights.checkpoint import open_checkpoint

from tiny_models import build_hybrid, convert_with_llama_cpp

pytestmark = pytest.mark.skipif(not fused.ENABLED, reason="needs kvlab's C extension")

# each family's build_hybrid overrides: a shared expert in whole 32-blocks (C products)
ARCHS = {"lfm2": {}, "lfm2_moe": {}, "qwen3_5": {},
         "qwen3_5_moe": {"shared_expert_intermediate_size": 64}, "granitehybrid": {},
         "granitehybrid_moe": {"shared_intermediate_size": 64}, "nemotron_h": {},
         "nemotron_h_moe": {"moe_shared_expert_intermediate_size": 64}}
# 256 wide for Q4_K's blocks (Granite's Mamba-2 heads as wide as its expand of 2 asks)
WIDE = {"hidden_size": 256}
WIDER = {"granitehybrid": {"mamba_d_head": 64}, "granitehybrid_moe": {"mamba_d_head": 64}}
# name -> (family, build_hybrid overrides, quantization at load)
VARIANTS = {f"{arch}_{quant}": (arch, {**extra, **({**WIDE, **WIDER.get(arch, {})}
                                                  if quant == "q4_k" else {})}, quant)
            for arch, extra in ARCHS.items() for quant in ("q8_0", "q4_k")}
# a plan row's recurrent fields, then the other hybrid ones, just before Gemma 4's and the
# latent-attention ones: mixer, n_rc_in, rc_in[4] (5 each), rc_out (5), conv, conv_k, ssm_a,
# dt_bias, rc_norm, k_heads, v_heads, k_dim, v_dim, v_tiled, q_gate, rotary; ssm_d,
# rc_in_bias, conv_bias, rc_out_bias, dt_min, dt_max, residual_scale, expert_relu2,
# latent_in (5), latent_out (5)
_END = -24 - decode_c._MLA_FIELDS
AFTER_MIXER_FIELDS = slice(_END - decode_c._AFTER_MIXER_FIELDS, _END)
MIXER_FIELDS = slice(AFTER_MIXER_FIELDS.start - decode_c._MIXER_FIELDS, AFTER_MIXER_FIELDS.start)
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request, tmp_path_factory):
    arch, overrides, quant = VARIANTS[request.param]
    out = tmp_path_factory.mktemp(f"hybrid_c_{request.param}")
    build_hybrid(arch, out, **overrides)
    return out, quant, arch


@pytest.fixture
def c_steps(monkeypatch) -> list[bool]:
    """What each decode_c.run call returns (True: the one C call ran the step)."""
    ran, run = [], decode_c.run
    monkeypatch.setattr(decode_c, "run",
                        lambda *args, **kw: ran.append(run(*args, **kw)) or ran[-1])
    return ran


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _loaded(out, quant: str, plan: bool):
    loaded = load_model(open_checkpoint(out / "hf"), LoadOptions(quantize=quant))
    assert loaded.model.c_plan is not None
    if not plan:
        loaded.model.c_plan = None
    return loaded


def _runner(out, quant: str, plan: bool) -> ModelRunner:
    loaded = _loaded(out, quant, plan)
    return ModelRunner(loaded.model, loaded.config, 64, 4, kv_dtype="f32", num_state_slots=4)


def _step(runner: ModelRunner, *seqs: ScheduledSeq) -> torch.Tensor:
    return runner.execute(SchedulerOutput(list(seqs))).logits


def _seq(name: str, start: int, ids: list[int], table: list[int], slot: int) -> ScheduledSeq:
    return ScheduledSeq(name, start, ids, table, True, len(ids) if start == 0 else 0,
                        state_slot=slot)


# each recurrent kind's mixer and its layer's in- and out-products
RECURRENT_ROWS = {"short_conv": (decode_c.MIX_SHORT_CONV, "conv_in", "conv_out"),
                  "gated_delta": (decode_c.MIX_GATED_DELTA, "delta_in", "delta_out"),
                  "mamba2": (decode_c.MIX_MAMBA2, "in_proj", "out_proj")}


def test_the_plan_takes_the_recurrent_layers(tiny):
    """Recurrent and MLP layers read no K/V; a recurrent row holds the in-products (LFM2 and
    Mamba-2: one; Qwen3.5: delta_in's as the loader stacked them), the out-projection, the
    conv weight and width, and (Gated DeltaNet, Mamba-2) A, the dt bias, the output norm
    and the head shapes; Qwen3.5's attention layers gate their output and rotate their
    first quarter; a Nemotron-H MLP layer mixes nothing (MIX_NONE)."""
    out, quant, _ = tiny
    model = _runner(out, quant, True).model
    config, rc = model.config, model.config.recurrent
    assert model.c_plan.sources == [i if config.is_attention(i) else None
                                    for i in range(config.num_layers)]
    delta = rc.kind == "gated_delta"
    for i, (row, layer) in enumerate(zip(model.c_plan.weights.tolist(), model.layers)):
        fields = row[MIXER_FIELDS]
        if not config.is_recurrent(i):
            gate = [1, config.head_dim // 4] if delta else [0, 0]
            kind = 0 if config.is_attention(i) else decode_c.MIX_NONE
            assert fields == [kind] + [0] * (decode_c._MIXER_FIELDS - 3) + gate
            continue
        kind, in_name, out_name = RECURRENT_ROWS[rc.kind]
        ins = layer[in_name].parts if delta else [layer[in_name]]
        assert fields[:2] == [kind, len(ins)]
        assert fields[2:2 + 5 * len(ins)] == [v for w in ins for v in decode_c.product_desc(w)]
        assert fields[22:27] == list(layer[out_name].kernel_args)
        assert fields[27:29] == [layer["conv"].data_ptr(), rc.conv_kernel]
        if delta:
            assert fields[29:] == [layer["ssm_a"].data_ptr(), layer["dt_bias"].data_ptr(),
                                   layer["delta_norm"].data_ptr(), rc.num_k_heads,
                                   rc.num_v_heads, rc.k_head_dim, rc.v_head_dim,
                                   int(rc.v_heads_tiled), 0, 0]
        if rc.kind == "mamba2":
            _check_mamba2_fields(fields, row[AFTER_MIXER_FIELDS], layer, config)


def _check_mamba2_fields(fields: list[int], last: list[int], layer: dict, config) -> None:
    """A, dt bias, the gated norm, groups x state size, heads x head size; D and the conv
    bias (these checkpoints' in and out products have none), dt in [0, inf); Granite's
    residual multiplier as fp32 bits."""
    rc = config.recurrent
    assert fields[29:] == [layer["ssm_a"].data_ptr(), layer["dt_bias"].data_ptr(),
                           layer["norm"].data_ptr(), rc.ssm_groups, rc.ssm_heads,
                           rc.ssm_state_size, rc.ssm_head_dim, 0, 0, 0]
    scale = 0 if config.residual_scale == 1.0 else decode_c._f32_bits(config.residual_scale)
    assert last[:7] == [layer["D"].data_ptr(), 0, layer["conv_bias"].data_ptr(), 0,
                        decode_c._f32_bits(0.0), decode_c._f32_bits(float("inf")), scale]


def test_decode_in_the_one_c_call_equals_the_per_op_path(tiny, c_steps):
    out, quant, _ = tiny
    ids, table = _ids(14, 1), [9, 3, 17, 0]  # scattered, out-of-order blocks
    logits = []
    for plan in (True, False):
        runner = _runner(out, quant, plan)
        rows = [_step(runner, _seq("a", 0, ids[:5], table, 2))[0]]
        for pos in range(5, len(ids)):
            rows.append(_step(runner, _seq("a", pos, [ids[pos]], table, 2))[0])
        logits.append(torch.stack(rows))
    assert c_steps[:len(ids) - 4] == [False] + [True] * (len(ids) - 5)  # prefill per-op
    assert float((logits[0] - logits[1]).abs().max()) <= _tolerance(tiny)


def test_batched_decode_in_the_one_c_call(tiny, c_steps):
    """Three sequences of unequal lengths in scattered state slots decode together in the C
    call: each row equals the per-op path's batch."""
    out, quant, _ = tiny
    seqs = {f"s{n}": (_ids(n, 20 + n), table, slot, _ids(3, 50 + n))
            for n, table, slot in ((3, [7, 2, 12, 19], 3), (11, [0, 15, 4, 9], 0),
                                   (6, [5, 1, 14, 11], 2))}
    fast, slow = (_decode_together(_runner(out, quant, plan), seqs) for plan in (True, False))
    assert c_steps[3:6] == [True] * 3  # after the three prefills
    assert float((fast - slow).abs().max()) <= _tolerance(tiny)


def _tolerance(tiny) -> float:
    """How far the C call's logits may be from the per-op path's: not at all for LFM2,
    Granite 4 hybrid and Nemotron-H, whose every op between the products is the same C call
    (but Mamba-2's dt softplus, which rounds alike on these inputs). Qwen3.5's gated attention and DeltaNet
    inputs compute sigmoid, softplus, the L2 norm and RoPE in C where the per-op path uses
    torch (1e-7 apart); a later layer cuts its activations into 8-bit blocks (32 values for
    Q8_0 weights, 256 for Q4_K), where such a difference can move one value to the next
    step: up to 5e-3 and 2e-2 there. So can the MoE families' router product, in C's fp32
    order where the per-op path's is torch's."""
    _, quant, arch = tiny
    if arch in ("lfm2", "granitehybrid", "nemotron_h"):
        return 0.0
    return 2e-2 if quant == "q4_k" else 5e-3


def _decode_together(runner: ModelRunner, seqs: dict) -> torch.Tensor:
    for name, (prompt, table, slot, _) in seqs.items():
        _step(runner, _seq(name, 0, prompt, table, slot))
    return torch.stack([_step(runner, *(
        _seq(name, len(prompt) + t, [nxt[t]], table, slot)
        for name, (prompt, table, slot, nxt) in seqs.items())) for t in range(3)])


def test_a_step_of_several_tokens_of_one_sequence_is_refused(tiny):
    """A verify step's rows (several tokens of one sequence, one state row) are not a decode
    step: the plan takes no state table for them, and the per-op path runs."""
    out, quant, _ = tiny
    runner = _runner(out, quant, True)
    plan, states = runner.model.c_plan, runner.states
    layers = states.layers
    one = torch.tensor([1], dtype=torch.int64)
    assert plan.states(StateBatch(layers, one, one), 1) is not None
    assert plan.states(StateBatch(layers, one, torch.tensor([2])), 2) is None
    assert plan.states(StateBatch(layers, one, one), 2) is None


def _engine(out, quant: str, plan: bool, **config) -> Engine:
    tokenizer = load_gguf_tokenizer(byte_tokenizer_metadata(96))
    return Engine(_loaded(out, quant, plan), tokenizer,
                  EngineConfig(**{"block_size": 4, "kv_dtype": "f32", **config}))


def _run_all(e: Engine, prompts: list[list[int]], prefix: str = "") -> list[list[int]]:
    for i, p in enumerate(prompts):
        e.add_request(f"{prefix}{i}", p, GREEDY)
    got: dict[str, list[int]] = {f"{prefix}{i}": [] for i in range(len(prompts))}
    while e.has_unfinished():
        for o in e.step():
            got[o.request_id].extend(o.new_token_ids)
    return [got[f"{prefix}{i}"] for i in range(len(prompts))]


PROMPTS = [_ids(5, 1), _ids(25, 2), _ids(9, 3), _ids(20, 4)]


def test_engine_with_preemption_in_the_one_c_call(tiny, c_steps, monkeypatch):
    """Room for 12 blocks of 4 tokens: some requests are preempted and recomputed from
    token 0 in whichever slot is free; the greedy tokens equal the per-op engine's with
    room for all."""
    out, quant, _ = tiny
    preempted, real = [], Scheduler._preempt
    monkeypatch.setattr(Scheduler, "_preempt", lambda s, seq: preempted.append(seq.seq_id)
                        or real(s, seq))
    expected = _run_all(_engine(out, quant, False), PROMPTS)
    c = _loaded(out, quant, False).config
    gib = (16 * c.state_bytes_per_seq() + 12 * 4 * c.kv_bytes_per_token(4)) / 2**30
    tight = _engine(out, quant, True, kv_cache_gib=gib)
    assert tight.kv.num_blocks == 12
    assert _run_all(tight, PROMPTS) == expected
    assert preempted and any(c_steps)


def test_a_prefix_hit_restores_a_snapshot_then_decodes_in_the_one_c_call(tiny, c_steps):
    """Snapshots every 2 blocks of 4 tokens, prefill chunks of at most 10: run again, the
    25-token prompt resumes at 24 from the restored state and decodes in the C call; its
    greedy tokens equal the per-op engine's without prefix caching."""
    out, quant, _ = tiny
    expected = _run_all(_engine(out, quant, False, enable_prefix_caching=False), [PROMPTS[1]])
    e = _engine(out, quant, True, state_snapshot_blocks=2, max_num_batched_tokens=10)
    assert _run_all(e, [PROMPTS[1]], "first") == expected
    del c_steps[:]
    e.add_request("again", PROMPTS[1], GREEDY)
    tokens, cached = [], None
    while e.has_unfinished():
        for o in e.step():
            tokens.extend(o.new_token_ids)
            cached = o.cached_tokens
    assert (tokens, cached) == (expected[0], 24)
    # the prompt's 25th token on the restored state is a one-token step too: every step ran
    # in the C call (the last sampled token is not computed)
    assert c_steps == [True] * len(tokens)


def test_llama_cpp_gguf_with_tiled_value_heads(tmp_path, c_steps):
    """Qwen3.5 converted by llama.cpp, where value head j reads key head j % Hk (the GGUF's
    tiled order; keys as wide as values, as its converter takes them): the C call repeats
    the key heads in that order, as the per-op path does."""
    build_hybrid("qwen3_5", tmp_path, linear_key_head_dim=16)
    skip = convert_with_llama_cpp(tmp_path / "hf", tmp_path / "model.gguf")
    if skip:
        pytest.skip(skip)
    config = load_model(open_checkpoint(tmp_path / "model.gguf"),
                        LoadOptions(quantize="q8_0")).config
    assert config.recurrent.v_heads_tiled
    fast, slow = _decode_seven(tmp_path / "model.gguf", c_steps)
    assert float((fast - slow).abs().max()) <= 5e-3


@pytest.mark.parametrize("arch", ["granitehybrid_moe", "nemotron_h_moe"])
def test_llama_cpp_gguf_with_mamba2_layers(tmp_path, c_steps, arch):
    """Granite 4 hybrid and Nemotron-H converted by llama.cpp (A stored as -exp(A_log), D
    and the gated norm's weight flattened from [H, 1] and [G, d/G], the shared MLP as
    *_shexp): the plan takes their layers, and the C call decodes as the per-op path."""
    build_hybrid(arch, tmp_path, **ARCHS[arch])
    skip = convert_with_llama_cpp(tmp_path / "hf", tmp_path / "model.gguf")
    if skip:
        pytest.skip(skip)
    fast, slow = _decode_seven(tmp_path / "model.gguf", c_steps)
    assert float((fast - slow).abs().max()) <= 5e-3


def test_mamba2_products_with_biases(tmp_path, c_steps):
    """Granite 4 hybrid with biases on its Mamba-2 in_proj and out_proj (mamba_proj_bias):
    the plan adds them (rc_in_bias, rc_out_bias) where the per-op path does, bit for bit."""
    build_hybrid("granitehybrid", tmp_path, mamba_proj_bias=True)
    _random_biases(tmp_path / "hf")
    fast, slow = _decode_seven(tmp_path / "hf", c_steps)
    row = _loaded(tmp_path, "q8_0", True).model.c_plan.weights[0, AFTER_MIXER_FIELDS].tolist()
    assert row[1] != 0 and row[3] != 0
    assert torch.equal(fast, slow)


def test_nemotron_h_mlp_biases(tmp_path, c_steps):
    """Nemotron-H with biases on its relu2 MLPs (mlp_bias): the plan adds them, bit for bit
    as the per-op path."""
    build_hybrid("nemotron_h", tmp_path, mlp_bias=True)
    _random_biases(tmp_path / "hf")
    fast, slow = _decode_seven(tmp_path / "hf", c_steps)
    assert torch.equal(fast, slow)


def _random_biases(hf_dir) -> None:
    """The checkpoint's bias vectors (transformers initialises them to 0) made random, so
    that a bias the C call left out shows."""
    (path,) = hf_dir.glob("*.safetensors")
    tensors = load_file(path)
    biases = [n for n in tensors if n.endswith("proj.bias")]
    assert biases
    gen = torch.Generator().manual_seed(7)
    for n in biases:
        tensors[n] = torch.randn(tensors[n].shape, generator=gen) * 0.3
    save_file(tensors, path, metadata={"format": "pt"})


def test_nemotron_h_experts_in_a_latent(tmp_path, c_steps):
    """Nemotron-3 Super's experts run in a latent narrower than the hidden size: the plan
    puts latent_in before them and latent_out after, as the per-op path."""
    build_hybrid("nemotron_h_moe", tmp_path, moe_latent_size=32,
                 **ARCHS["nemotron_h_moe"])
    fast, slow = _decode_seven(tmp_path / "hf", c_steps)
    model = _loaded(tmp_path, "q8_0", True).model
    (i, layer), = [(i, w) for i, w in enumerate(model.layers) if "latent_in" in w]
    last = model.c_plan.weights[i, AFTER_MIXER_FIELDS].tolist()
    assert last[8:] == [*layer["latent_in"].kernel_args, *layer["latent_out"].kernel_args]
    assert float((fast - slow).abs().max()) <= 5e-3


def _decode_seven(path, c_steps: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of a 4-token prefill then 6 decode steps at Q8_0, with the plan and
    without; every decode step ran in the C call."""
    ids, table, logits = _ids(10, 3), [4, 8, 1], []
    for plan in (True, False):
        loaded = load_model(open_checkpoint(path), LoadOptions(quantize="q8_0"))
        assert loaded.model.c_plan is not None
        if not plan:
            loaded.model.c_plan = None
        runner = ModelRunner(loaded.model, loaded.config, 16, 4, num_state_slots=2)
        rows = [_step(runner, _seq("a", 0, ids[:4], table, 1))[0]]
        rows += [_step(runner, _seq("a", pos, [ids[pos]], table, 1))[0] for pos in range(4, 10)]
        logits.append(torch.stack(rows))
    assert c_steps[:7] == [False] + [True] * 6
    return logits[0], logits[1]


def test_nemotron_h_mlp_layers_and_mixer_layers(tmp_path):
    """Nemotron-H's layers are one sublayer each: its MLP layers mix nothing and norm their
    input by their one norm (attn_norm, as the plan's mlp_norm), down(relu(up)^2) with up
    alone as gate_up; its Mamba-2 and attention layers have no MLP (n_gate_up 0)."""
    build_hybrid("nemotron_h", tmp_path)
    model = load_model(open_checkpoint(tmp_path / "hf"), LoadOptions(quantize="q8_0")).model
    config, fields = model.config, 28  # attn_norm .. mlp_norm
    for i, (row, layer) in enumerate(zip(model.c_plan.weights.tolist(), model.layers)):
        attention, mlp = row[:fields], row[fields:fields + 17]
        if config.layer_types[i] != "mlp":
            assert mlp[0] == 0 and attention[-1] == 0
            continue
        assert row[MIXER_FIELDS][0] == decode_c.MIX_NONE
        assert attention[0] == 0 and attention[-1] == layer["attn_norm"].data_ptr()
        assert mlp == [1, *layer["up"].kernel_args, *[0] * 5, decode_c.GATES["relu2"],
                       *layer["down"].kernel_args]
