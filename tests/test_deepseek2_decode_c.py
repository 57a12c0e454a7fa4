"""DeepSeek-V3 / V2 (tiny random configs, weights quantized to Q8_0 at load) decode in the
one C call: latent attention (q_a and its norm or one q product, kv_a and its norm, the
rotary part, the absorbed attention over the latent store, o), then the dense first layer
or the routed experts (V3's sigmoid with its correction bias and grouped top k, V2's
softmax over all experts or within its best groups, both times routed_scaling_factor) and
the shared expert. Logits equal the per-op path's within fp32 rounding of the router and
within cosine 0.999 of transformers'; alone, batched on scattered blocks, and through the
engine with preemption."""

from __future__ import annotations

import subprocess

import pytest
import test_decode_c
import test_deepseek2
import torch
from test_deepseek2 import LLAMA_BIN, _gguf
from test_engine import run_all
from test_models import reference_logits, step

from kvlab.engine import Engine, EngineConfig
from kvlab.kernels import fused
from kvlab.models.loader import LoadOptions, load_model
from kvlab.runner import ModelRunner
from kvlab.scheduler import ScheduledSeq, Scheduler
from kvlab.tokenizer import load_gguf_tokenizer
from kvlab.weights.checkpoint import open_checkpoint

from tiny_models import build_deepseek, convert_with_llama_cpp

pytestmark = pytest.mark.skipif(not fused.ENABLED, reason="needs kvlab's C extension")

VARIANTS = {"v3": {}, "v3_plain_q": {"q_lora_rank": None}, "v2": {"v2": True},
            "v2_groups": test_deepseek2.VARIANTS["v2_groups"]}


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"deepseek_c_{request.param}")
    return build_deepseek(out, **VARIANTS[request.param]), out


@pytest.fixture(name="c_steps")
def c_steps_fixture(monkeypatch) -> list[bool]:
    """What each decode_c.run call returns (True: the one C call ran the step)."""
    return test_decode_c.c_steps(monkeypatch)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _runner(out, plan: bool, kv_dtype: str = "f32", path=None) -> ModelRunner:
    """The tiny model quantized to Q8_0 at load, or the checkpoint at `path` as it is."""
    quantize = "q8_0" if path is None else None
    loaded = load_model(open_checkpoint(path or out / "hf"), LoadOptions(quantize=quantize))
    assert loaded.model.c_plan is not None
    if not plan:
        loaded.model.c_plan = None
    return ModelRunner(loaded.model, loaded.config, 64, 4, kv_dtype=kv_dtype)


def test_the_plan_holds_the_latent_attention(tiny):
    """Every layer's row ends with mla 1, q_a, q_b, kv_a, q_a_norm, kv_a_norm, w_uk,
    w_uv_t, rank, rope, vdim."""
    hf, out = tiny
    model, c = _runner(out, True).model, hf.config
    for row, layer in zip(model.c_plan.weights.tolist(), model.layers):
        assert row[-23] == 1
        assert row[-6:] == [layer["kv_a_norm"].data_ptr(), layer["w_uk"].data_ptr(),
                            layer["w_uv_t"].data_ptr(), c.kv_lora_rank, c.qk_rope_head_dim,
                            c.v_head_dim]
        q_a = [0] * 5 if c.q_lora_rank is None else list(layer["q_a"].kernel_args)
        assert row[-22:-17] == q_a


@pytest.mark.parametrize("kv_dtype", ["f32", "f16"])
def test_decode_in_the_one_c_call_equals_the_per_op_path(tiny, c_steps, kv_dtype):
    """The latent store in fp32, or in fp16 (the CPU's default), written and read in C."""
    hf, out = tiny
    logits = _decode_both_ways(out, c_steps, kv_dtype)
    ref = reference_logits(hf, _ids(14, 1))[4:]
    assert float(torch.cosine_similarity(logits, ref, dim=-1).min()) > 0.999


