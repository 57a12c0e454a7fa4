"""On a CUDA machine: the default Gemma 3 GGUF path (dequantized at load), sliding windows and
captured decode graphs give the CPU's greedy tokens in fp32 and near-identical log-probs in
bf16. Skipped where no CUDA device is present."""

from __future__ import annotations

import pytest
import torch

from test_decode_graph import run
from tiny_models import build

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
PROMPTS = [[3, 14, 15, 92, 65], list(range(20, 57)), [7] * 9]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    out = tmp_path_factory.mktemp("gemma3")
    build("gemma3", out)
    return out / "model.gguf"


def test_fp32_on_cuda_with_graphs_matches_cpu(gemma):
    _, want, want_lp = run(gemma, PROMPTS, device="cpu")
    engine, got, got_lp = run(gemma, PROMPTS, device="cuda", dtype="float32", kv_dtype="f32")
    assert engine.runner.graphs is not None and engine.runner.graphs.capture
    assert (4, 256) in engine.runner.graphs.buckets
    assert got == want
    for a, b in zip(got_lp, want_lp):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-3)


def test_bf16_on_cuda_stays_close(gemma):
    _, want, want_lp = run(gemma, PROMPTS, device="cpu")
    _, got, got_lp = run(gemma, PROMPTS, device="cuda")  # auto: bf16 weights and cache
    first = [a[0] for a in got_lp], [b[0] for b in want_lp]
    assert torch.allclose(torch.tensor(first[0]), torch.tensor(first[1]), atol=0.1)
    agree = sum(x == y for a, b in zip(got, want) for x, y in zip(a, b))
    assert agree >= 0.8 * sum(map(len, want))
