"""Gemma 4 (tiny random configs, weights quantized at load) decode in the one C call: the
per-layer inputs (computed once per step, handed to C as rows), the last layers attending
over earlier layers' K/V and writing none, full layers of their own head size and KV heads
with the keys as values, the values' norm, the layer scalars, and 26B-A4B's routed GeGLU
experts beside the dense MLP (their own input and output norms, per-expert scales). Logits
equal the per-op path's on the same weights (fp32 rounding of the F32 per-layer product and
the router apart) and stay as close to transformers' as the per-op path's; alone, batched
on scattered blocks, and through the engine with preemption."""

from __future__ import annotations

import copy

import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from test_engine import run_all
from test_models import reference_logits, step

from kvlab.engine import Engine, EngineConfig
from kvlab.kernels import dequantize, fused, quantize
from kvlab.models import decode_c
from kvlab.models.loader import LoadOptions, load_model
from kvlab.runner import ModelRunner
from kvlab.scheduler import ScheduledSeq, Scheduler
from kvlab.tokenizer import load_gguf_tokenizer
from kvlab.weights.checkpoint import open_checkpoint

from tiny_models import build_gemma4

pytestmark = pytest.mark.skipif(not fused.ENABLED, reason="needs kvlab's C extension")

# shape -> (build_gemma4 overrides, quantization at load); 256 wide for Q4_K's blocks
VARIANTS = {"ple_shared": ({}, "q8_0"), "k_eq_v": ({"k_eq_v": True}, "q8_0"),
            "moe": ({"k_eq_v": True, "moe": True}, "q8_0"),
            "ple_shared_q4_k": ({"hidden_size": 256}, "q4_k"),
            "moe_q4_k": ({"k_eq_v": True, "moe": True, "hidden_size": 256}, "q4_k")}
# a plan row's Gemma 4 fields, just before the latent-attention ones: head_dim, kv_heads,
# kv_shared, values_from_keys, v_norm, ple_gate (5), ple_out (5), ple_col, ple_post_norm,
# layer_scalar, router_norm, experts_norm, expert_scale, shexp_out_norm, experts_out_norm,
# expert_gelu
GEMMA4_FIELDS = slice(-24 - decode_c._MLA_FIELDS, -decode_c._MLA_FIELDS)


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request, tmp_path_factory):
    overrides, quant = VARIANTS[request.param]
    out = tmp_path_factory.mktemp(f"gemma4_c_{request.param}")
    return build_gemma4(out, **overrides), out, quant


@pytest.fixture
def c_steps(monkeypatch) -> list[bool]:
    """What each decode_c.run call returns (True: the one C call ran the step)."""
    ran, run = [], decode_c.run
    monkeypatch.setattr(decode_c, "run", lambda *args: ran.append(run(*args)) or ran[-1])
    return ran


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _loaded(out, quant: str, plan: bool, source: str = "hf"):
    loaded = load_model(open_checkpoint(out / source), LoadOptions(quantize=quant))
    assert loaded.model.c_plan is not None
    if not plan:
        loaded.model.c_plan = None
    return loaded


def _runner(out, quant: str, plan: bool, kv_dtype: str = "f32",
            source: str = "hf") -> ModelRunner:
    loaded = _loaded(out, quant, plan, source)
    return ModelRunner(loaded.model, loaded.config, 64, 4, kv_dtype=kv_dtype)


def test_the_plan_takes_every_layer(tiny):
    """Sharing layers read their source's store and write none; full layers have their own
    head size and KV heads (keys as values where the checkpoint says so); each layer's
    per-layer input column, output scale, and the MoE layers' GeGLU experts and norms."""
    hf, out, quant = tiny
    model, c = _runner(out, quant, True).model, hf.config
    config = model.config
    assert model.c_plan.sources == [config.kv_source(i) for i in range(c.num_hidden_layers)]
    ple = c.hidden_size_per_layer_input
    for i, (row, layer) in enumerate(zip(model.c_plan.weights.tolist(), model.plan_layers)):
        fields = row[GEMMA4_FIELDS]
        head_dim, kv_heads, shared, keys_as_values, v_norm = fields[:5]
        full = config.layer_types[i] == "full"
        assert head_dim == (32 if full else 0)
        assert kv_heads == (config.global_kv_heads if full else 0)
        assert shared == int(not config.owns_kv(i))
        assert keys_as_values == int(full and bool(c.attention_k_eq_v))
        assert v_norm == (0 if shared else layer["v_norm"].data_ptr())
        tail = fields[5:]
        assert tail[10] == i * ple and tail[12] == layer["layer_scalar"].data_ptr()
        assert (tail[0] != 0) == bool(ple)
        beside = fields[-6:]
        if "experts" in layer:
            assert beside == [layer["router_norm"].data_ptr(), layer["mlp_norm_2"].data_ptr(),
                              layer["expert_scale"].data_ptr(),
                              layer["post_mlp_norm_1"].data_ptr(),
                              layer["post_mlp_norm_2"].data_ptr(), 1]
        else:
            assert beside == [0] * 6


