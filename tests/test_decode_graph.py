"""The static decode path that CUDA graphs capture, run eagerly on the CPU: same tokens and
log-probs as the ordinary path, with padded batch rows, several key-width buckets and Gemma's
sliding window; and an in-memory checkpoint loads like the files it came from."""

from __future__ import annotations

import pytest
import torch

from kvlab.engine import Engine, EngineConfig
from kvlab.models.loader import LoadOptions, load_model
from kvlab.request import SamplingParams
from kvlab.runner.decode_graph import _round_up_pow2
from kvlab.tokenizer import load_gguf_tokenizer
from kvlab.weights.checkpoint import TensorCheckpoint, open_checkpoint

from tiny_models import build

PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    out = tmp_path_factory.mktemp("gemma3")
    build("gemma3", out)
    return out / "model.gguf"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    out = tmp_path_factory.mktemp("llama")
    model = build("llama", out, max_position_embeddings=1024)
    return model, out


def run(path, prompts, **kw):
    e = Engine.from_model(str(path), EngineConfig(block_size=4, **kw))
    for i, p in enumerate(prompts):
        e.add_request(str(i), p, PARAMS)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    logprobs: dict[str, list[float]] = {str(i): [] for i in range(len(prompts))}
    while e.has_unfinished():
        for out in e.step():
            tokens[out.request_id].extend(out.new_token_ids)
            logprobs[out.request_id].extend(lp.logprob for lp in out.logprobs or [])
    return e, [tokens[str(i)] for i in range(len(prompts))], \
        [logprobs[str(i)] for i in range(len(prompts))]


def check_same(path, prompts, **kw):
    _, want, want_lp = run(path, prompts, decode_graphs="off", **kw)
    engine, got, got_lp = run(path, prompts, decode_graphs="eager", **kw)
    assert got == want
    for a, b in zip(got_lp, want_lp):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4)
    return engine


def test_static_decode_matches_with_sliding_window_and_padding(gemma):
    # three sequences -> a batch bucket of 4 with one padding row; windows of 4 keys
    engine = check_same(gemma, [[3, 14, 15, 92, 65], list(range(20, 57)), [7] * 9])
    assert (4, 256) in engine.runner.graphs.buckets


def test_static_decode_matches_across_width_buckets(llama):
    _, out = llama
    prompts = [list(range(10, 90)) * 3 + [5] * 10, [1, 2, 3]]  # 250 tokens: crosses 256
    engine = check_same(out / "model.gguf", prompts)
    widths = {w for _, w in engine.runner.graphs.buckets}
    assert {256, 512} <= widths


def test_padding_rows_leave_the_cache_alone(gemma):
    # decode alone, then beside two others (padding rows write only the scratch slot)
    _, alone, _ = run(gemma, [[3, 14, 15, 92, 65]], decode_graphs="eager")
    _, batched, _ = run(gemma, [[3, 14, 15, 92, 65], [8] * 7, [9, 10]], decode_graphs="eager")
    assert batched[0] == alone[0]


def test_width_buckets_round_up_and_cap():
    assert _round_up_pow2(1, 1) == 1 and _round_up_pow2(3, 1) == 4
    assert _round_up_pow2(10, 256, 1024) == 256
    assert _round_up_pow2(300, 256, 1024) == 512
    assert _round_up_pow2(1000, 256, 600) == 600


def test_in_memory_checkpoint_loads_like_the_files(llama):
    model, out = llama
    ckpt = open_checkpoint(out / "hf")
    tensors = {k: v.detach() for k, v in model.state_dict().items()}
    memory = TensorCheckpoint(ckpt.metadata, tensors)
    assert memory.architecture == ckpt.architecture and memory.names() >= ckpt.names()
    tok = load_gguf_tokenizer(open_checkpoint(out / "model.gguf").metadata)
    a = Engine(load_model(ckpt, LoadOptions()), tok, EngineConfig(block_size=4))
    b = Engine(load_model(memory, LoadOptions()), tok, EngineConfig(block_size=4))
    ids = list(range(5, 40))
    assert torch.allclose(a.teacher_forced_logprobs(ids, 8), b.teacher_forced_logprobs(ids, 8))


def test_unknown_graph_mode_is_a_clear_error():
    from kvlab.errors import KvlabError

    with pytest.raises(KvlabError, match="valid: auto, off, eager"):
        EngineConfig(decode_graphs="sometimes")


def test_auto_dtypes_follow_the_device():
    c = EngineConfig()
    assert (c.dtype, c.kv_dtype) == ("float32", "f16")
