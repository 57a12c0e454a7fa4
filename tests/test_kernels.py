"""kvlab.kernels against gguf's reference (de)quantizers, on both C paths and the fallback.

Error bound for qmatmul (the C kernels, any number of rows): x is rounded to 8-bit blocks
(32 wide for the legacy types, 256 wide for K-quants) with step d = max|x_block| / 127,
so each x_i moves by at most d/2 and

    |qmatmul(x, W) - x @ dequantize(W)^T|[j, r] <= sum_i |W[r, i]| * max|x[j, block(i)]| / 254

plus fp32 rounding, taken as 1e-4 * (|x| @ |W|^T). dense_matmul (fp32 tiles) and the
float weight types get the fp32 term alone.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants
from kernel_paths import outputs_on_every_path

from kvlab.kernels import (
    SUPPORTED_TYPES,
    QuantizedWeight,
    dequantize,
    dequantize_rows,
    get_num_threads,
    ops,
    qmatmul,
    quantize,
    set_num_threads,
)

T = GGMLQuantizationType
GGUF_QUANTIZABLE = (T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.MXFP4)
ISAS = ["generic", "avx2"] if ops._qk is not None else []
if ops._qk is not None:
    try:
        ops._qk.set_isa("avx2")
    except ValueError:
        ISAS = ["generic"]
    ops._qk.set_isa("auto")
BACKENDS = ISAS + ["torch"]  # "torch": the extension hidden, the pure fallback


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    if request.param == "torch":
        monkeypatch.setattr(ops, "_qk", None)
    else:
        ops._qk.set_isa(request.param)
    yield request.param
    if ops._qk is not None:
        ops._qk.set_isa("auto")


def make_weight(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int = 0):
    """A QuantizedWeight with test data: gguf's quantizer where it has one, else random
    blocks (any bytes are valid K-quant blocks once the fp16 scales are sane)."""
    g = np.random.default_rng(seed)
    if qtype == T.F32:
        data = g.standard_normal((rows, cols), dtype=np.float32).view(np.uint8)
    elif qtype in GGUF_QUANTIZABLE:
        x = g.standard_normal((rows, cols), dtype=np.float32)
        data = gguf_quants.quantize(x, qtype).view(np.uint8).reshape(rows, -1)
    else:
        block, size = GGML_QUANT_SIZES[qtype]
        blocks = g.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
        scales = (g.uniform(0.001, 0.02, (len(blocks), 2)).astype(np.float16)).view(np.uint8)
        if qtype == T.Q6_K:
            blocks[:, 208:210] = scales[:, :2]
        elif qtype == T.Q3_K:  # d closes the block
            blocks[:, 108:110] = scales[:, :2]
        elif qtype == T.Q2_K:  # d, dmin close the block
            blocks[:, 80:84] = scales
        else:  # d, dmin lead the block
            blocks[:, 0:4] = scales
        data = blocks.reshape(rows, -1)
    return QuantizedWeight(qtype, (rows, cols), torch.from_numpy(np.ascontiguousarray(data)))


def reference_dequant(w: QuantizedWeight) -> np.ndarray:
    if w.qtype == T.F32:
        return w.data.numpy().view(np.float32)
    return gguf_quants.dequantize(w.data.numpy(), w.qtype)


def assert_blocks_equal(got: np.ndarray, ref: np.ndarray, qtype: GGMLQuantizationType):
    if np.array_equal(got, ref):
        return
    block = GGML_QUANT_SIZES[qtype][0]
    bad = np.argwhere(got != ref)[0]
    r, b = bad[0], bad[1] // block
    raise AssertionError(f"{qtype.name}: row {r} block {b} differs: "
                         f"{got[r, b * block:(b + 1) * block]} vs {ref[r, b * block:(b + 1) * block]}")


def qmatmul_bound(x: torch.Tensor, w_ref: torch.Tensor, qtype: GGMLQuantizationType,
                  quantized_x: bool) -> torch.Tensor:
    """Largest allowed |qmatmul - x @ w_ref^T| per output (see the module docstring)."""
    xd, wd = x.double(), w_ref.double()
    bound = 1e-4 * (xd.abs() @ wd.abs().T) + 1e-6
    block = GGML_QUANT_SIZES[qtype][0]
    if quantized_x and block > 1:
        amax = xd.abs().view(x.shape[0], -1, block).amax(-1)  # [n, blocks]
        half_step = (amax / 254).repeat_interleave(block, dim=1)  # [n, in]
        bound += half_step @ wd.abs().T
    return bound


# ---------------------------------------------------------------- dequantize


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf(qtype, backend):
    w = make_weight(qtype, 8, 512)
    assert_blocks_equal(dequantize(w).numpy(), reference_dequant(w), qtype)


def test_dequantize_dtype():
    w = make_weight(T.Q4_K, 4, 256)
    assert dequantize(w, torch.bfloat16).dtype == torch.bfloat16
    assert torch.equal(dequantize(w, torch.float16), dequantize(w).half())


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.Q6_K, T.BF16], ids=lambda t: t.name)
def test_dequantize_rows(qtype, backend):
    w = make_weight(qtype, 16, 256)
    ids = torch.tensor([[5, 0], [15, 5]])
    rows = dequantize_rows(w, ids)
    assert rows.shape == (2, 2, 256)
    assert torch.equal(rows, dequantize(w)[ids])
    with pytest.raises(IndexError):
        dequantize_rows(w, torch.tensor([16]))


# ---------------------------------------------------------------- qmatmul


@pytest.mark.parametrize("n", [1, 3, 64])
@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_qmatmul_within_activation_quantization_error(qtype, n, backend):
    w = make_weight(qtype, 40, 512, seed=n)
    x = torch.randn(n, 512, generator=torch.Generator().manual_seed(n))
    w_ref = torch.from_numpy(reference_dequant(w).copy())
    y = qmatmul(x, w)
    assert y.shape == (n, 40) and y.dtype == torch.float32
    decode = backend != "torch" and qtype != T.F32
    err = (y.double() - x.double() @ w_ref.double().T).abs()
    bound = qmatmul_bound(x, w_ref, qtype, quantized_x=decode)
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3g}"


def emulate_activation_quantization(x: torch.Tensor, block: int) -> torch.Tensor:
    """What the C kernels see of x: per block d = max|x|/127, q = round-half-even(x/d)."""
    xb = x.view(x.shape[0], -1, block)
    d = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(xb * inv) * d).view_as(x)


@pytest.mark.skipif(not ISAS, reason="C extension not built")
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", [t for t in SUPPORTED_TYPES if GGML_QUANT_SIZES[t][0] > 1],
                         ids=lambda t: t.name)
def test_qmatmul_is_exact_on_quantized_activations(qtype, isa):
    """A much tighter check than the bound: against the 8-bit x the kernels use, the only
    error left is fp32 rounding."""
    w = make_weight(qtype, 24, 512, seed=11)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(2))
    w_ref = torch.from_numpy(reference_dequant(w).copy()).double()
    x_hat = emulate_activation_quantization(x, GGML_QUANT_SIZES[qtype][0]).double()
    try:
        ops._qk.set_isa(isa)
        y = qmatmul(x, w).double()
    finally:
        ops._qk.set_isa("auto")
    tol = 1e-5 * (x_hat.abs() @ w_ref.abs().T) + 1e-6
    assert ((y - x_hat @ w_ref.T).abs() <= tol).all()


@pytest.mark.parametrize("cols", [32, 96])
@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.F16],
                         ids=lambda t: t.name)
def test_qmatmul_odd_block_counts(qtype, cols, backend):
    """The AVX2 kernels take the 4/5-bit types two blocks at a time: a lone last block."""
    w = make_weight(qtype, 7, cols, seed=cols)
    x = torch.randn(2, cols)
    w_ref = torch.from_numpy(reference_dequant(w).copy())
    err = (qmatmul(x, w).double() - x.double() @ w_ref.double().T).abs()
    assert (err <= qmatmul_bound(x, w_ref, qtype, quantized_x=backend != "torch")).all()
    assert_blocks_equal(dequantize(w).numpy(), w_ref.numpy(), qtype)


@pytest.mark.skipif("avx2" not in ISAS, reason="no AVX2 on this CPU")
@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_avx2_matches_portable_c(qtype):
    """Same 8-bit activations, same integer dot products: only fp32 summation order differs."""
    w = make_weight(qtype, 24, 1024, seed=7)
    x = torch.randn(5, 1024, generator=torch.Generator().manual_seed(1))
    try:
        ops._qk.set_isa("generic")
        y_c = qmatmul(x, w)
        ops._qk.set_isa("avx2")
        y_avx2 = qmatmul(x, w)
    finally:
        ops._qk.set_isa("auto")
    tol = 1e-5 * (x.abs() @ dequantize(w).abs().T) + 1e-6
    assert ((y_c - y_avx2).abs() <= tol).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q5_0, T.Q4_K, T.Q6_K, T.F16, T.Q2_K, T.Q3_K,
                                   T.IQ4_NL, T.IQ4_XS], ids=lambda t: t.name)
def test_qmatmul_propagates_nan_and_inf(qtype, bad, backend):
    """8-bit activations must not turn a NaN or inf into finite garbage (12 x rows: the
    tiled paths too)."""
    w = make_weight(qtype, 4, 512)
    x = torch.randn(12, 512)
    x[1, 300] = bad
    y = qmatmul(x, w)
    assert y[0].isfinite().all() and y[2:].isfinite().all() and not y[1].isfinite().any()


def test_qmatmul_leading_dims_and_shape_errors():
    w = make_weight(T.Q8_0, 8, 64)
    x = torch.randn(2, 3, 64)
    assert torch.equal(qmatmul(x, w), qmatmul(x.reshape(6, 64), w).reshape(2, 3, 8))
    assert qmatmul(torch.randn(0, 64), w).shape == (0, 8)
    with pytest.raises(ValueError, match="features"):
        qmatmul(torch.randn(1, 32), w)


@pytest.mark.parametrize("n", [1, 3, 64])
def test_threads_one_and_two_give_identical_results(n):
    w = make_weight(T.Q4_K, 512, 512, seed=3)  # 147 KB: big enough to be split
    x = torch.randn(n, 512)
    before = get_num_threads()
    try:
        set_num_threads(1)
        y1 = qmatmul(x, w)
        set_num_threads(2)
        y2 = qmatmul(x, w)
    finally:
        set_num_threads(before)
    assert torch.equal(y1, y2)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", [t for t in SUPPORTED_TYPES if t != T.F32], ids=lambda t: t.name)
def test_qmatmul_is_batch_invariant(qtype, isa):
    """A row's output is bit-identical whatever else is in the batch: the many-row paths
    (weights unpacked once per tile) do each row's arithmetic in the single-row order.
    (F32 weights go to torch.mm, whose blocking may depend on n: not covered.)"""
    block = GGML_QUANT_SIZES[qtype][0]
    cols = 768 if block == 256 else 224 if block == 32 else 200  # odd block counts
    w = make_weight(qtype, 203, cols, seed=11)  # odd: tiles end in a lone weight row
    x = torch.randn(300, cols, generator=torch.Generator().manual_seed(2))
    try:
        ops._qk.set_isa(isa)
        alone = torch.cat([qmatmul(x[j : j + 1], w) for j in range(len(x))])
        for n in (1, 2, 5, 8, 13, 64, 300):  # Q8_0: one-row kernel below 8, 4/2-row tiles above
            assert torch.equal(qmatmul(x[:n], w), alone[:n]), n
            assert torch.equal(qmatmul(x[-n:], w), alone[-n:]), n
    finally:
        ops._qk.set_isa("auto")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", [201, 202, 204])
def test_q8_0_tiles_are_batch_invariant(rows, isa):
    """Q8_0 with 8+ x rows takes weight rows four at a time on VNNI (pairs otherwise), then
    a pair and/or a lone row: every leftover shape gives the one-row kernel's bits."""
    w = make_weight(T.Q8_0, rows, 224, seed=5)
    x = torch.randn(64, 224, generator=torch.Generator().manual_seed(3))
    try:
        ops._qk.set_isa(isa)
        alone = torch.cat([qmatmul(x[j : j + 1], w) for j in range(len(x))])
        for n in (1, 5, 8, 13, 64):
            assert torch.equal(qmatmul(x[:n], w), alone[:n]), n
            assert torch.equal(qmatmul(x[-n:], w), alone[-n:]), n
    finally:
        ops._qk.set_isa("auto")


