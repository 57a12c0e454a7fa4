"""DeepSeek-V3 / V2 (multi-head latent attention) on tiny random configs: kvlab's logits
against transformers' (fp32, max abs diff <= 1e-4) for prefill, paged decode, chunked
prefill and a batch of unequal prompts, from the safetensors and from llama.cpp's
converter's GGUF; the latent cache's bytes per token; greedy tokens through the engine."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import test_families_2025
import torch
from safetensors.torch import load_file, save_file
from test_gpt_oss import _prefill_then_decode  # scattered, out-of-order blocks
from test_models import reference_logits, runner_for, step

from kvlab.estimate.specs import spec_from_gguf, spec_from_hf_config
from kvlab.kernels import fused
from kvlab.models import attention, deepseek2
from kvlab.models.kv_store import LatentKV
from kvlab.models.loader import LoadOptions, load_model
from kvlab.scheduler import ScheduledSeq
from kvlab.weights.checkpoint import open_checkpoint

from tiny_models import build_deepseek, convert_with_llama_cpp

TOL = 1e-4
# llama.cpp's built tools (llama-quantize): the folder KVLAB_LLAMA_BIN names, if any
LLAMA_BIN = Path(os.environ.get("KVLAB_LLAMA_BIN", "llama.cpp-tools-not-given"))
# v2_groups: V2's group_limited_greedy, three experts from the best two of four groups
VARIANTS = {"v3": {}, "v3_plain_q": {"q_lora_rank": None}, "v2": {"v2": True},
            "v2_groups": {"v2": True, "topk_method": "group_limited_greedy", "n_group": 4,
                          "topk_group": 2, "num_experts_per_tok": 3},
            "v3_yarn": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4,
                                            "factor": 4.0, "original_max_position_embeddings": 8,
                                            "mscale": 1.0, "mscale_all_dim": 1.0}}}


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"deepseek_{request.param}")
    return build_deepseek(out, **VARIANTS[request.param]), out


def _gguf(out) -> str:
    path = out / "model.gguf"  # where the shared engine test reads it
    if not path.exists():
        reason = convert_with_llama_cpp(out / "hf", path)
        if reason:
            pytest.skip(reason)
    return str(path)


def _path(out, fmt: str):
    return out / "hf" if fmt == "hf" else _gguf(out)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_prefill_then_paged_decode_matches_transformers(tiny, fmt):
    hf, out = tiny
    runner = runner_for(_path(out, fmt))
    assert all(isinstance(c, LatentKV) for c in runner.kv_caches)
    assert _prefill_then_decode(runner, hf, _ids(14, 1), 6) <= TOL


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_chunked_prefill_equals_one_pass(tiny, fmt):
    hf, out = tiny
    ids = _ids(13, 3)
    ref = reference_logits(hf, ids)
    runner = runner_for(_path(out, fmt))
    table = [4, 5, 6, 7]
    step(runner, ScheduledSeq("a", 0, ids[:5], table, False, 5))
    logits = step(runner, ScheduledSeq("a", 5, ids[5:], table, True, 8))
    assert float((logits[0] - ref[-1]).abs().max()) <= TOL


def test_batch_of_unequal_prompts_matches_transformers(tiny):
    hf, out = tiny
    runner = runner_for(out / "hf")
    prompts = [_ids(n, 10 + n) for n in (3, 9, 6)]
    seqs = [ScheduledSeq(f"s{i}", 0, p, [4 * i, 4 * i + 1, 4 * i + 2], True, len(p))
            for i, p in enumerate(prompts)]
    logits = step(runner, *seqs)
    for row, p in zip(logits, prompts):
        assert float((row - reference_logits(hf, p)[-1]).abs().max()) <= TOL
    # then one decode step for all three at once, unequal lengths
    nxt = [_ids(1, 40 + i)[0] for i in range(3)]
    logits = step(runner, *[ScheduledSeq(f"s{i}", len(p), [t], s.block_table, True, 0)
                            for i, (p, t, s) in enumerate(zip(prompts, nxt, seqs))])
    for row, p, t in zip(logits, prompts, nxt):
        assert float((row - reference_logits(hf, p + [t])[-1]).abs().max()) <= TOL


def test_kv_bytes_per_token_are_the_latents(tiny):
    hf, out = tiny
    runner = runner_for(out / "hf")
    c = hf.config
    latent = c.num_hidden_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * 4
    expanded = 2 * c.num_hidden_layers * c.num_attention_heads * (
        c.qk_nope_head_dim + c.qk_rope_head_dim) * 4  # K and V per head, as transformers
    assert runner.kv_bytes_per_token == latent < expanded
    assert runner.kv_caches[0].k.shape[1:] == (1, c.kv_lora_rank + c.qk_rope_head_dim)


def test_engine_greedy_equals_transformers(tiny):
    """Through the engine (scheduler, pool sized by the latent's bytes, sampler), on the
    converted GGUF (its vocabulary): greedy tokens equal the argmax of transformers' logits."""
    hf, out = tiny
    _gguf(out)
    test_families_2025.test_engine_greedy_equals_transformers_generate(("deepseek2", hf, out))


def test_llama_quantize_q8_0_gguf_matches_transformers(tiny, tmp_path):
    """llama-quantize's Q8_0 of the converted file: the 2-D products in Q8_0 blocks, the
    per-head attn_k_b (rows too short for a block) in F16 as a 3-D tensor; the logits stay
    within cosine 0.999 of transformers'."""
    hf, out = tiny
    tool = LLAMA_BIN / "llama-quantize"
    if not tool.exists():
        pytest.skip(f"llama-quantize is not at {tool} (KVLAB_LLAMA_BIN names its folder)")
    if hf.config.q_lora_rank is None:  # its loader wants q_lora_rank but for Lite's depths
        pytest.skip("llama.cpp reads deepseek2 without q_lora_rank only at 26 or 27 layers")
    path = tmp_path / "q8_0.gguf"
    subprocess.run([str(tool), _gguf(out), str(path), "Q8_0"], check=True,
                   capture_output=True, timeout=300)
    ids = _ids(12, 7)
    runner = runner_for(path)
    logits = step(runner, ScheduledSeq("a", 0, ids, [0, 1, 2], True, len(ids)))[0]
    assert float(torch.cosine_similarity(logits, reference_logits(hf, ids)[-1], dim=0)) > 0.999


def test_torch_attention_path_matches_transformers(tiny, monkeypatch):
    """The C latent attention (W_UK, the attention over the latent rows and W_UV in one call)
    and the torch path (a GPU's: W_UK and W_UV as torch products around paged_attention,
    which reads the latent view) both give transformers' logits; so does paged_attention's
    C kernel reading the latent rows as keys and as values (cut to the latent after)."""
    hf, out = tiny
    runner = runner_for(out / "hf")
    if fused.ENABLED:
        assert runner.kv_caches[0].c_stores() is not None
    taken = []
    real = deepseek2._latent_in_c
    monkeypatch.setattr(deepseek2, "_latent_in_c", lambda *a: taken.append(real(*a)) and False)
    assert _prefill_then_decode(runner_for(out / "hf"), hf, _ids(11, 4), 7) <= TOL
    assert all(taken) == fused.ENABLED  # it would have taken every step
    monkeypatch.setattr(attention, "_c_stores", lambda *a: None)
    assert _prefill_then_decode(runner_for(out / "hf"), hf, _ids(11, 4), 7) <= TOL


def test_mtp_layer_is_not_run_but_stays_readable(tiny, tmp_path):
    """A checkpoint with DeepSeek-V3's multi-token-prediction layer after num_hidden_layers
    (model.layers.3: a decoder layer plus eh_proj, enorm, hnorm): kvlab runs the three
    decoder layers, logits unchanged, and the MTP tensors stay readable by name."""
    hf, out = tiny
    src = out / "hf"
    dst = tmp_path / "hf"
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(src / "model.safetensors")
    hidden = hf.config.hidden_size
    extra = {k.replace("model.layers.2.", "model.layers.3."): v.clone()
             for k, v in tensors.items() if k.startswith("model.layers.2.")}
    extra["model.layers.3.eh_proj.weight"] = torch.randn(hidden, 2 * hidden)
    extra["model.layers.3.enorm.weight"] = torch.ones(hidden)
    save_file({**tensors, **extra}, dst / "model.safetensors")
    ckpt = open_checkpoint(dst)
    loaded = load_model(ckpt, LoadOptions())
    assert loaded.config.num_layers == 3 and len(loaded.model.layers) == 3
    assert not any(t.name.startswith("layers.3.") for t in loaded.tensors)
    assert ckpt.read("model.layers.3.eh_proj.weight").shape == (hidden, 2 * hidden)
    ids = _ids(6, 8)
    logits = step(runner_for(dst), ScheduledSeq("a", 0, ids, [0, 1], True, len(ids)))
    assert float((logits[0] - reference_logits(hf, ids)[-1]).abs().max()) <= TOL


def test_estimate_counts_the_latent_per_token(tiny):
    """`kvlab estimate` from the GGUF and from the HF config: each layer caches the latent
    and its rotary key part (kv_lora_rank + qk_rope_head_dim values), not per-head K/V."""
    hf, out = tiny
    c = hf.config
    latent = c.kv_lora_rank + c.qk_rope_head_dim
    for spec in (spec_from_gguf(_gguf(out)), spec_from_hf_config(out / "hf")):
        assert [lyr.kv_elements for lyr in spec.layers] == [latent] * c.num_hidden_layers
