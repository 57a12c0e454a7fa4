"""The packed-product kernels (kvlab.gpu.quant_matmul) compiled for sm_90 (H100/H200) by
Triton's compiler and the ptxas its wheel ships, no GPU needed: the interpreter runs the
kernels' arithmetic (test_triton_quant.py) but not Triton's type checks, layouts and code
generation, which only a compile reaches. The compile runs in a subprocess without the
session's TRITON_INTERPRET (conftest), under which the kernels are interpreted functions.
"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

if find_spec("triton") is None or find_spec("triton.backends.nvidia") is None:
    pytest.skip("triton with its CUDA backend is not installed", allow_module_level=True)

# every packed type through each product kernel, in the shapes the dispatch launches
SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvlab.gpu import quant_matmul as qm

PLANES = {f"p{i}": "*u8" for i in range(6)} | {"lut": "*fp32"}
SHAPES = {"M": "i32", "N": "i32", "K": "i32"}


def compile_(fn, sig, consts, **options):
    sig = dict(sig) | {name: "constexpr" for name in consts}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts)
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


for qt in sorted(qm._CODES.values()):
    compile_(qm._gemv_kernel, {"x_ptr": "*bf16", "y_ptr": "*bf16", "K_CHUNK": "i32"} | SHAPES
             | PLANES, {"QT": qt, "BLOCK_N": 32, "M_PAD": 8, "STEPS": 8}, num_warps=8)
    for x in ("bf16", "fp32"):  # tensor-core dots, and IEEE fp32 ones
        io = {"x_ptr": f"*{x}", "y_ptr": f"*{x}"}
        compile_(qm._gemm_kernel, io | SHAPES | PLANES,
                 {"QT": qt, "BLOCK_M": 128 if x == "bf16" else 16,
                  "BLOCK_N": 128 if x == "bf16" else 64, "STEPS": 1, "WIDEN": False},
                 num_warps=8 if x == "bf16" else 4)
    compile_(qm._dequant_kernel, {"ids_ptr": "*i64", "out_ptr": "*fp32", "n": "i32",
                                  "K": "i32"} | PLANES, {"QT": qt, "BLOCK_N": 32},
             enable_fp_fusion=False)
    print("compiled", qt)
"""


def test_every_packed_type_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # the launches set it; silences Triton's warning
    out = subprocess.run([sys.executable, "-c", SCRIPT], check=False, env=env,
                         capture_output=True, text=True, timeout=900,
                         cwd=Path(__file__).parent.parent)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.split("\n")[:-1] == [f"compiled {qt}" for qt in range(8)]