# ---------------------------------------------------------------- quantize


def test_quantize_q8_0_is_byte_identical_to_gguf(backend):
    g = np.random.default_rng(0)
    x = g.standard_normal((6, 256), dtype=np.float32) * np.float32(3)
    x[0, :32] = 0.0  # all-zero block
    x[1, :32] = -1.0  # the max magnitude is negative
    x[2, :32] = np.arange(32, dtype=np.float32) - 15.5  # exact .5 products
    x[3, :32] *= np.float32(1e-6)  # fp16 scale goes subnormal
    w = quantize(torch.from_numpy(x), T.Q8_0)
    ref = gguf_quants.quantize(x, T.Q8_0).view(np.uint8).reshape(6, -1)
    assert np.array_equal(w.data.numpy(), ref)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q5_1, T.F16, T.BF16], ids=lambda t: t.name)
def test_quantize_other_types_use_gguf(qtype):
    x = np.random.default_rng(1).standard_normal((4, 64), dtype=np.float32)
    w = quantize(torch.from_numpy(x), qtype)
    assert np.array_equal(w.data.numpy().ravel(),
                          gguf_quants.quantize(x, qtype).view(np.uint8).ravel())


def rms(a: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(a, dtype=np.float64))))


# K-quants have no reference quantizer in gguf: dequantize(quantize(x)) must be at least as
# close to x as gguf's quantizer of a comparable type with per-32 fp16 scales.
@pytest.mark.skipif(ops._qk is None, reason="K-quant quantizers are C only")
@pytest.mark.parametrize("qtype, peer, slack", [(T.Q4_K, T.Q4_1, 1.0), (T.Q5_K, T.Q5_1, 1.0),
                                                (T.Q6_K, T.Q5_0, 0.6)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_quantize_k_error_against_gguf_peer(qtype, peer, slack):
    g = np.random.default_rng(2)
    x = g.standard_normal((32, 512), dtype=np.float32)
    x[0] = g.uniform(0.5, 2.0, 512)  # all positive: min 0
    x[1] *= np.float32(1e-3)
    x[2, :256] = 0.0
    w = quantize(torch.from_numpy(x), qtype)
    got = reference_dequant(w)  # decoded by gguf: the packing is checked too
    peer_err = rms(gguf_quants.dequantize(gguf_quants.quantize(x, peer), peer) - x)
    assert rms(got - x) <= slack * peer_err
    assert np.array_equal(got[2, :256], np.zeros(256, np.float32))
    assert rms(got[1] - x[1]) <= 0.12 * rms(x[1])  # tiny values: fp16 scales still fine


def test_quantize_q4_k_roundtrip_on_real_weights(gguf_file):
    """Re-quantizing a dequantized Q4_K matrix loses little: its values are on a Q4_K grid."""
    w = QuantizedWeight.from_gguf(gguf_file, "blk.0.attn_output.weight")
    x = dequantize(w)[:64]
    err = rms((dequantize(quantize(x, T.Q4_K)) - x).numpy())
    assert err <= 0.2 * rms(x.numpy())


# ---------------------------------------------------------------- the default model's tensors


@pytest.fixture(scope="module")
def gguf_file():
    from kvlab.errors import ModelLoadError
    from kvlab.weights.default_model import default_model_path
    from kvlab.weights.gguf_file import GGUFFile

    try:
        return GGUFFile(default_model_path())
    except ModelLoadError as e:
        pytest.skip(str(e))


REAL = ["token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_v.weight",
        "blk.0.attn_output.weight", "blk.0.ffn_down.weight"]  # Q8_0 Q5_0 Q8_0 Q4_K Q6_K


@pytest.mark.parametrize("name", REAL)
def test_real_tensors(gguf_file, name, backend):
    w = QuantizedWeight.from_gguf(gguf_file, name)
    raw = gguf_file.raw(name)
    assert w.data.data_ptr() == raw.ctypes.data  # zero-copy view of the mmap
    assert w.nbytes == raw.nbytes and w.shape == gguf_file.tensors[name].shape
    part = QuantizedWeight(w.qtype, (64, w.in_features), w.data[:64])
    ref = reference_dequant(part)
    assert_blocks_equal(dequantize(part).numpy(), ref, w.qtype)
    x = torch.randn(3, w.in_features)
    err = (qmatmul(x, part).double() - x.double() @ torch.from_numpy(ref).double().T).abs()
    assert (err <= qmatmul_bound(x, torch.from_numpy(ref), w.qtype, backend != "torch")).all()
    ids = torch.tensor([63, 1])
    assert torch.equal(dequantize_rows(w, ids), torch.from_numpy(ref[[63, 1]]))


# ---------------------------------------------------------------- the type


def test_quantized_weight_checks_its_data():
    with pytest.raises(ValueError, match="multiple of 256"):
        QuantizedWeight(T.Q4_K, (2, 128), torch.zeros(2, 72, dtype=torch.uint8))
    with pytest.raises(ValueError, match="needs uint8 data"):
        QuantizedWeight(T.Q8_0, (2, 64), torch.zeros(2, 60, dtype=torch.uint8))
    with pytest.raises(ValueError, match="not supported"):
        QuantizedWeight(T.IQ1_S, (2, 256), torch.zeros(2, 50, dtype=torch.uint8))
    w = QuantizedWeight(T.Q8_0, (2, 64), torch.zeros(68, 2, dtype=torch.uint8).t())
    assert w.data.is_contiguous() and w.data.shape == (2, 68) and w.nbytes == 136
    assert "Q8_0" in repr(w)


def test_copies_point_the_kernels_at_their_own_bytes():
    import copy
    import pickle

    w = make_weight(T.Q4_K, 4, 256)
    for c in (copy.deepcopy(w), pickle.loads(pickle.dumps(w))):
        assert c.kernel_args[1] == c.data.data_ptr() != w.data.data_ptr()
        assert torch.equal(dequantize(c), dequantize(w))


# ---------------------------------------------------------------- fused fp32 decode ops

needs_c = pytest.mark.skipif(ops._qk is None, reason="C extension not built")


def _rope_tables(tokens: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    from kvlab.models.layers import rope_cos_sin

    inv = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    return rope_cos_sin(torch.arange(7, 7 + tokens), inv)


@needs_c
@pytest.mark.parametrize("rows,dim", [(1, 640), (5, 256), (3, 7)])
def test_fused_rms_norm_matches_torch(rows, dim):
    from kvlab.kernels import fused

    x, w = torch.randn(rows, dim) * 3, torch.randn(dim)
    ref = torch.nn.functional.rms_norm(x, (dim,), w, 1e-6)
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-6), ref, rtol=1e-6, atol=0)
    res = torch.randn(rows, dim)
    expected = res + fused.rms_norm(x, w, 1e-6)  # the same scale, so bit-exact
    assert torch.equal(fused.add_rms_norm_(res, x, w, 1e-6), expected)


@needs_c
@pytest.mark.parametrize("with_norm", [False, True])
def test_fused_norm_rope_matches_torch(with_norm):
    from kvlab.kernels import fused
    from kvlab.models.layers import apply_rope

    tokens, heads, dim = 3, 4, 64
    qkv = torch.randn(tokens, (heads + 2) * dim)
    q = qkv[:, : heads * dim].reshape(tokens, heads, dim)  # a strided view, as in the models
    w = torch.randn(dim) if with_norm else None
    cos, sin = _rope_tables(tokens, dim)
    normed = q if w is None else torch.nn.functional.rms_norm(q, (dim,), w, 1e-6)
    ref = apply_rope(normed, cos, sin)
    before = qkv[:, heads * dim:].clone()
    out = fused.norm_rope_(q, w, cos, sin, 1e-6)
    if w is None:
        assert torch.equal(out, ref)  # same products and sums, rounded the same
    else:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    assert out.data_ptr() == qkv.data_ptr() and torch.equal(qkv[:, heads * dim:], before)


@needs_c
@pytest.mark.parametrize("inter", [2048, 13])
def test_fused_geglu_within_fp32_rounding(inter):
    from kvlab.kernels import fused

    y = torch.randn(3, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 4
    g, up = y.double().chunk(2, dim=-1)
    u = 0.7978845608028654 * (g + 0.044715 * g ** 3)
    exact = g * torch.sigmoid(2 * u) * up  # = 0.5 * g * (1 + tanh(u)) * up
    out = fused.geglu(y).double()
    # fp32 rounding of the argument of exp moves e^(-2u) by |2u| ulps: the condition number
    bound = 1e-6 * (1 + 2 * u.abs()) * exact.abs() + 1e-30
    assert ((out - exact).abs() <= bound).all()
    # torch's 1 + tanh(u) keeps only ~6e-8 absolute near tanh = -1, hence the |g * up| term
    ref = (torch.nn.functional.gelu(y[:, :inter], approximate="tanh") * y[:, inter:]).double()
    assert ((out - ref).abs() <= 1e-5 * ref.abs() + 1e-7 * (g * up).abs()).all()


@needs_c
@pytest.mark.parametrize("gate", ["geglu", "swiglu"])
def test_fused_gates_split_over_threads_change_no_bits(gate):
    from kvlab.kernels import fused

    fn = getattr(fused, gate)
    y = torch.randn(37, 2 * 4096, generator=torch.Generator().manual_seed(5)) * 4
    whole = fn(y)  # 37 x 4096 elements: the rows run on the kernel threads
    assert torch.equal(whole, torch.cat([fn(y[i:i + 1]) for i in range(37)]))


@needs_c
@pytest.mark.parametrize("gate", ["geglu", "swiglu"])
def test_fused_gates_give_every_element_the_same_bits_at_any_width(gate):
    """A row of 2 * 15 runs 8 elements eight-wide (AVX2), 4 four-wide and 3 one at a time;
    as 15 rows of one element each, every element takes the scalar path."""
    from kvlab.kernels import fused

    fn = getattr(fused, gate)
    y = torch.randn(64, 2 * 15, generator=torch.Generator().manual_seed(9)) * 6
    y[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])
    alone = fn(torch.stack([y[:, :15], y[:, 15:]], dim=-1).reshape(-1, 2))
    assert torch.equal(fn(y).reshape(-1, 1), alone)


@needs_c
@pytest.mark.parametrize("inter", [2048, 13])
def test_fused_swiglu_within_fp32_rounding(inter):
    from kvlab.kernels import fused

    y = torch.randn(3, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 8
    y[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])  # e^x clamped at both ends, and zero
    g, up = y.double().chunk(2, dim=-1)
    exact = g * torch.sigmoid(g) * up
    out = fused.swiglu(y).double()
    bound = 1e-6 * (1 + g.abs()) * exact.abs() + 1e-30  # |g| ulps from exp's argument
    assert ((out - exact).abs() <= bound).all()
    ref = (torch.nn.functional.silu(y[:, :inter]) * y[:, inter:]).double()
    assert ((out - ref).abs() <= 1e-5 * ref.abs() + 1e-7 * (g * up).abs()).all()


@needs_c
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("heads,kv_heads,dim",
                         [(4, 1, 256), (4, 2, 64), (6, 1, 24), (6, 2, 40), (3, 3, 20)])
def test_attend_decode_matches_sdpa(isa, heads, kv_heads, dim):
    from kvlab.kernels import fused

    ops._qk.set_isa(isa)
    try:
        batch, ctx, num_slots = 2, 37, 100
        q = torch.randn(batch, heads, dim)
        k, v = torch.randn(num_slots, kv_heads, dim), torch.randn(num_slots, kv_heads, dim)
        slots = torch.stack([torch.randperm(num_slots)[:ctx] for _ in range(batch)])
        out = fused.attend_decode(q, k, v, slots, dim ** -0.5)
    finally:
        ops._qk.set_isa("auto")
    ref = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None], k[slots].transpose(1, 2), v[slots].transpose(1, 2),
        scale=dim ** -0.5, enable_gqa=True)[:, :, 0]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@needs_c
