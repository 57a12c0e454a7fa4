"""Golden test on the real default model against transformers loading the same GGUF (fp32).

Teacher-forced along transformers' own 32-token greedy continuation, kvlab's next-token
log-probabilities must agree position by position. Bounds reached here:
  dequantized weights (same numbers as transformers): max |d logprob| over the reference's
  top-20 <= 2e-3, top-20 sets identical;
  quantized kernels (decode quantizes activations to 8 bits for int8 dot products, as
  llama.cpp does): measured on three prompts, top-20 overlap >= 17/20, max |d logprob| over
  the reference's top-5 0.46-0.73 (mean 0.16-0.35), top-1 flips only at margins < 0.28.
  Asserted: overlap >= 16/20, top-5 max <= 1.0 and mean <= 0.5, top-1 equal wherever the
  reference's top-2 margin exceeds 0.5 nats.
Greedy text must equal up to the first step whose top-2 margin is tiny.
"""

from __future__ import annotations

import pytest
import torch

from kvlab.engine import Engine, EngineConfig
from kvlab.request import SamplingParams

pytestmark = pytest.mark.slow
PROMPT = "The capital of France is"
STEPS = 32


@pytest.fixture(scope="module")
def reference(default_model_path):
    from transformers import AutoModelForCausalLM

    p = default_model_path
    hf = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name,
                                              dtype=torch.float32)
    hf.eval()
    return hf


def kvlab_teacher_forced(engine: Engine, ids: list[int], n_prompt: int) -> torch.Tensor:
    """log-probs [len(ids) - n_prompt + 1, vocab]: the prompt in one pass, then one per step."""
    return engine.teacher_forced_logprobs(ids, n_prompt)


@pytest.fixture(scope="module")
def golden(reference, default_model_path):
    dense = Engine.from_model(str(default_model_path),  # fp32 throughout, as transformers
                              EngineConfig(keep_quantized=False, kv_dtype="f32"))
    ids = dense.tokenizer.encode(PROMPT)
    with torch.no_grad():
        out = reference.generate(torch.tensor([ids]), max_new_tokens=STEPS, do_sample=False)
        ref = torch.log_softmax(reference(out).logits[0, len(ids) - 1:].float(), dim=-1)
    full = out[0].tolist()
    return ids, full, ref, dense


def test_dequantized_path_matches_transformers(golden):
    ids, full, ref, dense = golden
    ours = kvlab_teacher_forced(dense, full, len(ids))
    for pos in range(ref.shape[0]):
        top = ref[pos].topk(20).indices
        assert set(top.tolist()) == set(ours[pos].topk(20).indices.tolist())
        assert (ours[pos, top] - ref[pos, top]).abs().max() <= 2e-3


@pytest.fixture(scope="module")
def quantized(default_model_path):
    return Engine.from_model(str(default_model_path), EngineConfig())


def test_quantized_kernels_match_transformers(golden, quantized):
    ids, full, ref, _ = golden
    engine = quantized
    ours = kvlab_teacher_forced(engine, full, len(ids))
    diffs = []
    for pos in range(ref.shape[0]):
        top20 = set(ref[pos].topk(20).indices.tolist())
        assert len(top20 & set(ours[pos].topk(20).indices.tolist())) >= 16
        top5 = ref[pos].topk(5).indices
        diffs.append((ours[pos, top5] - ref[pos, top5]).abs().max().item())
        values = ref[pos].topk(2).values
        if values[0] - values[1] > 0.5:
            assert ours[pos].argmax() == ref[pos].argmax()
    assert max(diffs) <= 1.0 and sum(diffs) / len(diffs) <= 0.5


def test_greedy_text_equal_until_a_near_tie(golden, quantized):
    ids, full, ref, _ = golden
    engine = quantized
    engine.add_request("g", ids, SamplingParams(max_tokens=STEPS, temperature=0,
                                                ignore_eos=True))
    got: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            got.extend(out.new_token_ids)
    expected = full[len(ids):]
    for pos, (a, b) in enumerate(zip(got, expected)):
        if a != b:
            values = ref[pos].topk(2).values
            assert values[0] - values[1] < 0.5, f"diverged at {pos} with margin " \
                f"{float(values[0] - values[1]):.3f}"
            break
