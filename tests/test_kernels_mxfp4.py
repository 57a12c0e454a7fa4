"""MXFP4 (gpt-oss's expert type) against gguf's dequantizer, on every kernel path.

A block is one E8M0 exponent byte e and 16 bytes of E2M1 nibbles; gguf dequantizes it to
2^(e - 128) * (the E2M1 value doubled), with e < 2 as fp32 subnormals and no NaN for e = 255
(2^127; the largest values overflow to inf as fp32 does). The kernels are IQ4_NL's on
MXFP4's table and scales (kernels/csrc/qk_iq4.c, qk_group8_iq4.c). test_kernels.py runs its
per-type checks over SUPPORTED_TYPES, MXFP4 among them, test_kernels_iq4.py the prefill
tiles and test_moe.py the C experts on MXFP4 too; here: every exponent, every index, odd
block counts, the 8-row groups (MXFP4x8) on every path, a GGUF file with stacked experts and
a tiny MoE model whose experts are MXFP4.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants
from test_kernels import (
    ISAS,
    assert_blocks_equal,
    backend,  # noqa: F401 (fixture)
    make_weight,
    qmatmul_bound,
    reference_dequant,
)
from test_models import reference_logits, runner_for, step

from kvlab.kernels import (
    SUPPORTED_TYPES,
    QuantizedWeight,
    dequantize,
    dequantize_rows,
    group_rows,
    ops,
    qmatmul,
)
from kvlab.models.loader import LoadOptions, load_model
from kvlab.scheduler import ScheduledSeq
from kvlab.weights.checkpoint import open_checkpoint
from kvlab.weights.gguf_file import GGUFFile

from tiny_models import build, write_gguf

T = GGMLQuantizationType
VALUES = np.array(gguf_quants.MXFP4.kvalues, dtype=np.float32)  # E2M1 values, doubled


def mxfp4_blocks(e: np.ndarray, q: np.ndarray) -> np.ndarray:
    """E8M0 bytes [B] and indices [B, 32] -> MXFP4 blocks [B, 17]: element l in the low
    nibble of byte l, l + 16 in its high nibble."""
    qs = (q[:, :16] | q[:, 16:] << 4).astype(np.uint8)
    return np.concatenate([e.astype(np.uint8)[:, None], qs], 1)


def as_weight(blocks: np.ndarray, rows: int) -> QuantizedWeight:
    return QuantizedWeight(T.MXFP4, (rows, blocks.size // 17 * 32 // rows),
                           torch.from_numpy(blocks.reshape(rows, -1).copy()))


def every_exponent() -> QuantizedWeight:
    """256 blocks, block e with exponent e (0 and 1 subnormal, 127 the unit 0.5, 254 and 255
    overflowing for the larger values), each holding all 16 indices twice in its own order;
    8 rows of 32 blocks"""
    g = np.random.default_rng(0)
    q = np.stack([g.permutation(np.tile(np.arange(16), 2)) for _ in range(256)])
    return as_weight(mxfp4_blocks(np.arange(256), q), rows=8)


def test_block_layout_and_values_are_gguf_s():
    assert GGML_QUANT_SIZES[T.MXFP4] == (32, 17) and T.MXFP4 in SUPPORTED_TYPES
    assert mxfp4_blocks(np.zeros(1), np.zeros((1, 32), int)).shape == (1, 17)
    assert VALUES.tolist() == [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_dequantize_every_exponent_and_index(backend):  # noqa: F811
    w = every_exponent()
    got = dequantize(w).numpy()
    assert_blocks_equal(got, reference_dequant(w), T.MXFP4)
    blocks = got.reshape(256, 32)
    q = w.data.numpy().reshape(256, 17)[:, 1:]
    first = VALUES[q[:, 0] & 0xF]  # element 0 of each block
    assert np.array_equal(blocks[0, 0], np.float32(2.0 ** -128) * first[0])  # subnormal
    assert np.array_equal(blocks[1, 0], np.float32(2.0 ** -127) * first[1])
    assert np.array_equal(blocks[127], VALUES[np.concatenate([q[127] & 0xF, q[127] >> 4])] / 2)
    # e = 255 is 2^127, not NaN, as gguf has it: |v| >= 2 overflows (12 of the 16 indices,
    # each twice); at e = 254 |v| >= 4 does (8 of them)
    assert not np.isnan(got).any()
    assert np.isinf(blocks[255]).sum() == 24 and np.isinf(blocks[254]).sum() == 16


@pytest.mark.parametrize("isa", ISAS)
def test_grouped_rows_keep_every_value(isa):
    w = every_exponent()
    try:
        ops._qk.set_isa(isa)
        g = group_rows(w)
        assert g.grouped and g.qtype == T.MXFP4 and g.nbytes == w.nbytes
        assert g.type_name == "MXFP4x8"
        assert torch.equal(dequantize(g), dequantize(w))
        ids = torch.tensor([[7, 0], [3, 3]])
        assert torch.equal(dequantize_rows(g, ids), dequantize(w)[ids])
        assert torch.equal(dequantize_rows(w, ids), dequantize(w)[ids])
    finally:
        ops._qk.set_isa("auto")


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_random_bytes_dequantize_as_gguf(backend):  # noqa: F811
    """Any byte is a valid block: every exponent and index, at random."""
    g = np.random.default_rng(3)
    w = as_weight(g.integers(0, 256, (24 * 64, 17), dtype=np.uint8), rows=24)
    assert_blocks_equal(dequantize(w).numpy(), reference_dequant(w), T.MXFP4)


def realistic(rows: int, cols: int, seed: int) -> QuantizedWeight:
    """Random indices with exponents around 1 (0.5 to 2^8): a weight's range, finite sums"""
    g = np.random.default_rng(seed)
    n = rows * cols // 32
    return as_weight(mxfp4_blocks(g.integers(119, 136, n), g.integers(0, 16, (n, 32))), rows)