@pytest.mark.parametrize("isa", ISAS)
def test_attend_decode_on_an_fp16_cache_is_the_fp32_cache_of_its_values(isa):
    """fp16 K/V widen to fp32 as they load: the same bits as an fp32 cache of those values."""
    from kvlab.kernels import fused

    heads, kv_heads, dim, num_slots = 4, 1, 256, 300
    q = torch.randn(3, heads, dim)
    k = torch.randn(num_slots, kv_heads, dim).half()
    v = torch.randn(num_slots, kv_heads, dim).half()
    slots = torch.stack([torch.randperm(num_slots)[:280] for _ in range(3)])
    lengths = torch.tensor([280, 5, 257])  # two chunks, one short row, a chunk of one
    ops._qk.set_isa(isa)
    try:
        half = fused.attend_decode(q, k, v, slots, dim ** -0.5, lengths)
        full = fused.attend_decode(q, k.float(), v.float(), slots, dim ** -0.5, lengths)
    finally:
        ops._qk.set_isa("auto")
    assert fused.cache_fits(k, v) and not fused.cache_fits(k, v.float())
    assert torch.equal(half, full)


@needs_c
@pytest.mark.parametrize("threads", [1, 2])
def test_attend_decode_long_rows_split_into_chunks(threads):
    """Rows of 700 and 300 keys (chunks of 256, spread over the kernel threads) against SDPA,
    and each row's output identical alone and batched."""
    from kvlab.kernels import fused, set_num_threads

    before = ops.get_num_threads()
    set_num_threads(threads)
    try:
        heads, kv_heads, dim, num_slots = 4, 2, 64, 1200
        q = torch.randn(2, heads, dim)
        k, v = torch.randn(num_slots, kv_heads, dim), torch.randn(num_slots, kv_heads, dim)
        slots = torch.stack([torch.randperm(num_slots)[:700] for _ in range(2)])
        lengths = torch.tensor([700, 300])
        out = fused.attend_decode(q, k, v, slots, dim ** -0.5, lengths)
        alone = fused.attend_decode(q[1:], k, v, slots[1:, :300].contiguous(), dim ** -0.5)
    finally:
        set_num_threads(before)
    for b, n in enumerate(lengths.tolist()):
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[b, :, None], k[slots[b, :n]].transpose(0, 1), v[slots[b, :n]].transpose(0, 1),
            scale=dim ** -0.5, enable_gqa=True)[:, 0]
        torch.testing.assert_close(out[b], ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[1], alone[0])


