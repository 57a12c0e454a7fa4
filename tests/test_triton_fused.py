"""The Triton kernels of kvlab.gpu against kvlab's torch reference ops, on the CPU under
Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported): each fused
kernel on small random inputs (fp32 tight, bf16 within its rounding), paged decode
attention over a scattered block table with sequences of different lengths, and a tiny
Llama's, Qwen 3's and Gemma 3's decode steps through the Triton plan (kvlab.models.decode_gpu)
against the per-op path, dense and with packed Q4_K products; and the kernels compile for
sm_90."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: its kernels are CUDA-only")

from test_triton_quant import _each_weight

from kvlab.engine import Engine, EngineConfig
from kvlab.gpu import attention as gpu_attention
from kvlab.gpu import fused as gpu_fused
from kvlab.kernels import QuantizedWeight
from kvlab.kernels.packed import PackedWeight, pack
from kvlab.models import decode_gpu, layers
from kvlab.models.attention import SeqSpan, build_metadata, paged_attention
from kvlab.models.kv_store import FloatKV
from kvlab.models.layers import (
    add_rms_norm,
    apply_rope,
    geglu,
    norm_rope,
    rms_norm,
    rope_cos_sin,
    swiglu,
)
from kvlab.models.loader import LoadOptions, load_model
from kvlab.request import SamplingParams
from kvlab.runner import ModelRunner
from kvlab.scheduler import ScheduledSeq, SchedulerOutput
from kvlab.weights.checkpoint import open_checkpoint

from tiny_models import build

# the interpreter's numpy exp overflows to inf in sigmoid(-large) = 0, as the GPU's does
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
TOL = {torch.float32: {"atol": 2e-5, "rtol": 2e-5},
       torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2}}
DTYPES = (torch.float32, torch.bfloat16)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("post", [False, True])
def test_residual_norm(dtype, post):
    torch.manual_seed(0)
    x = torch.randn(3, 96)  # the residual stream stays fp32
    h = torch.randn(3, 96).to(dtype)
    w_post, w = torch.rand(96) + 0.5, torch.rand(96) + 0.5
    want_x = add_rms_norm(x.clone(), h, w_post, 1e-6) if post else x + h.float()
    want = rms_norm(want_x, w, 1e-6).to(dtype)
    got_x = x.clone()
    got = gpu_fused.residual_norm(got_x, h, w_post if post else None, w, 1e-6, dtype)
    _close(got_x, want_x, dtype)
    _close(got, want, dtype)
    assert got.dtype == dtype


def test_rms_norm_alone_and_last_residual():
    torch.manual_seed(1)
    x, w = torch.randn(2, 80), torch.rand(80) + 0.5
    _close(gpu_fused.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5), torch.float32)
    h, before = torch.randn(2, 80), x.clone()
    assert gpu_fused.residual_norm(x, h, None, None, 1e-5) is None  # the add alone
    _close(x, before + h, torch.float32)


def _qkv(tokens: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_qkv_rope_write(dtype, qk_norm):
    torch.manual_seed(2)
    tokens, heads, kv_heads, dim = 3, 4, 2, 16
    qkv = _qkv(tokens, heads, kv_heads, dim, dtype)
    positions = torch.tensor([5, 0, 17])
    inv = 1.0 / (1e4 ** (torch.arange(0, dim, 2).float() / dim))
    inv[-2:] = 0  # partial rotary: the last pairs pass unchanged
    cos, sin = (t.to(dtype) for t in rope_cos_sin(positions, inv))
    q_norm, k_norm = ((torch.rand(dim) + 0.5, torch.rand(dim) + 0.5) if qk_norm
                      else (None, None))
    slots = torch.tensor([7, 2, 11])
    k_cache, v_cache = torch.zeros(2, 16, kv_heads, dim, dtype=dtype)
    q = gpu_fused.qkv_rope_write(qkv, heads, kv_heads, dim, q_norm, k_norm, cos, sin, 1e-6,
                                 slots, k_cache, v_cache)
    rq, rk, rv = qkv.float().split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)
    want_q = norm_rope(rq.reshape(tokens, heads, dim).to(dtype), q_norm, cos, sin, 1e-6)
    want_k = norm_rope(rk.reshape(tokens, kv_heads, dim).to(dtype), k_norm, cos, sin, 1e-6)
    _close(q, want_q, dtype)
    _close(k_cache[slots], want_k, dtype)
    _close(v_cache[slots], rv.reshape(tokens, kv_heads, dim), dtype)
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


def test_qkv_rope_without_write_matches_apply_rope():
    torch.manual_seed(3)
    qkv = _qkv(2, 2, 1, 8, torch.float32)
    cos, sin = rope_cos_sin(torch.tensor([3, 9]), 1.0 / (1e4 ** (torch.arange(0, 8, 2) / 8)))
    q = gpu_fused.qkv_rope_write(qkv, 2, 1, 8, None, None, cos, sin, 1e-6, None, None, None)
    _close(q, apply_rope(qkv[:, :16].reshape(2, 2, 8), cos, sin), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_activations(dtype):
    torch.manual_seed(4)
    y = (torch.randn(3, 2 * 1100) * 3).to(dtype)  # two column blocks per row
    _close(gpu_fused.gated(y, "silu"), swiglu(y.float()).to(dtype), dtype)
    _close(gpu_fused.gated(y, "gelu_tanh"), geglu(y.float()).to(dtype), dtype)
    with pytest.raises(ValueError, match="valid: silu, gelu_tanh"):
        gpu_fused.gated(y, "relu")


BLOCK = 4
# three sequences of different lengths over blocks scattered through a pool of 16
TABLES = [[9, 2, 14, 5, 0], [3, 11], [7, 12, 1, 15, 6, 10]]
LENGTHS = [19, 6, 23]


def _pool(dtype: torch.dtype, kv_heads: int, dim: int) -> FloatKV:
    cache = FloatKV(17 * BLOCK, kv_heads, dim, dtype, torch.device("cpu"))
    cache.k.copy_(torch.randn(cache.k.shape))
    cache.v.copy_(torch.randn(cache.v.shape))
    return cache


def _spans() -> list[SeqSpan]:
    spans = []
    for table, n in zip(TABLES, LENGTHS):
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)])
        spans.append(SeqSpan(n - 1, 1, slots))
    return spans


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window,softcap,sinks,splits", [
    (None, None, False, 1), (None, None, False, 3), (5, None, False, 1),
    (None, 2.0, True, 1), (7, 3.0, True, 2)])
def test_paged_decode_attention(dtype, window, softcap, sinks, splits):
    """Over the block table (page = block size) against kvlab's paged_attention."""
    torch.manual_seed(5)
    heads, kv_heads, dim, scale = 6, 2, 16, 0.3
    cache = _pool(dtype, kv_heads, dim)
    q = torch.randn(len(TABLES), heads, dim).to(dtype)
    sink = torch.randn(heads) if sinks else None
    meta = build_metadata(_spans(), window, torch.device("cpu"))
    want = paged_attention(q, None, None, cache, meta, sliding=window is not None,
                           scale=scale, softcap=softcap, sinks=sink)
    table = torch.tensor([t + [0] * (6 - len(t)) for t in TABLES])
    got = gpu_attention.paged_decode_attention(
        q, cache.k, cache.v, table, scale, lengths=torch.tensor(LENGTHS), page=BLOCK,
        window=window or 0, softcap=softcap or 0.0, sinks=sink, splits=splits)
    _close(got.reshape(len(TABLES), -1), want, dtype)


