"""Quantized GGUF files written directly: llama-quantize's per-tensor type plan, random blocks.

The peer benchmarks (bench/quant_peers.py, bench/moe_peers.py) need a file of a given
quant mix with a given shape. llama-quantize makes one from an F16 copy, but that takes an F16
file on disk and minutes per type, and it refuses the IQ1/IQ2 mixes (and, in this llama.cpp,
IQ3_XXS, whose q/k projections are IQ2_S) without an importance matrix. Speed does not depend
on the weights' values, so this module writes the file a quantization would, without one:

  1. `write_gguf(..., sparse=True)`: an F16 skeleton whose tensor data is a hole (names,
     shapes and metadata only);
  2. `quantize_plan`: `llama-quantize --dry-run` on it gives each tensor's ggml type. Where
     the dry run says the mix needs an imatrix, it runs again with a stand-in one (one legacy
     entry; a dry run reads no values from it), since an imatrix changes the plan: without
     one, llama.cpp's IQ3_XXS mix gives ffn_down Q3_K/Q4_K (and a GQA-less attn_v IQ3_S),
     and the plan wanted is the one a real imatrix quantization gets;
  3. `write_gguf(..., types=plan)`: random blocks of each tensor's type (`random_blocks`),
     scaled so the weights' std is about 0.02 as the F16 values' is.
"""

from __future__ import annotations

import functools
import math
import os
import re
import shutil
import struct
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

Tensors = list[tuple[str, tuple[int, ...]]]  # (GGUF name, numpy shape) in file order


class QuantizeFailed(Exception):
    pass


