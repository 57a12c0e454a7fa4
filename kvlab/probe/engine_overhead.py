"""kvlab's engine overhead, timed on synthetic models: what a decode step costs besides the
products and the decode attention.

A decode step of kvlab runs a few dozen Python-level calls per layer (norms, RoPE, KV
writes, product wrappers, attention metadata) and some per step (scheduler, runner inputs,
embedding, sampling, detokenizing). Their cost depends on the machine and on kvlab's code,
and on one more thing: between two layers the products stream megabytes of weights through
the caches, so the glue of a real model runs with cold caches, about twice as slow as on a
toy model whose every byte stays cached. So the probe writes a random GGUF of the same
architecture at a small model's width (hidden 1024, 12 MB of Q8_0 weights a layer; values
do not matter to the speed), runs kvlab's own engine on it, and takes away the time spent
inside the C products and the C decode attention (timed around each call): the weights and
KV terms of the step model predict those. Gemma 3 on quantized weights runs its decode
layers as one C call (kvlab.models.decode_c); that call is taken away whole, and the small
fused ops inside it (norms, RoPE, KV writes, GeGLU) are timed on the per-op path of the
same engine and added back to the glue. What is left is split as

    overhead = per_step + layers x per_layer + attended positions x per_position

from three runs: 2 and 8 layers at 16 positions, 2 layers at 1024 positions.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvlab.engine import Engine, EngineConfig
from kvlab.kernels import ops
from kvlab.probe.timing import spread_median, torch_threads
from kvlab.request import SamplingParams

ARCHITECTURES = ("llama", "gemma3")


@dataclass(frozen=True)
class SyntheticShape:
    hidden: int = 1024
    inter: int = 2816
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 128
    window: int = 4096  # Gemma's sliding window: wider than any depth timed, one key range


SHAPE = SyntheticShape()
_FEW, _MANY = 2, 8  # layer counts timed
_SHALLOW, _DEEP = 16, 1024  # attended positions timed
_VOCAB = [chr(c) for c in range(33, 127)] + ["\u0120", "\u010a"]  # byte-level, no merges


@dataclass(frozen=True)
class EngineOverhead:
    per_step: float  # seconds: scheduler, runner inputs, embedding, output wrapper, sampling
    per_layer: float  # seconds: one layer's calls, less the C products and attention
    per_position: float  # seconds per attended position (slot lists, masks)


def measure_engine_overhead(architecture: str, threads: int, budget_s: float = 2.0,
                            shape: SyntheticShape = SHAPE) -> EngineOverhead:
    """Time kvlab's engine on synthetic `architecture` models, in one round."""
    with engine_timers(threads, shape, (architecture,)) as timers:
        return overhead_from(spread_median(timers, budget_s, rounds=1)[0], architecture)


_RUNS = ((_FEW, _SHALLOW), (_MANY, _SHALLOW), (_FEW, _DEEP))  # (layers, positions) timed


def _timer_name(architecture: str, layers: int, depth: int) -> str:
    return f"engine {architecture} {layers} layers at {depth}"


@contextmanager
def engine_timers(threads: int, shape: SyntheticShape = SHAPE,
                  architectures: tuple[str, ...] = ARCHITECTURES
                  ) -> Iterator[dict[str, Callable[[float], tuple[float]]]]:
    """Timers of kvlab's engine on synthetic models (built once, on entry), for
    `kvlab.probe.timing.spread_median`; `overhead_from` reads their times."""
    import torch


    with tempfile.TemporaryDirectory(prefix="kvlab-probe-") as tmp, \
            torch_threads(torch.get_num_threads()):  # the engine's runner changes it
        timers = {}
        for arch in architectures:
            for layers in sorted({layers for layers, _ in _RUNS}):
                path = Path(tmp) / f"{arch}-{layers}.gguf"
                write_synthetic_gguf(path, arch, layers, shape)
                for depth in (d for n, d in _RUNS if n == layers):
                    timers[_timer_name(arch, layers, depth)] = _EngineRun(path, threads, depth)
        yield timers


def overhead_from(best: dict[str, tuple[float, ...]], architecture: str) -> EngineOverhead:
    """Split the best glue seconds of `engine_timers` into step, layer and position parts."""
    glue = {(n, d): best[_timer_name(architecture, n, d)][0] for n, d in _RUNS}
    per_layer = max(0.0, (glue[_MANY, _SHALLOW] - glue[_FEW, _SHALLOW]) / (_MANY - _FEW))
    per_position = max(0.0, (glue[_FEW, _DEEP] - glue[_FEW, _SHALLOW]) / (_DEEP - _SHALLOW))
    per_step = glue[_FEW, _SHALLOW] - _FEW * per_layer - _SHALLOW * per_position
    return EngineOverhead(max(per_step, 0.0), per_layer, per_position)


