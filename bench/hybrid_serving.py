"""A hybrid model (recurrent layers beside attention) served by kvlab against llama.cpp and
against a dense model of about the same size: second-turn TTFT, peak RSS of one long
sequence, and decode speed at depth.

    KVLAB_LLAMA_CPP_LIB=/path/to/llama.cpp/build/bin \\
    .venv/bin/python bench/hybrid_serving.py [--parts ttft,memory,depth] [--arch qwen3_5]
        [--hidden 1024 --layers 16 --quant Q4_K_M] [-t 2] [-r 3] [--workdir DIR]
        [--tokens 4000 --reply 32 --reasoning 0] [--memory-tokens 32000]
        [--depth 16000 -n 64]

A check of the whole pipeline in a few minutes (figures meaningless at this size):

    .venv/bin/python bench/hybrid_serving.py --hidden 256 --layers 4 -r 1 \\
        --tokens 2000 --memory-tokens 4000 --depth 1000 -n 16

Models: the hybrid is bench/hybrid_vs_llamacpp.py's --speed shape of --arch (random weights,
llama.cpp's converter, llama-quantize --quant); the dense one is Qwen3-shaped with the same
width, heads and MLP, and as many layers as bring its parameters nearest the hybrid's. Both
keep the byte-level vocabulary of the tiny test models (one token per character), and a
context of CONTEXT positions. They are built once into --workdir and reused. --models
HYBRID,DENSE runs the same on two given GGUF files (real checkpoints: the prompts are then
tokenized by their vocabulary).

ttft: a chat whose first turn is --tokens tokens (a long system prompt of the project's own
documentation, then a user question), a greedy --reply-token answer, then the second turn:
the whole history, the answer re-tokenized from its text as a client sends it, and a short
new question. --reasoning R leaves the answer's first R tokens out of the history, as
Qwen3.5's template leaves out an earlier turn's reasoning block: the history then parts
from the cached tokens where the answer starts. Each turn goes to /v1/completions as token
ids (the models have no chat template: the roles are plain "System:", "User:",
"Assistant:" lines), streamed; TTFT is send -> first streamed text, the median over -r
conversations, each starting with its own number so that none reuses another's cache.

Setups, one server up at a time, -t threads, one sequence: kvlab serve on the hybrid (its
prefix cache resumes the recurrent state from the deepest snapshot inside the shared
prefix: every EngineConfig.state_snapshot_blocks blocks, at each prompt's last full block
and at the deepest block a finished sequence computed), llama-server on the same file
(prompt cache on, as by default: it reuses a recurrent state where the new prompt extends
the cached one exactly, else restores a context checkpoint inside the shared part, and it
takes one a few tokens before each prompt's end), kvlab serve on the dense model. Printed:
both turns' TTFT, the prompt tokens each server says it took from its cache in the second
turn, then kvlab-hybrid / llama.cpp (target < 1) and kvlab-hybrid / kvlab-dense (target
<= 1.5).

memory: `kvlab bench -p 0 -n 4 -d TOKENS -r 1` (one sequence: TOKENS prefilled, then 4
decode steps) under /usr/bin/time -v, each model in a fresh process: peak RSS of both, its
growth over the same run with a SHORT-token sequence (the weights and the process itself
left out), and hybrid / dense of each.

depth: `kvlab bench -p 0 -n N -d DEPTH -r 1` tg tests, one process per test and the median
of -r processes, at depth 0 and DEPTH on both models, and llama-bench's on the hybrid: tg
tok/s at each depth and their ratio (a recurrent layer's step does not grow with depth, so
the hybrid's ratio should be nearer 1; target within 10 % for the recurrent share).

Figures taken while other work shares the cores are meaningless; run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers as tf

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests"), str(Path(__file__).parent)]

from hybrid_vs_llamacpp import BIN, quantized_gguf, speed_shape
from long_context import Test, kvlab_command, kvlab_tok_s, llama_command, llama_tok_s, timed
from spec_vs_llama_server import Reply, Setup, complete, serving

from kvlab.tokenizer import Tokenizer, load_gguf_tokenizer
from kvlab.weights.checkpoint import open_checkpoint

from tiny_models import build_hybrid

REPO = Path(__file__).resolve().parents[1]
CONTEXT = 40960  # positions each model takes: the 32k-token memory test and some room
# between requests: llama-server may drop a request sent within milliseconds of a streamed
# reply's end ("Server disconnected without sending a response"); no user answers that fast
PAUSE_S = 0.5
SHORT = 64  # the memory test's baseline sequence: the process without a long context
QUESTION = "Summarize how the prefix cache decides what a new request can reuse."
FOLLOW_UP = "And what happens to the recurrent state of a hybrid model?"


# ---- models ---------------------------------------------------------------------------------


def hybrid_model(args: argparse.Namespace) -> tuple[Path, int]:
    """The hybrid GGUF and its parameter count, built into --workdir unless already there."""
    out = args.workdir / f"{args.arch}-h{args.hidden}-l{args.layers}"
    model = out / f"{args.quant.lower()}.gguf"
    count = out / "parameters"
    if not model.exists():
        built = build_hybrid(args.arch, out, **{**speed_shape(args.arch, args.hidden, args.layers),
                                                "max_position_embeddings": CONTEXT})
        count.write_text(str(_parameters(built)))
        quantized_gguf(out, args.quant)
    return model, int(count.read_text())


def dense_config(args: argparse.Namespace, layers: int) -> tf.Qwen3Config:
    """Qwen3 with the hybrid's width, heads and MLP (bench/hybrid_vs_llamacpp.py's shape)."""
    shape = {**speed_shape("qwen3", args.hidden, layers), "max_position_embeddings": CONTEXT}
    return tf.Qwen3Config(**shape, head_dim=64,
                          rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=1e6)


def dense_layers(args: argparse.Namespace, target: int) -> int:
    """The layer count that brings a dense model's parameters nearest `target`."""
    with torch.device("meta"):
        one, two = (_parameters(tf.Qwen3ForCausalLM(dense_config(args, n))) for n in (1, 2))
    return max(1, round((target - (one - (two - one))) / (two - one)))


