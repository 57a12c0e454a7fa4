"""IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS and IQ3_S (kernels/csrc/qk_iq2_iq3.c, and the value
planes of kernels/csrc/qk_iq_planes.c) against gguf's dequantizer, on every path.

test_kernels.py runs its per-type checks (dequantize, qmatmul's error bound, exactness on the
8-bit activations, AVX2 against portable C, batch invariance) over SUPPORTED_TYPES, these
five included. Here: the grids are gguf's, blocks that reach every grid row, sign pattern and
scale, fp16 scales of every kind, AVX2 and portable C to the bit, a GGUF file, and the error
for a type kvlab still lacks.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from kernel_paths import outputs_on_every_path
from test_kernels import (
    ISAS,
    assert_blocks_equal,
    backend,  # noqa: F401 (fixture)
    reference_dequant,
)
from test_kernels_iq4 import assert_read_in_place

from kvlab.kernels import SUPPORTED_TYPES, QuantizedWeight, dequantize, ops, qmatmul
from kvlab.kernels.grids import GRID_TYPES, grid
from kvlab.kernels.qweight import row_bytes

T = GGMLQuantizationType
ids = lambda t: t.name
# grid rows and the values a row's entries take, per type (gguf's definition)
GRIDS = {T.IQ2_XXS: (256, 8, {8, 25, 43}), T.IQ2_XS: (512, 8, {8, 25, 43}),
         T.IQ2_S: (1024, 8, {8, 25, 43}), T.IQ3_XXS: (256, 4, {4, 12, 20, 28, 36, 44, 52, 62}),
         T.IQ3_S: (512, 4, {1, 3, 5, 7, 9, 11, 13, 15})}


def random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int,
                  d: np.ndarray | None = None) -> QuantizedWeight:
    """Random bytes (every byte pattern is a valid block of these types) under fp16 d."""
    g = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = g.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    if d is None:
        d = g.uniform(0.001, 0.02, len(blocks))
    blocks[:, :2] = np.resize(d, len(blocks)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return QuantizedWeight(qtype, (rows, cols), torch.from_numpy(blocks.reshape(rows, -1)))


def test_grids_are_gguf_s():
    for qtype, (rows, width, values) in GRIDS.items():
        g = grid(qtype)
        assert g.shape == (rows, width) and g.dtype == np.uint8
        assert set(np.unique(g).tolist()) == values
        assert len(np.unique(g, axis=0)) == rows  # every row its own point
    with pytest.raises(ValueError, match="IQ4_NL has no lattice grid"):
        grid(T.IQ4_NL)


@pytest.mark.parametrize("qtype", GRID_TYPES, ids=ids)
def test_dequantize_reaches_every_grid_row_and_scale(qtype, backend):  # noqa: F811
    """2048 random super-blocks (about 260k grid lookups, every index, sign byte and 4-bit
    scale many times) under fp16 d of every kind: negative, subnormal, zero, large."""
    d = np.array([0.01, -0.003, 3e-6, 0.0, 2.5, -1000.0, 6e-8, 0.02])
    w = random_blocks(qtype, 16, 256 * 128, seed=int(qtype), d=d)
    assert_blocks_equal(dequantize(w).numpy(), reference_dequant(w), qtype)


def portable_and_simd(x: torch.Tensor, w: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """qmatmul(x, w) on the portable C, then on the AVX2 set (with the AVX-512 paths it takes
    on this CPU)."""
    try:
        ops._qk.set_isa("generic")
        y_c = qmatmul(x, w)
        ops._qk.set_isa("avx2")
        return y_c, qmatmul(x, w)
    finally:
        ops._qk.set_isa("auto")


@pytest.mark.skipif("avx2" not in ISAS, reason="no AVX2 on this CPU")
@pytest.mark.parametrize("qtype", GRID_TYPES, ids=ids)
def test_avx2_products_are_the_portable_bits(qtype):
    """The AVX2 kernels decode with vector lookups to the same integers and take the same
    float steps as the portable C, for one x row and for tiles of them."""
    w = random_blocks(qtype, 13, 1280, seed=3)
    x = torch.randn(11, 1280, generator=torch.Generator().manual_seed(4))
    y_c, y = portable_and_simd(x, w)
    assert torch.equal(y, y_c)
    assert torch.equal(portable_and_simd(x[3:4], w)[1], y[3:4])


@pytest.mark.skipif("avx2" not in ISAS, reason="no AVX2 on this CPU")
@pytest.mark.parametrize("qtype", GRID_TYPES, ids=ids)
@pytest.mark.parametrize("n", [8, 9, 14, 15])
def test_avx2_prefill_tiles_are_the_portable_bits(qtype, n):
    """From 8 x rows the AVX2 kernels decode tiles of weight rows once (+64 offset taken off
    through the x block sums): 4096 columns make several tiles over 23 rows, and n leaves a
    last group of 8, 1, 6 or 7 x rows; each row's output is the portable C's and its own
    alone."""
    w = random_blocks(qtype, 23, 4096, seed=7)
    x = torch.randn(n, 4096, generator=torch.Generator().manual_seed(n))
    x[1] *= 1e-3  # another activation scale per row
    y_c, y = portable_and_simd(x, w)
    assert torch.equal(y, y_c)
    assert torch.equal(portable_and_simd(x[-1:], w)[1], y[-1:])


@pytest.mark.skipif("avx2" not in ISAS, reason="no AVX2 on this CPU")
@pytest.mark.parametrize("qtype", GRID_TYPES, ids=ids)
@pytest.mark.parametrize("cols", [1280, 2048])
def test_decode_value_planes_are_the_portable_bits(qtype, cols):
    """With AVX512-VBMI, decode (1 to 7 x rows) of IQ2_XXS, IQ2_XS, IQ3_XXS and IQ3_S looks up
    64 grid rows per value position at once (IQ2_S runs its row kernel): an odd number of
    super-blocks (1280 columns: an IQ2 type's last register holds one) and an even one, x rows
    in passes of 4 and a remainder, every row's output the portable C's. Elsewhere the same
    calls run the row kernels, to the same bits."""
    w = random_blocks(qtype, 21, cols, seed=13)
    x = torch.randn(7, cols, generator=torch.Generator().manual_seed(14))
    x[2] *= 1e-3
    for n in (1, 2, 5, 7):
        y_c, y = portable_and_simd(x[:n], w)
        assert torch.equal(y, y_c), n


@pytest.mark.skipif("avx2" not in ISAS, reason="no AVX2 on this CPU")
def test_every_simd_path_gives_the_same_bits(tmp_path):
    """Decode (1 and 3 x rows), the tiles (9) and the byte rows (40) of every type, and 240 x
    rows of 4096 columns (on the AVX2 path, tiles over x in two chunks), on this CPU's
    paths, the AVX2 one (KVLAB_NO_VNNI), the AVX512-VNNI row kernels without the value planes
    (KVLAB_NO_VBMI) and, where built, the emulated AVX-512 kernels."""
    script = (
        "import sys, torch\n"
        "sys.path.insert(0, sys.argv[2])\n"
        "from test_kernels_iq2_iq3 import GRID_TYPES, random_blocks\n"
        "from kvlab.kernels import qmatmul\n"
        "x = torch.randn(40, 1280, generator=torch.Generator().manual_seed(15))\n"
        "wide = torch.randn(240, 4096, generator=torch.Generator().manual_seed(17))\n"
        "torch.save([qmatmul(x[:n].contiguous(), random_blocks(q, 19, 1280, seed=16))\n"
        "            for q in GRID_TYPES for n in (1, 3, 9, 40)]\n"
        "           + [qmatmul(wide, random_blocks(q, 7, 4096, seed=18)) for q in GRID_TYPES],\n"
        "           sys.argv[1])\n")
    outs = outputs_on_every_path(script, tmp_path, str(Path(__file__).parent),
                                 extra=({"KVLAB_NO_VBMI": "1"},))
    for out in outs[1:]:
        assert len(out) == len(outs[0]) == 5 * len(GRID_TYPES)
        for a, b in zip(outs[0], out):
            assert torch.equal(a, b)


@pytest.mark.skipif("avx2" not in ISAS, reason="no AVX2 on this CPU")
@pytest.mark.parametrize("qtype", GRID_TYPES, ids=ids)
def test_prefill_byte_rows_are_the_portable_bits(qtype):
    """From 32 x rows the AVX512-VNNI kernels decode 16 weight rows at a time into byte rows
    (x of 300 rows at 4096 columns is two passes; of 37 rows, 32 are two such 16, the last 5
    run through the tiles): every row's output is the portable C's and its own
    alone. Without AVX512-VNNI the same call runs the AVX2 tiles, to the same bits."""
    w = random_blocks(qtype, 37, 4096, seed=11)
    x = torch.randn(300, 4096, generator=torch.Generator().manual_seed(12))
    x[5] *= 1e-3
    y_c, y = portable_and_simd(x, w)
    assert torch.equal(y, y_c)
    assert torch.equal(portable_and_simd(x[5:6], w)[1], y[5:6])
    assert torch.equal(portable_and_simd(x[:33], w)[1], y[:33])


@pytest.mark.parametrize("qtype", GRID_TYPES, ids=ids)
def test_products_are_exact_integers_on_8_bit_x(qtype, backend):  # noqa: F811
    """x already on the 8-bit grid the kernels round it to (one scale per 256, integers up
    to 127): the product is the dequantized one up to fp32 rounding."""
    if backend == "torch":
        pytest.skip("the torch path multiplies in fp32 without 8-bit activations")
    w = random_blocks(qtype, 8, 512, seed=5)
    g = torch.Generator().manual_seed(6)
    x = torch.randint(-127, 128, (3, 512), generator=g).float()
    x[:, ::256] = 127.0  # each 256-block's largest value: its scale is 1 exactly
    ref = x.double() @ torch.from_numpy(reference_dequant(w)).double().T
    assert ((qmatmul(x, w).double() - ref).abs() <= 1e-5 * ref.abs().max()).all()


def test_gguf_file_tensors_are_read_in_place(tmp_path):
    made = {f"{t.name.lower()}.weight": random_blocks(t, 3, 512, seed=int(t)) for t in GRID_TYPES}
    assert_read_in_place(made, tmp_path / "iq.gguf")


@pytest.mark.parametrize("qtype", [T.IQ1_S, T.IQ1_M, T.TQ1_0, T.TQ2_0], ids=ids)
def test_types_kvlab_lacks_are_a_clear_error(qtype):
    with pytest.raises(ValueError, match=f"{qtype.name} is not supported .valid: .*IQ3_S"):
        row_bytes(qtype, 256)
    assert qtype not in SUPPORTED_TYPES

