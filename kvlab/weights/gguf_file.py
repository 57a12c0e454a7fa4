"""GGUF container parsing: header, metadata and tensor directory over a memory map.

The `gguf` package's GGUFReader builds a numpy view per array element and takes about
9 s to open the default model (262k-token vocabulary); this parser reads the same
layout in well under a second and hands out zero-copy views of the tensor bytes.
Quant-type constants come from the `gguf` package.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvlab.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
_SCALARS = {  # GGUF value type -> struct format
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
    10: "<Q", 11: "<q", 12: "<d",
}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # PyTorch order: (rows, cols) for a matrix, i.e. GGUF dims reversed
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int


class _Cursor:
    def __init__(self, buf: memoryview, path: str) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            raise ModelLoadError(f"{self.path}: GGUF header is truncated at byte {self.pos}")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return bytes(self.take(self.scalar("<Q"))).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.scalar("<I"), self.scalar("<Q")
            if etype in _NUMPY:
                dt = np.dtype(_NUMPY[etype])
                return np.frombuffer(self.take(count * dt.itemsize), dtype=dt).tolist()
            return [self.value(etype) for _ in range(count)]
        raise ModelLoadError(f"{self.path}: unknown GGUF metadata value type {vtype}")


class GGUFFile:
    """An opened GGUF file: `metadata` (plain Python values) and `tensors` by name."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        try:
            with open(self.path, "rb") as f:
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            raise ModelLoadError(f"model file not found: {self.path}") from None
        except (IsADirectoryError, ValueError, OSError) as e:
            raise ModelLoadError(f"cannot open model file {self.path}: {e}") from None
        buf = memoryview(self._mmap)
        if bytes(buf[:4]) != GGUF_MAGIC:
            raise ModelLoadError(
                f"{self.path} is not a GGUF file (magic {bytes(buf[:4])!r}, expected b'GGUF'); "
                "pass a .gguf file or a Hugging Face model directory")
        cur = _Cursor(buf, self.path)
        cur.take(4)
        self.version = cur.scalar("<I")
        if self.version not in (2, 3):
            raise ModelLoadError(f"{self.path}: GGUF version {self.version} is not supported "
                                 "(valid: 2, 3)")
        n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.scalar("<I"))
        infos = [self._tensor_info(cur) for _ in range(n_tensors)]
        align = int(self.metadata.get("general.alignment", 32))
        data_start = (cur.pos + align - 1) // align * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, qtype, rel in infos:
            nbytes = _tensor_nbytes(shape, qtype)
            info = TensorInfo(name, shape, qtype, data_start + rel, nbytes)
            if info.offset + nbytes > len(buf):
                raise ModelLoadError(
                    f"{self.path} is truncated: tensor {name} needs bytes up to "
                    f"{info.offset + nbytes}, the file has {len(buf)}")
            self.tensors[name] = info

    def _tensor_info(self, cur: _Cursor) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = cur.string()
        dims = [cur.scalar("<Q") for _ in range(cur.scalar("<I"))]
        raw_type = cur.scalar("<I")
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise ModelLoadError(f"{self.path}: tensor {name} has unknown type id {raw_type}") \
                from None
        return name, tuple(reversed(dims)), qtype, cur.scalar("<Q")

    def raw(self, name: str) -> np.ndarray:
        """Zero-copy uint8 view of a tensor's bytes in the memory map."""
        info = self.tensors[name]
        return np.frombuffer(self._mmap, dtype=np.uint8, count=info.nbytes, offset=info.offset)

    def release_pages(self, name: str | None = None, start: int = 0,
                      end: int | None = None) -> None:
        """Drop this process's resident copy of tensor `name`'s pages (the whole pages inside
        its bytes [start, end), all of them by default), or of the whole file. The map is
        read-only and file-backed, so a later read of a tensor kept in place faults its pages
        back in from the page cache; what is not read again no longer counts in the RSS."""
        if name is None:
            self._mmap.madvise(mmap.MADV_DONTNEED)
            return
        info, page = self.tensors[name], mmap.PAGESIZE
        stop = info.nbytes if end is None else min(end, info.nbytes)
        first = -(-(info.offset + start) // page) * page
        last = (info.offset + stop) // page * page
        if last > first:
            self._mmap.madvise(mmap.MADV_DONTNEED, first, last - first)

    def head(self, nbytes: int) -> bytes:
        """The file's first `nbytes` bytes (header, metadata and tensor directory before
        the first tensor's offset)."""
        return self._mmap[:nbytes]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "<missing>"))


def _tensor_nbytes(shape: tuple[int, ...], qtype: GGMLQuantizationType) -> int:
    block, type_size = GGML_QUANT_SIZES[qtype]
    n = int(np.prod(shape)) if shape else 1
    return n // block * type_size
