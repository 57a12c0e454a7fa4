"""Mixture-of-experts architectures on tiny random configs: kvlab's logits against transformers'
(fp32, max abs diff <= 1e-4) for prefill, paged decode and a batch of unequal prompts, from the
safetensors and from a GGUF copy; the experts each token chooses, per layer, equal
transformers' choices; quantized experts stay in their blocks."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from gguf import GGMLQuantizationType as T
from test_decode_c import quantized_engine
from test_models import reference_logits, runner_for, step

from kvlab.cost import expert_share
from kvlab.engine import Engine, EngineConfig
from kvlab.harness.llama_bench import bench_tg, weight_check
from kvlab.kernels import QuantizedWeight, dequantize, fused, group_rows, quantize
from kvlab.models import find_arch, moe
from kvlab.models.layers import Stacked, linear
from kvlab.models.loader import LoadOptions, load_model
from kvlab.request import RequestOutput, RequestTimings, SamplingParams
from kvlab.runner import ModelRunner
from kvlab.scheduler import ScheduledSeq
from kvlab.server.viz.events import LiveRequests, RunSpec, VizRun
from kvlab.weights.checkpoint import TensorCheckpoint, open_checkpoint

from tiny_models import MOE_ARCHS, build, write_gguf


@pytest.fixture(scope="module", params=MOE_ARCHS)
def tiny(request, tmp_path_factory):
    arch = request.param
    out = tmp_path_factory.mktemp(arch)
    return arch, build(arch, out), out


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("fmt", ["hf", "model.gguf"])
def test_batched_decode_equals_each_alone(tiny, fmt):
    """Experts serve the tokens of several sequences at once (grouped by expert): each row's
    logits are those it gets alone. (Logits against transformers: tests/test_models.py.)"""
    arch, hf, out = tiny
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (3, 11, 7)]
    tables = [[0, 1, 2], [3, 4, 5, 6], [7, 8, 9]]
    runner = runner_for(out / fmt)
    step(runner, *(ScheduledSeq(str(i), 0, p, t, False, len(p))
                   for i, (p, t) in enumerate(zip(prompts, tables))))
    batched = step(runner, *(ScheduledSeq(str(i), len(p), [n], t, True, 0)
                             for i, (p, n, t) in enumerate(zip(prompts, (5, 6, 7), tables))))
    for i, (p, n) in enumerate(zip(prompts, (5, 6, 7))):
        alone = runner_for(out / fmt)
        step(alone, ScheduledSeq("x", 0, p, tables[i], False, len(p)))
        one = step(alone, ScheduledSeq("x", len(p), [n], tables[i], True, 0))
        assert (batched[i] - one[0]).abs().max() <= 1e-5


def _transformers_choices(hf, ids: list[int]) -> list[torch.Tensor]:
    """Per layer: the expert ids [T, k] transformers' router picked, from a forward hook."""
    picked: list[torch.Tensor] = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, out: picked.append(out[2]))
             for layer in hf.model.layers]
    try:
        reference_logits(hf, ids)
    finally:
        for h in hooks:
            h.remove()
    return picked


def test_routing_decisions_equal_transformers(tiny, monkeypatch):
    arch, hf, out = tiny
    ids = _ids(14, 4)
    picked: list[torch.Tensor] = []
    real_route = moe.route

    def recording_route(h, router, config):
        weights, chosen = real_route(h, router, config)
        picked.append(chosen)
        return weights, chosen

    monkeypatch.setattr(moe, "route", recording_route)
    runner = runner_for(out / "model.gguf")
    step(runner, ScheduledSeq("a", 0, ids, [0, 1, 2, 3], True, 14))
    ref = _transformers_choices(hf, ids)
    assert len(picked) == len(ref) == hf.config.num_hidden_layers
    used = set()
    for layer, (ours, theirs) in enumerate(zip(picked, ref)):
        assert torch.equal(ours.sort(-1).values, theirs.sort(-1).values), f"layer {layer}"
        used |= set(ours.flatten().tolist())
    assert len(used) > 2  # the tokens spread over several experts


def test_quantized_gguf_experts_stay_in_their_blocks(tiny, tmp_path):
    arch, hf, out = tiny
    path = tmp_path / "q8.gguf"
    write_gguf(arch, hf, path, quantize=T.Q8_0)
    loaded = load_model(open_checkpoint(path), LoadOptions(group_rows=False))
    experts = loaded.model.layers[0]["experts"]
    assert len(experts) == loaded.config.moe.num_experts
    assert all(isinstance(w, QuantizedWeight) and w.qtype == T.Q8_0
               for w in experts.down)
    assert all(p.all_quantized for p in experts.gate_up)
    assert experts.c_table is not None  # one C call per layer runs the chosen experts
    # the down experts are views of one block of bytes, expert after expert (zero copies)
    d0, d1 = experts.down[0], experts.down[1]
    assert d1.data.data_ptr() - d0.data.data_ptr() == d0.nbytes
    assert {t.qtype for t in loaded.tensors if "_exps." in t.name} == {"Q8_0"}
    assert not isinstance(loaded.model.layers[0]["router"], QuantizedWeight)
    ids = _ids(12, 5)
    runner = runner_for(path)
    got = step(runner, ScheduledSeq("a", 0, ids, [0, 1, 2], True, 12))[0]
    cos = torch.nn.functional.cosine_similarity(got, reference_logits(hf, ids)[-1], dim=0)
    assert cos > 0.99