@pytest.mark.parametrize("n", [1, 2, 9])
@pytest.mark.parametrize("cols", [32, 96, 2080])
@pytest.mark.parametrize("grouped", [False, True], ids=["rows", "x8"])
def test_qmatmul_within_the_bound_of_the_dequantized_product(cols, n, grouped, backend):  # noqa: F811
    """AVX2 takes two blocks per step: a lone last block; n = 9 takes the tiles"""
    w = realistic(16, cols, seed=cols)
    if grouped and backend == "torch":
        pytest.skip("8-row groups need the C kernels")
    w_ref = torch.from_numpy(reference_dequant(w).copy())
    w = group_rows(w) if grouped else w
    x = torch.randn(n, cols, generator=torch.Generator().manual_seed(n))
    err = (qmatmul(x, w).double() - x.double() @ w_ref.double().T).abs()
    assert (err <= qmatmul_bound(x, w_ref, T.MXFP4, quantized_x=backend != "torch")).all()


@pytest.mark.parametrize("isa", ISAS)
def test_grouped_product_bits_do_not_depend_on_batch_or_path(isa):
    """MXFP4x8: the same exact block integers and fp32 steps on every path (AVX512-VNNI in the
    emulated build, AVX2, portable) and for every batch size; near the plain kernels' dot."""
    w = realistic(56, 96, seed=5)
    g = group_rows(w)
    x = torch.randn(21, 96, generator=torch.Generator().manual_seed(6))
    alone = torch.cat([qmatmul(x[j:j + 1], g) for j in range(len(x))])
    try:
        ops._qk.set_isa(isa)
        for n in (1, 2, 7, 8, 9, 16, 21):
            assert torch.equal(qmatmul(x[:n], g), alone[:n]), n
        plain = qmatmul(x, w)
    finally:
        ops._qk.set_isa("auto")
    assert (alone - plain).abs().max() <= 1e-5 * (x.abs() @ dequantize(w).abs().T).max()


def test_largest_sums_stay_exact():
    """Every weight -12 at the same scale, x all 127 after rounding: the int16 pairs of the
    AVX2 path and the unsigned bytes of VNNI's stay exact, grouped as in rows."""
    w = as_weight(mxfp4_blocks(np.full(16 * 16, 127), np.full((16 * 16, 32), 15)), rows=16)
    x = torch.ones(3, 512)
    expected = torch.full((3, 16), -6.0 * 512)
    assert torch.equal(qmatmul(x, w), expected)
    assert torch.equal(qmatmul(x, group_rows(w)), expected)


def test_quantize_is_gguf_s():
    t = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    w = ops.quantize(t, T.MXFP4)
    assert np.array_equal(w.data.numpy().reshape(-1),
                          gguf_quants.quantize(t.numpy(), T.MXFP4).reshape(-1))


def test_stacked_experts_in_a_gguf_file(tmp_path):
    """A [experts, out, in] MXFP4 tensor, as gpt-oss stores its experts: read in place, its
    rows flattened, each expert's slice dequantized as gguf does"""
    x = np.random.default_rng(2).standard_normal((4, 16, 64), dtype=np.float32)
    blocks = gguf_quants.quantize(x, T.MXFP4)
    path = tmp_path / "mxfp4.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    writer.add_tensor("blk.0.ffn_down_exps.weight", blocks, raw_dtype=T.MXFP4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    file = GGUFFile(path)
    w = QuantizedWeight.from_gguf(file, "blk.0.ffn_down_exps.weight")
    assert w.qtype == T.MXFP4 and w.shape == (64, 64)
    assert w.data.data_ptr() == file.raw("blk.0.ffn_down_exps.weight").ctypes.data
    ref = gguf_quants.dequantize(blocks, T.MXFP4).reshape(64, 64)
    assert np.array_equal(dequantize(w).numpy(), ref)
    expert = QuantizedWeight(T.MXFP4, (16, 64), w.data[16:32])
    assert np.array_equal(dequantize(expert).numpy(), ref[16:32])


def test_grouping_is_refused_with_the_types_it_takes():
    w = make_weight(T.Q4_1, 8, 64)
    with pytest.raises(ValueError, match="MXFP4"):
        group_rows(w)


def test_a_moe_model_with_mxfp4_experts_from_gguf(tmp_path):
    """A tiny Qwen3-MoE whose stacked experts a GGUF file holds in MXFP4 (the others F32):
    the loader keeps them as MXFP4x8 groups run by the one-call C experts, and the logits
    follow transformers' on the unquantized weights."""
    hf = build("qwen3moe", tmp_path)
    path = tmp_path / "mxfp4.gguf"
    write_gguf("qwen3moe", hf, path, quantize=T.MXFP4)
    experts = load_model(open_checkpoint(path), LoadOptions()).model.layers[0]["experts"]
    assert {w.type_name for w in experts.down} == {"MXFP4x8"} and experts.c_table is not None
    ids = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    got = step(runner_for(path), ScheduledSeq("a", 0, ids, [0, 1, 2], True, 12))[0]
    cos = torch.nn.functional.cosine_similarity(got, reference_logits(hf, ids)[-1], dim=0)
    assert cos > 0.999
