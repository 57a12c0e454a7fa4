"""kvlab.kernels.group_rows: Q8_0 / Q4_0 rows as Q8_0x8, and Q5_0, Q4_K, Q5_K, Q6_K, Q2_K,
Q3_K, IQ4_XS and IQ4_NL
rows as Q4_Kx8 etc., interleaved in groups of 8.

The values must be exactly those of the GGUF blocks, and a product must give the same bits
on every kernel path (AVX512-VNNI, AVX2 maddubs, portable C) and for any number of x rows.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from gguf import GGMLQuantizationType as T
from test_kernels import make_weight

from kvlab.kernels import (
    QuantizedWeight,
    can_group,
    dequantize,
    dequantize_rows,
    group_rows,
    ops,
    qmatmul,
    quantize,
)

pytestmark = pytest.mark.skipif(ops._qk is None, reason="C extension not built")
GROUPABLE = [T.Q8_0, T.Q5_0, T.Q4_0, T.Q4_K, T.Q5_K, T.Q6_K, T.Q2_K, T.Q3_K, T.IQ4_XS,
             T.IQ4_NL]
SELF_GROUPED = (T.Q4_K, T.Q5_K, T.Q6_K, T.Q2_K, T.Q3_K, T.IQ4_XS, T.IQ4_NL, T.Q5_0)  # as themselves
NO_QUANTIZER = (T.Q2_K, T.Q3_K, T.IQ4_XS, T.IQ4_NL)


def weight(qtype: T, rows: int = 48, cols: int = 0, seed: int = 0) -> QuantizedWeight:
    """cols: 224 (7 blocks) by default, 768 (3 super-blocks) for 256-element blocks; types
    kvlab cannot quantize to as random blocks"""
    cols = cols or (224 if qtype in (T.Q8_0, T.Q5_0, T.Q4_0, T.IQ4_NL) else 768)
    if qtype in NO_QUANTIZER:
        return make_weight(qtype, rows, cols, seed=seed)
    g = torch.Generator().manual_seed(seed)
    return quantize(torch.randn(rows, cols, generator=g), qtype)


def isas() -> list[str]:
    try:
        ops._qk.set_isa("avx2")
        return ["generic", "avx2"]
    except ValueError:
        return ["generic"]
    finally:
        ops._qk.set_isa("auto")


@pytest.mark.parametrize("qtype", GROUPABLE, ids=lambda t: t.name)
def test_grouped_values_are_the_gguf_values(qtype):
    w = weight(qtype)
    g = group_rows(w)
    kind = qtype if qtype in SELF_GROUPED else T.Q8_0
    assert g.grouped and g.qtype == kind and g.shape == w.shape
    # each its own size; Q8_0's
    per_block = {T.Q4_K: 144 / 256, T.Q5_K: 176 / 256, T.Q6_K: 210 / 256, T.Q2_K: 84 / 256,
                 T.Q3_K: 110 / 256, T.IQ4_XS: 136 / 256,
                 T.IQ4_NL: 18 / 32, T.Q5_0: 22 / 32}.get(qtype, 34 / 32)
    assert g.nbytes == w.out_features * w.in_features * per_block
    assert torch.equal(dequantize(g), dequantize(w))
    ids = torch.tensor([[0, 7, 8], [47, 40, 13]])
    assert torch.equal(dequantize_rows(g, ids), dequantize(w)[ids])


@pytest.mark.parametrize("qtype", GROUPABLE, ids=lambda t: t.name)
def test_grouped_product_is_the_plain_kernels_dot(qtype):
    """The same 8-bit activations and the same exact int32 block sums as the plain kernel
    of the GGUF type: only the order of the fp32 steps differs."""
    w = weight(qtype, seed=3)
    x = torch.randn(5, w.in_features, generator=torch.Generator().manual_seed(4))
    y, plain = qmatmul(x, group_rows(w)), qmatmul(x, w)
    scale = (x.abs() @ dequantize(w).abs().T).max()
    assert (y - plain).abs().max() <= 1e-5 * scale


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("qtype", [T.Q5_0, T.Q4_K, T.Q5_K, T.Q6_K, T.Q2_K, T.Q3_K, T.IQ4_XS,
                                   T.IQ4_NL], ids=lambda t: t.name)
def test_grouped_product_bits_do_not_depend_on_batch_or_kernel_path(isa, qtype):
    cols = 96 if qtype in (T.Q5_0, T.IQ4_NL) else 768
    # 7 groups: prefill tiles take two groups at a time where they can, then the odd one;
    # n = 1 takes one group at a time
    g = group_rows(weight(qtype, rows=56, cols=cols, seed=5))
    x = torch.randn(21, g.in_features, generator=torch.Generator().manual_seed(6))
    alone = torch.cat([qmatmul(x[j:j + 1], g) for j in range(len(x))])
    try:
        ops._qk.set_isa(isa)
        for n in (1, 2, 7, 8, 9, 16, 21):  # tiles of 8 x rows, then the rest
            assert torch.equal(qmatmul(x[:n], g), alone[:n]), n
    finally:
        ops._qk.set_isa("auto")


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0, T.IQ4_XS], ids=lambda t: t.name)
def test_many_x_rows_go_in_chunks_with_the_same_bits(qtype):
    """More than 2 MiB of quantized x goes in chunks of about 256 KiB against every group: at
    8192 columns 250 rows (2.3 MB) are ten chunks of 24 and one of 10, each row as alone."""
    g = group_rows(weight(qtype, rows=24, cols=8192, seed=8))
    x = torch.randn(250, 8192, generator=torch.Generator().manual_seed(9))
    alone = torch.cat([qmatmul(x[j:j + 1], g) for j in range(len(x))])
    assert torch.equal(qmatmul(x, g), alone)


def test_iq4_xs_prefill_panels_keep_each_rows_bits():
    """AVX2 without VNNI (this CPU's path there, or KVLAB_NO_VNNI in the path test of
    test_kernels.py) takes IQ4_XSx8 from 12 x rows through int16 panels: x rows in
    blocks of 64 (here 70: a block, then tiles of 4 and 2), columns in chunks of 4
    super-blocks (here 5: a chunk, then one); each row as alone, through tile_xs."""
    g = group_rows(weight(T.IQ4_XS, rows=24, cols=1280, seed=12))
    x = torch.randn(70, 1280, generator=torch.Generator().manual_seed(13))
    alone = torch.cat([qmatmul(x[j:j + 1], g) for j in range(len(x))])
    for n in (11, 12, 13, 64, 70):
        assert torch.equal(qmatmul(x[:n], g), alone[:n]), n


def test_threads_split_between_groups():
    """Row ranges handed to the kernel threads start on a group: 1 and 2 threads agree."""
    g = group_rows(weight(T.Q8_0, rows=8 * 600, cols=256, seed=7))  # several 16 KiB units
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(8))
    before = ops.get_num_threads()
    try:
        ops.set_num_threads(1)
        one = qmatmul(x, g)
        ops.set_num_threads(2)
        assert torch.equal(qmatmul(x, g), one)
    finally:
        ops.set_num_threads(before)


@pytest.mark.parametrize("n", [1, 3])
def test_split_product_computes_every_row_once(n):
    """Threads take their parts in chunks (halving ones for one x row): 301 groups (odd, so a
    lone group at the end for several x rows) on 2 threads give each 8-row slice's own
    product, bit for bit, in an output that starts as NaN (a skipped chunk stays NaN)."""
    w = weight(T.Q4_K, rows=8 * 301, cols=512, seed=5)  # 694 KB: parts of many chunks
    x = torch.randn(n, 512, generator=torch.Generator().manual_seed(6))
    slices = [group_rows(QuantizedWeight(T.Q4_K, (8, 512), w.data[r:r + 8]))
              for r in range(0, 8 * 301, 8)]
    before = ops.get_num_threads()
    try:
        ops.set_num_threads(2)
        whole = qmatmul(x, group_rows(w), out=torch.full((n, 8 * 301), float("nan")))
    finally:
        ops.set_num_threads(before)
    assert torch.equal(whole, torch.cat([qmatmul(x, g) for g in slices], dim=1))


def test_what_cannot_be_grouped_says_why():
    assert not can_group(weight(T.Q8_0, rows=44))
    assert not can_group(weight(T.Q5_1, rows=48, cols=256))
    with pytest.raises(ValueError, match="multiple of 8"):
        group_rows(weight(T.Q8_0, rows=44))
    with pytest.raises(ValueError, match="groups of 8"):
        QuantizedWeight(T.Q5_1, (48, 224), quantize(torch.randn(48, 224), T.Q5_1).data,
                        grouped=True)


def q5_0_as_q8_0(w: QuantizedWeight) -> QuantizedWeight:
    """The same values as Q8_0 blocks: Q5_0's scale, its 5-bit values less 16 as int8."""
    b = w.data.view(-1, 22)
    qh = b[:, 2:6].to(torch.int64)
    qh = qh[:, 0] | qh[:, 1] << 8 | qh[:, 2] << 16 | qh[:, 3] << 24
    bit = (qh[:, None] >> torch.arange(32)) & 1
    nib = torch.cat([b[:, 6:] & 0xF, b[:, 6:] >> 4], dim=1).to(torch.int64)
    values = (nib | bit << 4) - 16
    blocks = torch.cat([b[:, :2], values.to(torch.int8).view(torch.uint8)], dim=1)
    return QuantizedWeight(T.Q8_0, w.shape, blocks.reshape(w.out_features, -1).contiguous())


