"""kvlab against llama.cpp (llama-cpp-python) and transformers on the same GGUF, same threads.

    .venv/bin/python bench/compare_peers.py [-m MODEL.gguf] -p 512 -n 128 -r 3 -t 2

Runs alternate between engines inside one process (kvlab pp, llama.cpp pp, kvlab tg,
llama.cpp tg, ...) so machine noise hits both alike; transformers runs fewer repetitions
(it is slow). Prints median tok/s per engine and the ratios kvlab / peer, plus the decode
ceiling (this machine's measured bandwidth / bytes one decode step reads with the weights as
the file stores them, the same for every engine).
llama-cpp-python is an optional extra: pip install -e '.[peers]' (compiles llama.cpp).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from kvlab.engine import Engine, EngineConfig
from kvlab.harness.llama_bench import bench_pp, bench_tg
from kvlab.models.loader import LoadOptions, load_model
from kvlab.probe import this_machine
from kvlab.weights.checkpoint import open_checkpoint
from kvlab.weights.default_model import default_model_path


def llama_cpp_runner(path: Path, threads: int, n_ctx: int, n_batch: int):
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                n_batch=n_batch, n_ubatch=n_batch, verbose=False)
    vocab = llm.n_vocab()

    def pp(n: int) -> float:
        llm.reset()
        tokens = [1000 + (i * 7919) % (vocab - 1000) for i in range(n)]
        t = time.perf_counter()
        llm.eval(tokens)
        return n / (time.perf_counter() - t)

    def tg(n: int) -> float:
        llm.reset()
        llm.eval([2])
        t = time.perf_counter()
        for i in range(n):
            llm.eval([1000 + i])
        return n / (time.perf_counter() - t)

    return pp, tg


def transformers_runner(path: Path, threads: int):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32).eval()

    @torch.inference_mode()
    def pp(n: int) -> float:
        ids = torch.randint(1000, 200000, (1, n))
        t = time.perf_counter()
        model(ids, use_cache=True)
        return n / (time.perf_counter() - t)

    @torch.inference_mode()
    def tg(n: int) -> float:
        out = model(torch.tensor([[2]]), use_cache=True)
        past, tok = out.past_key_values, torch.tensor([[1000]])
        t = time.perf_counter()
        for _ in range(n):
            out = model(tok, past_key_values=past, use_cache=True)
            past = out.past_key_values
        return n / (time.perf_counter() - t)

    return pp, tg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("--hf-n", type=int, default=32, help="decode tokens for transformers")
    ap.add_argument("--no-transformers", action="store_true")
    args = ap.parse_args()
    path = Path(args.model) if args.model else default_model_path()

    engine = Engine.from_model(str(path), EngineConfig(
        threads=args.t, enable_prefix_caching=False, max_num_seqs=1,
        max_num_batched_tokens=max(512, args.p), max_model_len=max(2048, args.p + args.n + 8)))
    lpp, ltg = llama_cpp_runner(path, args.t, args.p + args.n + 16, args.p)
    runs: dict[str, list[float]] = {k: [] for k in ("kv_pp", "kv_tg", "ll_pp", "ll_tg")}
    bench_tg(engine, 4, 1)  # warm-up: page in the weights
    lpp(32)
    for _ in range(args.r):
        runs["kv_pp"].append(bench_pp(engine, args.p, 1).tok_s_mean)
        runs["ll_pp"].append(lpp(args.p))
        runs["kv_tg"].append(bench_tg(engine, args.n, 1).tok_s_mean)
        runs["ll_tg"].append(ltg(args.n))
    hf = {}
    if not args.no_transformers:
        hpp, htg = transformers_runner(path, args.t)
        hpp(32)
        hf = {"pp": statistics.median(hpp(args.p) for _ in range(2)), "tg": htg(args.hf_n)}
    report(engine, stored_weight_bytes(path), runs, hf, args)


def stored_weight_bytes(path: Path) -> int:
    """Weight bytes a decode step reads as the file stores them: the yardstick common to all
    engines (kvlab's Q8_0x8 widens Q5_0 and Q4_0 to 8 bits in memory, and reads more)."""
    loaded = load_model(open_checkpoint(path), LoadOptions(group_rows=False))
    return round(loaded.model_spec().decode_weight_bytes(1))


def report(engine: Engine, stored: int, runs: dict[str, list[float]], hf: dict[str, float],
           args: argparse.Namespace) -> None:
    med = {k: statistics.median(v) for k, v in runs.items()}
    in_memory = engine.cost.decode_bytes(1 + args.n // 2)
    bytes_per_token = in_memory - engine.cost.decode_weight_bytes + stored
    bandwidth = _bandwidth()
    print(f"model {engine.model_name}, {args.t} threads, {args.r} alternating repetitions "
          f"(median tok/s)")
    print(f"{'test':<8} {'kvlab':>9} {'llama.cpp':>10} {'transformers':>13} "
          f"{'kvlab/llama.cpp':>16} {'kvlab/transformers':>19}")
    for test, label in (("pp", f"pp{args.p}"), ("tg", f"tg{args.n}")):
        k, ll, h = med[f"kv_{test}"], med[f"ll_{test}"], hf.get(test)
        print(f"{label:<8} {k:>9.1f} {ll:>10.1f} {(f'{h:.1f}' if h else '-'):>13} "
              f"{k / ll:>15.2f}x {(f'{k / h:.1f}x' if h else '-'):>19}")
    ceiling = bandwidth * 1e9 / bytes_per_token if bandwidth else None
    if ceiling:
        print(f"decode ceiling: {bandwidth:.1f} GB/s / {bytes_per_token / 1e6:.1f} MB per token "
              f"= {ceiling:.1f} tok/s; kvlab reaches {100 * med['kv_tg'] / ceiling:.0f} %, "
              f"llama.cpp {100 * med['ll_tg'] / ceiling:.0f} % (kvlab's step reads "
              f"{in_memory / 1e6:.1f} MB of its in-memory layout)")
    print("raw:", {k: [round(x, 1) for x in v] for k, v in runs.items()})


def _bandwidth() -> float | None:
    try:

        return this_machine().bandwidth / 1e9
    except Exception:  # noqa: BLE001 - run `kvlab probe` first for the ceiling line
        return None


if __name__ == "__main__":
    main()
