"""Packed GGUF weights (kvlab.kernels.packed) and their Triton kernels (kvlab.gpu.quant_matmul).

On every packed type, on real blocks (kvlab's and gguf's quantizers; IQ4_XS, which has none,
from blocks built to reach every table entry and scale): the planes stay within 10 % of the
file's bytes, the Triton dequantizer equals kvlab's C dequantizer bit for bit, and the GEMV
(decode) and GEMM (prefill) products agree with x @ dequantize(W)^T within fp32 rounding
(fp16/bf16: the rounding of the activations' dtype), as the C products do within their
8-bit activations' bound. Where no CUDA device is present the kernels run on CPU tensors
through Triton's interpreter, which is set before triton is first imported.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (pip install kvlab[test])")

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvlab.engine import Engine, EngineConfig
from kvlab.gpu import quant_matmul
from kvlab.kernels import (
    QuantizedWeight,
    dequantize,
    dequantize_rows,
    group_rows,
    qmatmul,
    quantize,
)
from kvlab.kernels.packed import PACKED_TYPES, PackedWeight, concat_rows, pack
from kvlab.models.layers import Stacked, embed, linear, packs_on
from kvlab.models.loader import LoadOptions, load_model
from kvlab.models.moe import Experts
from kvlab.runner import ModelRunner
from kvlab.scheduler import ScheduledSeq, SchedulerOutput
from kvlab.weights.checkpoint import open_checkpoint
from tests.test_kernels import qmatmul_bound
from tests.test_kernels_iq4 import iq4_xs_blocks

from tiny_models import build

T = GGMLQuantizationType
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROWS, COLS = 40, 512  # 40: a partial tile of weight rows in every kernel
# resident bytes / file bytes: the K-quants' 12 packed scale bytes unpack to 16 (+4 of 144)
RATIOS = {T.Q8_0: 1.0, T.Q4_K: 148 / 144, T.Q5_K: 180 / 176, T.Q6_K: 1.0,
          T.IQ4_XS: 138 / 136, T.MXFP4: 1.0, T.Q4_0: 1.0, T.Q5_0: 1.0}
ids = lambda t: t.name


def real_weight(qtype: GGMLQuantizationType, rows: int = ROWS, cols: int = COLS,
                seed: int = 0) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    if qtype != T.IQ4_XS:  # K-quants: kvlab's search; Q8_0 as gguf's; Q4_0/Q5_0/MXFP4: gguf's
        return quantize(torch.randn(rows, cols, generator=g), qtype)
    r = np.random.default_rng(seed)
    n = rows * cols // 256
    blocks = iq4_xs_blocks(r.uniform(0.002, 0.02, n), r.integers(0, 64, (n, 8)),
                           r.integers(0, 16, (n, 256)))
    return QuantizedWeight(qtype, (rows, cols), torch.from_numpy(blocks.reshape(rows, -1)))


@pytest.fixture(scope="module", params=PACKED_TYPES, ids=ids)
def weights(request):
    w = real_weight(request.param)
    return w, pack(w, torch.float32, DEVICE), dequantize(w)


def test_types_are_the_brief_ones():
    assert set(PACKED_TYPES) == set(RATIOS)


@pytest.mark.parametrize("qtype", PACKED_TYPES, ids=ids)
def test_resident_bytes_stay_within_ten_percent_of_the_file(qtype):
    w = real_weight(qtype, 8, 256)
    p = pack(w, torch.bfloat16, DEVICE)
    ratio = p.nbytes / w.nbytes
    print(f"{qtype.name}: packed {p.nbytes} bytes, file {w.nbytes}: ratio {ratio:.3f}")
    assert p.file_nbytes == w.nbytes
    assert ratio == pytest.approx(RATIOS[qtype]) and ratio <= 1.10


def test_triton_dequantize_equals_the_c_dequantizer_bit_for_bit(weights):
    w, p, ref = weights
    got = quant_matmul.dequantize(p).cpu()
    assert torch.equal(got, ref), f"{w.qtype.name}: max diff {(got - ref).abs().max()}"
    for a, b in zip(concat_rows(p, p).planes, p.planes):  # stacking keeps every plane's rows
        assert torch.equal(a[: b.shape[0]], b) and torch.equal(a[b.shape[0]:], b)


def test_row_lookup_equals_the_c_rows(weights):
    w, p, _ = weights
    picks = torch.tensor([[5, ROWS - 1], [0, 5]])
    got = quant_matmul.dequantize_rows(p, picks.to(DEVICE)).cpu()
    assert torch.equal(got, dequantize_rows(w, picks))
    assert torch.equal(embed(picks.to(DEVICE), p).cpu(), got)  # the models' lookup


def _bound(x: torch.Tensor, ref_w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 accumulation rounding, plus for fp16/bf16 the rounding of the weight tile (GEMM),
    of the activations and of the output to that dtype."""
    scale = x.double().abs() @ ref_w.double().abs().T
    if dtype == torch.float32:
        return 1e-5 * scale + 1e-6
    return 4 * torch.finfo(dtype).eps * scale + 1e-4