def dense_model(args: argparse.Namespace, target: int) -> tuple[Path, int]:
    """The dense GGUF of about `target` parameters and its count, built unless already there."""
    layers = dense_layers(args, target)
    out = args.workdir / f"qwen3-h{args.hidden}-l{layers}"
    model = out / f"{args.quant.lower()}.gguf"
    if not model.exists():
        torch.manual_seed(0)
        built = tf.Qwen3ForCausalLM(dense_config(args, layers)).float().eval()
        built.save_pretrained(out / "hf", safe_serialization=True)
        quantized_gguf(out, args.quant)
    with torch.device("meta"):
        return model, _parameters(tf.Qwen3ForCausalLM(dense_config(args, layers)))


def _parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ---- second-turn TTFT -----------------------------------------------------------------------


def documentation() -> str:
    """The project's own prose, the characters a byte-level vocabulary holds."""
    text = "\n\n".join(p.read_text() for p in [REPO / "README.md",
                                               *sorted((REPO / "docs").glob("*.md"))])
    return re.sub(r"[^\x20-\x7e\n]", "", text.replace("\t", "    "))


@dataclass(frozen=True)
class Chat:
    """One conversation's first turn, as token ids, and how to extend it."""

    tokenizer: Tokenizer
    first: list[int]

    def second(self, reply: str, dropped: int = 0) -> list[int]:
        """The whole history: first turn, the answer as its text tokenizes (less its first
        `dropped` tokens), a new question."""
        return (self.first + self.tokenizer.encode(reply)[dropped:]
                + self.tokenizer.encode(f"\nUser: {FOLLOW_UP}\nAssistant:"))


def chats(model: Path, tokens: int, count: int) -> list[Chat]:
    """`count` first turns of `tokens` tokens each: a numbered system prompt cut to length,
    then the question."""
    tokenizer = load_gguf_tokenizer(open_checkpoint(model).metadata)
    body = tokenizer.encode(documentation())
    tail = tokenizer.encode(f"\n\nUser: {QUESTION}\nAssistant:")
    out = []
    for i in range(count):
        head = tokenizer.encode(f"System (conversation {i}):\n")
        room = tokens - len(head) - len(tail)
        if room > len(body):
            raise SystemExit(f"--tokens {tokens} is more than the documentation gives "
                             f"({len(body) + len(head) + len(tail)} tokens)")
        out.append(Chat(tokenizer, head + body[:max(room, 0)] + tail))
    return out


