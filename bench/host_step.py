"""Host (Python) time of one decode step, on a model so small that its forward is trivial.

A random 1-layer, hidden-64 Llama is built in process; `batch` sequences of `context`
tokens are prefilled, then decode-only steps are timed in steady state, in the loop the
server runs (--loop server: Engine.core_step on this thread, the output processor's text on
a thread of its own, as kvlab.server.core.async_engine does; the time ends once the last
step's text is made) or in Engine.step() (--loop engine: both on one thread, as `kvlab run`).
A decode step's plain tokens reach the processor as columns and their RequestOutputs are
built only when read: the server loop reads them all on its output thread, as the server
does to hand them to the clients (--no-read-outputs leaves them unbuilt), Engine.step() too.
What is left is the engine's own bookkeeping: scheduling, building the step's input tensors,
sampling and emitting outputs. On a GPU this is the time that starves the device; on the
CPU it is pure overhead. Beside the wall-clock time per step: the process's CPU time per
step (what a busy machine disturbs least), and where the engine records where a step's time
goes (Engine.phase_seconds), that split (with async scheduling the forward and sampling
overlap the rest, so the split adds up to more than the step).

    python bench/host_step.py                       # batches 1, 16, 64, 256
    python bench/host_step.py --async-scheduling off --rounds 3   # on/off alternately
    python bench/host_step.py --batches 64 -n 50 --profile    # and a cProfile of 64
    python bench/host_step.py --batches 256 --no-read-outputs  # without the output objects
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import queue
import threading
import time
from collections.abc import Callable

import torch
import transformers as tf
from gpu_decode import numbered_tokenizer  # the sibling script's vocabulary, by path

from kvlab.engine import Engine, EngineConfig
from kvlab.models.loader import LoadOptions, load_model
from kvlab.request import SamplingParams
from kvlab.weights.checkpoint import TensorCheckpoint


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--context", type=int, default=64, help="prompt tokens per sequence")
    ap.add_argument("-n", "--steps", type=int, default=32, help="decode steps timed")
    ap.add_argument("-r", "--reps", type=int, default=3, help="rounds; the best is shown")
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("--sampled", action="store_true",
                    help="temperature 1, top-p 0.9, a seed and a repetition penalty "
                         "instead of greedy")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile the timed steps of the largest batch")
    ap.add_argument("--async-scheduling", choices=("on", "off", "both"), default="on",
                    help="both: an engine each way, timed alternately --rounds times")
    ap.add_argument("--rounds", type=int, default=1,
                    help="with --async-scheduling both: on/off alternations")
    ap.add_argument("--loop", choices=("server", "engine"), default="server")
    ap.add_argument("--no-read-outputs", dest="read_outputs", action="store_false",
                    help="server loop: the output thread leaves each step's RequestOutputs "
                         "unread (unbuilt), where the server reads them all for its clients")
    return ap.parse_args()


def tiny_engine(args: argparse.Namespace, max_seqs: int, async_on: bool) -> Engine:
    cfg = tf.LlamaConfig(vocab_size=args.vocab, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096, rms_norm_eps=1e-5,
                         tie_word_embeddings=False)
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).eval()
    tensors = {k: v.detach() for k, v in model.state_dict().items()}
    loaded = load_model(TensorCheckpoint(cfg.to_dict(), tensors),
                        LoadOptions(dtype=torch.float32, device="cpu"))
    config = EngineConfig(kv_cache_gib=0.25, max_model_len=1024, max_num_seqs=max_seqs,
                          max_num_batched_tokens=max(2048, max_seqs),
                          enable_prefix_caching=False, threads=args.threads,
                          async_scheduling=async_on)
    return Engine(loaded, numbered_tokenizer(args.vocab), config, model_name="host-step")


def params(args: argparse.Namespace, b: int, max_tokens: int) -> SamplingParams:
    if not args.sampled:
        return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=0.9, seed=b,
                          repetition_penalty=1.1, ignore_eos=True)


class ServerLoop:
    """The server's loop without the server: core steps here, text on an output thread
    (and there each step's RequestOutputs where `read` asks, as the server hands them to
    its clients)."""

    def __init__(self, engine: Engine, read: bool) -> None:
        self.engine, self.read = engine, read
        self.jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="kvlab-outputs", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            job()

    def step(self) -> None:
        items = self.engine.core_step()
        self.jobs.put(lambda: self._text(items))

    def _text(self, items: list) -> object:
        processed = self.engine.outputs.process(items)
        return processed.outputs if self.read else None  # reading them builds them

    def drain(self) -> None:
        """Wait until the text of every step so far is made."""
        done = threading.Event()
        self.jobs.put(done.set)
        done.wait()

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join()


def decode_round(engine: Engine, args: argparse.Namespace, batch: int,
                 profiler: cProfile.Profile | None = None) -> tuple[float, dict[str, float]]:
    """Seconds per decode step over args.steps steps of `batch` sequences, and per step:
    the process's CPU seconds (steadier than the wall clock on a shared machine) and the
    engine's phase split where it records one."""
    warm = 4
    for b in range(batch):
        prompt = [100 + (b * 7 + i) % (args.vocab - 100) for i in range(args.context)]
        engine.add_request(f"s{b}", prompt, params(args, b, 1024 - args.context))
    started: set[str] = set()
    while len(started) < batch:  # the prefills, chunked under the token budget
        started.update(o.request_id for o in engine.step())
    loop = ServerLoop(engine, args.read_outputs) if args.loop == "server" else None
    step = engine.step if loop is None else loop.step
    for _ in range(warm):
        step()
    if loop is not None:
        loop.drain()
    before = dict(getattr(engine, "phase_seconds", {}))
    if profiler is not None:
        profiler.enable()
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(args.steps):
        step()
    if loop is not None:
        loop.drain()
        loop.close()
    seconds = (time.perf_counter() - start) / args.steps
    split = {"cpu": (time.process_time() - cpu) / args.steps}
    if profiler is not None:
        profiler.disable()
    after = getattr(engine, "phase_seconds", {})
    split.update({k: (v - before.get(k, 0.0)) / args.steps for k, v in after.items()})
    for b in range(batch):  # none finishes by itself: each runs every timed step
        engine.abort(f"s{b}")
    return seconds, split


