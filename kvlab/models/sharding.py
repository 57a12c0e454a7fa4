"""Tensor parallel inside the model: the slice of each weight a rank holds, and the
all-reduce its layers call.

Megatron's split of a decoder layer over N ranks of one torch.distributed group:

    q, k, v, gate, up (and q/k/v biases)   column-parallel: each rank holds a block of rows
                                           (its heads; its share of the MLP's columns)
    o, down                                row-parallel: the matching block of input columns;
                                           each rank's output is a partial sum, all-reduced
    norms, embedding, output head, router  replicated

So a layer costs two all-reduces of [T, hidden]: after the attention output projection and
after the MLP's down projection (for a mixture of experts, after the whole MoE output).
Each rank attends with its own heads and keeps only their share of the KV cache. With fewer
KV heads than ranks (GQA), every rank keeps the one KV head its query heads read, so KV
heads are replicated N / kv_heads times.

Quantized blocks stay quantized: a row split never cuts a block, and a column split must
fall on block boundaries (32 or 256 elements), else the model is refused with the sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from kvlab.config import ModelConfig
from kvlab.errors import ModelLoadError

# kvlab names split by output rows (column-parallel) and by input columns (row-parallel)
_ROWS_Q = {"q", "q_bias"}
_ROWS_KV = {"k", "v", "k_bias", "v_bias"}
_ROWS_INTER = {"gate", "up", "shexp_gate", "shexp_up", "gate_exps", "up_exps"}
_COLS = {"o", "down", "shexp_down", "down_exps"}
_HALVES = {"gate_up", "gate_up_exps"}  # gate | up stored as one matrix


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the group: rank of size; `group` is the torch.distributed
    process group (None for a single rank, whose all-reduce does nothing)."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place; x is a rank's partial sum of a row-parallel product."""
        if self.size > 1:
            torch.distributed.all_reduce(x, group=self.group)
        return x

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 full_dim: int) -> torch.Tensor:
        """RMSNorm of a vector split over the ranks (OLMoE's norm over all heads' queries):
        x [T, local] with this rank's slice of `weight`, the mean square taken over full_dim."""
        if self.size == 1:
            return F.rms_norm(x.float(), weight.shape, weight, eps).to(x.dtype)
        squares = x.float().pow(2).sum(-1, keepdim=True)
        self.all_reduce(squares)
        return (x.float() * torch.rsqrt(squares / full_dim + eps) * weight).to(x.dtype)


SINGLE = TensorParallel()


def check_split(config: ModelConfig, size: int) -> None:
    """Refuse a model whose heads or MLP columns do not divide `size` ways, saying why."""
    if size < 1:
        raise ModelLoadError(f"--tensor-parallel-size must be at least 1, got {size}")
    why = _split_problems(config, size)
    if why:
        raise ModelLoadError(f"{config.name or config.architecture} cannot be split {size} "
                             f"ways: {'; '.join(why)} (valid sizes: "
                             f"{', '.join(map(str, valid_sizes(config)))})")


def valid_sizes(config: ModelConfig, most: int = 64) -> list[int]:
    """The tensor-parallel sizes up to `most` whose heads and MLP columns divide evenly."""
    return [n for n in range(1, most + 1) if not _split_problems(config, n)]


def _split_problems(c: ModelConfig, size: int) -> list[str]:
    why = [f"{c.num_heads} attention heads"] if c.num_heads % size else []
    kv = c.num_kv_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        why.append(f"{kv} KV heads (fewer KV heads than ranks is fine when the ranks are a "
                   "multiple of them: each KV head is then replicated)")
    if c.qk_norm_whole and kv < size:
        why.append(f"{kv} KV heads normed as one vector (which cannot hold replicated heads)")
    inters = {"intermediate size": c.intermediate_size}
    if c.moe is not None:
        inters |= {"expert intermediate size": c.moe.expert_intermediate_size,
                  "shared expert intermediate size": c.moe.shared_intermediate_size}
    return why + [f"{name} {n}" for name, n in inters.items() if n % size]