def test_llama_quantize_q8_0_gguf_decodes_in_the_one_c_call(tiny, c_steps):
    """llama.cpp's converter and llama-quantize (its attn_k_b and attn_v_b apart, not
    kv_b): the plan reads the GGUF's Q8_0 blocks as they are."""
    hf, out = tiny
    tool = LLAMA_BIN / "llama-quantize"
    if not tool.exists():
        pytest.skip(f"llama-quantize is not at {tool} (KVLAB_LLAMA_BIN names its folder)")
    if hf.config.q_lora_rank is None:
        pytest.skip("llama.cpp reads deepseek2 without q_lora_rank only at 26 or 27 layers")
    path = out / "q8_0.gguf"
    subprocess.run([str(tool), _gguf(out), str(path), "Q8_0"], check=True,
                   capture_output=True, timeout=300)
    logits = _decode_both_ways(out, c_steps, "f16", path)
    ref = reference_logits(hf, _ids(14, 1))[4:]
    assert float(torch.cosine_similarity(logits, ref, dim=-1).min()) > 0.999


def _decode_both_ways(out, c_steps: list[bool], kv_dtype: str, path=None) -> torch.Tensor:
    """Logits at positions 4..13 (a prefill of 5, then a token a step on scattered blocks)
    with the one-call C decode and without: equal within 1e-4; the first way's."""
    ids, table = _ids(14, 1), [9, 3, 17, 0]  # scattered, out-of-order blocks
    logits = []
    for plan in (True, False):
        runner = _runner(out, plan, kv_dtype, path)
        rows = [step(runner, ScheduledSeq("a", 0, ids[:5], table, True, 5))[0]]
        for pos in range(5, len(ids)):
            rows.append(step(runner, ScheduledSeq("a", pos, [ids[pos]], table, True, 0))[0])
        logits.append(torch.stack(rows))
        assert runner.kv_caches[0].k.dtype == {"f32": torch.float32,
                                               "f16": torch.float16}[kv_dtype]
    assert c_steps[:len(ids) - 4] == [False] + [True] * (len(ids) - 5)  # prefill per-op
    assert float((logits[0] - logits[1]).abs().max()) <= 1e-4
    return logits[0]


def test_batched_decode_in_the_one_c_call(tiny, c_steps):
    """Three sequences of unequal lengths decode together in the C call: each row equals
    the per-op path's batch."""
    hf, out = tiny
    prompts = [_ids(n, 20 + n) for n in (3, 11, 6)]
    tables = [[7, 2, 12], [0, 15, 4, 9], [5, 1, 14]]
    nxt = [_ids(3, 50 + i) for i in range(3)]  # three decode steps per sequence
    logits = []
    for plan in (True, False):
        runner = _runner(out, plan)
        for i, p in enumerate(prompts):
            step(runner, ScheduledSeq(f"s{i}", 0, p, tables[i], True, len(p)))
        logits.append(torch.stack([step(runner, *[
            ScheduledSeq(f"s{i}", len(p) + t, [nxt[i][t]], tables[i], True, 0)
            for i, p in enumerate(prompts)]) for t in range(3)]))
    assert c_steps[3:6] == [True] * 3  # after the three prefills
    assert float((logits[0] - logits[1]).abs().max()) <= 1e-4


def _engine(out, plan: bool, **config) -> Engine:
    path = out / "model.gguf"  # lends the tokenizer
    if not path.exists():
        why = convert_with_llama_cpp(out / "hf", path)
        if why is not None:
            pytest.skip(why)
    loaded = load_model(open_checkpoint(out / "hf"), LoadOptions(quantize="q8_0"))
    if not plan:
        loaded.model.c_plan = None
    tokenizer = load_gguf_tokenizer(open_checkpoint(path).metadata)
    return Engine(loaded, tokenizer, EngineConfig(block_size=4, kv_dtype="f32", **config))


def test_engine_with_preemption_in_the_one_c_call(tiny, c_steps, monkeypatch):
    """Four requests in a pool of 16 blocks of 4 tokens (they need 121 tokens): some are
    preempted and recomputed; the greedy tokens equal the per-op engine's with room for all."""
    hf, out = tiny
    preempted, real = [], Scheduler._preempt
    monkeypatch.setattr(Scheduler, "_preempt", lambda s, seq: preempted.append(seq.seq_id)
                        or real(s, seq))
    prompts = [_ids(5, 1), _ids(37, 2), _ids(9, 3), _ids(30, 4)]
    c = hf.config
    block = 4 * c.num_hidden_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * 4
    small = _engine(out, True, kv_cache_gib=16 * block / 2**30)
    assert small.kv.num_blocks == 16
    got = run_all(small, prompts)
    assert preempted and any(c_steps)
    assert got == run_all(_engine(out, False), prompts)
