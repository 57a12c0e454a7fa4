"""On a CUDA machine: the default Gemma 3 GGUF path (dequantized at load), sliding windows and
captured decode graphs give the CPU's greedy tokens in fp32 and near-identical log-probs in
bf16. Skipped where no CUDA device is present."""

from __future__ import annotations

import pytest
import torch
from test_decode_graph import run

from kvlab.engine import Engine, EngineConfig

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
    # teacher-forced along one sequence, so a near-tie flip does not change what follows
    ids = list(range(5, 60))
    cpu = Engine.from_model(str(gemma), EngineConfig(block_size=4))
    cuda = Engine.from_model(str(gemma), EngineConfig(block_size=4, device="cuda"))
    assert cuda.config.dtype == "bfloat16" and cuda.config.kv_dtype == "bf16"
    want = cpu.teacher_forced_logprobs(ids, 8)
    got = cuda.teacher_forced_logprobs(ids, 8).float().cpu()
    assert (got - want).abs().max() < 0.25
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.85


def test_triton_decode_plan_matches_per_op_path(gemma):
    """Where triton is present, decode steps (graphs captured) run through the Triton plan
    (kvlab.models.decode_gpu); in fp32 its log-probs equal the per-op path's."""
    pytest.importorskip("triton", reason="the Triton decode plan needs triton")
    ids = list(range(5, 60))

    def logprobs(triton: bool) -> torch.Tensor:
        engine = Engine.from_model(str(gemma), EngineConfig(block_size=4, device="cuda",
                                                            dtype="float32", kv_dtype="f32"))
        model = engine.runner.model
        assert model.gpu_plan is not None
        if not triton:
            model.gpu_plan = None
        return engine.teacher_forced_logprobs(ids, 8).float().cpu()

    torch.testing.assert_close(logprobs(True), logprobs(False), atol=1e-3, rtol=1e-3)
