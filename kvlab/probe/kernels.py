"""kvlab's own kernels timed on this machine, for predicting kvlab rather than an ideal engine.

The stream-read bandwidth of `kvlab probe` is a ceiling; kvlab's decode reaches under it,
because its kernels unpack blocks and sum per row, its attention computes as much as it
reads, and every layer makes a few dozen small Python-level calls. Each of these is timed
here on its own, with no real model, so that a prediction built from them is fitted to no
run:

    weight read     batch-1 products over 128 MiB of blocks per weight type, the same blocks
                    seen as long rows (4096 columns) and short rows (512): the two times give
                    bytes/s and the fixed cost per output row
    prefill         a 512-row product per weight type (OP/s)
    call            products over ~240 small matrices (half a MiB each, shuffled) against one
                    product over the same bytes: the cost of one call, cold
    attention       one decode query against 64k cached positions (64 MiB of f32 K/V), with
                    one KV head per cache row and with eight interleaved
    sampling        kvlab's greedy sampler at two vocabulary sizes: seconds per entry
    row ops         prefill's element-wise passes (norm, norm + RoPE, GeGLU in C; SiLU x up
                    in torch) over 512 rows: seconds per element
    engine          kvlab's engine on synthetic models (kvlab.probe.engine_overhead)

Each figure comes from a timer that returns the best of a few runs within its share of the
time budget. The timers run in several rounds, one after another (`spread_median`), and each
keeps the median of its rounds, with their spread (IQR / median): a burst of other work on
a shared machine then moves every figure a little rather than one figure a lot, and the
spread says how steady the machine was. Whole engine steps, which these kernels leave out
(shared caches, thread wake-ups, activation rounding), are timed by kvlab.probe.steps.
"""

from __future__ import annotations

from contextlib import ExitStack
from functools import partial

import torch
from gguf import GGMLQuantizationType

from kvlab.estimate.hardware import KernelRates
from kvlab.kernels import (
    QuantizedWeight,
    fused,
    get_num_threads,
    group_rows,
    kernel_backend,
    qmatmul,
    quantize,
)
from kvlab.kernels.qweight import row_bytes
from kvlab.probe.engine_overhead import ARCHITECTURES, engine_timers, overhead_from
from kvlab.probe.timing import (
    ROUNDS,
    Timer,
    best_seconds,
    per_call_seconds,
    spread_median,
    torch_threads,
)
from kvlab.request import SamplingParams
from kvlab.sampler import SamplingBatch, sample

T = GGMLQuantizationType
# GGML type names, and kvlab's 8-row groups Q8_0x8, Q4_Kx8 and Q6_Kx8 (what the loader makes
# of Q8_0, Q5_0, Q4_0, Q4_K and Q6_K matrices on the CPU)
WEIGHT_TYPES = ("Q8_0", "Q8_0x8", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q4_Kx8", "Q5_K",
                "Q6_K", "Q6_Kx8", "F16", "BF16")
GROUPED = "Q8_0x8"  # the most common type in a model's matrices
LONG_COLS, SHORT_COLS = 4096, 512  # two row lengths over the same blocks
PREFILL_ROWS = 512  # kvlab's default prefill chunk
PREFILL_SHAPE = (1024, 2048)  # out, in features of the prefill product
ATTENTION_HEAD_DIM = 128
_SMALL_VOCAB, _LARGE_VOCAB = 4096, 262144