@pytest.mark.parametrize("isa", isas())
def test_q5_0_groups_give_q8_0_groups_bits_at_q5_0s_size(isa):
    w = weight(T.Q5_0)
    as_q8 = q5_0_as_q8_0(w)
    assert torch.equal(dequantize(as_q8), dequantize(w))
    g5, g8 = group_rows(w), group_rows(as_q8)
    assert g5.nbytes == w.data.numel() < g8.nbytes
    try:
        ops._qk.set_isa(isa)
        for n in (1, 3, 11):
            x = torch.randn(n, 224)
            assert torch.equal(qmatmul(x, g5), qmatmul(x, g8))
    finally:
        ops._qk.set_isa("auto")


def test_copies_keep_the_layout():
    for qtype in (T.Q8_0, *SELF_GROUPED):
        g = group_rows(weight(qtype))
        copy = pickle.loads(pickle.dumps(g))
        assert copy.grouped and f"{qtype.name}x8" in repr(copy)
        x = torch.randn(2, g.in_features)
        assert torch.equal(qmatmul(x, copy), qmatmul(x, g))


def test_dense_matmul_tiles_start_on_groups(monkeypatch):
    monkeypatch.setattr(ops, "TILE_ELEMENTS", 224 * 13)  # 13-row tiles round up to 16
    g = group_rows(weight(T.Q8_0))
    x = torch.randn(3, 224)
    assert torch.allclose(ops.dense_matmul(x, g), x @ dequantize(g).T, atol=1e-4)
