"""kvlab against llama.cpp on a Llama-3.2-1B-shaped model at several quant types, and on Gemma.

    .venv/bin/python bench/quant_peers.py [-t 2] [-r 3] [-p 512] [-n 128]
        [--types Q4_K_M,Q3_K_M,Q2_K,IQ4_XS] [--workdir /tmp/kvlab-quant-peers]
        [--llama-bin DIR] [--vocab FILE] [--ik-llama-bin DIR] [--models A.gguf B.gguf]
        [--skip-gemma] [--random-blocks]

The IQ2/IQ3 mixes (IQ2_M is llama.cpp's name for the IQ2_S mix, IQ3_M the IQ3_S one's):

    .venv/bin/python bench/quant_peers.py --types IQ2_XXS,IQ2_XS,IQ2_M,IQ3_XXS,IQ3_M \
        --llama-bin /work/peers/build/bin \
        --vocab /work/peers/llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-llama-bpe.gguf \
        -t 2 -r 3 -p 512 -n 128 --skip-gemma

Steps, each skipped when its output already exists in --workdir:
  1. llama-quantize --dry-run on a sparse F16 skeleton of the model below gives each tensor's
     ggml type for the mix (bench/planned_gguf.py);
  2. a mix llama-quantize needs an importance matrix for (IQ1, IQ2 and, in this llama.cpp,
     IQ3_XXS, whose q/k projections are IQ2_S) is planned again with a stand-in imatrix
     file given to --dry-run (so the plan is the one an imatrix quantization gets) and
     written directly as random blocks of the planned types, weights of std ~0.02; so is
     every mix with --random-blocks;
  3. otherwise: write a random-weight F16 GGUF with Llama-3.2-1B's shape (16 layers, hidden
     2048, 32/8 heads of 64, FFN 8192, tied output, rope theta 500000 with llama3 scaling
     baked into rope_freqs.weight as llama.cpp's converter does) and the real Llama 3
     tokenizer copied from llama.cpp's vocabulary file, and quantize it with llama-quantize.
Then, for every quantized file, the default Gemma 3 model and any --models, it runs `kvlab
bench` and llama.cpp's `llama-bench` (and ik_llama.cpp's, if given) as separate processes,
alternating, one repetition each per round, so machine noise hits all engines alike and each
has the machine alone. It prints median pp/tg tok/s, the ratios kvlab / llama.cpp (or the
faster peer) and the decode ceiling: this machine's read bandwidth (probed before each round)
over the bytes one decode step reads with the weights as the file stores them (the yardstick
common to every engine).
An engine that cannot run a file (kvlab without a kernel for a quant type) gets a row with the
first line of its error; the other files still run.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from planned_gguf import (
    QuantizeFailed,
    add_file_type,
    skeleton_plan,
    write_gguf,
    write_planned,
)
from planned_gguf import error_line as _error_line

LLAMA_BIN = Path("/tmp/llama/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin")
VOCAB_FILE = Path("/tmp/vocab/ggml-vocab-llama-bpe.gguf")
DEFAULT_TYPES = "Q4_K_M,Q3_K_M,Q2_K,IQ4_XS"
F16_NAME = "llama-3.2-1b-shape-F16.gguf"
KVLAB_CLI = [sys.executable, "-c", "import sys; from kvlab.cli.main import main; sys.exit(main())"]
ENGINE_TIMEOUT_S = 1800


# ---------------------------------------------------------------- the Llama-shaped model


@dataclass(frozen=True)
class LlamaShape:
    """Llama-3.2-1B's config.json, the fields a GGUF carries."""

    layers: int = 16
    hidden: int = 2048
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 64
    ffn: int = 8192
    vocab: int = 128256
    context: int = 131072
    rope_theta: float = 500000.0
    rms_eps: float = 1e-5
    # rope_scaling {"rope_type": "llama3", ...}
    rope_factor: float = 32.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192