@pytest.mark.parametrize("kv_dtype", ["f32", "f16"])
@pytest.mark.parametrize("source", ["hf", "model.gguf"])  # the GGUF as llama.cpp names it
def test_decode_in_the_one_c_call_equals_the_per_op_path(tiny, c_steps, kv_dtype, source):
    hf, out, quant = tiny
    ids, table = _ids(14, 1), [9, 3, 17, 0]  # scattered, out-of-order blocks
    logits, kind = [], None
    for plan in (True, False):
        runner = _runner(out, quant, plan, kv_dtype, source)
        rows = [step(runner, ScheduledSeq("a", 0, ids[:5], table, True, 5))[0]]
        for pos in range(5, len(ids)):  # past the window of 4
            rows.append(step(runner, ScheduledSeq("a", pos, [ids[pos]], table, True, 0))[0])
        logits.append(torch.stack(rows))
        if plan:
            kind = runner.model.c_plan.kv_kind
    assert c_steps[:len(ids) - 4] == [False] + [True] * (len(ids) - 5)  # prefill per-op
    assert kind == {"f32": 0, "f16": 1}[kv_dtype]  # the C attention read those stores
    assert float((logits[0] - logits[1]).abs().max()) <= _tolerance(tiny)
    # transformers on the same rounded weights: what is left is the 8-bit activations of
    # the quantized products (both paths), which six 64-wide random layers add up
    ref = reference_logits(_rounded(hf, quant), ids)[4:]
    cos = torch.cosine_similarity(logits[0], ref, dim=-1)
    assert float(cos.mean()) > 0.95


def _tolerance(tiny) -> float:
    """How far the C call's logits may be from the per-op path's: not at all where every
    product is one both paths share. Its fp32 products of its own (the router's, the
    per-layer input's F32 projection) round differently from torch's (1e-7); a later
    layer cuts its activations into 8-bit blocks (32 values for Q8_0 weights, 256 for
    Q4_K), where such a difference can move one value to the next step at some token (that
    token's K/V then carries it): up to 5e-3 and 2e-2 there."""
    hf, _, quant = tiny
    if not (hf.config.enable_moe_block or hf.config.hidden_size_per_layer_input):
        return 0.0
    return 2e-2 if quant == "q4_k" else 5e-3


def _rounded(hf, quant: str):
    """A copy of the transformers model with each matrix kvlab quantizes at load (not the
    routers) rounded through that block type, as the loader picks it (Q8_0 where the rows
    are not whole blocks of the asked-for type)."""
    model = copy.deepcopy(hf)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() < 2 or name.endswith("router.proj.weight"):
                continue
            for qtype in (GGMLQuantizationType[quant.upper()], GGMLQuantizationType.Q8_0):
                if p.shape[-1] % GGML_QUANT_SIZES[qtype][0] == 0:
                    rows = p.detach().float().reshape(-1, p.shape[-1])
                    p.copy_(dequantize(quantize(rows, qtype)).reshape(p.shape))
                    break
    return model


def test_batched_decode_in_the_one_c_call(tiny, c_steps):
    """Three sequences of unequal lengths decode together in the C call: each row equals
    the per-op path's batch."""
    _, out, quant = tiny
    seqs = {f"s{n}": (_ids(n, 20 + n), table, _ids(3, 50 + n))  # prompt, blocks, 3 steps
            for n, table in ((3, [7, 2, 12, 19]), (11, [0, 15, 4, 9]), (6, [5, 1, 14, 11]))}
    fast, slow = (_decode_together(_runner(out, quant, plan), seqs) for plan in (True, False))
    assert c_steps[3:6] == [True] * 3  # after the three prefills
    assert float((fast - slow).abs().max()) <= _tolerance(tiny)


def _decode_together(runner: ModelRunner, seqs: dict) -> torch.Tensor:
    """Each sequence's prompt alone, then their decode steps in one batch: [steps, B, V]."""
    for name, (prompt, table, _) in seqs.items():
        step(runner, ScheduledSeq(name, 0, prompt, table, True, len(prompt)))
    steps = len(next(iter(seqs.values()))[2])
    return torch.stack([step(runner, *(
        ScheduledSeq(name, len(prompt) + t, [nxt[t]], table, True, 0)
        for name, (prompt, table, nxt) in seqs.items())) for t in range(steps)])


def _engine(out, quant: str, plan: bool, **config) -> Engine:
    tokenizer = load_gguf_tokenizer(open_checkpoint(out / "model.gguf").metadata)
    return Engine(_loaded(out, quant, plan), tokenizer,
                  EngineConfig(block_size=4, kv_dtype="f32", **config))


def test_engine_with_preemption_in_the_one_c_call(tiny, c_steps, monkeypatch):
    """Four requests in a pool of 16 blocks of 4 tokens (they need far more): some are
    preempted and recomputed; the greedy tokens equal the per-op engine's with room for
    all."""
    _, out, quant = tiny
    preempted, real = [], Scheduler._preempt
    monkeypatch.setattr(Scheduler, "_preempt", lambda s, seq: preempted.append(seq.seq_id)
                        or real(s, seq))
    prompts = [_ids(5, 1), _ids(37, 2), _ids(9, 3), _ids(30, 4)]
    roomy = _engine(out, quant, False)
    block = 4 * roomy.runner.kv_bytes_per_token
    small = _engine(out, quant, True, kv_cache_gib=16 * block / 2**30)
    assert small.kv.num_blocks == 16
    got = run_all(small, prompts)
    assert preempted and any(c_steps)
    assert got == run_all(roomy, prompts)
