"""Speculative decoding in kvlab serve against llama.cpp's llama-server: batch-1 greedy decode
tok/s on the same GGUF and the same prompt tokens, n-gram (prompt lookup) on both and, with a
draft pair, a draft model on both.

    .venv/bin/python bench/spec_vs_llama_server.py [--llama-server PATH] [-m MODEL.gguf]
        [-n 128] [-t 2] [-k 4] [-r 2] [--prompts 12] [--ignore-eos] [--baseline]
        [--draft-pair DIR [--skip-ngram]] [--llama-ngram-n 3] [--llama-spec "FLAGS"]
        [--fixed-k]

llama-server comes from --llama-server or $KVLAB_LLAMA_BIN/llama-server. The prompts are
bench/spec_decode.py's input-grounded requests (the answer copies from the prompt), rendered
with the model's chat template (plain text where it has none) and tokenized by kvlab; both
servers get those token ids through /v1/completions, temperature 0, one request at a time.

One server is up at a time (llama.cpp's idle threads spin and would slow the other), both on
-t threads and one sequence; a round starts each setup in turn, warms it with one request and
sends every prompt; rounds alternate the order. Decode tok/s is (completion tokens - 1) over
the time from the first streamed text to the last (the prompt's processing excluded); the
summary also gives end-to-end tok/s (from the request's send). Tokens come from the usage
each server reports; "kept" is accepted/proposed tokens, from kvlab's
usage.completion_tokens_details and llama-server's timings (draft_n, draft_n_accepted).
"same" says whether the two greedy texts agree (else the character where they part);
quantized kernels round differently in the two engines, so a text may part at a near tie
(bench/greedy_vs_llama_server.py measures that).

Sections: n-gram speculation on MODEL (kvlab --speculative ngram -k K; llama-server
--spec-type ngram-simple, lookup n-gram --llama-ngram-n, draft m-gram K; 3 by default, as
kvlab looks up the last 4 down to 1 tokens, where llama.cpp's own default of 12 seldom
matches within a reply); with --draft-pair DIR (bench/draft_pair.py's target and draft)
kvlab --speculative draft against llama-server --spec-type draft-simple -md DRAFT
--spec-draft-n-max K on that target. --baseline adds each engine without speculation per
model and prints each engine's speed-up over itself. kvlab sizes its proposals from their
acceptance and its measured step costs and may propose none where a draft costs more than
it saves; llama-server proposes at every step it can (its draft p-min is 0), as kvlab does
with --fixed-k (`--speculative-adaptive off`).
Figures are meaningless while other work shares the cores.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import socket
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from draft_pair import pair_paths  # the sibling scripts' helpers, by path
from greedy_vs_llama_server import start_llama_server
from server_soak import start_server
from spec_decode import grounded

from kvlab.tokenizer import Tokenizer, load_gguf_tokenizer
from kvlab.weights.checkpoint import open_checkpoint
from kvlab.weights.default_model import default_model_path

LLAMA_CONTEXT = 4096


@dataclass(frozen=True)
class Setup:
    """One server configuration: which engine, on which GGUF, with which extra flags."""

    label: str
    engine: str  # "kvlab" | "llama.cpp"
    model: Path
    flags: tuple[str, ...] = ()


@dataclass(frozen=True)
class Reply:
    """One streamed completion, timed on the client."""

    text: str
    tokens: int
    decode_s: float  # first streamed text -> last
    e2e_s: float  # send -> last streamed text
    drafted: int | None  # proposed tokens, where the server says
    accepted: int | None
    cached: int | None = None  # prompt tokens the server took from its cache, where it says

    @property
    def ttft_s(self) -> float:
        """send -> first streamed text"""
        return self.e2e_s - self.decode_s

    @property
    def decode_rate(self) -> float:
        return (self.tokens - 1) / self.decode_s if self.decode_s > 0 else math.nan

    @property
    def e2e_rate(self) -> float:
        return self.tokens / self.e2e_s if self.e2e_s > 0 else math.nan


# ---- prompts --------------------------------------------------------------------------------


def prompt_ids(model: Path, count: int) -> list[list[int]]:
    """The first `count` input-grounded requests as token ids: chat-rendered where the GGUF
    has a template, the bare text otherwise."""
    ckpt = open_checkpoint(model)
    tokenizer = load_gguf_tokenizer(ckpt.metadata)
    has_template = bool(ckpt.metadata.get("tokenizer.chat_template"))
    return [_encode(tokenizer, p, has_template) for p in grounded()[:count]]


def _encode(tokenizer: Tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat:
        return tokenizer.encode_chat([{"role": "user", "content": prompt}])
    return tokenizer.encode(prompt)


# ---- one request ----------------------------------------------------------------------------


def complete(client: httpx.Client, model: str, ids: list[int], n: int, ignore_eos: bool
             ) -> Reply:
    """Greedy /v1/completions of `ids`, streamed, with the usage chunk asked for."""
    body = {"model": model, "prompt": ids, "max_tokens": n, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    parts, times, usage, timings = [], [], None, {}
    start = time.perf_counter()
    with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise SystemExit(f"{client.base_url}: HTTP {resp.status_code}: "
                             f"{resp.read()[:300]!r}")
        for line in resp.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[5:])
            text = "".join(c.get("text") or "" for c in chunk.get("choices") or [])
            if text:
                parts.append(text)
                times.append(time.perf_counter())
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
    if not times:
        return Reply("", 0, 0.0, 0.0, None, None)
    tokens = usage["completion_tokens"] if usage else len(parts)
    drafted, accepted = _proposals(usage, timings)
    return Reply("".join(parts), tokens, times[-1] - times[0], times[-1] - start, drafted,
                 accepted, _cached(usage, timings))


def _proposals(usage: dict | None, timings: dict) -> tuple[int | None, int | None]:
    """(drafted, accepted): kvlab's usage details, else llama-server's timings."""
    details = (usage or {}).get("completion_tokens_details") or {}
    if "accepted_prediction_tokens" in details:
        kept = details["accepted_prediction_tokens"]
        return kept + details.get("rejected_prediction_tokens", 0), kept
    if "predicted_n" in timings:  # llama-server leaves draft_n out where it proposed none
        return timings.get("draft_n", 0), timings.get("draft_n_accepted", 0)
    return None, None


def _cached(usage: dict | None, timings: dict) -> int | None:
    """Prompt tokens served from the cache: the usage's details, else llama-server's cache_n."""
    details = (usage or {}).get("prompt_tokens_details") or {}
    return details.get("cached_tokens", timings.get("cache_n"))


def served_model(client: httpx.Client) -> str:
    return client.get("/v1/models").json()["data"][0]["id"]


# ---- servers and rounds ---------------------------------------------------------------------


def free_port() -> int:
    """A port nothing listens on now, so /health answers from the server started here."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(setup: Setup, args: argparse.Namespace) -> tuple[subprocess.Popen, int]:
    """The setup's server, healthy, and its port."""
    port = free_port()
    if setup.engine == "llama.cpp":
        flags = ("-c", str(LLAMA_CONTEXT), "--parallel", "1", *setup.flags)
        return start_llama_server(args.llama_server, setup.model, args.t, port, flags), port
    return start_server(port, ["--model", str(setup.model), "--threads", str(args.t),
                               "--max-num-seqs", "1", *setup.flags]), port