def conversations(setup: Setup, args: argparse.Namespace) -> list[tuple[Reply, Reply]]:
    """(first turn, second turn) of each conversation on the setup's server."""
    convs = chats(setup.model, args.tokens, args.r)
    with serving(setup, args) as (client, model):
        complete(client, model, convs[0].tokenizer.encode("Warm-up."), 4, True)
        turns = []
        for chat in convs:
            time.sleep(PAUSE_S)
            first = complete(client, model, chat.first, args.reply, True)
            time.sleep(PAUSE_S)
            second = chat.second(first.text, args.reasoning)
            turns.append((first, complete(client, model, second, 2, True)))
        return turns


def ttft_part(hybrid: Path, dense: Path, args: argparse.Namespace) -> None:
    flags = ("--max-model-len", str(CONTEXT))
    setups = [Setup("kvlab hybrid", "kvlab", hybrid, flags),
              Setup("llama.cpp hybrid", "llama.cpp", hybrid, ("-c", str(CONTEXT))),
              Setup("kvlab dense", "kvlab", dense, flags)]
    print(f"\n## second-turn TTFT: first turn {args.tokens} tokens, reply {args.reply} "
          f"({args.reasoning} of them left out of the history), median of {args.r}")
    print(f"{'setup':18s} {'turn 1 ms':>10s} {'turn 2 ms':>10s} {'turn 2 cached':>14s}")
    second = {}
    for setup in setups:
        turns = conversations(setup, args)
        second[setup.label] = statistics.median(t.ttft_s for _, t in turns)
        cached = "/".join("-" if t.cached is None else str(t.cached) for _, t in turns)
        print(f"{setup.label:18s} {statistics.median(f.ttft_s for f, _ in turns) * 1e3:10.1f} "
              f"{second[setup.label] * 1e3:10.1f} {cached:>14s}", flush=True)
    ours = second["kvlab hybrid"]
    print(f"kvlab-hybrid / llama.cpp: {ours / second['llama.cpp hybrid']:.2f} (target < 1); "
          f"kvlab-hybrid / kvlab-dense: {ours / second['kvlab dense']:.2f} (target <= 1.5)")


# ---- memory and decode at depth -------------------------------------------------------------


def run(label: str, cmd: list[str]) -> tuple[str, float]:
    """stdout and peak RSS (MB) of one bench process; a failure names the run."""
    try:
        out, _, rss = timed(cmd)
    except RuntimeError as e:
        raise SystemExit(f"{label} failed: {e}") from None
    return out, rss


def memory_part(models: dict[str, Path], args: argparse.Namespace) -> None:
    tests = [Test(f"d{d}", gen=4, depth=d) for d in (args.memory_tokens, SHORT)]
    print(f"\n## peak RSS of one {args.memory_tokens}-token sequence (then 4 decode steps), "
          f"and its growth over a {SHORT}-token one")
    print(f"{'model':8s} {'peak MB':>8s} {'growth MB':>10s}")
    rss, growth = {}, {}
    for name, model in models.items():
        rss[name], short = (run(f"kvlab {name} {t.name}", kvlab_command(model, t, args.t))[1]
                            for t in tests)
        growth[name] = rss[name] - short
        print(f"{name:8s} {rss[name]:8.0f} {growth[name]:10.0f}", flush=True)
    print(f"hybrid / dense: peak {rss['hybrid'] / rss['dense']:.2f}, growth "
          f"{growth['hybrid'] / growth['dense']:.2f}")


