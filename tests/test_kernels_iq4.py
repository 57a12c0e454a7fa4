"""IQ4_NL and IQ4_XS (kernels/csrc/qk_iq4.c) against gguf's dequantizer, on every path.

test_kernels.py runs its per-type checks (dequantize, qmatmul's error bound, exactness on
the 8-bit activations, AVX2 against portable C, batch invariance) over SUPPORTED_TYPES,
these two included. Here: blocks that reach every table entry and every IQ4_XS scale, odd
block counts, the prefill tiles at model-sized rows, NaN and inf, and a GGUF file.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from kvlab.kernels import QuantizedWeight, dequantize, dequantize_rows, ops, qmatmul, quantize
from tests.test_kernels import (
    ISAS,
    assert_blocks_equal,
    backend,  # noqa: F401 (fixture)
    make_weight,
    qmatmul_bound,
    reference_dequant,
)

T = GGMLQuantizationType
IQ4 = (T.IQ4_NL, T.IQ4_XS)
VALUES = np.array(gguf_quants.IQ4_NL.kvalues, dtype=np.float32)
ids = lambda t: t.name


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """[..., 32] indices -> [..., 16] bytes: element l in the low nibble of byte l, l + 16
    in its high nibble."""
    return (q[..., :16] | q[..., 16:] << 4).astype(np.uint8)


def iq4_nl_blocks(d: np.ndarray, q: np.ndarray) -> np.ndarray:
    """fp16 scales [B] and indices [B, 32] -> IQ4_NL blocks [B, 18]."""
    return np.concatenate([d.astype(np.float16).view(np.uint8).reshape(-1, 2), pack_nibbles(q)], 1)


def iq4_xs_blocks(d: np.ndarray, scales: np.ndarray, q: np.ndarray) -> np.ndarray:
    """fp16 d [B], 6-bit scales [B, 8] (stored, before the -32), indices [B, 256] -> [B, 136]."""
    lo, hi = scales & 0xF, scales >> 4
    scales_l = (lo[:, 0::2] | lo[:, 1::2] << 4).astype(np.uint8)
    scales_h = sum(hi[:, s].astype(np.uint16) << (2 * s) for s in range(8)).astype(np.uint16)
    qs = pack_nibbles(q.reshape(-1, 8, 32)).reshape(-1, 128)
    return np.concatenate([d.astype(np.float16).view(np.uint8).reshape(-1, 2),
                           scales_h.view(np.uint8).reshape(-1, 2), scales_l, qs], 1)


def as_weight(qtype: GGMLQuantizationType, blocks: np.ndarray, rows: int) -> QuantizedWeight:
    cols = blocks.size // GGML_QUANT_SIZES[qtype][1] * GGML_QUANT_SIZES[qtype][0] // rows
    return QuantizedWeight(qtype, (rows, cols), torch.from_numpy(blocks.reshape(rows, -1).copy()))


def test_block_layouts_have_the_file_sizes():
    assert GGML_QUANT_SIZES[T.IQ4_NL] == (32, 18) and GGML_QUANT_SIZES[T.IQ4_XS] == (256, 136)
    assert iq4_nl_blocks(np.ones(1), np.zeros((1, 32), int)).shape == (1, 18)
    assert iq4_xs_blocks(np.ones(1), np.zeros((1, 8), int), np.zeros((1, 256), int)).shape == (1, 136)


def test_iq4_nl_dequantize_every_index(backend):  # noqa: F811
    """Each block holds all 16 indices twice, in a different order per block; scales
    include negative, tiny (subnormal fp16) and zero."""
    g = np.random.default_rng(0)
    q = np.stack([g.permutation(np.tile(np.arange(16), 2)) for _ in range(8)])
    d = np.array([0.01, -0.003, 1e-6, 0.0, 2.5, 0.0007, -1.0, 0.02])
    w = as_weight(T.IQ4_NL, iq4_nl_blocks(d, q), rows=2)
    expected = (d.astype(np.float16).astype(np.float32)[:, None] * VALUES[q]).reshape(2, -1)
    got = dequantize(w).numpy()
    assert_blocks_equal(got, reference_dequant(w), T.IQ4_NL)
    assert_blocks_equal(got, expected, T.IQ4_NL)


def test_iq4_xs_dequantize_every_scale(backend):  # noqa: F811
    """Eight super-blocks whose 64 sub-blocks take each 6-bit scale once: the split of the
    scales over scales_l and scales_h, and the -32."""
    g = np.random.default_rng(1)
    scales = g.permutation(64).reshape(8, 8)
    q = g.integers(0, 16, (8, 256))
    d = np.array([0.01, -0.002, 1e-6, 0.5, 0.003, 0.0, 0.0001, -0.04])
    w = as_weight(T.IQ4_XS, iq4_xs_blocks(d, scales, q), rows=4)
    dl = d.astype(np.float16).astype(np.float32)[:, None] * (scales - 32).astype(np.float32)
    expected = (np.repeat(dl, 32, axis=1) * VALUES[q]).reshape(4, -1)
    got = dequantize(w).numpy()
    assert_blocks_equal(got, reference_dequant(w), T.IQ4_XS)
    assert_blocks_equal(got, expected, T.IQ4_XS)
    assert torch.equal(dequantize_rows(w, torch.tensor([3, 0])), dequantize(w)[[3, 0]])


@pytest.mark.parametrize("qtype", IQ4, ids=ids)
def test_dequantize_random_blocks_match_gguf(qtype, backend):  # noqa: F811
    w = make_weight(qtype, 16, 2048, seed=4)
    assert_blocks_equal(dequantize(w).numpy(), reference_dequant(w), qtype)


@pytest.mark.parametrize("n", [1, 2, 9])
@pytest.mark.parametrize("qtype, cols", [(T.IQ4_NL, 32), (T.IQ4_NL, 96), (T.IQ4_NL, 2080),
                                         (T.IQ4_XS, 256), (T.IQ4_XS, 1280)], ids=str)
def test_qmatmul_odd_block_counts(qtype, cols, n, backend):  # noqa: F811
    """IQ4_NL goes two blocks per step on AVX2: a lone last block; n = 9 takes the tiles."""
    w = make_weight(qtype, 7, cols, seed=cols)
    x = torch.randn(n, cols, generator=torch.Generator().manual_seed(n))
    w_ref = torch.from_numpy(reference_dequant(w).copy())
    err = (qmatmul(x, w).double() - x.double() @ w_ref.double().T).abs()
    assert (err <= qmatmul_bound(x, w_ref, qtype, quantized_x=backend != "torch")).all()


@pytest.mark.skipif("avx2" not in ISAS, reason="no AVX2 on this CPU")
@pytest.mark.parametrize("qtype", [*IQ4, T.MXFP4], ids=ids)  # MXFP4: IQ4_NL's kernels
def test_prefill_tiles_match_portable_c_and_one_row(qtype):
    """Model-sized rows (a few per tile) with 40 x rows: the tiled AVX2 path against the
    portable kernels, and each row bit-identical to its batch-1 product."""
    w = make_weight(qtype, 37, 4096, seed=9)
    x = torch.randn(40, 4096, generator=torch.Generator().manual_seed(5))
    try:
        ops._qk.set_isa("generic")
        y_c = qmatmul(x, w)
        ops._qk.set_isa("avx2")
        y = qmatmul(x, w)
        alone = torch.cat([qmatmul(x[j : j + 1], w) for j in (0, 17, 39)])
    finally:
        ops._qk.set_isa("auto")
    tol = 1e-5 * (x.abs() @ dequantize(w).abs().T) + 1e-6
    assert ((y - y_c).abs() <= tol).all()
    assert torch.equal(y[[0, 17, 39]], alone)


@pytest.mark.parametrize("qtype", IQ4, ids=ids)
def test_no_quantizer_is_a_clear_error(qtype):
    with pytest.raises(ValueError, match=f"no quantizer for {qtype.name}"):
        quantize(torch.randn(2, 256), qtype)


def test_gguf_file_tensors_are_read_in_place(tmp_path):
    """IQ4 tensors from a GGUF file: zero-copy views of the map, dequantized as gguf does."""
    made = {"a.weight": make_weight(T.IQ4_NL, 6, 64), "b.weight": make_weight(T.IQ4_XS, 3, 512)}
    assert_read_in_place(made, tmp_path / "iq4.gguf")


def assert_read_in_place(made: dict[str, QuantizedWeight], path) -> None:
    """`made` written to a GGUF file at `path` and read back: zero-copy views of the map,
    dequantized as gguf does."""
    import gguf

    from kvlab.weights.gguf_file import GGUFFile

    writer = gguf.GGUFWriter(str(path), "llama")
    for name, w in made.items():
        writer.add_tensor(name, w.data.numpy(), raw_dtype=w.qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    file = GGUFFile(path)
    for name, w in made.items():
        got = QuantizedWeight.from_gguf(file, name)
        assert got.qtype == w.qtype and got.shape == w.shape
        assert got.data.data_ptr() == file.raw(name).ctypes.data
        assert np.array_equal(dequantize(got).numpy(), reference_dequant(w))


@pytest.mark.parametrize("qtype", IQ4, ids=ids)
def test_grouped_rows_at_the_int16_limit(qtype):
    """8-row groups (IQ4_XSx8, IQ4_NLx8): every weight -127 (index 0) at the largest scales,
    x all 127 after rounding, so each maddubs pair reaches 2 * 127 * 127; the sums stay exact
    on every path, as the file layout's kernels compute them."""
    rows, cols = 16, 512
    q = np.zeros((rows * cols // 32, 32), int)
    if qtype == T.IQ4_XS:
        scales = np.where(np.arange(rows * cols // 256 * 8) % 2, 0, 63).reshape(-1, 8)
        blocks = iq4_xs_blocks(np.full(len(scales), 0.01), scales, q.reshape(-1, 256))
    else:
        blocks = iq4_nl_blocks(np.full(len(q), 0.01), q)
    w = as_weight(qtype, blocks, rows)
    x = torch.ones(3, cols)
    plain = qmatmul(x, w)
    g = ops.group_rows(w)
    for isa in ISAS:
        try:
            ops._qk.set_isa(isa)
            assert torch.allclose(qmatmul(x, g), plain, rtol=1e-6, atol=0), isa
        finally:
            ops._qk.set_isa("auto")