def test_paged_decode_attention_masked_slot_table():
    """The decode graph's form: a slot per key (page 1) and a mask of the visible keys,
    padding keys pointing at the row's first slot."""
    torch.manual_seed(6)
    cache = _pool(torch.float32, 2, 16)
    q = torch.randn(len(TABLES), 4, 16)
    spans = _spans()
    width, window = 32, 6
    slots = torch.stack([torch.cat([s.slots, s.slots[:1].expand(width - s.end)])
                         for s in spans])
    keys, seen = torch.arange(width)[None], torch.tensor(LENGTHS)[:, None]
    mask = (keys < seen) & (keys >= seen - window)
    got = gpu_attention.paged_decode_attention(q, cache.k, cache.v, slots, 0.25, mask=mask,
                                               splits=2)
    meta = build_metadata(spans, window, torch.device("cpu"))
    want = paged_attention(q, None, None, cache, meta, sliding=True, scale=0.25)
    _close(got.reshape(len(TABLES), -1), want, torch.float32)


PARAMS = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, logprobs=3)
PROMPTS = [[3, 14, 15, 92, 65], [8] * 7, [9, 10]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    paths = {}
    for arch in ("llama", "qwen3", "gemma3"):
        out = tmp_path_factory.mktemp(arch)
        build(arch, out)
        paths[arch] = out / "model.gguf"
    return paths


def _generate(path, triton: bool, graphs: str, gate: str):
    """Greedy tokens and log-probs of PROMPTS, decode steps through the Triton plan or the
    per-op path."""
    engine = Engine.from_model(str(path), EngineConfig(block_size=4, decode_graphs=graphs))
    model = engine.runner.model
    model.c_plan = None  # the per-op path is the reference
    if triton:
        model.gpu_plan = decode_gpu.plan_for(model.config, model.layers, gate)
        assert model.gpu_plan is not None
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, PARAMS)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    logprobs: dict[str, list[float]] = {str(i): [] for i in range(len(PROMPTS))}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            logprobs[out.request_id].extend(lp.logprob for lp in out.logprobs or [])
    return list(tokens.values()), torch.tensor(list(logprobs.values()))


