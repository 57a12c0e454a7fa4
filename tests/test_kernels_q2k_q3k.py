"""Q2_K and Q3_K beyond the type-parametrized tests of test_kernels.py: the corners of the
block formats, the largest integer sums the AVX2 kernels form, the prefill tiles at their
edges, and the loader taking the types. Each of these holds for the 8-row groups (Q2_Kx8,
Q3_Kx8) too.

gguf has no quantizer for either type, so blocks are random bytes with sane fp16 scales
(every byte pattern is a valid block), plus hand-made extreme ones.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from test_kernels import (
    ISAS,
    assert_blocks_equal,
    backend,  # noqa: F401 (fixture)
    make_weight,
    qmatmul_bound,
    reference_dequant,
)

from kvlab.kernels import (
    QuantizedWeight,
    dequantize,
    dequantize_rows,
    get_num_threads,
    group_rows,
    ops,
    qmatmul,
    set_num_threads,
)

T = GGMLQuantizationType
K23 = [T.Q2_K, T.Q3_K]
needs_c = pytest.mark.skipif(ops._qk is None, reason="C extension not built")


def from_blocks(qtype: GGMLQuantizationType, blocks: np.ndarray, rows: int) -> QuantizedWeight:
    block, size = GGML_QUANT_SIZES[qtype]
    assert blocks.shape[1] == size and len(blocks) % rows == 0
    cols = len(blocks) // rows * block
    data = torch.from_numpy(np.ascontiguousarray(blocks.reshape(rows, -1)))
    return QuantizedWeight(qtype, (rows, cols), data)


def set_half(blocks: np.ndarray, offset: int, values) -> None:
    """fp16 `values` (one per block, or one for all) into bytes [offset, offset + 2)."""
    v = np.broadcast_to(np.asarray(values, np.float16), (len(blocks),))
    blocks[:, offset:offset + 2] = np.ascontiguousarray(v).view(np.uint8).reshape(-1, 2)


D_OFFSET = {T.Q2_K: 80, T.Q3_K: 108}  # Q2_K's dmin follows its d


def corner_blocks(qtype: GGMLQuantizationType) -> np.ndarray:
    """Blocks with every byte 0x00, 0xFF, 0x55, 0xAA, one bit set, and odd fp16 scales
    (negative, zero, subnormal, large)."""
    size = GGML_QUANT_SIZES[qtype][1]
    patterns = [0x00, 0xFF, 0x55, 0xAA, 0x01, 0x80, 0x0F, 0xF0]
    blocks = np.stack([np.full(size, p, np.uint8) for p in patterns])
    blocks = np.concatenate([blocks, blocks])
    d = [0.5, -0.25, 0.0, 6e-8, 1000.0, 1.0, -3.0, 0.125] * 2
    set_half(blocks, D_OFFSET[qtype], d)
    if qtype == T.Q2_K:
        set_half(blocks, 82, d[::-1])
    return blocks


# ---------------------------------------------------------------- dequantize


@pytest.mark.parametrize("qtype", K23, ids=lambda t: t.name)
def test_dequantize_corner_blocks_match_gguf(qtype, backend):  # noqa: F811
    w = from_blocks(qtype, corner_blocks(qtype), rows=2)
    assert_blocks_equal(dequantize(w).numpy(), reference_dequant(w), qtype)


@pytest.mark.parametrize("qtype", K23, ids=lambda t: t.name)
def test_each_element_is_read_from_its_own_bits(qtype):
    """One 2-bit field (and for Q3_K one high bit) set at a time: the value lands on
    exactly the element gguf puts it on."""
    size = GGML_QUANT_SIZES[qtype][1]
    qs = 0 if qtype == T.Q2_K else 32
    blocks = []
    for byte in range(64):
        for shift in range(0, 8, 2):
            b = np.zeros(size, np.uint8)
            b[qs + byte] = 1 << shift
            blocks.append(b)
    if qtype == T.Q3_K:
        for byte in range(32):
            for bit in range(8):
                b = np.zeros(size, np.uint8)
                b[byte] = 1 << bit
                blocks.append(b)
    blocks = np.stack(blocks)
    if qtype == T.Q2_K:
        blocks[:, :16] = 0x11  # every scale and min 1
    else:
        blocks[:, 96:108] = 0  # every scale -32
    set_half(blocks, D_OFFSET[qtype], 1.0)
    if qtype == T.Q2_K:
        set_half(blocks, 82, 0.5)
    w = from_blocks(qtype, blocks, rows=len(blocks))
    assert_blocks_equal(dequantize(w).numpy(), reference_dequant(w), qtype)
    if ops._qk is not None:  # each bit moves to its own place in the groups
        assert torch.equal(dequantize(group_rows(w)), dequantize(w))


@needs_c
@pytest.mark.parametrize("qtype", K23, ids=lambda t: t.name)
def test_grouped_corner_blocks_keep_their_values(qtype):
    w = from_blocks(qtype, corner_blocks(qtype), rows=8)  # 2 super-blocks a row
    assert torch.equal(dequantize(group_rows(w)), dequantize(w))


@pytest.mark.parametrize("qtype", K23, ids=lambda t: t.name)
def test_dequantize_rows_reads_single_rows(qtype, backend):  # noqa: F811
    w = make_weight(qtype, 9, 512, seed=4)
    ids = torch.tensor([8, 0, 3])
    assert torch.equal(dequantize_rows(w, ids), torch.from_numpy(reference_dequant(w)[[8, 0, 3]]))


# ---------------------------------------------------------------- qmatmul


@pytest.mark.parametrize("cols", [256, 768, 1280])
@pytest.mark.parametrize("qtype", K23, ids=lambda t: t.name)
def test_qmatmul_odd_super_block_counts(qtype, cols, backend):  # noqa: F811
    w = make_weight(qtype, 11, cols, seed=cols)
    w_ref = torch.from_numpy(reference_dequant(w).copy())
    for n in (1, 9):  # per-pass kernel and prefill tiles
        x = torch.randn(n, cols, generator=torch.Generator().manual_seed(n))
        err = (qmatmul(x, w).double() - x.double() @ w_ref.double().T).abs()
        assert (err <= qmatmul_bound(x, w_ref, qtype, quantized_x=backend != "torch")).all()


def extreme_blocks(qtype: GGMLQuantizationType, count: int) -> np.ndarray:
    """The widest values and scales the formats hold: every 2-bit field 3, Q3_K's high bits
    all set (q = 3, the largest unsigned q + 4) or all clear (q = -1) and its scales -32;
    Q2_K's scales and mins 15."""
    size = GGML_QUANT_SIZES[qtype][1]
    b = np.full((count, size), 0xFF, np.uint8)
    if qtype == T.Q3_K:
        b[1::2, :32] = 0x00
        b[:, 96:108] = 0x00
    set_half(b, D_OFFSET[qtype], 0.01)
    if qtype == T.Q2_K:
        set_half(b, 82, 0.02)
    return b