@pytest.mark.parametrize("rows", [1, 3])
def test_qmatmul_stacked_is_concatenated_qmatmul(rows):
    from kvlab.kernels import qmatmul_stacked

    ws = (make_weight(T.Q5_0, 64, 256), make_weight(T.Q8_0, 32, 256, seed=1))
    x = torch.randn(rows, 256)
    expected = torch.cat([qmatmul(x, w) for w in ws], dim=-1)
    assert torch.equal(qmatmul_stacked(x, ws), expected)


@needs_c
def test_scatter_rows_is_index_copy():
    from kvlab.kernels import fused

    store = torch.randn(10, 2, 8)
    expected = store.clone()
    kv = torch.randn(3, 2 * 2 * 8)[:, :16].reshape(3, 2, 8)  # strided rows, heads packed
    slots = torch.tensor([7, 0, 3])
    expected.index_copy_(0, slots, kv)
    fused.scatter_rows_(store, slots, kv)
    assert torch.equal(store, expected)
    with pytest.raises(IndexError, match="slot 10 is out of range"):
        fused.scatter_rows_(store, torch.tensor([1, 10, 2]), kv)
    half = torch.zeros(10, 2, 8, dtype=torch.float16)  # rounded as .to(torch.float16)
    kv = kv * 1000 + 1e-3  # some values need rounding, some overflow fp16's range
    fused.scatter_rows_(half, slots, kv)
    assert torch.equal(half[slots], kv.to(torch.float16))
    # 20 values a row: 16 eight at a time (F16C) and 4 one at a time; subnormal halves,
    # ties to even and overflow on both paths
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(4, 2, 10, generator=g) * torch.tensor([1e-6, 1.0, 7e4, 1e-8])[:, None, None]
    kv[0, 0, :3] = torch.tensor([2049.0, 2051.0, 65519.0])  # halfway between two halves
    kv[0, 1, 8:] = torch.tensor([2049.0, -65520.0])
    half = torch.zeros(6, 2, 10, dtype=torch.float16)
    fused.scatter_rows_(half, torch.tensor([5, 1, 0, 2]), kv)
    assert torch.equal(half[torch.tensor([5, 1, 0, 2])], kv.to(torch.float16))


