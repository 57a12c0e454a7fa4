"""Build of kvlab's C kernels (kvlab.kernels._qk); all other metadata is in pyproject.toml.

The AVX2 kernels carry `__attribute__((target("avx2,fma,f16c")))` in the source and are
chosen at run time with __builtin_cpu_supports, so no -march flag is needed and the same
binary runs on any x86-64 (and the portable C path builds everywhere else).
`pip install -e .` or `python setup.py build_ext --inplace` compiles it; if compilation
fails the package still imports and falls back to a (slow) pure numpy/torch path.
"""

from __future__ import annotations

import sys

from setuptools import Extension, setup

CSRC = "kvlab/kernels/csrc"
COMPILE_ARGS = [] if sys.platform == "win32" else [
    "-O3", "-std=gnu11", "-ffp-contract=off",  # no FMA contraction: dequant matches gguf bit-for-bit
    "-fno-strict-aliasing", "-pthread", "-Wall", "-Wno-unused-function",
]

qk = Extension(
    "kvlab.kernels._qk",
    sources=[f"{CSRC}/{name}.c" for name in ("qk_module", "qk_pool", "qk_generic", "qk_avx2",
                                            "qk_quant", "qk_fused", "qk_attn", "qk_x8",
                                            "qk_x8k")],
    depends=[f"{CSRC}/qk.h", f"{CSRC}/qk_dequant.inc"],
    extra_compile_args=COMPILE_ARGS,
    extra_link_args=[] if sys.platform == "win32" else ["-pthread"],
)

setup(ext_modules=[qk])