@contextmanager
def serving(setup: Setup, args: argparse.Namespace) -> Iterator[tuple[httpx.Client, str]]:
    """The setup's server, healthy: a client on it and its model's name; stopped afterwards.
    A failed request names the setup, its flags and the server's exit status."""
    proc, port = start(setup, args)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=3600) as client:
            yield client, served_model(client)
    except httpx.HTTPError as e:
        raise SystemExit(f"{setup.label} ({shlex.join(setup.flags)}): {type(e).__name__}: "
                         f"{e}; server exit status {proc.poll()}") from None
    finally:
        proc.terminate()
        proc.wait(timeout=120)


def run_setup(setup: Setup, prompts: list[list[int]], args: argparse.Namespace
              ) -> list[Reply]:
    """Start the server, warm it with one short request, send every prompt, stop it."""
    with serving(setup, args) as (client, model):
        complete(client, model, prompts[0], 8, False)
        return [complete(client, model, ids, args.n, args.ignore_eos) for ids in prompts]


def run_rounds(setups: list[Setup], prompts: dict[Path, list[list[int]]],
               args: argparse.Namespace) -> dict[str, list[list[Reply]]]:
    """{label: per prompt, its replies over the rounds}; odd rounds run the setups reversed."""
    results: dict[str, list[list[Reply]]] = {
        s.label: [[] for _ in prompts[s.model]] for s in setups}
    for r in range(args.r):
        for setup in setups if r % 2 == 0 else setups[::-1]:
            print(f"# round {r + 1}/{args.r}: {setup.label}", flush=True)
            for per_prompt, reply in zip(results[setup.label],
                                         run_setup(setup, prompts[setup.model], args)):
                per_prompt.append(reply)
    return results


