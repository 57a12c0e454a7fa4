"""The lattice grids of GGUF's IQ2 and IQ3 types (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S),
read from the gguf package and handed once to the C kernels (csrc/qk_iq2_iq3.c).

The grids are the output of a search, not of a formula, so kvlab keeps no copy of its own:
gguf's dequantizers, the reference the kernels are checked against, hold them (as hex,
decoded at first use) and these are those values.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

T = GGMLQuantizationType
GRID_TYPES = (T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S)


def grid(qtype: GGMLQuantizationType) -> np.ndarray:
    """uint8 [rows, values per row]: the grid of `qtype` (one of GRID_TYPES)."""
    if qtype not in GRID_TYPES:
        names = ", ".join(t.name for t in GRID_TYPES)
        raise ValueError(f"{qtype.name} has no lattice grid (types with one: {names})")
    quant = gguf_quants._type_traits[qtype]
    quant.init_grid()
    return np.ascontiguousarray(quant.grid.reshape(quant.grid_shape).astype(np.uint8))


def load_grids(qk: ModuleType) -> None:
    """Every grid into the C kernels of the extension module `qk`."""
    for qtype in GRID_TYPES:
        values = grid(qtype)
        qk.set_grid(int(qtype), values.ctypes.data, values.nbytes)
