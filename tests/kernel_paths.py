"""The environments under which the C kernels take each of their SIMD paths, for tests that
check every path gives the same bits: this CPU's best, the AVX2 (maddubs) path with
KVLAB_NO_VNNI=1, and, where `make emu512` built the test module, the AVX512-VNNI and 512-bit
kernels emulated as AVX2 code through SIMDe (so they are checked on CPUs without AVX-512)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import torch

EMULATED_512 = {"KVLAB_EMULATE_512": "1"}


def emulated_512_built() -> bool:
    return importlib.util.find_spec("kvlab.kernels._qk_emu512") is not None


def path_envs() -> list[dict[str, str]]:
    envs = [{}, {"KVLAB_NO_VNNI": "1"}]
    return envs + [EMULATED_512] if emulated_512_built() else envs


def outputs_on_every_path(script: str, out_dir: Path, *args: str,
                          extra: tuple[dict[str, str], ...] = ()) -> list:
    """What `script` saves (torch.save to its first argument; `args` follow it) when run under
    each of path_envs() and then each `extra` environment, in that order."""
    outs = []
    for env in [*path_envs(), *extra]:
        path = out_dir / f"out{len(outs)}.pt"
        subprocess.run([sys.executable, "-c", script, str(path), *args], check=True,
                       env={**os.environ, **env})
        outs.append(torch.load(path))
    return outs