def _experts(gate_up_types, down_type, grouped: bool, hidden: int = 256, inter: int = 256,
             count: int = 6) -> moe.Experts:
    """Random quantized experts; gate|up in one matrix, or (two types) in two parts."""
    gen = torch.Generator().manual_seed(11)

    def weight(rows, cols, qtype, scale=1.0):
        w = quantize(torch.randn(rows, cols, generator=gen) * scale, qtype)
        return group_rows(w) if grouped else w

    gate_up = tuple(Stacked.of([weight(2 * inter, hidden, gate_up_types[0])]
                               if len(gate_up_types) == 1 else
                               [weight(inter, hidden, t) for t in gate_up_types])
                    for _ in range(count))
    down = tuple(weight(hidden, inter, down_type, 0.1) for _ in range(count))
    return moe.Experts(gate_up, down)


@pytest.mark.parametrize("gate_up_types, down_type, grouped", [
    ((T.Q4_K,), T.Q6_K, True), ((T.Q8_0,), T.Q8_0, False), ((T.Q4_K, T.Q8_0), T.Q6_K, True),
    ((T.Q8_0, T.Q4_K), T.Q4_K, False), ((T.MXFP4,), T.MXFP4, True),
    ((T.MXFP4,), T.MXFP4, False)])
@pytest.mark.parametrize("tokens", [1, 3, 19])
def test_c_experts_equal_the_per_expert_products(gate_up_types, down_type, grouped, tokens):
    """One C call runs a layer's chosen experts on the same 8-bit blocks as one product per
    expert: the batch path's bits exactly; one token differs only where torch's add with
    alpha fuses the multiply (a rounding of the sum, not of the products)."""
    experts = _experts(gate_up_types, down_type, grouped)
    assert experts.c_table is not None
    gen = torch.Generator().manual_seed(tokens)
    h = torch.randn(tokens, 256, generator=gen)
    ids = torch.stack([torch.randperm(len(experts), generator=gen)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=gen)
    got = fused.moe_experts(h, ids, weights, experts.c_table)
    each = moe.run_experts_each(h, experts, weights, ids)
    if tokens > 1:
        assert torch.equal(got, each)
    assert (got - each).abs().max() <= 1e-6 * each.abs().max()
    # each token's row is what it gets alone
    assert torch.equal(got[-1:], fused.moe_experts(h[-1:], ids[-1:], weights[-1:],
                                                   experts.c_table))


@pytest.mark.parametrize("types, grouped", [((T.MXFP4,), True), ((T.Q8_0,), False),
                                             ((T.Q4_K, T.Q8_0), True)])
@pytest.mark.parametrize("tokens", [1, 5, 19])
def test_c_experts_with_biases_and_clamped_swiglu(types, grouped, tokens):
    """gpt-oss's experts in the one C call (bias rows on gate|up and down, the clamped
    SwiGLU, values past the clamp included) give the per-expert torch products on the same
    blocks, and torch's fp32 math on the dequantized weights up to the 8-bit activations."""
    plain = _experts(types, types[-1] if len(types) == 1 else T.Q6_K, grouped)
    gen = torch.Generator().manual_seed(40 + tokens)
    experts = moe.Experts(plain.gate_up, plain.down, torch.randn(6, 512, generator=gen) * 4,
                          torch.randn(6, 256, generator=gen), moe.ClampedSwiglu(1.702, 7.0))
    assert experts.c_table is not None
    h = torch.randn(tokens, 256, generator=gen)
    ids = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=gen)
    got = moe.run_experts(h, experts, weights, ids)
    each = moe.run_experts_each(h, experts, weights, ids)
    assert (got - each).abs().max() <= 1e-5 * each.abs().max()
    dense = moe.run_experts_each(h, _dequantized(experts), weights, ids)
    assert (got - dense).abs().max() <= 0.05 * dense.abs().max()
    gate_up = torch.stack([linear(h, experts.gate_up[e], experts.gate_up_bias[e])
                           for e in range(6)])
    assert (gate_up.abs() > 7).any()  # the clamps act