@needs_c
def test_argmax_is_torch_argmax_with_ties_nan_and_inf():
    from kvlab.kernels import fused

    x = torch.randn(7, 1003)
    x[1, 10] = x[1, 900] = 50.0  # a tie: the first index wins
    x[2, 500] = x[2, 20] = float("nan")  # NaN counts as the largest, the first one
    x[3] = -float("inf")
    x[4, -1] = float("inf")
    x[5, 1002] = 60.0  # in the scalar tail
    assert torch.equal(fused.argmax(x), x.argmax(dim=-1))
    assert torch.equal(fused.argmax(x[:, :3].contiguous()), x[:, :3].argmax(dim=-1))


@needs_c
def test_attend_decode_checks_slots():
    from kvlab.kernels import fused

    k = torch.randn(8, 1, 16)
    with pytest.raises(IndexError, match="slot 8 is out of range"):
        fused.attend_decode(torch.randn(1, 2, 16), k, k, torch.tensor([[0, 8]]), 0.25)


def test_q8_0_paths_with_and_without_vnni_agree(tmp_path):
    """The maddubs path (CPUs without AVX512-VNNI) gives the same bits as the VNNI path (this
    CPU's, or emulated where it has none and `make emu512` built it),
    for Q8_0 and for the 8-row groups of Q8_0, Q5_0, Q4_K, Q6_K, Q5_K, IQ4_XS, Q2_K and Q3_K;
    40 x rows take the byte-row paths of Q2_K and Q3_K with VNNI, and from 13 x rows IQ4_XS
    takes its int16 panels without."""
    import pickle

    from kvlab.kernels import group_rows

    xs = tmp_path / "random_blocks.pkl"  # types kvlab has no quantizer for
    xs.write_bytes(pickle.dumps([group_rows(make_weight(t, 16, 512, seed=1))
                                 for t in (T.IQ4_XS, T.Q2_K, T.Q3_K)]))

    script = (
        "import pickle, torch, sys\n"
        "from gguf import GGMLQuantizationType as T\n"
        "from kvlab.kernels import group_rows, qmatmul, quantize\n"
        "g = torch.Generator().manual_seed(0)\n"
        "w = quantize(torch.randn(67, 320, generator=g), T.Q8_0)\n"
        "w8 = group_rows(quantize(torch.randn(64, 320, generator=g), T.Q8_0))\n"
        "w5 = group_rows(quantize(torch.randn(64, 320, generator=g), T.Q5_0))\n"
        "k8 = [group_rows(quantize(torch.randn(16, 512, generator=g), t)) for t in (T.Q4_K, T.Q6_K, T.Q5_K)]\n"
        "k8 += pickle.loads(open(sys.argv[2], 'rb').read())\n"
        "x, xk = torch.randn(13, 320, generator=g), torch.randn(40, 512, generator=g)\n"
        "torch.save([qmatmul(x[:n].contiguous(), v) for n in (1, 4, 8, 13) for v in (w, w8, w5)]\n"
        "           + [qmatmul(xk[:n].contiguous(), v) for n in (1, 13, 21, 40) for v in k8], sys.argv[1])\n")
    outs = outputs_on_every_path(script, tmp_path, str(xs))
    for out in outs[1:]:
        assert len(out) == len(outs[0]) > 0
        for a, b in zip(outs[0], out):
            assert torch.equal(a, b)