def main() -> None:
    args = parse()
    batches = [int(b) for b in args.batches.split(",")]
    torch.set_num_threads(args.threads)
    modes = {"on": [True], "off": [False], "both": [True, False]}[args.async_scheduling]
    engines = {on: tiny_engine(args, max(batches), on) for on in modes}
    rounds = args.rounds if len(modes) > 1 else 1
    print(f"host time per decode step: 1 layer, hidden 64, vocab {args.vocab}, "
          f"{args.context}-token prompts, {args.steps} steps, best of {args.reps}, "
          f"{'sampled' if args.sampled else 'greedy'}, {args.threads} thread(s), "
          f"{args.loop} loop")
    header = f"{'async':>5} {'batch':>6} {'ms/step':>9} {'us/seq':>8}"
    rows = []
    for r in range(rounds):
        for batch in batches:
            for on in modes:  # alternately: a shared machine's load falls on both
                best, split = min((decode_round(engines[on], args, batch)
                                   for _ in range(args.reps)), key=lambda x: x[0])
                rows.append((on, batch, best, split))
    names = list(rows[-1][3])
    print(header + "".join(f" {n[:9]:>9}" for n in names) + ("  (ms per step)" if names
                                                               else ""))
    for on, batch, seconds, split in rows:
        print(f"{'on' if on else 'off':>5} {batch:>6} {seconds * 1e3:>9.3f} "
              f"{seconds * 1e6 / batch:>8.1f}"
              + "".join(f" {split.get(n, 0.0) * 1e3:>9.3f}" for n in names))
    if args.profile:
        profiler = cProfile.Profile(time.thread_time)  # CPU time: a busy machine blurs less
        decode_round(engines[modes[0]], args, batches[-1], profiler)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    for engine in engines.values():
        engine.close()  # its KV pager's thread stops before the interpreter does


if __name__ == "__main__":
    main()