# ---- report ---------------------------------------------------------------------------------


def median_of(replies: list[Reply], rate: Callable[[Reply], float]) -> float:
    return statistics.median(rate(r) for r in replies)


def acceptance(replies: list[Reply]) -> str:
    """accepted/proposed over the rounds; "-" where the server does not report them."""
    if any(r.drafted is None for r in replies):
        return "-"
    return f"{sum(r.accepted or 0 for r in replies)}/{sum(r.drafted or 0 for r in replies)}"


def agreement(a: str, b: str) -> str:
    """"yes", or the character at which the two texts part."""
    if a == b:
        return "yes"
    return f"@{next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))}"


def geomean(values: list[float]) -> float:
    finite = [v for v in values if v > 0 and math.isfinite(v)]
    return statistics.geometric_mean(finite) if finite else math.nan


def compare(title: str, ours: list[list[Reply]], theirs: list[list[Reply]],
            names: tuple[str, str] = ("kvlab", "llama.cpp")) -> None:
    """Per prompt: median decode tok/s of both, their ratio, acceptance, same greedy text."""
    print(f"\n{title}")
    print(f"{'#':>3} {names[0] + ' t/s':>14} {names[1] + ' t/s':>14} {'ratio':>6} "
          f"{'kept ' + names[0]:>14} {'kept ' + names[1]:>14} {'tokens':>7} {'same':>5}")
    decode, e2e, same = [], [], 0
    for i, (a, b) in enumerate(zip(ours, theirs)):
        ra, rb = (median_of(x, lambda r: r.decode_rate) for x in (a, b))
        decode.append(ra / rb)
        e2e.append(median_of(a, lambda r: r.e2e_rate) / median_of(b, lambda r: r.e2e_rate))
        agree = agreement(a[0].text, b[0].text)
        same += agree == "yes"
        print(f"{i:>3} {ra:>14.1f} {rb:>14.1f} {ra / rb:>6.2f} {acceptance(a):>14} "
              f"{acceptance(b):>14} {a[0].tokens:>3}/{b[0].tokens:<3} {agree:>5}")
    print(f"geometric mean {names[0]} / {names[1]}: decode {geomean(decode):.2f}, "
          f"end to end {geomean(e2e):.2f}; greedy texts agree on {same}/{len(ours)} prompts")


# ---- setups ---------------------------------------------------------------------------------


def ngram_setups(model: Path, args: argparse.Namespace) -> tuple[Setup, Setup]:
    llama = shlex.split(args.llama_spec) if args.llama_spec else [
        "--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(args.llama_ngram_n),
        "--spec-ngram-simple-size-m", str(args.k)]
    return (Setup("kvlab ngram", "kvlab", model,
                  ("--speculative", "ngram", "--num-speculative", str(args.k),
                   *fixed_k(args))),
            Setup("llama.cpp ngram", "llama.cpp", model, tuple(llama)))


def draft_setups(target: Path, draft: Path, args: argparse.Namespace) -> tuple[Setup, Setup]:
    return (Setup("kvlab draft", "kvlab", target,
                  ("--speculative", "draft", "--draft-model", str(draft), "--num-speculative",
                   str(args.k), *fixed_k(args))),
            Setup("llama.cpp draft", "llama.cpp", target,
                  ("--spec-type", "draft-simple", "-md", str(draft), "--spec-draft-n-max",
                   str(args.k), "--spec-draft-n-min", "0")))