def local_config(config: ModelConfig, tp: TensorParallel) -> ModelConfig:
    """The shapes one rank runs: its heads, KV heads and MLP columns."""
    if tp.size == 1:
        return config
    check_split(config, tp.size)
    n, moe = tp.size, config.moe
    if moe is not None:
        moe = replace(moe, expert_intermediate_size=moe.expert_intermediate_size // n,
                      shared_intermediate_size=moe.shared_intermediate_size // n)
    return replace(config, num_heads=config.num_heads // n,
                   num_kv_heads=max(1, config.num_kv_heads // n),
                   intermediate_size=config.intermediate_size // n, moe=moe)


def shard_ranges(name: str, config: ModelConfig, tp: TensorParallel,
                 shape: tuple[int, ...]) -> tuple[int, list[tuple[int, int]]] | None:
    """(axis, [(start, stop), ...]): the elements along axis of the tensor `name` (kvlab
    name, whole shape `shape`) that rank tp.rank holds, concatenated; None: replicated."""
    c, d, length = config, config.head_dim, shape[0]
    if name in _COLS:
        return 1, [_block(shape[1], tp)]
    if name in _ROWS_INTER:
        return 0, [_block(length, tp)]
    if name in _ROWS_Q or (name == "q_norm" and c.qk_norm_whole):
        return 0, [_block(length, tp)]
    if name in _ROWS_KV or (name == "k_norm" and c.qk_norm_whole):
        return 0, [_kv_rows(c, tp)]
    if name == "qkv":
        q = _block(c.num_heads * d, tp)
        k0, k1 = _kv_rows(c, tp)
        kv = c.num_kv_heads * d
        off = c.num_heads * d
        return 0, [q, (off + k0, off + k1), (off + kv + k0, off + kv + k1)]
    if name in _HALVES:
        half = length // 2
        a, b = _block(half, tp)
        return 0, [(a, b), (half + a, half + b)]
    return None


def _block(length: int, tp: TensorParallel) -> tuple[int, int]:
    step = length // tp.size
    return tp.rank * step, (tp.rank + 1) * step


def _kv_rows(c: ModelConfig, tp: TensorParallel) -> tuple[int, int]:
    """Rows of k (or v) whose heads rank tp.rank's query heads read."""
    d = c.head_dim
    if c.num_kv_heads >= tp.size:
        return _block(c.num_kv_heads * d, tp)
    head = tp.rank * c.num_kv_heads // tp.size  # the KV head of this rank's query heads
    return head * d, (head + 1) * d


def take(data: torch.Tensor, axis: int, ranges: list[tuple[int, int]],
         scale: tuple[int, int] = (1, 1)) -> torch.Tensor:
    """data's elements `ranges` along axis, concatenated (a copy). `scale` (block elements,
    block bytes) maps element columns to the bytes of quantized rows."""
    elems, nbytes = scale
    parts = [data.narrow(axis, a // elems * nbytes, (b - a) // elems * nbytes)
             for a, b in ranges]
    return torch.cat(parts, dim=axis).contiguous() if len(parts) > 1 else parts[0].clone()


def check_columns(name: str, qtype: str, cols: int, ranges: list[tuple[int, int]],
                  block: int, size: int) -> None:
    """A column split of a quantized matrix must cut on block boundaries."""
    if all(a % block == 0 and b % block == 0 for a, b in ranges):
        return
    valid = [n for n in range(1, 65) if cols % n == 0 and (cols // n) % block == 0]
    raise ModelLoadError(
        f"{name} ({qtype}, {cols} input columns) cannot be split {size} ways: each rank's "
        f"{cols / size:g} columns must be a multiple of the {qtype} block of {block} "
        f"(valid sizes for it: {', '.join(map(str, valid))})")