def depth_part(models: dict[str, Path], args: argparse.Namespace) -> None:
    tests = [Test(f"tg{args.n}@d{d}", gen=args.n, depth=d) for d in (0, args.depth)]
    print(f"\n## decode tok/s over {args.n} tokens at depth 0 and {args.depth}")
    print(f"{'engine':18s} {'depth 0':>9s} {f'depth {args.depth}':>12s} {'ratio':>6s}")
    runs = [(f"kvlab {name}", model, kvlab_command, kvlab_tok_s)
            for name, model in models.items()]
    runs.append(("llama.cpp hybrid", models["hybrid"],
                 lambda m, t, n: llama_command(BIN, m, t, n), llama_tok_s))
    for label, model, command, rate in runs:
        shallow, deep = (statistics.median(rate(run(f"{label} {t.name}",
                                                     command(model, t, args.t))[0])
                                           for _ in range(args.r)) for t in tests)
        print(f"{label:18s} {shallow:9.1f} {deep:12.1f} {deep / shallow:6.2f}", flush=True)


# ---- main -----------------------------------------------------------------------------------

PARTS = ("ttft", "memory", "depth")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default=",".join(PARTS), help=f"some of {','.join(PARTS)}")
    ap.add_argument("--arch", default="qwen3_5", help="the hybrid family (tiny_models' name)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16, help="the hybrid's layers")
    ap.add_argument("--quant", default="Q4_K_M", help="llama-quantize's type name")
    ap.add_argument("--workdir", type=Path,
                    default=Path(tempfile.gettempdir()) / "kvlab-hybrid-serving")
    ap.add_argument("--models", metavar="HYBRID.gguf,DENSE.gguf", default=None,
                    help="two model files in place of the random ones")
    ap.add_argument("-t", type=int, default=2, help="threads of each engine")
    ap.add_argument("-r", type=int, default=3,
                    help="conversations per setup; processes per depth test (median)")
    ap.add_argument("--tokens", type=int, default=4000, help="first turn's prompt tokens")
    ap.add_argument("--reply", type=int, default=32, help="first turn's answer tokens")
    ap.add_argument("--reasoning", type=int, default=0,
                    help="the answer's first tokens that stand for a reasoning block, which "
                         "the second turn's history leaves out (as Qwen3.5's template does)")
    ap.add_argument("--memory-tokens", type=int, default=32000)
    ap.add_argument("--depth", type=int, default=16000)
    ap.add_argument("-n", type=int, default=64, help="tokens generated per depth test")
    args = ap.parse_args()
    args.parts = args.parts.split(",")
    if unknown := set(args.parts) - set(PARTS):
        raise SystemExit(f"--parts: {','.join(sorted(unknown))} unknown; choose from "
                         f"{','.join(PARTS)}")
    if args.models and len(args.models.split(",")) != 2:
        raise SystemExit(f"--models takes two files, HYBRID,DENSE; got {args.models!r}")
    if max(args.tokens + 256, args.memory_tokens, args.depth + args.n) >= CONTEXT:
        raise SystemExit(f"--tokens, --memory-tokens and --depth must stay below the models' "
                         f"context of {CONTEXT}")
    args.llama_server = BIN / "llama-server"  # what spec_vs_llama_server.serving reads
    return args


def random_models(args: argparse.Namespace) -> tuple[Path, Path]:
    """The hybrid and dense random GGUFs, built unless already in --workdir."""
    args.workdir.mkdir(parents=True, exist_ok=True)
    hybrid, count = hybrid_model(args)
    dense, dense_count = dense_model(args, count)
    print(f"# hybrid {args.arch} {count / 1e6:.1f} M parameters, dense qwen3 "
          f"{dense_count / 1e6:.1f} M, {args.quant}, {args.t} threads")
    return hybrid, dense


def main() -> None:
    args = parse_args()
    if args.models:
        hybrid, dense = (Path(p) for p in args.models.split(","))
        print(f"# hybrid {hybrid.name}, dense {dense.name}, {args.t} threads")
    else:
        hybrid, dense = random_models(args)
    if "ttft" in args.parts:
        ttft_part(hybrid, dense, args)
    models = {"hybrid": hybrid, "dense": dense}
    if "memory" in args.parts:
        memory_part(models, args)
    if "depth" in args.parts:
        depth_part(models, args)


if __name__ == "__main__":
    main()