def error_line(output: str) -> str:
    """The line that says what went wrong: kvlab's 'error:' line, else the last line (a
    traceback's exception, llama.cpp's final complaint)."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or ["(no output)"])[0 if errors else -1]


# ---------------------------------------------------------------- random blocks


# Each block type's f16 scale fields (byte offset, multiple of d): where a block also holds a
# min, it is set to cancel the codes' mean (mins and scales are drawn alike), so the weights
# are centred as trained ones are; Q4_1/Q5_1's min is added, not subtracted. The IQ types
# start with their one f16 d; every byte pattern of the rest is a valid set of grid indices,
# signs and 4-bit sub-block scales, and their signs centre the weights.
_SCALES = {"Q4_0": ((0, 1),), "Q4_1": ((0, 1), (2, -7.5)), "Q5_0": ((0, 1),),
           "Q5_1": ((0, 1), (2, -15.5)), "Q8_0": ((0, 1),), "Q2_K": ((80, 1), (82, 1.5)),
           "Q3_K": ((108, 1),), "Q4_K": ((0, 1), (2, 7.5)), "Q5_K": ((0, 1), (2, 15.5)),
           "Q6_K": ((208, 1),), "IQ4_NL": ((0, 1),), "IQ4_XS": ((0, 1),),
           "IQ2_XXS": ((0, 1),), "IQ2_XS": ((0, 1),), "IQ2_S": ((0, 1),),
           "IQ3_XXS": ((0, 1),), "IQ3_S": ((0, 1),)}


def random_blocks(qtype, shape: tuple[int, ...], seed: int, std: float = 0.02) -> np.ndarray:
    """Random `qtype` blocks for a [..., in] tensor as uint8 [..., in / block * bytes]: random
    codes and sub-block scales, the f16 scales set so that the weights' std is about `std`."""
    from gguf import GGML_QUANT_SIZES

    if qtype.name not in _SCALES:
        raise ValueError(f"no random-block layout for {qtype.name}; valid: {sorted(_SCALES)}")
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (*shape[:-1], shape[-1] // block, size), dtype=np.uint8)
    for offset, factor in _SCALES[qtype.name]:
        value = np.float16(_unit_scale(qtype) * std * factor)
        blocks[..., offset:offset + 2] = np.frombuffer(value.tobytes(), np.uint8)
    return blocks.reshape(*shape[:-1], shape[-1] // block * size)


@functools.cache
def _unit_scale(qtype) -> float:
    """The d that makes random `qtype` blocks' weights of std 1 (gguf's dequantizer)."""
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    size = GGML_QUANT_SIZES[qtype][1]
    blocks = np.random.default_rng(0).integers(0, 256, (64, size), dtype=np.uint8)
    for offset, factor in _SCALES[qtype.name]:
        blocks[:, offset:offset + 2] = np.frombuffer(np.float16(factor).tobytes(), np.uint8)
    return 1.0 / float(dequantize(blocks, qtype).std())


# ---------------------------------------------------------------- the writer


def stored_type(name: str, shape: tuple[int, ...], types: dict[str, str] | None,
                is_f32: Callable[[str, tuple[int, ...]], bool]):
    """The tensor's ggml type: from `types` (a plan), else F32 or F16 as the converter
    stores it."""
    from gguf import GGMLQuantizationType

    if types is None:
        return GGMLQuantizationType.F32 if is_f32(name, shape) else GGMLQuantizationType.F16
    return GGMLQuantizationType[types[name].upper()]


def stored_bytes(shape: tuple[int, ...], qtype) -> int:
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    return math.prod(shape) // block * size


def add_file_type(w, ftype: str) -> None:
    """general.file_type (and, quantized, the quantization version) as llama-quantize writes
    them for `ftype` (a llama-quantize type name: F16, Q4_K_M, IQ2_M, ...)."""
    from gguf import LlamaFileType

    w.add_uint32("general.file_type", LlamaFileType[f"MOSTLY_{ftype}"].value)
    if ftype != "F16":
        w.add_uint32("general.quantization_version", 2)


def write_gguf(path: Path, arch: str, add_keys: Callable[[object], None], tensors: Tensors,
               is_f32: Callable[[str, tuple[int, ...]], bool],
               values: Callable[[str, tuple[int, ...], int], np.ndarray],
               types: dict[str, str] | None = None, sparse: bool = False) -> None:
    """Stream `tensors` to `path` one at a time via a .part file (renamed when complete, so an
    interrupted run is never taken for a finished one). `add_keys(writer)` writes the
    metadata; unquantized tensors hold `values(name, shape, seed)`; with `types` (name ->
    ggml type, a plan) the quantized ones hold random blocks. `sparse`: the tensor data is
    left a hole of zeros (no disk, no time), enough for llama-quantize --dry-run."""
    import gguf

    part = path.with_suffix(".part")
    w = gguf.GGUFWriter(str(part), arch)
    add_keys(w)
    specs = [(name, shape, stored_type(name, shape, types, is_f32)) for name, shape in tensors]
    for name, shape, qtype in specs:
        w.add_tensor_info(name, shape, np.dtype(np.float32), stored_bytes(shape, qtype),
                          raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    if sparse:
        size = w.ggml_pad(w.fout[0].tell(), w.data_alignment) + sum(
            w.ggml_pad(stored_bytes(shape, qtype), w.data_alignment) for _, shape, qtype in specs)
        w.close()
        os.truncate(part, size)
    else:
        for seed, (name, shape, qtype) in enumerate(specs):
            w.write_tensor_data(values(name, shape, seed) if qtype.name in ("F16", "F32")
                                else random_blocks(qtype, shape, seed))
        w.close()
    part.rename(path)


# ---------------------------------------------------------------- llama-quantize's plan


_PLAN_LINE = re.compile(r"^\[\s*\d+/\s*\d+\]\s+(\S+)\s+- .*type =\s*(\w+),.*?(?:\((\w+)\))?\s*$")
_NEEDS_IMATRIX = "will require an imatrix"


def quantize_plan(skeleton: Path, ftype: str, llama_bin: Path) -> tuple[dict[str, str], bool]:
    """(tensor name -> the ggml type llama-quantize gives it for `ftype`, whether the mix
    needs an imatrix), from its --dry-run, which reads names and shapes only (a sparse file
    does). A mix that needs an imatrix is planned with a stand-in one."""
    plan, output = _dry_run(skeleton, ftype, llama_bin, None)
    if _NEEDS_IMATRIX not in output:
        return plan, False
    with tempfile.TemporaryDirectory() as tmp:
        imatrix = Path(tmp) / "stand-in.imatrix"
        imatrix.write_bytes(_stand_in_imatrix())
        plan, _ = _dry_run(skeleton, ftype, llama_bin, imatrix)
    return plan, True


def _dry_run(skeleton: Path, ftype: str, llama_bin: Path,
             imatrix: Path | None) -> tuple[dict[str, str], str]:
    cmd = [str(llama_bin / "llama-quantize"), "--dry-run",
           *(["--imatrix", str(imatrix)] if imatrix else []), str(skeleton), ftype]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    output = proc.stdout + proc.stderr
    plan = {m[1]: m[3] or m[2] for line in output.splitlines() if (m := _PLAN_LINE.match(line))}
    if proc.returncode != 0 or not plan:
        raise QuantizeFailed(f"llama-quantize --dry-run {ftype} exited {proc.returncode}: "
                             f"{error_line(output)}")
    return plan, output


def _stand_in_imatrix() -> bytes:
    """A legacy-format imatrix of one entry (name, 1 call, one value 1.0): llama-quantize
    takes any non-empty imatrix as present; a dry run looks up no entry."""
    name = b"stand-in.weight"
    return struct.pack(f"<ii{len(name)}siif", 1, len(name), name, 1, 1, 1.0)


def skeleton_plan(path: Path, ftype: str, llama_bin: Path,
                  write: Callable[..., None]) -> tuple[dict[str, str], bool]:
    """quantize_plan on a sparse F16 skeleton written beside `path` (and removed);
    `write(path, ftype=, types=, sparse=)` writes the model's file."""
    skeleton = path.with_name(f"{path.stem}-skeleton-F16.gguf")
    write(skeleton, ftype="F16", types=None, sparse=True)
    try:
        return quantize_plan(skeleton, ftype, llama_bin)
    finally:
        skeleton.unlink()


def write_planned(path: Path, ftype: str, plan: dict[str, str], imatrix: bool,
                  tensors: Tensors, write: Callable[..., None],
                  is_f32: Callable[[str, tuple[int, ...]], bool]) -> Path:
    """The `ftype` file at `path` written as random blocks of each tensor's type in `plan`
    (`imatrix`: planned with a stand-in imatrix); `tensors` lists the model's tensors,
    `write` writes them as skeleton_plan's does."""
    need = sum(stored_bytes(shape, stored_type(name, shape, plan, is_f32))
               for name, shape in tensors)
    if (free := shutil.disk_usage(path.parent).free) < need:
        raise QuantizeFailed(f"{path.name} needs ~{need / 1e9:.1f} GB; {path.parent} has "
                             f"{free / 1e9:.1f} GB free")
    kinds = ", ".join(sorted(set(plan.values())))
    planned = "planned with a stand-in imatrix" if imatrix else "planned by a dry run"
    print(f"# writing {path} (~{need / 1e9:.2f} GB of random {ftype} blocks, {planned}: "
          f"{kinds})", flush=True)
    start = time.perf_counter()
    write(path, ftype=ftype, types=plan, sparse=False)
    print(f"#   done in {time.perf_counter() - start:.0f} s")
    return path


def ensure_planned(path: Path, ftype: str, llama_bin: Path, tensors: Tensors,
                   write: Callable[..., None],
                   is_f32: Callable[[str, tuple[int, ...]], bool]) -> Path:
    """The `ftype` file at `path`, written as planned random blocks unless it exists."""
    if path.exists():
        print(f"# have {path} ({path.stat().st_size / 1e9:.2f} GB)")
        return path
    plan, imatrix = skeleton_plan(path, ftype, llama_bin, write)
    return write_planned(path, ftype, plan, imatrix, tensors, write, is_f32)