@pytest.mark.parametrize("arch,graphs", [("llama", "eager"), ("qwen3", "off"),
                                         ("gemma3", "eager")])
def test_decode_plan_matches_per_op_path(checkpoints, monkeypatch, arch, graphs):
    """Decode steps through decode_gpu's plan: Llama (SwiGLU), Qwen 3 (QK-norm) and Gemma 3
    (GeGLU, post norms, sliding window); "eager" is the decode graph's static pass (a key
    mask per row, strided input columns), "off" the ordinary metadata (lengths)."""
    monkeypatch.setattr(decode_gpu, "gpu_fused", gpu_fused)  # None where CUDA is absent
    monkeypatch.setattr(decode_gpu, "gpu_attention", gpu_attention)
    gate = "gelu_tanh" if arch.startswith("gemma") else "silu"
    want, want_lp = _generate(checkpoints[arch], False, graphs, gate)
    got, got_lp = _generate(checkpoints[arch], True, graphs, gate)
    assert got == want
    torch.testing.assert_close(got_lp, want_lp, atol=1e-4, rtol=1e-4)


def test_plan_declines_what_it_does_not_run(checkpoints):
    engine = Engine.from_model(str(checkpoints["llama"]), EngineConfig(block_size=4))
    model = engine.runner.model
    layers = [dict(layer, router=layer["o"]) for layer in model.layers]
    assert decode_gpu.plan_for(model.config, layers, "silu") is None
    assert decode_gpu.build_plan(model.config, model.layers, "silu") is None  # CPU weights


def test_kernels_compile_for_sm90():
    """Every kernel configuration the plan launches compiles for an H200 (sm_90), in a
    process without the interpreter (tests/triton_sm90.py)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("triton_sm90.py"))],
                          capture_output=True, text=True, env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "compiled 11 of 11" in done.stdout


def test_decode_plan_over_packed_gguf_weights(tmp_path, monkeypatch):
    """The GPU's Q4_K path: a model whose products are packed GGUF weights (Triton's
    quantized matmuls), its decode step through the plan against the per-op path."""
    if layers.quant_matmul is None:
        pytest.skip("kvlab.models.layers was imported without triton's packed products")
    monkeypatch.setattr(decode_gpu, "gpu_fused", gpu_fused)
    monkeypatch.setattr(decode_gpu, "gpu_attention", gpu_attention)
    build("llama", tmp_path, hidden_size=256, intermediate_size=256, num_hidden_layers=1)
    loaded = load_model(open_checkpoint(tmp_path / "model.gguf"),
                        LoadOptions(quantize="q4_k", group_rows=False))

    def packed(w: QuantizedWeight) -> PackedWeight:
        return pack(w, torch.float32, "cpu")

    ids, logits = [3], []  # one prompt token: both steps are decode steps
    for triton in (True, False):
        model = loaded.model
        model = type(model)(loaded.config, _each_weight(model.weights, packed),
                            [_each_weight(layer, packed) for layer in model.layers])
        assert isinstance(model.layers[0]["qkv"].parts[0], PackedWeight)
        model.gpu_plan = decode_gpu.plan_for(loaded.config, model.layers, "silu") if triton \
            else None
        runner = ModelRunner(model, loaded.config, 8, 4)
        runner.execute(SchedulerOutput([ScheduledSeq("a", 0, ids, [0], True, len(ids))]))
        step = ScheduledSeq("a", len(ids), [20], [0], True, 0)
        logits.append(runner.execute(SchedulerOutput([step])).logits[0])
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)