class _EngineRun:
    """kvlab's engine on one synthetic model, decoding one sequence from `depth` positions;
    a call times a few steps and returns the best mean step less the C kernels' time."""

    def __init__(self, path: Path, threads: int, depth: int) -> None:
        self.engine = Engine.from_model(str(path), EngineConfig(
            threads=threads, enable_prefix_caching=False, max_model_len=4 * _DEEP,
            max_num_batched_tokens=_DEEP))
        self.depth = depth

    def _start(self) -> None:
        """A fresh sequence, prefilled and warmed up (a run never crosses its end)."""
        rng = np.random.default_rng(self.depth)
        prompt = [int(t) for t in rng.integers(0, len(_VOCAB), self.depth)]
        self.engine.add_request("probe", prompt, SamplingParams(
            max_tokens=_DEEP, temperature=0, ignore_eos=True))
        self.left = _DEEP
        for _ in range(4):
            self.engine.step()
        self.left -= 4

    def __call__(self, budget_s: float) -> tuple[float]:
        steps = max(4, int(budget_s / 3 / 0.004))  # about 4 ms a step, three runs
        glue = min(self._glue(steps)[0] for _ in range(3))
        model = self.engine.runner.model
        plan = getattr(model, "c_plan", None)
        if plan is not None:  # the one-call C layers: add the small fused ops inside them
            model.c_plan = None
            try:
                glue += min(self._glue(steps, _FUSED)[1] for _ in range(2))
            finally:
                model.c_plan = plan
        return (glue,)

    def _glue(self, steps: int, names: tuple[str, ...] = ()) -> tuple[float, float]:
        """(step seconds outside the C products, attention and one-call layers, step seconds
        inside the C calls `names`) over `steps` decode steps."""
        if not self.engine.has_unfinished() or self.left <= steps:
            if self.engine.has_unfinished():
                self.engine.abort("probe")
            self._start()
        with _timed_kernels() as inside, _timed_kernels(names) as fused:
            start = time.perf_counter()
            for _ in range(steps):
                self.engine.step()
            elapsed = time.perf_counter() - start
        self.left -= steps
        return (elapsed - inside[0]) / steps, fused[0] / steps


# the small fused C ops of a decode layer: inside the one-call C layers they cannot be
# timed, so the probe times them once on the per-op path and adds them to the glue
_FUSED = ("rms_norm", "add_rms_norm", "norm_rope", "gelu_mul", "silu_mul", "scatter_rows")
# the C products, decode attention and the one-call decode layers: the weights and KV
# terms of the step model predict these
_PREDICTED = ("qmatmul", "attend_decode", "decode_layers")


@contextmanager
def _timed_kernels(names: tuple[str, ...] = _PREDICTED) -> Iterator[list[float]]:
    """Seconds spent inside the C calls `names` while the block runs."""
    module, inside = ops._qk, [0.0]
    originals = {name: getattr(module, name) for name in names}

    def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                inside[0] += time.perf_counter() - start
        return call

    try:
        for name, fn in originals.items():
            setattr(module, name, timed(fn))
        yield inside
    finally:
        for name, fn in originals.items():
            setattr(module, name, fn)


def write_synthetic_gguf(path: Path, architecture: str, layers: int,
                         shape: SyntheticShape = SHAPE) -> None:
    """A random `architecture` model with Q8_0 matrices of `shape`, in llama.cpp's layout."""
    import gguf

    if architecture not in ARCHITECTURES:
        raise ValueError(f"no synthetic model for {architecture!r}; valid: "
                         f"{', '.join(ARCHITECTURES)}")
    w = gguf.GGUFWriter(str(path), architecture)
    _add_metadata(w, architecture, layers, shape)
    q_dim, kv_dim, hidden = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, \
        shape.hidden
    w.add_tensor("token_embd.weight", _q8_blocks(len(_VOCAB), hidden),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        for name, rows, cols in (("attn_q", q_dim, hidden), ("attn_k", kv_dim, hidden),
                                 ("attn_v", kv_dim, hidden), ("attn_output", hidden, q_dim),
                                 ("ffn_gate", shape.inter, hidden),
                                 ("ffn_up", shape.inter, hidden),
                                 ("ffn_down", hidden, shape.inter)):
            w.add_tensor(f"blk.{i}.{name}.weight", _q8_blocks(rows, cols),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        norms = {"attn_norm": hidden, "ffn_norm": hidden}
        if architecture == "gemma3":
            norms |= {"post_attention_norm": hidden, "post_ffw_norm": hidden,
                      "attn_q_norm": shape.head_dim, "attn_k_norm": shape.head_dim}
        for name, size in norms.items():
            w.add_tensor(f"blk.{i}.{name}.weight", np.ones(size, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _q8_blocks(rows: int, cols: int) -> np.ndarray:
    """uint8 [rows, cols / 32 * 34]: Q8_0 blocks of small random values (a quantized tile,
    repeated: the quantizer is slow and the speed of a product does not depend on values)."""
    from gguf import GGMLQuantizationType, quants

    tile_rows = min(rows, 16)
    tile = quants.quantize(np.random.default_rng(rows + cols).standard_normal(
        (tile_rows, cols)).astype(np.float32) * 0.05, GGMLQuantizationType.Q8_0)
    return np.ascontiguousarray(np.tile(tile, (-(-rows // tile_rows), 1))[:rows])


def _add_metadata(w: Any, arch: str, layers: int, shape: SyntheticShape) -> None:
    """Model shape and a byte-level tokenizer (any id sequence detokenizes) for gguf `w`."""
    for key, value in (("block_count", layers), ("context_length", 4 * _DEEP),
                       ("embedding_length", shape.hidden), ("feed_forward_length", shape.inter),
                       ("attention.head_count", shape.heads),
                       ("attention.head_count_kv", shape.kv_heads),
                       ("attention.key_length", shape.head_dim),
                       ("attention.value_length", shape.head_dim), ("vocab_size", len(_VOCAB))):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32(f"{arch}.rope.freq_base", 10000.0)
    if arch == "gemma3":
        w.add_uint32(f"{arch}.attention.sliding_window", shape.window)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "default")
    w.add_array("tokenizer.ggml.tokens", _VOCAB)
    w.add_array("tokenizer.ggml.token_type", [1] * len(_VOCAB))
    w.add_array("tokenizer.ggml.merges", ["! !"])
    w.add_uint32("tokenizer.ggml.eos_token_id", len(_VOCAB) - 1)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
