"""The kernel tests again, on the AVX512-VNNI and 512-bit kernels emulated through SIMDe
(the _qk_emu512 test module, `make emu512`), so those paths are tested on any AVX2 CPU,
not only where AVX-512 runs. Every test in these files checks against a float or gguf
reference or against the AVX2 path's bits."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from kernel_paths import EMULATED_512, emulated_512_built

FILES = ("test_kernels.py", "test_kernels_group8.py", "test_kernels_q2k_q3k.py",
         "test_kernels_iq4.py", "test_kernels_mxfp4.py", "test_kernels_iq2_iq3.py",
         "test_attention_prefill.py", "test_attention_sinks.py", "test_attention_mla.py")


@pytest.mark.skipif(not emulated_512_built(), reason="AVX-512 test module not built: make emu512")
def test_the_kernel_tests_pass_on_the_emulated_avx512_kernels():
    here = Path(__file__).parent
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          *(str(here / f) for f in FILES)],
                         env={**os.environ, **EMULATED_512}, capture_output=True, text=True,
                         check=False)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "passed" in run.stdout and " failed" not in run.stdout