def _dequantized(experts: moe.Experts) -> moe.Experts:
    def dense(w):
        return dequantize(w)
    return moe.Experts(tuple(Stacked.of([dense(p) for p in s.parts]) for s in experts.gate_up),
                       tuple(dense(w) for w in experts.down), experts.gate_up_bias,
                       experts.down_bias, experts.gate)


def test_c_experts_refuse_an_expert_id_out_of_range():
    experts = _experts((T.Q8_0,), T.Q8_0, False, count=4)
    ids = torch.tensor([[0, 4]])
    with pytest.raises(IndexError, match=r"expert id 4 is out of range \[0, 4\)"):
        fused.moe_experts(torch.randn(1, 256), ids, torch.rand(1, 2), experts.c_table)


def test_dense_experts_take_the_per_expert_products(tiny):
    arch, hf, out = tiny
    loaded = load_model(open_checkpoint(out / "hf"), LoadOptions())
    assert loaded.model.layers[0]["experts"].c_table is None  # fp32 weights: torch products


def test_quantized_moe_models_decode_in_the_c_layers(tiny):
    arch, hf, out = tiny
    loaded = load_model(open_checkpoint(out / "hf"), LoadOptions(quantize="q8_0"))
    # the one-call C layers route and run the experts and a shared expert
    assert loaded.model.c_plan is not None
    assert isinstance(loaded.model.layers[0]["experts"].down[0], QuantizedWeight)
    assert not isinstance(loaded.model.layers[0]["router"], QuantizedWeight)


def test_llama_gguf_with_experts_is_mixtral():
    meta = {"llama.expert_count": 8}
    assert find_arch("llama", meta).name == "mixtral"
    assert find_arch("llama", {}).name == "llama"
    assert find_arch("llama").name == "llama"
    assert find_arch("MixtralForCausalLM").name == "mixtral"


def test_expert_share_formula():
    assert expert_share(8, 64, 1) == pytest.approx(8 / 64)
    assert expert_share(8, 64, 2) == pytest.approx(1 - (56 / 64) ** 2)
    assert expert_share(2, 8, 1000) == pytest.approx(1.0)
    assert expert_share(0, 0, 5) == 1.0  # dense: everything, every step


def test_cost_counts_the_chosen_experts(tiny):
    """Batch 1 reads attention, router, shared expert and k of E experts a layer; a batch of B
    reads the expected distinct experts E * (1 - (1 - k/E)^B)."""
    arch, hf, out = tiny
    loaded = load_model(open_checkpoint(out / "hf"), LoadOptions())
    c, m = loaded.config, loaded.config.moe
    k, e = m.experts_per_token, m.num_experts
    routed_params = c.num_layers * e * 3 * m.expert_intermediate_size * c.hidden_size
    routed = 4 * routed_params  # fp32
    cost = loaded.run_cost(2)
    spec = cost.spec
    embed = 4 * c.vocab_size * c.hidden_size  # untied: one row read per token
    row = embed // c.vocab_size
    assert sum(lyr.expert_bytes for lyr in spec.layers) == routed
    assert (spec.experts, spec.experts_used) == (e, k)
    assert cost.decode_weight_bytes == (loaded.weight_bytes - embed + row
                                        - routed * (e - k) // e)
    assert loaded.active_params == loaded.num_params - routed_params * (e - k) // e
    assert spec.active_params == loaded.active_params
    for batch in (1, 3, 16):  # the distinct experts a batch picks, and one row per token
        distinct = e * (1 - (1 - k / e) ** batch)
        assert spec.decode_weight_bytes(batch) == pytest.approx(
            cost.decode_weight_bytes + routed * (distinct - k) / e + (batch - 1) * row)
    dense_params = sum(math.prod(t.shape) for t in loaded.tensors
                       if t.name.startswith("layers.") and len(t.shape) == 2 and not t.routed)
    assert spec.matmul_flop_per_token() == pytest.approx(
        2 * (dense_params + routed_params * k / e))


def test_info_reports_experts_and_active_parameters(tiny):
    from kvlab.cli.info import describe

    arch, hf, out = tiny
    loaded = load_model(open_checkpoint(out / "model.gguf"), LoadOptions())
    info = describe(loaded, "tiny")
    assert info["experts"] == loaded.config.moe.num_experts
    assert info["active_parameters"] < info["parameters"]
    steps = info["decode_bytes_per_step"]
    assert steps[1] == info["decode_bytes_per_token"] < steps[4] < steps[16] <= steps[64]


def test_engine_greedy_equals_transformers_and_reports_the_experts(tiny):
    """End to end through the engine: greedy tokens equal transformers' generate, and with
    record_experts each output carries, per layer, the experts of the row that sampled it
    (the prefill's last prompt position: transformers' choice there)."""
    arch, hf, out = tiny
    prompt = _ids(7, 6)
    config = EngineConfig(block_size=4, record_experts=True)
    engine = Engine.from_model(str(out / "model.gguf"), config)
    engine.add_request("a", prompt, SamplingParams(max_tokens=5, temperature=0,
                                                   ignore_eos=True))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    tokens = [t for o in outputs for t in o.new_token_ids]
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False,
                      min_new_tokens=5)
    assert ref[0, len(prompt):].tolist() == tokens
    k, layers = hf.config.num_experts_per_tok, hf.config.num_hidden_layers
    assert all(len(o.experts) == layers and all(len(e) == k for e in o.experts)
               for o in outputs)
    theirs = _transformers_choices(hf, prompt)
    assert [sorted(e) for e in outputs[0].experts] == \
        [sorted(t[-1].tolist()) for t in theirs]
    quiet = Engine.from_model(str(out / "model.gguf"), EngineConfig(block_size=4))
    quiet.add_request("a", prompt, SamplingParams(max_tokens=1, temperature=0))
    assert all(o.experts is None for o in quiet.step())