def measure_kernels(budget_s: float = 8.0, weight_mib: int = 128,
                    attention_positions: int = 65536, engine: bool = True,
                    rounds: int = ROUNDS) -> KernelRates | None:
    """All the figures of `KernelRates` at the current kernel thread count, in about
    `budget_s` seconds plus buffer set-up; None when kvlab's C kernels are not built.
    `engine=False` leaves the engine figures empty (fast tests)."""
    if kernel_backend() == "torch":
        return None
    threads = get_num_threads()
    scratch = torch.empty(weight_mib << 20, dtype=torch.uint8)  # one weight buffer, refilled
    timers: dict[str, Timer] = {}
    for name in WEIGHT_TYPES:
        timers[f"read {name}"] = partial(_read_times, name, scratch)
        timers[f"prefill {name}"] = partial(_prefill_times, name)
    timers["call"] = partial(_call_times, scratch)
    timers["attention"] = partial(_attention_times, 1, attention_positions)
    timers["attention strided"] = partial(_attention_times, 8, attention_positions // 8)
    timers["sampling"] = _sampling_times
    timers["row ops"] = _row_op_times
    with ExitStack() as stack:
        if engine:
            timers |= stack.enter_context(engine_timers(threads))
        med, spread = spread_median(timers, budget_s, rounds)
    overhead = {arch: overhead_from(med, arch) for arch in (ARCHITECTURES if engine else ())}
    return KernelRates(
        threads=threads,
        weight_read={t: _fit_read(t, weight_mib, *med[f"read {t}"])[0] for t in WEIGHT_TYPES},
        row_seconds={t: _fit_read(t, weight_mib, *med[f"read {t}"])[1] for t in WEIGHT_TYPES},
        prefill_ops={t: _prefill_ops(*med[f"prefill {t}"]) for t in WEIGHT_TYPES},
        call_seconds=_call_cost(weight_mib, *med["call"]),
        attention_read=_attention_rate(1, attention_positions, *med["attention"]),
        attention_read_strided=_attention_rate(8, attention_positions // 8,
                                               *med["attention strided"]),
        logit_seconds=_logit_cost(*med["sampling"]),
        row_op_seconds=_row_op_costs(*med["row ops"]),
        step_seconds={a: o.per_step for a, o in overhead.items()},
        layer_seconds={a: o.per_layer for a, o in overhead.items()},
        position_seconds={a: o.per_position for a, o in overhead.items()}, spread=spread)


# -- weights ---------------------------------------------------------------------------------


def _qtype(name: str) -> GGMLQuantizationType:
    return T[name.removesuffix("x8")]


def _grouped(name: str) -> bool:
    return name.endswith("x8")


def _row_bytes(name: str, cols: int) -> int:
    return row_bytes(_qtype(name), cols, _grouped(name))


def _weight(name: str, shape: tuple[int, int], data: torch.Tensor):
    """A QuantizedWeight of the probe type `name` over `data` (uint8 [rows, row bytes])."""
    return QuantizedWeight(_qtype(name), shape, data.view(shape[0], -1), grouped=_grouped(name))


def _fill(name: str, rows: int, cols: int, out: torch.Tensor | None = None,
          tile_rows: int = 64) -> torch.Tensor:
    """uint8 [rows, row bytes] of valid blocks of the probe type `name`, in `out` when given:
    a small random tile, repeated (the quantizers are slow; a product's speed does not
    depend on values). Tiles are whole 8-row groups, so Q8_0x8 repeats validly too."""
    gen = torch.Generator().manual_seed(0)
    tile = quantize(torch.randn(tile_rows, cols, generator=gen), _qtype(name))
    tile = (group_rows(tile) if _grouped(name) else tile).data
    nbytes = rows * _row_bytes(name, cols)
    fits = out is not None and out.numel() >= nbytes
    data = out[:nbytes] if fits else torch.empty(nbytes, dtype=torch.uint8)
    view = data.view(rows, -1)
    for r0 in range(0, rows, tile_rows):
        view[r0:r0 + tile_rows] = tile[:rows - r0]
    return view


def _long_rows(name: str, buffer_mib: int) -> int:
    return max(64, (buffer_mib << 20) // _row_bytes(name, LONG_COLS) // 8 * 8)


def _read_times(name: str, scratch: torch.Tensor, budget_s: float) -> tuple[float, float]:
    """Best seconds of a batch-1 product over the blocks in `scratch` as long rows, then
    as short rows (the same bytes: for Q8_0x8 then not valid groups, timed all the same)."""
    long_rows = _long_rows(name, scratch.numel() >> 20)
    data = _fill(name, long_rows, LONG_COLS, scratch)
    ratio = LONG_COLS // SHORT_COLS
    seconds = []
    for rows, cols in ((long_rows, LONG_COLS), (long_rows * ratio, SHORT_COLS)):
        run = partial(qmatmul, torch.randn(1, cols), _weight(name, (rows, cols), data))
        run()  # warm-up: threads awake
        seconds.append(best_seconds(run, budget_s / 2, max_runs=8)[0])
    return seconds[0], seconds[1]


def _fit_read(name: str, buffer_mib: int, t_long: float, t_short: float
              ) -> tuple[float, float]:
    """(bytes/s, seconds per output row) from the two times of `_read_times`:

        t_long  = B / rate + R       * t_row
        t_short = B / rate + R * 8   * t_row      (8 = LONG_COLS / SHORT_COLS)
    """
    long_rows = _long_rows(name, buffer_mib)
    t_row = max(0.0, (t_short - t_long) / (long_rows * (LONG_COLS // SHORT_COLS - 1)))
    stream = max(t_long - long_rows * t_row, t_long / 4)  # noise can not make it free
    return long_rows * _row_bytes(name, LONG_COLS) / stream, t_row


def measure_weight_read(name: str, buffer_mib: int = 128, budget_s: float = 0.5
                        ) -> tuple[float, float]:
    """(bytes/s, seconds per output row) of batch-1 products over `buffer_mib` MiB of
    blocks of the probe type `name` (WEIGHT_TYPES), in one round."""
    scratch = torch.empty(buffer_mib << 20, dtype=torch.uint8)
    return _fit_read(name, buffer_mib, *_read_times(name, scratch, budget_s))


def _call_times(scratch: torch.Tensor, budget_s: float, cols: int = 1024,
                part_rows: int = 512) -> tuple[float, float]:
    """Best seconds of one product over all the Q8_0 blocks in `scratch`, and of products
    over its small matrices one by one, in shuffled order."""
    n_parts = _call_parts(scratch.numel() >> 20, cols, part_rows)
    data = _fill(GROUPED, n_parts * part_rows, cols, scratch)  # most model matrices' type
    x = torch.randn(1, cols)
    whole = partial(qmatmul, x, _weight(GROUPED, (n_parts * part_rows, cols), data))
    order = torch.randperm(n_parts, generator=torch.Generator().manual_seed(0)).tolist()
    parts = [_weight(GROUPED, (part_rows, cols), data[i * part_rows:(i + 1) * part_rows])
             for i in order]

    def each() -> None:
        for w in parts:
            qmatmul(x, w)

    whole()
    each()
    return (best_seconds(whole, budget_s / 2, max_runs=8)[0],
            best_seconds(each, budget_s / 2, max_runs=8)[0])


def _call_parts(buffer_mib: int, cols: int = 1024, part_rows: int = 512) -> int:
    return max(2, (buffer_mib << 20) // (row_bytes(T.Q8_0, cols) * part_rows))


def _call_cost(buffer_mib: int, t_whole: float, t_each: float) -> float:
    """Seconds one product call costs besides its bytes and rows: waking the kernel threads,
    rounding x to 8 bits, the memory latency a fresh matrix pays before its rows stream."""
    return max(0.0, (t_each - t_whole) / (_call_parts(buffer_mib) - 1))


def measure_call(buffer_mib: int = 128, budget_s: float = 0.5) -> float:
    """The cost of one product call (`_call_cost`), in one round."""
    scratch = torch.empty(buffer_mib << 20, dtype=torch.uint8)
    return _call_cost(buffer_mib, *_call_times(scratch, budget_s))


# -- prefill ---------------------------------------------------------------------------------


def _prefill_times(name: str, budget_s: float, shape: tuple[int, int] = PREFILL_SHAPE
                   ) -> tuple[float, float]:
    """(best seconds, OP) of a PREFILL_ROWS-row product through a matrix of type `name`."""
    out_features, in_features = shape
    w = _weight(name, shape, _fill(name, out_features, in_features))
    run = partial(qmatmul, torch.randn(PREFILL_ROWS, in_features), w)
    run()
    ops = 2.0 * PREFILL_ROWS * out_features * in_features
    return best_seconds(run, budget_s, max_runs=8)[0], ops


def _prefill_ops(seconds: float, ops: float) -> float:
    return ops / seconds


def measure_prefill(name: str, budget_s: float = 0.5, out_features: int = 1024,
                    in_features: int = 2048) -> float:
    """OP/s of a PREFILL_ROWS-row product through a matrix of the probe type `name`
    (activations in 8 bits)."""
    return _prefill_ops(*_prefill_times(name, budget_s, (out_features, in_features)))


# -- attention, sampling, element-wise -------------------------------------------------------


def _attention_times(kv_heads: int, positions: int, budget_s: float,
                     heads_per_kv: int = 4) -> tuple[float]:
    """Best seconds of kvlab's decode attention: one query of `heads_per_kv` x `kv_heads`
    heads against `positions` cached f32 positions."""
    d = ATTENTION_HEAD_DIM
    k, v = torch.randn(positions, kv_heads, d), torch.randn(positions, kv_heads, d)
    q = torch.randn(1, kv_heads * heads_per_kv, d)
    run = partial(fused.attend_decode, q, k, v, torch.arange(positions).view(1, positions),
                  d ** -0.5, torch.tensor([positions]))
    run()
    return (best_seconds(run, budget_s, max_runs=8)[0],)


def _attention_rate(kv_heads: int, positions: int, seconds: float) -> float:
    """K and V bytes read per second."""
    return 2 * positions * kv_heads * ATTENTION_HEAD_DIM * 4 / seconds


def measure_attention(kv_heads: int, positions: int, budget_s: float = 0.5) -> float:
    """KV bytes/s of kvlab's decode attention (`_attention_times`), in one round."""
    return _attention_rate(kv_heads, positions, *_attention_times(kv_heads, positions, budget_s))


def _sampling_times(budget_s: float) -> tuple[float, float]:
    """Best seconds of one greedy pick by kvlab's sampler over a small and a large
    vocabulary, on one torch thread as kvlab's runner leaves torch during decode."""
    params = SamplingParams(temperature=0)

    def pick(logits: torch.Tensor) -> None:
        batch = SamplingBatch.build([params], [[]], [[]], [None], "cpu")
        sample(logits, batch).token_ids.tolist()

    small, large = torch.randn(1, _SMALL_VOCAB), torch.randn(1, _LARGE_VOCAB)
    with torch_threads(1):
        return (per_call_seconds(lambda: pick(small), 50, budget_s / 2),
                per_call_seconds(lambda: pick(large), 10, budget_s / 2))


def _logit_cost(t_small: float, t_large: float) -> float:
    """Seconds per vocabulary entry: the fixed part (held by the engine figures) drops out."""
    return max(0.0, (t_large - t_small) / (_LARGE_VOCAB - _SMALL_VOCAB))


def measure_sampling(budget_s: float = 0.3) -> float:
    return _logit_cost(*_sampling_times(budget_s))


ROW_OPS = ("norm", "rope", "gelu", "silu")


def _row_op_times(budget_s: float, rows: int = PREFILL_ROWS, hidden: int = 1024,
                  heads: int = 8, head_dim: int = 128, width: int = 2816
                  ) -> tuple[float, ...]:
    """Best seconds per element of the element-wise passes prefill makes over every prompt
    row: RMSNorm ("norm"), per-head norm + RoPE ("rope"), and the gated activations:
    Gemma's GeGLU in C ("gelu"), Llama's SiLU(gate) x up in torch ("silu")."""
    import torch.nn.functional as F


    x, w = torch.randn(rows, hidden), torch.randn(hidden)
    q, norm = torch.randn(rows, heads, head_dim), torch.randn(head_dim)
    cos, sin = torch.randn(rows, 1, head_dim), torch.randn(rows, 1, head_dim)
    gate_up = torch.randn(rows, 2 * width)
    gate, up = gate_up[:, :width], gate_up[:, width:]
    share = budget_s / len(ROW_OPS)
    return (per_call_seconds(lambda: fused.rms_norm(x, w, 1e-6), 5, share) / x.numel(),
            per_call_seconds(lambda: fused.norm_rope_(q, norm, cos, sin, 1e-6), 5, share)
            / q.numel(),
            per_call_seconds(lambda: fused.geglu(gate_up), 5, share) / (rows * width),
            per_call_seconds(lambda: F.silu(gate) * up, 5, share) / (rows * width))


def _row_op_costs(*seconds: float) -> dict[str, float]:
    return dict(zip(ROW_OPS, seconds, strict=True))


def measure_row_ops(budget_s: float = 0.3, **shape: int) -> dict[str, float]:
    return _row_op_costs(*_row_op_times(budget_s, **shape))
