"""Every architecture on a tiny random config: kvlab's logits against transformers' on the same
weights (fp32, max abs diff <= 1e-4), for prefill, for decode steps through the paged cache and
for a batch of unequal prompts; safetensors and GGUF copies give the same logits."""

from __future__ import annotations

import pytest
import torch

from kvlab.models.loader import QUANTIZE_CHOICES, LoadOptions, load_model
from kvlab.runner import ModelRunner
from kvlab.scheduler import ScheduledSeq, SchedulerOutput
from kvlab.weights.checkpoint import open_checkpoint

from tiny_models import ARCHS, MOE_ARCHS, build

TOL = 1e-4


@pytest.fixture(scope="module", params=ARCHS + MOE_ARCHS)
def tiny(request, tmp_path_factory):
    arch = request.param
    out = tmp_path_factory.mktemp(arch)
    hf = build(arch, out)
    return arch, hf, out


def reference_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def runner_for(path, num_blocks: int = 32, block_size: int = 4) -> ModelRunner:
    loaded = load_model(open_checkpoint(path), LoadOptions())
    return ModelRunner(loaded.model, loaded.config, num_blocks, block_size)


def step(runner: ModelRunner, *seqs: ScheduledSeq) -> torch.Tensor:
    return runner.execute(SchedulerOutput(list(seqs))).logits