def _first_half(w: QuantizedWeight) -> QuantizedWeight:
    """The first half of each row: blocks run along the row, so the first half of its bytes."""
    return QuantizedWeight(w.qtype, (w.shape[0], w.shape[1] // 2),
                           w.data[:, : w.row_bytes // 2].contiguous())


CASES = [(n, dtype) for n in (1, 40) for dtype in (torch.float32, torch.bfloat16, torch.float16)]


@pytest.mark.parametrize(("n", "dtype"), [*CASES, (5, torch.float32)],
                         ids=lambda v: f"{v}rows" if isinstance(v, int) else str(v)[6:])
def test_gemv_and_gemm_match_dequantize_then_matmul(weights, n, dtype):
    """1 and 5 rows run the GEMV kernel (5: padded to 8), 40 the GEMM; the C product on the same blocks stays
    within its own bound (activations rounded to 8 bits) of the same reference."""
    w, _, ref_w = weights
    w, ref_w = _first_half(w), ref_w[:, : COLS // 2]  # a shorter run of the interpreter
    p = pack(w, dtype, DEVICE)
    x = torch.randn(n, COLS // 2, generator=torch.Generator().manual_seed(n))
    xt = x.to(dtype)  # what the kernels read
    ref = (xt.double() @ ref_w.double().T)
    got = quant_matmul.linear(xt.to(DEVICE), p)
    assert got.dtype == dtype and got.shape == (n, ROWS)
    err = (got.cpu().double() - ref).abs()
    bound = _bound(xt.float(), ref_w, dtype)
    assert (err <= bound).all(), f"{w.qtype.name}: worst {(err / bound).max():.2f} of the bound"
    if dtype == torch.float32:
        c_err = (qmatmul(x, w).double() - ref).abs()
        assert (c_err <= qmatmul_bound(x, ref_w, w.qtype, True)).all()


@pytest.mark.parametrize("splits", [3])  # 3 asked, 2 taken: parts are whole loop trips
def test_gemv_split_along_the_row_sums_the_same(weights, splits):
    """Parts of each row in programs of their own (decode on a GPU with more SMs than row
    tiles), partial sums added after: the same products within fp32 rounding."""
    w, p, ref_w = weights
    x = torch.randn(3, COLS, generator=torch.Generator().manual_seed(splits)).to(DEVICE)
    y = torch.empty(3, ROWS, device=DEVICE)
    quant_matmul.gemv(x, p, y, splits=splits)
    err = (y.cpu().double() - x.cpu().double() @ ref_w.double().T).abs()
    assert (err <= _bound(x.cpu(), ref_w, torch.float32)).all()


def test_stacked_packed_weights_multiply_as_one():
    """q|k|v of one type concatenate into one packed matrix; its product splits back."""
    parts = [real_weight(T.Q4_K, rows, 256, seed) for rows, seed in ((64, 1), (32, 2))]
    packed = [pack(w, torch.float32, DEVICE) for w in parts]
    stacked = Stacked.of(packed)
    assert len(stacked.parts) == 1 and stacked.parts[0].shape == (96, 256)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    got = linear(x, stacked)
    want = torch.cat([quant_matmul.linear(x, q) for q in packed], -1)
    assert torch.equal(got, want)


def test_only_cuda_loads_pack_and_only_the_packed_types():
    """The loader's choice: a CUDA device (with the kernels importable, as here) and a
    packed type; CPU loads keep their C-kernel blocks, other types dequantize as before."""
    q4k = real_weight(T.Q4_K, 8, 256)
    assert packs_on(q4k, "cuda") and packs_on(q4k, torch.device("cuda", 1))
    assert not packs_on(q4k, "cpu")
    assert not packs_on(quantize(torch.zeros(8, 256), T.Q4_1), "cuda")
    assert not packs_on(group_rows(q4k), "cuda")  # CPU's 8-row groups: never on a GPU


def test_a_row_of_the_wrong_width_is_refused():
    p = pack(real_weight(T.Q8_0, 8, 64), torch.float32, DEVICE)
    with pytest.raises(ValueError, match="takes 64"):
        quant_matmul.linear(torch.zeros(1, 32, device=DEVICE), p)
    with pytest.raises(ValueError, match="cannot be packed"):
        pack(quantize(torch.zeros(8, 64), T.Q4_1), torch.float32, DEVICE)


def test_block_sizes_match_gguf():
    assert {t: GGML_QUANT_SIZES[t] for t in PACKED_TYPES} == {
        T.Q8_0: (32, 34), T.Q4_K: (256, 144), T.Q5_K: (256, 176), T.Q6_K: (256, 210),
        T.IQ4_XS: (256, 136), T.MXFP4: (32, 17), T.Q4_0: (32, 18), T.Q5_0: (32, 22)}


def _each_weight(layer: dict, convert) -> dict:
    """A layer's (or the globals') dict with every QuantizedWeight converted, stacked parts
    and experts included."""
    def one(v):
        if isinstance(v, QuantizedWeight):
            return convert(v)
        if isinstance(v, Stacked):
            return Stacked(tuple(one(p) for p in v.parts), v.sizes)
        if isinstance(v, Experts):
            return replace(v, gate_up=tuple(map(one, v.gate_up)), down=tuple(map(one, v.down)))
        return v
    return {k: one(v) for k, v in layer.items()}


MODELS = [("llama", "q4_k", {"hidden_size": 256, "intermediate_size": 256,
                             "num_hidden_layers": 1}),
          ("qwen2moe", "q8_0", {})]  # routed experts and a shared one, each its products


@pytest.mark.parametrize(("arch", "quant", "shape"), MODELS, ids=[m[0] for m in MODELS])
def test_a_model_of_packed_weights_gives_the_dense_models_logits(tmp_path, arch, quant, shape):
    """A tiny model quantized at load, once as packed weights (every product and the
    embedding lookup through the Triton kernels: prefill by GEMM, decode by GEMV) and once
    dequantized to fp32 tensors (torch): the same logits up to fp32 rounding."""
    build(arch, tmp_path, **shape)
    loaded = load_model(open_checkpoint(tmp_path / "model.gguf"),
                        LoadOptions(quantize=quant, group_rows=False))
    model = loaded.model
    quantized = [t for t in loaded.tensors if t.qtype == quant.upper()]
    assert {t.qtype for t in loaded.tensors if len(t.shape) == 2 and "router" not in t.name} \
        == {quant.upper()}
    runners, packed = [], []

    def to_packed(w: QuantizedWeight) -> PackedWeight:
        packed.append(pack(w, torch.float32, "cpu"))
        return packed[-1]

    for convert in (to_packed, dequantize):
        layers = [_each_weight(layer, convert) for layer in model.layers]
        rebuilt = type(model)(loaded.config, _each_weight(model.weights, convert), layers)
        runners.append(ModelRunner(rebuilt, loaded.config, 8, 4))
    # every quantized matrix (experts too) went packed
    assert sum(w.shape[0] * w.shape[1] for w in packed) == sum(
        t.shape[0] * t.shape[1] for t in quantized)
    packed_layer = runners[0].model.layers[0]
    assert isinstance(packed_layer["qkv"].parts[0], PackedWeight)
    assert len(packed_layer["qkv"].parts) == 1  # q|k|v stacked into one packed matrix
    ids = list(range(3, 14))
    got, want = [], []
    for runner, out in zip(runners, (got, want)):
        seqs = [ScheduledSeq("a", 0, ids, [0, 1, 2], True, len(ids))]
        seqs.append(ScheduledSeq("a", len(ids), [20], [0, 1, 2], True, 0))
        for seq in seqs:
            out.append(runner.execute(SchedulerOutput([seq])).logits[0])
    for a, b in zip(got, want):
        assert (a - b).abs().max() <= 1e-4 * b.abs().max(), (a - b).abs().max()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_default_model_stays_packed_on_cuda(default_model_path):
    """Gemma 3 Q4_K_M on CUDA: its quantized matrices load packed (near the file's bytes,
    a quarter or so of the bf16 dequantized load) and give the dequantized load's tokens."""
    ids = list(range(5, 60))
    engines = [Engine.from_model(str(default_model_path),
                                 EngineConfig(block_size=16, device="cuda", keep_quantized=keep))
               for keep in (True, False)]
    packed, dense = (e.loaded for e in engines)
    kinds = {t.qtype for t in packed.tensors if len(t.shape) == 2}
    assert kinds == {"Q5_0", "Q8_0", "Q4_K", "Q6_K"}  # every matrix of the file stays packed
    assert packed.weight_bytes < 0.6 * dense.weight_bytes  # bf16: 16 bits a weight
    got, want = (e.teacher_forced_logprobs(ids, 8).float().cpu() for e in engines)
    assert (got - want).abs().max() < 0.25
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.85