@pytest.mark.skipif(not ISAS, reason="C extension not built")
def test_backend_detail_names_the_vnni_paths_this_cpu_takes():
    """Reports say 'AVX512-VNNI paths' exactly where the AVX2 set takes them: a CPU with
    AVX512-VNNI, VL and BW, unless KVLAB_NO_VNNI is set; 'VBMI value planes' where it also has
    AVX512-VBMI, unless KVLAB_NO_VBMI is set (the emulated test build takes both on any
    CPU); the portable set never does either."""
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":")[1].split() for line in f if line.startswith("flags")), [])
    emulated = bool(os.environ.get("KVLAB_EMULATE_512"))  # every AVX-512 path, as AVX2 code
    vnni = ((emulated or {"avx512_vnni", "avx512vl", "avx512bw"} <= set(flags))
            and not os.environ.get("KVLAB_NO_VNNI"))
    vbmi = vnni and (emulated or "avx512vbmi" in flags) and not os.environ.get("KVLAB_NO_VBMI")
    try:
        for isa in ISAS:
            ops._qk.set_isa(isa)
            detail = ops.kernel_backend_detail()
            avx2 = ops.kernel_backend() == "avx2"
            assert detail.startswith(ops.kernel_backend())
            assert ("AVX512-VNNI" in detail) == (vnni and avx2), detail
            assert ("VBMI value planes" in detail) == (vbmi and avx2), detail
    finally:
        ops._qk.set_isa("auto")
