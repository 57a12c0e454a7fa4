"""Sentence embeddings from final hidden states: pooling, Matryoshka truncation, L2 norm.

    hidden [T, H] (sequences packed back to back, `lengths` tokens each)
      -> pool: mean of each sequence's rows | its first row (CLS) | its last row
      -> [n, H] -> keep the first `dimensions` columns -> divide each row by its L2 norm

Which pooling a model wants is the checkpoint's to say: GGUF's `<arch>.pooling_type`
(llama.cpp's enum: 1 mean, 2 CLS, 3 last) or sentence-transformers' `1_Pooling/config.json`
(found through `modules.json`); without either, the architecture's own default (last token
for decoders, as Qwen3-Embedding; CLS for BERT).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvlab.errors import ModelLoadError, RequestError

POOLINGS = ("mean", "cls", "last")
_GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}  # llama.cpp's LLAMA_POOLING_TYPE_*
# sentence-transformers' pooling_mode_* flags, in the order they are honoured
_ST_MODES = (("pooling_mode_cls_token", "cls"), ("pooling_mode_mean_tokens", "mean"),
             ("pooling_mode_lasttoken", "last"))


def pool(hidden: torch.Tensor, lengths: list[int], kind: str) -> torch.Tensor:
    """hidden [sum(lengths), H] -> [len(lengths), H] fp32, one row per sequence."""
    rows = torch.split(hidden.float(), lengths)
    if kind == "mean":
        return torch.stack([r.mean(dim=0) for r in rows])
    ends = torch.tensor(lengths).cumsum(0)
    index = ends - torch.tensor(lengths) if kind == "cls" else ends - 1
    return hidden.float().index_select(0, index.to(hidden.device))


def check_dimensions(dimensions: int | None, width: int) -> None:
    """Refuse a truncation outside [1, width]."""
    if dimensions is not None and not 1 <= dimensions <= width:
        raise RequestError(f"dimensions must be in [1, {width}] (the model's hidden size), "
                           f"got {dimensions}")


def finish(vectors: torch.Tensor, dimensions: int | None, normalize: bool) -> torch.Tensor:
    """Keep the first `dimensions` columns (Matryoshka), then L2-normalize each row."""
    check_dimensions(dimensions, vectors.shape[-1])
    if dimensions is not None:
        vectors = vectors[:, :dimensions]
    return F.normalize(vectors, dim=-1) if normalize else vectors


def gguf_pooling(meta: dict[str, Any], arch: str) -> str | None:
    """`<arch>.pooling_type` as a pooling name; None when absent or 0 (none)."""
    value = meta.get(f"{arch}.pooling_type")
    if value is None or int(value) == 0:
        return None
    if int(value) not in _GGUF_POOLING:
        raise ModelLoadError(f"{arch}.pooling_type {value} is not supported (valid: "
                             f"{', '.join(f'{k} {v}' for k, v in _GGUF_POOLING.items())})")
    return _GGUF_POOLING[int(value)]


def hf_pooling(model_dir: Path) -> str | None:
    """A sentence-transformers directory's pooling module config as a pooling name."""
    config = model_dir / "1_Pooling" / "config.json"
    modules = model_dir / "modules.json"
    if modules.is_file():
        for module in _read(modules):
            if str(module.get("type", "")).endswith("Pooling"):
                config = model_dir / module.get("path", "") / "config.json"
    if not config.is_file():
        return None
    settings = _read(config)
    for key, kind in _ST_MODES:
        if settings.get(key):
            return kind
    raise ModelLoadError(f"{config} asks for a pooling kvlab does not run (valid: "
                         f"{', '.join(k for k, _ in _ST_MODES)})")


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None
