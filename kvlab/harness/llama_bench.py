"""`kvlab bench`: prompt processing (pp) and token generation (tg) speed, llama-bench style.

Each test runs `repetitions` times on the public engine API with random prompt tokens and
the prefix cache off (every run computes its whole prompt). Beside tok/s it prints the bytes a
decode step reads, the GB/s that reached and its share of this machine's bandwidth, and the
FLOP/s of prefill: each figure read against the ceiling it is bound by. The weight bytes the C
kernels really read per decode token are counted too (`weight_check`), against the bytes the
cost model says the active weights take: a mixture of experts must read only its chosen ones.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import asdict, dataclass

from kvlab.engine import Engine
from kvlab.request import SamplingParams


@dataclass(frozen=True)
class BenchResult:
    test: str  # "pp512", "tg128", "tg128@d1024"
    n_prompt: int
    n_gen: int
    depth: int
    tok_s_mean: float
    tok_s_std: float
    samples: tuple[float, ...]
    bytes_per_token: float  # decode: weight + KV bytes one step reads; prefill: 0
    gb_s: float  # decode: bytes per token x tok/s
    gflop_s: float
    bandwidth_share: float | None  # gb_s / measured machine bandwidth
    weights_read_per_token: float = 0.0  # decode: weight bytes the C kernels read; 0 uncounted

    def as_dict(self) -> dict:
        return asdict(self)


def _tokens(engine: Engine, n: int, rng: random.Random) -> list[int]:
    """Random ordinary token ids (no specials), starting with BOS when the model uses one."""
    tok = engine.tokenizer
    vocab = engine.loaded.config.vocab_size
    low = min(1000, vocab // 2)  # skip the control-token range most vocabularies start with
    ordinary = [i for i in range(low, min(vocab, low + 50_000)) if not tok.is_special(i)]
    ids = [rng.choice(ordinary) for _ in range(n)]
    if tok.bos_id is not None and tok.add_bos and ids:
        ids[0] = tok.bos_id
    return ids


def _run_one(engine: Engine, prompt: list[int],
             max_tokens: int) -> tuple[float, list[float], float]:
    """(prefill seconds, decode inter-token latencies, weight bytes the kernels read per
    decode step) of one request: the steps after its first token are one decode each."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start_read = engine.stats().weight_bytes_read
    engine.add_request("bench", prompt, params)
    last, first_read, decodes = None, None, 0
    while engine.has_unfinished():
        for out in engine.step():
            last = out
        if first_read is None and last is not None and last.new_token_ids:
            first_read = engine.stats().weight_bytes_read
        elif first_read is not None:
            decodes += 1
    assert last is not None and last.timings is not None
    end_read = engine.stats().weight_bytes_read
    # A one-token prompt's forward is a decode step like the rest, and async scheduling may
    # have run the next step by the time the first token is out: count every forward. A
    # longer prompt's prefill runs alone (synchronously) and is left out.
    if len(prompt) == 1:
        read = (end_read - start_read) / (decodes + 1)
    else:
        read = (end_read - first_read) / decodes if decodes else 0.0
    return last.timings.prefill_seconds, last.timings.inter_token_latencies, read


def bench_pp(engine: Engine, n_prompt: int, reps: int, seed: int = 0) -> BenchResult:
    rng = random.Random(seed)
    samples = []
    flops = engine.cost.prefill_flops(n_prompt)
    for _ in range(reps):
        prefill_s, _, _ = _run_one(engine, _tokens(engine, n_prompt, rng), 1)
        samples.append(n_prompt / prefill_s)
    mean = statistics.fmean(samples)
    return BenchResult(f"pp{n_prompt}", n_prompt, 0, 0, mean, _std(samples), tuple(samples),
                       0.0, 0.0, flops * mean / n_prompt / 1e9, None)


def bench_tg(engine: Engine, n_gen: int, reps: int, depth: int = 0, seed: int = 0,
             bandwidth_gb_s: float | None = None) -> BenchResult:
    rng = random.Random(seed)
    samples, read = [], []
    for _ in range(reps):
        _, itl, weights = _run_one(engine, _tokens(engine, max(1, depth), rng), n_gen + 1)
        samples.append(len(itl) / sum(itl))
        read.append(weights)
    mean = statistics.fmean(samples)
    context = max(1, depth) + n_gen // 2
    per_token = engine.cost.decode_bytes(context)
    gb_s = per_token * mean / 1e9
    name = f"tg{n_gen}" + (f"@d{depth}" if depth else "")
    return BenchResult(name, 0, n_gen, depth, mean, _std(samples), tuple(samples), per_token,
                       gb_s, engine.cost.decode_flops(context) * mean / 1e9,
                       gb_s / bandwidth_gb_s if bandwidth_gb_s else None,
                       statistics.fmean(read))


def weight_check(results: list[BenchResult], active_bytes: int) -> str | None:
    """The decode weight bytes counted in the kernels against the active weights' bytes."""
    counted = [r.weights_read_per_token for r in results if r.weights_read_per_token]
    if not counted or not active_bytes:
        return None
    read = statistics.fmean(counted)
    off = read / active_bytes - 1
    return (f"decode weights read: {read / 1e6:.1f} MB per token counted in the kernels, "
            f"{active_bytes / 1e6:.1f} MB of active weights: {100 * off:+.1f} % "
            f"({'within' if abs(off) <= 0.10 else 'outside'} 10 %)")


def _std(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def format_table(results: list[BenchResult], fmt: str = "md") -> str:
    head = ["test", "t/s", "± std", "MB/token", "GB/s", "% of BW", "GFLOP/s"]
    rows = [[r.test, f"{r.tok_s_mean:.2f}", f"{r.tok_s_std:.2f}",
             f"{r.bytes_per_token / 1e6:.1f}" if r.bytes_per_token else "-",
             f"{r.gb_s:.2f}" if r.gb_s else "-",
             f"{100 * r.bandwidth_share:.0f} %" if r.bandwidth_share else "-",
             f"{r.gflop_s:.1f}"] for r in results]
    if fmt == "csv":
        return "\n".join(",".join(c.replace(" ", "") for c in row) for row in [head] + rows)
    widths = [max(len(row[i]) for row in [head] + rows) for i in range(len(head))]
    line = lambda row: "| " + " | ".join(c.rjust(w) for c, w in zip(row, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(head), sep] + [line(r) for r in rows])
