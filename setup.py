"""Build of kvlab's C extensions; all other metadata is in pyproject.toml.

kvlab.kernels._qk holds the CPU kernels, kvlab.tokenizer._tok the GGUF tokenizers.

The AVX2 kernels carry `__attribute__((target("avx2,fma,f16c")))` in the source and are
chosen at run time with __builtin_cpu_supports, so no -march flag is needed and the same
binary runs on any x86-64 (and the portable C path builds everywhere else).
`pip install -e .` or `python setup.py build_ext --inplace` compiles it; if compilation
fails the package still imports and falls back to a (slow) pure numpy/torch path (and to the
pure-Python tokenizers).
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
                                            "qk_x8k", "qk_k23", "qk_iq4", "qk_x8k23",
                                            "qk_iq4x8", "qk_flash", "qk_x8q5", "qk_x8k5", "qk_moe")],
    depends=[f"{CSRC}/qk.h", f"{CSRC}/qk_avx2.h", f"{CSRC}/qk_dequant.inc"],
    extra_compile_args=COMPILE_ARGS,
    extra_link_args=[] if sys.platform == "win32" else ["-pthread"],
)

TOK_CSRC = "kvlab/tokenizer/csrc"
tok = Extension(
    "kvlab.tokenizer._tok",
    sources=[f"{TOK_CSRC}/{name}.c" for name in ("tok_module", "tok_tables", "tok_encode")],
    depends=[f"{TOK_CSRC}/tok.h"],
    extra_compile_args=COMPILE_ARGS,
    extra_link_args=[] if sys.platform == "win32" else ["-pthread"],
)

setup(ext_modules=[qk, tok])