def test_qwen2moe_dense_layers_between_expert_layers(tmp_path):
    """`mlp_only_layers`: those layers keep a dense SwiGLU (no router), the others route."""
    hf = build("qwen2moe", tmp_path, mlp_only_layers=[1])
    ids = _ids(10, 7)
    ref = reference_logits(hf, ids)
    for fmt in ("hf", "model.gguf"):
        runner = runner_for(tmp_path / fmt)
        layers = runner.model.layers
        assert "router" not in layers[1] and "router" in layers[0] and "router" in layers[2]
        logits = step(runner, ScheduledSeq("a", 0, ids[:8], [0, 1, 2], True, 8))
        assert (logits[0] - ref[7]).abs().max() <= 1e-4
        for pos in (8, 9):
            logits = step(runner, ScheduledSeq("a", pos, [ids[pos]], [0, 1, 2], True, 0))
            assert (logits[0] - ref[pos]).abs().max() <= 1e-4


def test_a_transformers_model_in_memory_loads_its_fused_experts(tiny):
    """In memory transformers holds each layer's experts as 3-D gate_up_proj / down_proj
    (save_pretrained splits them per expert): TensorCheckpoint hands those over as they are."""
    arch, hf, out = tiny
    config = {**hf.config.to_dict(), "architectures": [type(hf).__name__]}
    ckpt = TensorCheckpoint(config, dict(hf.state_dict()))
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in ckpt.names())
    loaded = load_model(ckpt, LoadOptions())
    runner = ModelRunner(loaded.model, loaded.config, 32, 4)
    ids = _ids(9, 8)
    logits = step(runner, ScheduledSeq("a", 0, ids, [0, 1, 2], True, 9))
    assert (logits[0] - reference_logits(hf, ids)[-1]).abs().max() <= 1e-4


def test_viz_token_events_carry_the_experts():
    """The visualiser's prefill/decode events of a sampled token carry its experts per layer;
    an output without them (dense models, recording off) adds no field."""
    served = SimpleNamespace(block_size=4, kv_bytes_per_token=8)
    engine = SimpleNamespace(tokenizer=SimpleNamespace(decode=lambda ids, **kw: "x"),
                             snapshot=lambda: served)
    run = VizRun(engine, LiveRequests(), RunSpec([1, 2, 3], [SamplingParams()]))
    state = run.states[0]
    timings = RequestTimings(arrival=0.0, token_times=[0.5, 0.7])

    def output(token: int, experts) -> RequestOutput:
        return RequestOutput(state.request_id, [token], "x", False, None, 3, 0,
                             len(state.output_ids) + 1, timings=timings, experts=experts)

    first = run._step_events(state, output(7, [[3, 1], [0, 2]]))
    assert first[0]["event"] == "prefill" and first[0]["experts"] == [[3, 1], [0, 2]]
    second = run._step_events(state, output(8, None))
    assert second[0]["event"] == "decode" and "experts" not in second[0]


def test_decode_reads_the_active_weights_bytes(tiny):
    """The weight bytes the kernels count per decode token equal the cost model's active
    weights (k of E experts a layer) within 10 % (fp32 norms and a per-op router are not
    counted), and `weight_check` says so."""
    arch, hf, out = tiny
    engine = quantized_engine(out, "q8_0")
    result = bench_tg(engine, 6, 1)
    active = engine.cost.decode_weight_bytes
    assert abs(result.weights_read_per_token / active - 1) <= 0.10
    assert "(within 10 %)" in weight_check([result], active)


def test_a_copy_of_the_experts_points_at_its_own_weights():
    experts = _experts((T.Q8_0,), T.Q8_0, False, count=2)
    twin = copy.deepcopy(experts)
    assert twin.c_table[0, 2, 1] == twin.down[0].data.data_ptr() != experts.c_table[0, 2, 1]
