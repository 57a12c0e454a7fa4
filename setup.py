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

import os
import sys

from setuptools import Extension, setup

CSRC = "kvlab/kernels/csrc"
COMPILE_ARGS = [] if sys.platform == "win32" else [
    "-O3", "-std=gnu11", "-ffp-contract=off",  # no FMA contraction: dequant matches gguf bit-for-bit
    "-fno-strict-aliasing", "-pthread", "-Wall", "-Wno-unused-function",
]

QK_SOURCES = [f"{CSRC}/{name}.c" for name in (
    "qk_bindings", "qk_decode", "qk_moe", "qk_runtime", "qk_pool", "qk_generic", "qk_avx2",
    "qk_quant", "qk_fused", "qk_attn", "qk_flash", "qk_mla", "qk_q2k_q3k", "qk_iq4",
    "qk_group8_q8_0", "qk_group8_q5_0", "qk_group8_q4k_q6k", "qk_group8_q5k", "qk_group8_q2k_q3k",
    "qk_group8_iq4", "qk_iq2_iq3", "qk_iq_planes", "qk_recurrent", "qk_recurrent_bindings")]
QK_DEPENDS = [f"{CSRC}/{name}" for name in (
    "qk.h", "qk_pool.h", "qk_runtime.h", "qk_moe.h", "qk_decode.h", "qk_mla.h", "qk_avx2.h",
    "qk_zmm.h", "qk_dequant.inc", "qk_emu512.h", "qk_recurrent.h")]
qk = Extension(
    "kvlab.kernels._qk",
    sources=QK_SOURCES,
    depends=QK_DEPENDS,
    extra_compile_args=COMPILE_ARGS,
    extra_link_args=[] if sys.platform == "win32" else ["-pthread"],
)
# Test build (`make emu512`, needs Debian's libsimde-dev): the same kernels as _qk_emu512,
# whose AVX-512 paths run as AVX2 code through SIMDe, so they are checked on any AVX2 CPU.
qk_emu512 = Extension(
    "kvlab.kernels._qk_emu512",
    sources=QK_SOURCES,
    depends=QK_DEPENDS,
    extra_compile_args=COMPILE_ARGS + ["-DKV_EMULATE_512", "-mavx2", "-mfma", "-mf16c", "-Wno-psabi"],
    extra_link_args=["-pthread"],
)

TOK_CSRC = "kvlab/tokenizer/csrc"
tok = Extension(
    "kvlab.tokenizer._tok",
    sources=[f"{TOK_CSRC}/{name}.c" for name in ("tok_module", "tok_tables", "tok_encode")],
    depends=[f"{TOK_CSRC}/tok.h"],
    extra_compile_args=COMPILE_ARGS,
    extra_link_args=[] if sys.platform == "win32" else ["-pthread"],
)

setup(ext_modules=[qk_emu512] if os.environ.get("KVLAB_BUILD_EMU512") else [qk, tok])