def llama3_rope_factors(s: LlamaShape) -> np.ndarray:
    """rope_freqs.weight [head_dim / 2] f32: per-frequency divisors, as convert_hf_to_gguf.py
    computes them for rope_type llama3 (1 at high frequencies, the factor at low ones)."""
    freqs = 1.0 / s.rope_theta ** (np.arange(0, s.head_dim, 2, dtype=np.float64) / s.head_dim)
    low_wavelen = s.original_context / s.low_freq_factor
    high_wavelen = s.original_context / s.high_freq_factor
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(s.rope_factor)
        else:
            smooth = (s.original_context / wavelen - s.low_freq_factor) / \
                (s.high_freq_factor - s.low_freq_factor)
            factors.append(1 / ((1 - smooth) / s.rope_factor + smooth))
    return np.array(factors, dtype=np.float32)


def llama_tensors(s: LlamaShape) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy shape [rows, cols]) of every tensor, in llama.cpp's names (the ones
    kvlab's GGUF_NAMES table reads). Tied output: no output.weight."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    tensors = [("token_embd.weight", (s.vocab, s.hidden)),
               ("rope_freqs.weight", (s.head_dim // 2,))]
    for i in range(s.layers):
        tensors += [(f"blk.{i}.{name}.weight", shape) for name, shape in (
            ("attn_norm", (s.hidden,)), ("attn_q", (q, s.hidden)), ("attn_k", (kv, s.hidden)),
            ("attn_v", (kv, s.hidden)), ("attn_output", (s.hidden, q)),
            ("ffn_norm", (s.hidden,)), ("ffn_gate", (s.ffn, s.hidden)),
            ("ffn_up", (s.ffn, s.hidden)), ("ffn_down", (s.hidden, s.ffn)))]
    return tensors + [("output_norm.weight", (s.hidden,))]


def tensor_values(name: str, shape: tuple[int, ...], s: LlamaShape, seed: int,
                  std: float = 0.02) -> np.ndarray:
    """Norms 1.0 and rope factors in f32 (as the converter keeps 1-D tensors); matrices
    N(0, std) in f16, drawn in row chunks so no f32 copy of a whole matrix exists."""
    if name == "rope_freqs.weight":
        return llama3_rope_factors(s)
    if len(shape) == 1:
        return np.ones(shape, np.float32)
    rng = np.random.default_rng(seed)
    out = np.empty(shape, np.float16)
    rows = max(1, (1 << 22) // shape[1])
    for r in range(0, shape[0], rows):
        chunk = rng.standard_normal((min(rows, shape[0] - r), shape[1]), dtype=np.float32)
        out[r:r + rows] = chunk * std
    return out


def write_llama_gguf(path: Path, vocab_file: Path, s: LlamaShape = LlamaShape(),
                     ftype: str = "F16", types: dict[str, str] | None = None,
                     sparse: bool = False) -> None:
    """Stream the model to `path` (planned_gguf.write_gguf): F16 matrices, or with `types`
    (a plan for the file type `ftype`) random blocks of each tensor's type; `sparse`: a
    skeleton for llama-quantize --dry-run."""

    def add_keys(w) -> None:
        _llama_metadata(w, s, ftype)
        _copy_tokenizer(w, vocab_file, s.vocab)

    write_gguf(path, "llama", add_keys, llama_tensors(s), _is_f32,
               lambda name, shape, seed: tensor_values(name, shape, s, seed), types, sparse)


def _is_f32(name: str, shape: tuple[int, ...]) -> bool:
    return len(shape) == 1  # the converter keeps norms and rope factors F32


def _llama_metadata(w, s: LlamaShape, ftype: str = "F16") -> None:
    """The keys llama.cpp's converter writes for Llama-3.2-1B (and llama-quantize's for a
    quantized `ftype`)."""
    w.add_string("general.name", "Llama-3.2-1B-shaped (random weights)")
    add_file_type(w, ftype)
    for key, value in (("block_count", s.layers), ("context_length", s.context),
                       ("embedding_length", s.hidden), ("feed_forward_length", s.ffn),
                       ("attention.head_count", s.heads), ("attention.head_count_kv", s.kv_heads),
                       ("attention.key_length", s.head_dim),
                       ("attention.value_length", s.head_dim),
                       ("rope.dimension_count", s.head_dim), ("vocab_size", s.vocab)):
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.rope.freq_base", s.rope_theta)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", s.rms_eps)


def _copy_tokenizer(w, vocab_file: Path, vocab: int) -> None:
    """Every tokenizer.* key of a llama.cpp vocabulary file, with its GGUF types, sized to
    the model's `vocab` embedding rows: "[PAD<i>]" tokens (type UNUSED) added, as llama.cpp's
    converter pads a checkpoint's vocabulary, or the file's own trailing ones dropped."""
    from gguf import GGUFReader, GGUFValueType

    if not vocab_file.exists():
        raise SystemExit(f"no vocabulary file at {vocab_file}: pass --vocab (llama.cpp's "
                         f"models/ggml-vocab-*.gguf)")
    reader = GGUFReader(str(vocab_file))
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    real = len(tokens)
    while real and tokens[real - 1].startswith("[PAD"):
        real -= 1
    if real > vocab:
        raise SystemExit(f"{vocab_file} has {real} tokens, more than the model's {vocab}")
    have = len(tokens)
    padding = {"tokenizer.ggml.tokens": [f"[PAD{i}]" for i in range(have, vocab)],
               "tokenizer.ggml.token_type": [5] * (vocab - have),  # UNUSED
               "tokenizer.ggml.scores": [-1000.0] * (vocab - have)}
    for key, f in reader.fields.items():
        if key.startswith("tokenizer."):
            sub = f.types[1] if f.types[0] == GGUFValueType.ARRAY else None
            value = (f.contents() + padding[key])[:vocab] if key in padding else f.contents()
            w.add_key_value(key, value, f.types[0], sub_type=sub)


copy_tokenizer = _copy_tokenizer


def ensure_f16(workdir: Path, vocab_file: Path) -> Path:
    path = workdir / F16_NAME
    if path.exists():
        print(f"# have {path}")
        return path
    print(f"# writing {path} (random N(0, 0.02) weights, ~2.5 GB)", flush=True)
    start = time.perf_counter()
    write_llama_gguf(path, vocab_file)
    print(f"#   done in {time.perf_counter() - start:.0f} s")
    return path


def quantize(f16: Path, qtype: str, llama_bin: Path, allow_requantize: bool = False) -> Path:
    """f16 (a name with "F16" in it) -> the same name with {qtype} beside it; llama-quantize's log goes beside
    it too (.log), and the lines that warn are echoed. `allow_requantize`: the source is
    itself quantized (its name says Q8_0 where it says F16 here)."""
    source_type = "Q8_0" if allow_requantize else "F16"
    out = f16.with_name(f16.name.replace(source_type, qtype))
    cmd = [str(llama_bin / "llama-quantize"), *(["--allow-requantize"] * allow_requantize),
           str(f16), str(out.with_suffix(".part")), qtype, str(os.cpu_count() or 1)]
    if out.exists():
        print(f"# have {out}  ($ {shlex.join(cmd)})")
        return out
    print(f"$ {shlex.join(cmd)}", flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    out.with_suffix(".log").write_text(log)
    for line in log.splitlines():
        if "warn" in line.lower() or "imatrix" in line.lower():
            print(f"#   {line.strip()}")
    if proc.returncode != 0:
        raise QuantizeFailed(f"llama-quantize {qtype} exited {proc.returncode}: "
                             f"{_error_line(log)} (log: {out.with_suffix('.log')})")
    out.with_suffix(".part").rename(out)
    print(f"#   {out.stat().st_size / 1e6:.0f} MB in {time.perf_counter() - start:.0f} s")
    return out


# ---------------------------------------------------------------- engines


@dataclass(frozen=True)
class Run:
    """One repetition of pp and tg; kvlab also reports the bytes its decode step reads in
    its in-memory layout and the GB/s that reached."""

    pp: float
    tg: float
    kvlab_bytes_per_token: float | None = None
    kvlab_gb_s: float | None = None
    kvlab_weights_read: float | None = None  # weight bytes per token counted in its kernels

    def note(self) -> str:
        return f"pp {self.pp:.1f}, tg {self.tg:.2f} tok/s"


class EngineFailed(Exception):
    pass


@dataclass(frozen=True)
class KvlabBench:
    """`kvlab bench` in its own process (the kvlab this script imports: PYTHONPATH decides)."""

    name: str = "kvlab"

    def command(self, model: Path, args: argparse.Namespace) -> list[str]:
        return KVLAB_CLI + ["bench", "-m", str(model), "-p", str(args.p), "-n", str(args.n),
                            "-r", "1", "-t", str(args.t), "-o", "json"]

    def parse(self, stdout: str, args: argparse.Namespace) -> Run:
        results = {r["test"]: r for r in json.loads(stdout[stdout.index("{"):])["results"]}
        tg = results[f"tg{args.n}"]
        return Run(results[f"pp{args.p}"]["tok_s_mean"], tg["tok_s_mean"],
                   tg["bytes_per_token"], tg["gb_s"], tg.get("weights_read_per_token"))


@dataclass(frozen=True)
class LlamaBench:
    """llama.cpp's (or ik_llama.cpp's) llama-bench, JSON output."""

    name: str
    bin_dir: Path

    def command(self, model: Path, args: argparse.Namespace) -> list[str]:
        return [str(self.bin_dir / "llama-bench"), "-m", str(model), "-p", str(args.p),
                "-n", str(args.n), "-r", "1", "-t", str(args.t), "-o", "json"]

    def parse(self, stdout: str, args: argparse.Namespace) -> Run:
        tests = json.loads(stdout[stdout.index("["):])
        pp = [t["avg_ts"] for t in tests if t["n_prompt"] == args.p and t["n_gen"] == 0]
        tg = [t["avg_ts"] for t in tests if t["n_gen"] == args.n and t["n_prompt"] == 0]
        return Run(pp[0], tg[0])


Engine = KvlabBench | LlamaBench


def run_once(engine: Engine, model: Path, args: argparse.Namespace) -> Run:
    cmd = engine.command(model, args)
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True,
                              timeout=ENGINE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise EngineFailed(f"timed out after {ENGINE_TIMEOUT_S} s") from None
    if proc.returncode != 0:
        raise EngineFailed(f"exit {proc.returncode}: {_error_line(proc.stderr + proc.stdout)}")
    try:
        return engine.parse(proc.stdout, args)
    except (ValueError, KeyError, IndexError) as e:
        raise EngineFailed(f"unreadable output ({e!r}): {proc.stdout[-300:]!r}") from None


@dataclass
class Series:
    """One engine's repetitions on one file; `error` once it failed (no more attempts)."""

    runs: list[Run] = field(default_factory=list)
    error: str | None = None

    def median(self, attr: str) -> float | None:
        values = [getattr(r, attr) for r in self.runs if getattr(r, attr) is not None]
        return statistics.median(values) if values else None


def bench_file(model: Path, engines: list, args: argparse.Namespace,
               bandwidths: list[float] | None = None,
               run_one: Callable[..., Run] | None = None) -> dict[str, Series]:
    """`args.r` rounds; each round runs every engine once, in turn. With `bandwidths`, each
    round first probes the read bandwidth and appends it: on a shared host it drifts over
    minutes, and the decode ceiling is then read against the bandwidth of the same rounds.
    `run_one(engine, model, args)`: one repetition (default run_once); what it returns has
    a note() for the progress line."""
    run_one = run_one or run_once
    series = {e.name: Series() for e in engines}
    for rnd in range(1, args.r + 1):
        if bandwidths is not None and (gb_s := measure_bandwidth(args.t, quiet=True)):
            bandwidths.append(gb_s)
        for engine in engines:
            s = series[engine.name]
            if s.error is not None:
                continue
            start = time.perf_counter()
            try:
                run = run_one(engine, model, args)
                s.runs.append(run)
                note = run.note()
            except EngineFailed as e:
                s.error = str(e)
                note = f"FAILED {e}"
            print(f"# round {rnd}/{args.r} {engine.name:<12} {model.name}: {note} "
                  f"({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    return series


# ---------------------------------------------------------------- the decode ceiling


def decode_bytes_as_stored(model: Path, context: int) -> tuple[float, float]:
    """(bytes one decode step reads at `context` tokens, the file's tensor bytes): every
    tensor but the embedding table, whose one row is read, plus the output matrix (the table
    itself when the output is tied), plus an f16 KV cache (llama.cpp's default)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(model))
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    total = sum(sizes.values())
    weights = total if "output.weight" not in sizes else total - sizes["token_embd.weight"]

    def meta(key: str, default: int | None = None) -> int:
        f = reader.fields.get(f"{arch}.{key}")
        return int(f.contents()) if f is not None else int(default)

    arch = reader.fields["general.architecture"].contents()
    heads = meta("attention.head_count")
    head_dim = meta("attention.key_length", meta("embedding_length") // heads)
    kv_per_token = meta("block_count") * meta("attention.head_count_kv", heads) * \
        (head_dim + meta("attention.value_length", head_dim)) * 2
    return weights + kv_per_token * context, total


_BANDWIDTH_SNIPPET = """
import sys, torch
from kvlab.kernels import set_num_threads
from kvlab.probe.machine import measure_bandwidth
threads, budget, both = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3] == "1"
torch.set_num_threads(threads)
set_num_threads(threads)
small = measure_bandwidth(512, budget, huge_pages=False)[0] if both else 0.0
gb_s, runs = measure_bandwidth(512, budget)
print(gb_s / 1e9, runs, small / 1e9)
"""


def measure_bandwidth(threads: int, quiet: bool = False) -> float | None:
    """GB/s of kvlab's C stream read over 512 MiB at `threads` (what `kvlab probe` measures),
    in its own process so nothing of it stays running beside the engines. The ceiling is the
    read in 2 MiB pages, as kvlab keeps its weights; the read in 4 KiB pages is printed too
    (`quiet`: a shorter probe between rounds, 2 MiB pages only, printed with the file's
    ceiling)."""
    cmd = [sys.executable, "-c", _BANDWIDTH_SNIPPET, str(threads), "1.5" if quiet else "4.0",
           "0" if quiet else "1"]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"# bandwidth probe failed: {_error_line(proc.stderr)}; no ceiling line")
        return None
    gb_s, runs, small = proc.stdout.split()
    if quiet:
        return float(gb_s)
    print(f"# read bandwidth at {threads} threads: {float(gb_s):.2f} GB/s in 2 MiB pages, "
          f"{float(small):.2f} in 4 KiB pages (kvlab.probe.machine.measure_bandwidth, 512 MiB, "
          f"best of {runs})")
    return float(gb_s)


# ---------------------------------------------------------------- the report


def report(model: Path, series: dict[str, Series], bandwidth: float | None,
           args: argparse.Namespace, step_bytes: float | None = None,
           probes: list[float] | None = None) -> None:
    """`step_bytes`: what one decode step reads where not every tensor is (MoE); `probes`:
    the bandwidths probed between this file's rounds, whose median is then the ceiling's."""
    dense_bytes, file_bytes = decode_bytes_as_stored(model, args.n // 2 + 1)
    step_bytes = step_bytes or dense_bytes
    names = list(series)
    peers = names[1:]
    ratio_head = f"kvlab/{peers[0]}" if len(peers) == 1 else "kvlab/faster"
    print(f"\n== {model.name}  ({file_bytes / 1e6:.0f} MB of tensors; {args.t} threads, "
          f"median of {args.r} alternating rounds, tok/s)")
    print(f"{'test':<8}" + "".join(f"{n:>14}" for n in names) + f"{ratio_head:>18}")
    for test, attr in ((f"pp{args.p}", "pp"), (f"tg{args.n}", "tg")):
        med = {n: s.median(attr) for n, s in series.items()}
        cells = "".join(f"{_cell(med[n], series[n]):>14}" for n in names)
        print(f"{test:<8}{cells}{_ratio(med, peers):>26}")
    for name, s in series.items():
        if s.error is not None:
            print(f"{name} failed: {s.error}")
    if probes:
        bandwidth = statistics.median(probes)
        print(f"# read bandwidth probed before each round: "
              f"{', '.join(f'{b:.2f}' for b in probes)} GB/s; the ceiling takes the median")
    _ceiling_line(series, step_bytes, bandwidth)


def _cell(value: float | None, s: Series) -> str:
    if value is None:
        return "failed" if s.error else "-"
    return f"{value:.2f}"


def _ratio(med: dict[str, float | None], peers: list[str]) -> str:
    ran = [p for p in peers if med[p]]
    if med["kvlab"] is None or not ran:
        return "-"
    best = max(ran, key=lambda p: med[p])
    label = f" ({best})" if len(peers) > 1 else ""
    return f"{med['kvlab'] / med[best]:.2f}x{label}"


def _ceiling_line(series: dict[str, Series], step_bytes: float,
                  bandwidth: float | None) -> None:
    """tg x bytes per token / bandwidth: the share of the memory-bound ceiling reached."""
    if bandwidth:
        ceiling = bandwidth * 1e9 / step_bytes
        shares = ", ".join(f"{n} {100 * tg / ceiling:.0f} %" for n, s in series.items()
                           if (tg := s.median("tg")))
        print(f"decode ceiling: {bandwidth:.2f} GB/s / {step_bytes / 1e6:.1f} MB per token "
              f"(weights as stored + f16 KV) = {ceiling:.1f} tok/s; "
              f"{shares or 'no engine ran'}")
    kv = series["kvlab"]
    if kv.median("kvlab_bytes_per_token"):
        print(f"kvlab's own figures: its step reads "
              f"{kv.median('kvlab_bytes_per_token') / 1e6:.1f} MB per token in its in-memory "
              f"layout, {kv.median('kvlab_gb_s'):.2f} GB/s reached"
              + (f"; its kernels counted {kv.median('kvlab_weights_read') / 1e6:.1f} MB of "
                 "weights read per token" if kv.median("kvlab_weights_read") else ""))
    print("raw tg:", {n: [round(r.tg, 2) for r in s.runs] for n, s in series.items()},
          "pp:", {n: [round(r.pp, 1) for r in s.runs] for n, s in series.items()})


# ---------------------------------------------------------------- main


def cpu_kind() -> str:
    """'AVX512-VNNI' or 'AVX2-only' (what llama.cpp's and kvlab's kernels dispatch on), with
    the CPU's name and core count. KVLAB_NO_VNNI=1 runs kvlab's AVX2 kernels on an AVX-512
    CPU; pair it with peers built for AVX2 (cmake -DGGML_NATIVE=OFF -DGGML_AVX2=ON ...)."""
    flags, name = set(), "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags" and not flags:
            flags = set(value.split())
        elif key.strip() == "model name":
            name = value.strip()
    if "avx512_vnni" in flags:
        kind = "AVX512-VNNI"
        if os.environ.get("KVLAB_NO_VNNI"):  # kvlab's kernels as on an AVX2-only CPU
            kind += ", kvlab on its AVX2 paths (KVLAB_NO_VNNI=1)"
    elif "avx512f" in flags:
        kind = "AVX512 without VNNI"
    elif "avx2" in flags:
        kind = "AVX2-only" + (" (with AVX-VNNI)" if "avx_vnni" in flags else "")
    else:
        kind = "no AVX2"
    return f"{kind}; {name}; {os.cpu_count()} logical cores"


def add_run_args(ap: argparse.ArgumentParser, types: str, workdir: str) -> None:
    """The flags every peer benchmark takes: threads, rounds, test sizes, quant types, the
    work folder, llama.cpp's binaries and the vocabulary file."""
    ap.add_argument("-t", type=int, default=2, help="threads, every engine")
    ap.add_argument("-r", type=int, default=3, help="alternating rounds")
    ap.add_argument("-p", type=int, default=512, help="prompt tokens (pp test)")
    ap.add_argument("-n", type=int, default=128, help="generated tokens (tg test)")
    ap.add_argument("--types", default=types, help="llama-quantize types, comma-separated")
    ap.add_argument("--workdir", type=Path, default=Path(workdir))
    ap.add_argument("--llama-bin", type=Path, default=LLAMA_BIN,
                    help="llama.cpp's build/bin (llama-quantize, llama-bench)")
    ap.add_argument("--vocab", type=Path, default=VOCAB_FILE,
                    help="llama.cpp's ggml-vocab-llama-bpe.gguf (the Llama 3 tokenizer)")


def check_run_args(ap: argparse.ArgumentParser, args: argparse.Namespace,
                   binaries: list[Path]) -> None:
    for name in ("t", "r", "p", "n"):
        if getattr(args, name) < 1:
            ap.error(f"-{name} must be >= 1, got {getattr(args, name)}")
    for binary in [args.llama_bin / "llama-quantize", args.llama_bin / "llama-bench",
                   *binaries]:
        if not binary.is_file():
            ap.error(f"no {binary}: pass --llama-bin / --ik-llama-bin DIR (a build/bin)")


def print_header(engines: list[Engine], args: argparse.Namespace) -> float | None:
    """The CPU, this command and each engine's, then the measured bandwidth (returned)."""
    print(f"# CPU: {cpu_kind()}")
    print(f"# {shlex.join([sys.executable] + sys.argv)}")
    for engine in engines:
        print(f"# {engine.name}: {shlex.join(engine.command(Path('FILE'), args))}")
    return measure_bandwidth(args.t)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(ap, DEFAULT_TYPES, "/tmp/kvlab-quant-peers")
    ap.add_argument("--ik-llama-bin", type=Path, default=None,
                    help="ik_llama.cpp's build/bin: its llama-bench runs as a third engine")
    ap.add_argument("--models", type=Path, nargs="+", default=[], help="extra GGUF files")
    ap.add_argument("--skip-gemma", action="store_true", help="leave out the default Gemma 3")
    ap.add_argument("--random-blocks", action="store_true",
                    help="write every type as random blocks of llama-quantize's plan, not "
                         "only the mixes it needs an imatrix for (no F16 file, no quantizing)")
    args = ap.parse_args(argv)
    check_run_args(ap, args, [args.ik_llama_bin / "llama-bench"] if args.ik_llama_bin else [])
    return args


def model_files(args: argparse.Namespace) -> Iterator[Path]:
    """Gemma first (small: a broken setup shows in seconds), then each quant type, then
    --models. A type that cannot be made is reported and left out."""
    if not args.skip_gemma:
        from kvlab.weights.default_model import default_model_path

        yield Path(default_model_path())
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    if types:
        args.workdir.mkdir(parents=True, exist_ok=True)
    for qtype in types:
        try:
            yield quantized(args, qtype)
        except QuantizeFailed as e:
            print(f"# {e}")
    yield from args.models


# the mixes llama-quantize refuses without an imatrix: some of their tensors are IQ1, IQ2,
# IQ3_XXS, or Q2_K within Q2_K_S (llama-quant.cpp's tensor_requires_imatrix)
IMATRIX_MIXES = frozenset({"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M",
                           "IQ3_XXS", "IQ3_XS", "Q2_K_S"})


def quantized(args: argparse.Namespace, qtype: str) -> Path:
    """The Llama-shaped `qtype` file: llama-quantize's pass over the F16 file, or, for a mix
    llama-quantize needs an imatrix for (or every mix, with --random-blocks), random blocks
    of the types its dry run plans (bench/planned_gguf.py). Only those take a dry run, and a
    mix that needs no imatrix is quantized where the dry run fails (a llama-quantize without
    --dry-run)."""
    out = args.workdir / F16_NAME.replace("F16", qtype)
    if out.exists():
        print(f"# have {out} ({out.stat().st_size / 1e9:.2f} GB)")
        return out
    if args.random_blocks or qtype in IMATRIX_MIXES:
        write = functools.partial(write_llama_gguf, vocab_file=args.vocab)
        try:
            plan, imatrix = skeleton_plan(out, qtype, args.llama_bin, write)
        except QuantizeFailed as e:
            if qtype in IMATRIX_MIXES:
                raise
            print(f"# {e}: {qtype} quantized instead")
        else:
            if imatrix or args.random_blocks:
                return write_planned(out, qtype, plan, imatrix, llama_tensors(LlamaShape()),
                                     write, _is_f32)
    return quantize(ensure_f16(args.workdir, args.vocab), qtype, args.llama_bin)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    engines: list[Engine] = [KvlabBench(), LlamaBench("llama.cpp", args.llama_bin)]
    if args.ik_llama_bin:
        engines.append(LlamaBench("ik_llama.cpp", args.ik_llama_bin))
    bandwidth = print_header(engines, args)
    files = list(model_files(args))  # all quantizing first: the benchmarks then run alone
    for model in files:
        probes: list[float] = []
        report(model, bench_file(model, engines, args, probes), bandwidth, args, probes=probes)
        sys.stdout.flush()


if __name__ == "__main__":
    main()