@pytest.mark.parametrize("fmt", ["hf", "model.gguf"])
def test_prefill_then_paged_decode_matches_transformers(tiny, fmt):
    arch, hf, out = tiny
    ids = torch.randint(0, 96, (14,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = reference_logits(hf, ids)
    runner = runner_for(out / fmt)
    table = [9, 3, 17, 0]  # scattered, out-of-order blocks: paging must not matter
    logits = step(runner, ScheduledSeq("a", 0, ids[:9], table, True, 9))
    assert (logits[0] - ref[8]).abs().max() <= TOL
    for pos in range(9, 14):  # decode past gemma3's 4-token sliding window
        logits = step(runner, ScheduledSeq("a", pos, [ids[pos]], table, True, 0))
        assert (logits[0] - ref[pos]).abs().max() <= TOL, f"{arch} decode at {pos}"


def test_batch_of_unequal_prompts_matches_each_alone(tiny):
    arch, hf, out = tiny
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (3, 11, 7)]
    runner = runner_for(out / "model.gguf")
    tables = [[0, 1, 2], [3, 4, 5, 6], [7, 8, 9]]
    logits = step(runner, *(ScheduledSeq(str(i), 0, p, t, True, len(p))
                            for i, (p, t) in enumerate(zip(prompts, tables))))
    for i, p in enumerate(prompts):
        assert (logits[i] - reference_logits(hf, p)[-1]).abs().max() <= TOL
    # one batched decode step: three sequences at different depths
    nxt = [5, 6, 7]
    logits = step(runner, *(ScheduledSeq(str(i), len(p), [n], t, True, 0)
                            for i, (p, n, t) in enumerate(zip(prompts, nxt, tables))))
    for i, (p, n) in enumerate(zip(prompts, nxt)):
        assert (logits[i] - reference_logits(hf, p + [n])[-1]).abs().max() <= TOL


def test_both_loaders_give_the_same_logits(tiny):
    arch, hf, out = tiny
    ids = [1, 5, 9, 13, 17, 21]
    a = step(runner_for(out / "hf"), ScheduledSeq("a", 0, ids, [0, 1], True, 6))
    b = step(runner_for(out / "model.gguf"), ScheduledSeq("a", 0, ids, [0, 1], True, 6))
    assert (a - b).abs().max() <= 1e-5


def test_chunked_prefill_equals_one_pass(tiny):
    arch, hf, out = tiny
    ids = list(range(2, 15))
    ref = reference_logits(hf, ids)
    runner = runner_for(out / "model.gguf")
    table = [4, 5, 6, 7]
    step(runner, ScheduledSeq("a", 0, ids[:5], table, False, 5))
    logits = step(runner, ScheduledSeq("a", 5, ids[5:], table, True, 8))
    assert (logits[0] - ref[-1]).abs().max() <= TOL


@pytest.mark.parametrize("quant", QUANTIZE_CHOICES)
def test_quantize_safetensors_at_load(tiny, quant):
    arch, hf, out = tiny
    ids = list(range(3, 19))
    ref = reference_logits(hf, ids)[-1]
    loaded = load_model(open_checkpoint(out / "hf"), LoadOptions(quantize=quant))
    kinds = {t.qtype for t in loaded.tensors if len(t.shape) == 2 and "router" not in t.name}
    # routers stay as stored; rows of 256k elements take the K-quant, others Q8_0; 8k rows run in 8-row groups
    assert kinds <= {"Q8_0x8", "Q8_0", f"{quant.upper()}x8", quant.upper()}
    runner = ModelRunner(loaded.model, loaded.config, 32, 4)
    got = step(runner, ScheduledSeq("a", 0, ids, [0, 1, 2, 3], True, 16))[0]
    # 8-bit weights (and 8-bit activations in the kernels): close, not equal
    assert torch.nn.functional.cosine_similarity(got, ref, dim=0) > 0.99


def test_grouped_rows_give_the_plain_kernels_logits(tiny):
    """Q8_0x8 holds the same values as Q8_0 and forms the same int32 block sums: the
    logits move only by fp32 summation order."""
    arch, hf, out = tiny
    ids = list(range(3, 19))
    logits = []
    for group in (True, False):
        loaded = load_model(open_checkpoint(out / "hf"),
                            LoadOptions(quantize="q8_0", group_rows=group))
        kinds = {t.qtype for t in loaded.tensors if len(t.shape) == 2}
        assert ("Q8_0x8" in kinds) == group
        runner = ModelRunner(loaded.model, loaded.config, 32, 4)
        logits.append(step(runner, ScheduledSeq("a", 0, ids, [0, 1, 2, 3], True, 16))[0])
    assert (logits[0] - logits[1]).abs().max() <= 1e-4 * logits[1].abs().max()


def test_mistral_sliding_window_matches_transformers(tmp_path):
    hf = build("mistral", tmp_path, sliding_window=4)  # every layer sees its last 4 keys
    ids = torch.randint(0, 96, (14,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = reference_logits(hf, ids)
    runner = runner_for(tmp_path / "hf")
    assert runner.config.sliding_window == 4 and runner.config.is_sliding(0)
    table = [5, 1, 8, 2]
    logits = step(runner, ScheduledSeq("a", 0, ids[:9], table, True, 9))
    assert (logits[0] - ref[8]).abs().max() <= TOL
    for pos in range(9, 14):
        logits = step(runner, ScheduledSeq("a", pos, [ids[pos]], table, True, 0))
        assert (logits[0] - ref[pos]).abs().max() <= TOL, f"decode at {pos}"


def test_phi3_refuses_partial_rotary_and_incomplete_longrope():
    from kvlab.errors import ModelLoadError
    from kvlab.models import phi3

    cfg = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    assert phi3.config_from_hf(cfg).architecture == "phi3"
    with pytest.raises(ModelLoadError, match="partial rotary"):
        phi3.config_from_hf({**cfg, "partial_rotary_factor": 0.75})
    with pytest.raises(ModelLoadError, match="short_factor and long_factor"):
        phi3.config_from_hf({**cfg, "rope_scaling": {"rope_type": "longrope", "factor": 32}})


LONGROPE = {"rope_type": "longrope", "rope_theta": 1e4,
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.6, 3.3, 4.0],
            "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 12.0, 16.0]}


@pytest.mark.parametrize("fmt", ["hf", "model.gguf"])
def test_phi3_longrope_matches_transformers_decoding_past_the_original_context(tmp_path, fmt):
    """Short factors below position 16, long ones from there on: transformers' choice when it
    decodes one token at a time with a cache (its long factors cover every position only
    when one forward pass runs past the original context)."""
    hf = build("phi3", tmp_path, max_position_embeddings=64,
               original_max_position_embeddings=16, rope_parameters=LONGROPE)
    ids = torch.randint(0, 96, (22,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        out = hf(torch.tensor([ids[:10]]), use_cache=True)
        ref, cache = [out.logits[0, -1]], out.past_key_values
        for pos in range(10, 22):
            out = hf(torch.tensor([[ids[pos]]]), past_key_values=cache, use_cache=True)
            ref.append(out.logits[0, -1])
            cache = out.past_key_values
    runner = runner_for(tmp_path / fmt)
    assert runner.config.rope.longrope.original == 16
    table = [4, 9, 1, 7, 2, 5]
    logits = step(runner, ScheduledSeq("a", 0, ids[:10], table, True, 10))
    assert (logits[0] - ref[0]).abs().max() <= TOL
    for i, pos in enumerate(range(10, 22)):
        logits = step(runner, ScheduledSeq("a", pos, [ids[pos]], table, True, 0))
        assert (logits[0] - ref[i + 1]).abs().max() <= TOL, f"decode at {pos}"


@pytest.mark.parametrize("arch", ["llama", "olmoe"])
def test_qkv_of_no_tokens_splits_into_heads(arch, tmp_path):
    """A qkv product of T = 0 rows still reads as q [0, H, D], k and v [0, KVH, D]."""
    build(arch, tmp_path)
    model = runner_for(tmp_path / "hf").model
    c = model.config
    qkv = torch.empty(0, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim)
    q, k, v = model._heads(qkv, model.layers[0])
    assert q.shape == (0, c.num_heads, c.head_dim)
    assert k.shape == v.shape == (0, c.num_kv_heads, c.head_dim)