@needs_c
@pytest.mark.parametrize("qtype", K23, ids=lambda t: t.name)
def test_largest_integer_sums_do_not_saturate(qtype):
    """x at +-max in every position against the largest weights: maddubs's int16 pairs and the
    scaled int32 sums are at their widest. The portable C sums in plain int, so any
    saturation on the AVX2 path shows as a difference."""
    w = from_blocks(qtype, extreme_blocks(qtype, 24), rows=8)  # 3 super-blocks a row
    x = torch.ones(10, w.in_features)
    x[1::2] = -1.0
    x[2, ::3] = -1.0
    w_ref = torch.from_numpy(reference_dequant(w).copy()).double()
    exact = x.double() @ w_ref.T
    for isa, v in itertools.product(ISAS, (w, group_rows(w))):  # the groups' sums too
        ops._qk.set_isa(isa)
        try:
            y = qmatmul(x, v).double()  # 10 rows: the prefill tiles on AVX2
            y1 = qmatmul(x[:3].contiguous(), v).double()
        finally:
            ops._qk.set_isa("auto")
        tol = 1e-5 * (x.double().abs() @ w_ref.abs().T) + 1e-6
        assert ((y - exact).abs() <= tol).all(), isa  # +-1 quantizes exactly to +-127
        assert ((y1 - exact[:3]).abs() <= tol[:3]).all(), isa


@needs_c
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", K23, ids=lambda t: t.name)
def test_wide_rows_are_batch_invariant_across_tiles(qtype, isa):
    """8192-wide rows: a prefill tile holds two weight rows, so 37 rows end in a lone one;
    n around the tile threshold (8) and the four-row passes."""
    w = make_weight(qtype, 37, 8192, seed=8)
    x = torch.randn(19, 8192, generator=torch.Generator().manual_seed(9))
    ops._qk.set_isa(isa)
    try:
        alone = torch.cat([qmatmul(x[j:j + 1], w) for j in range(len(x))])
        for n in (2, 7, 8, 9, 13, 19):
            assert torch.equal(qmatmul(x[:n], w), alone[:n]), n
    finally:
        ops._qk.set_isa("auto")


@needs_c
@pytest.mark.parametrize("qtype", K23, ids=lambda t: t.name)
def test_many_x_rows_through_byte_rows_keep_each_rows_bits(qtype):
    """From 32 x rows (with AVX512-VNNI) each pair of groups is first turned into bytes, once
    per pass over about 1 MiB of x: 56 weight rows are three pairs and a lone group (the
    one-group tile), and 250 x rows at 8192 columns are three passes. Random blocks hold every
    value and scale, Q3_K's -4 x -32 and -4 x 31 (bytes 0 and 252) among them. Every output
    row has the bits it has alone."""
    for rows, cols, n in ((56, 768, 40), (16, 8192, 250)):
        w = group_rows(make_weight(qtype, rows, cols, seed=11))
        x = torch.randn(n, cols, generator=torch.Generator().manual_seed(12))
        alone = torch.cat([qmatmul(x[j:j + 1], w) for j in range(n)])
        assert torch.equal(qmatmul(x, w), alone), (rows, cols)


@needs_c
@pytest.mark.parametrize("qtype", K23, ids=lambda t: t.name)
def test_threads_one_and_two_give_identical_results(qtype):
    w = make_weight(qtype, 1024, 512, seed=3)  # above the single-thread threshold
    x = torch.randn(9, 512)
    before = get_num_threads()
    try:
        set_num_threads(1)
        y1 = qmatmul(x, w)
        set_num_threads(2)
        y2 = qmatmul(x, w)
    finally:
        set_num_threads(before)
    assert torch.equal(y1, y2)


# ---------------------------------------------------------------- the loader


def test_quantize_to_them_says_what_is_valid():
    from kvlab.kernels import quantize

    with pytest.raises(ValueError, match="no quantizer for Q3_K.*Q8_0"):
        quantize(torch.randn(2, 256), T.Q3_K)


def test_loader_takes_the_types():
    from kvlab.models import loader

    assert {"Q2_K", "Q3_K"} <= loader._SUPPORTED