def fixed_k(args: argparse.Namespace) -> tuple[str, ...]:
    """kvlab's flags for proposing -k tokens at every step it can, as llama-server does."""
    return ("--speculative-adaptive", "off") if args.fixed_k else ()


def plain_setups(model: Path, tag: str) -> tuple[Setup, Setup]:
    return (Setup(f"kvlab plain {tag}", "kvlab", model),
            Setup(f"llama.cpp plain {tag}", "llama.cpp", model))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", type=Path, default=Path(os.environ.get(
        "KVLAB_LLAMA_BIN", "llama.cpp/build/bin")) / "llama-server")
    ap.add_argument("-m", "--model", type=Path, default=None,
                    help="GGUF of the n-gram section (default: kvlab's default model)")
    ap.add_argument("-n", type=int, default=128, help="max tokens per prompt")
    ap.add_argument("-t", type=int, default=2, help="threads of each server")
    ap.add_argument("-k", type=int, default=4, help="tokens proposed per step, at most")
    ap.add_argument("-r", type=int, default=2, help="rounds (median per prompt)")
    ap.add_argument("--prompts", type=int, default=len(grounded()),
                    help="how many of spec_decode.py's input-grounded prompts")
    ap.add_argument("--ignore-eos", action="store_true", help="always generate -n tokens")
    ap.add_argument("--baseline", action="store_true",
                    help="also run each engine without speculation")
    ap.add_argument("--draft-pair", type=Path, default=None, metavar="DIR",
                    help="bench/draft_pair.py's folder: add the draft-model section")
    ap.add_argument("--fixed-k", action="store_true",
                    help="kvlab proposes -k tokens at every step it can instead of sizing "
                         "proposals (--speculative-adaptive off)")
    ap.add_argument("--skip-ngram", action="store_true", help="only the draft-model section")
    ap.add_argument("--llama-ngram-n", type=int, default=3,
                    help="llama-server's lookup n-gram (--spec-ngram-simple-size-n)")
    ap.add_argument("--llama-spec", default=None,
                    help="llama-server's n-gram flags, in place of the ngram-simple ones")
    args = ap.parse_args()
    if not args.llama_server.is_file():
        raise SystemExit(f"no llama-server at {args.llama_server}: pass --llama-server PATH "
                         "or set KVLAB_LLAMA_BIN to llama.cpp's build/bin")
    if args.skip_ngram and args.draft_pair is None:
        raise SystemExit("--skip-ngram leaves nothing to run without --draft-pair DIR")
    return args


def sections(args: argparse.Namespace) -> list[tuple[str, Setup, Setup, Setup | None,
                                                      Setup | None]]:
    """(title, kvlab spec, llama spec, kvlab plain, llama plain) per section to run."""
    out = []
    if not args.skip_ngram:
        model = args.model or Path(default_model_path())
        plain = plain_setups(model, "(n-gram model)") if args.baseline else (None, None)
        out.append((f"n-gram speculation on {model.name}, up to {args.k} per step",
                    *ngram_setups(model, args), *plain))
    if args.draft_pair is not None:
        target, draft = pair_paths(args.draft_pair)
        plain = plain_setups(target, "(draft target)") if args.baseline else (None, None)
        out.append((f"draft model {draft.name} for {target.name}, up to {args.k} per step",
                    *draft_setups(target, draft, args), *plain))
    return out


def main() -> None:
    args = parse_args()
    plan = sections(args)
    setups = [s for section in plan for s in section[1:] if s is not None]
    prompts = {s.model: prompt_ids(s.model, args.prompts) for s in setups}
    results = run_rounds(setups, prompts, args)
    for title, ours, theirs, ours_plain, theirs_plain in plan:
        compare(title, results[ours.label], results[theirs.label])
        for spec, plain, name in ((ours, ours_plain, "kvlab"), (theirs, theirs_plain,
                                                                  "llama.cpp")):
            if plain is not None:
                compare(f"{name}: speculative / plain ({title})", results[spec.label],
                        results[plain.label], ("spec", "plain"))


if __name__ == "__main__":
    main()
