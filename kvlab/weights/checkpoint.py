"""Checkpoints as torch tensors: GGUF files and Hugging Face safetensors directories.

No model code here: a `Checkpoint` says what architecture the file declares, hands out its
metadata, and reads tensors in their stored form (quantized GGUF blocks stay bytes). An HF
pair `X_blocks` + `X_scales` (gpt-oss's MXFP4 experts) is read as one MXFP4 tensor `X` in
GGML's block layout, the form GGUF stores it in.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType

from kvlab.errors import ModelLoadError
from kvlab.weights.gguf_file import GGUFFile

_FLOAT_TYPES = {GGMLQuantizationType.F32: torch.float32, GGMLQuantizationType.F16: torch.float16,
                GGMLQuantizationType.BF16: torch.bfloat16}
_TORCH_TYPES = {torch_type: ggml.name for ggml, torch_type in _FLOAT_TYPES.items()}


@dataclass(frozen=True)
class RawTensor:
    """A tensor as stored. Float types: `data` has `shape`. Quantized: uint8 [rows, row_bytes]."""

    shape: tuple[int, ...]
    qtype: str  # "F32", "F16", "BF16", "Q8_0", "Q4_K", ...
    data: torch.Tensor

    @property
    def quantized(self) -> bool:
        return self.data.dtype == torch.uint8


class Checkpoint:
    """An opened model checkpoint of either format."""

    format: str
    path: Path
    architecture: str
    metadata: dict[str, Any]  # GGUF key/values or the HF config.json

    def names(self) -> set[str]:
        raise NotImplementedError

    def read(self, name: str) -> RawTensor:
        raise NotImplementedError

    def release_pages(self, name: str | None = None, start: int = 0,
                      end: int | None = None) -> None:
        """Drop the pages of tensor `name` (its bytes [start, end), all by default; or of the
        whole file) that this process has resident, once what was built from them is a copy;
        whatever is still read in place faults back in. A no-op where the format has no
        memory map of its own."""


    def drop_vocabulary(self) -> None:
        """Forget the tokenizer's arrays in the metadata once a tokenizer is built from them
        (a GGUF's largest metadata: tens of MB of Python objects). A no-op for HF."""


class GGUFCheckpoint(Checkpoint):
    def __init__(self, path: Path) -> None:
        self.format, self.path = "gguf", path
        self.file = GGUFFile(path)
        self.metadata = self.file.metadata
        self.architecture = self.file.architecture

    def names(self) -> set[str]:
        return set(self.file.tensors)

    def release_pages(self, name: str | None = None, start: int = 0,
                      end: int | None = None) -> None:
        self.file.release_pages(name, start, end)

    def drop_vocabulary(self) -> None:
        for key in [k for k, v in self.metadata.items()
                    if k.startswith("tokenizer.ggml.") and isinstance(v, list)]:
            del self.metadata[key]

    def read(self, name: str) -> RawTensor:
        info = self.file.tensors[name]
        raw = self.file.raw(name)
        if info.qtype in _FLOAT_TYPES:
            data = _as_torch(raw).view(_FLOAT_TYPES[info.qtype]).view(info.shape)
        else:
            rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
            data = _as_torch(raw).view(rows, -1)
        return RawTensor(info.shape, info.qtype.name, data)


def _as_torch(raw: np.ndarray) -> torch.Tensor:
    """Zero-copy uint8 tensor over the read-only mmap (kvlab never writes weight pages)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable"
        return torch.from_numpy(raw)


class HFCheckpoint(Checkpoint):
    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self.format, self.path = "hf", path
        self.metadata = _read_json(path / "config.json")
        self.architecture = _hf_architecture(self.metadata)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{path} has no *.safetensors files")
        self._where: dict[str, Any] = {}
        for f in files:
            try:
                handle = safe_open(str(f), framework="pt")
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
                raise ModelLoadError(f"{f} is not a valid safetensors file: {e}") from None
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                self._where[key] = handle

    def names(self) -> set[str]:
        pairs = {n.removesuffix("_blocks") for n in self._where if n.endswith("_blocks")
                 and n.removesuffix("_blocks") + "_scales" in self._where}
        return (set(self._where) - {f"{n}_{part}" for n in pairs for part in ("blocks", "scales")}
                | pairs)

    def read(self, name: str) -> RawTensor:
        if name not in self._where and name + "_blocks" in self._where:
            return mxfp4_from_hf(self._where[name + "_blocks"].get_tensor(name + "_blocks"),
                                 self._where[name + "_scales"].get_tensor(name + "_scales"))
        return _raw(self._where[name].get_tensor(name))


def mxfp4_from_hf(blocks: torch.Tensor, scales: torch.Tensor) -> RawTensor:
    """OpenAI's MXFP4 ([..., rows, n / 32, 16] bytes, element 2j in byte j's low nibble and
    2j + 1 in its high one; [..., rows, n / 32] E8M0 scales) -> GGML's MXFP4 [..., rows, n]:
    per block the scale byte, then byte j holding element j (low) and j + 16 (high). The
    nibbles index the same E2M1 values and the scale byte is the same exponent."""
    lead, nb = blocks.shape[:-2], blocks.shape[-2]
    elems = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # [..., nb, 32]
    qs = elems[..., :16] | (elems[..., 16:] << 4)
    data = torch.cat([scales[..., None], qs], dim=-1).reshape(-1, nb * 17)
    return RawTensor((*lead, nb * 32), "MXFP4", data.contiguous())


class TensorCheckpoint(Checkpoint):
    """An HF checkpoint held in memory: a config.json dict plus tensors by HF name. Random-
    weight benchmarks hand kvlab a transformers model's own tensors this way (on any device)
    instead of writing gigabytes to disk and reading them back."""

    def __init__(self, config: dict[str, Any], tensors: dict[str, torch.Tensor],
                 path: str = "<memory>") -> None:
        self.format, self.path = "hf", Path(path)
        self.metadata, self.tensors = config, tensors
        self.architecture = _hf_architecture(config)

    def names(self) -> set[str]:
        return set(self.tensors)

    def read(self, name: str) -> RawTensor:
        return _raw(self.tensors[name])


def _hf_architecture(config: dict[str, Any]) -> str:
    archs = config.get("architectures") or [config.get("model_type", "?")]
    return str(archs[0])


def _raw(t: torch.Tensor) -> RawTensor:
    kind = _TORCH_TYPES.get(t.dtype, str(t.dtype).removeprefix("torch."))
    return RawTensor(tuple(t.shape), kind, t)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path} not found; a model directory needs config.json "
                             "and *.safetensors") from None
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None


def open_checkpoint(path: str | Path) -> Checkpoint:
    """A .gguf file or an HF directory (config.json + *.safetensors)."""
    p = Path(path).expanduser()
    if p.is_dir():
        return HFCheckpoint(p)
    if not p.exists():
        raise ModelLoadError(f"model not found: {p} (expected a .gguf file or a directory "
                             "with config.json and *.safetensors)")
    return GGUFCheckpoint(p)
