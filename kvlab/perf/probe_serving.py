"""Serving's costs besides the engine's steps, timed: `kvlab serve` runs the model and `kvlab
loadtest` streams from it, each in its own process on this machine, as a user runs them; what
the client sees past the step model's prediction of the very same requests is the streaming
path's cost (the server's detokenizing, SSE encoding and HTTP writes, the event loop taking
each step's outputs, the client reading the stream, all on the same cores).

The model itself is served, not the replica the steps were timed on: a replica's random
weights pick the same few tokens (special ones, of no text), and the client times text.

    measured ITL p50 at c streams - predicted step at c streams = step + c x token
    measured TTFT p50 at 1 stream - predicted TTFT at 1 stream  = request + step + token

Two loads (LEVELS) give step and token; the first token's gap gives request. The medians are
over every token gap and first token of each load.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvlab.errors import KvlabError
from kvlab.perf.hardware import HardwareSpec, StreamCosts
from kvlab.perf.model import ModelSpec

LEVELS = (1, 8)  # streams at once, in two loads
REQUESTS = 2  # requests per stream in each load
MAX_TOKENS = 48  # tokens each request streams (ignore_eos)
START_TIMEOUT_S = 180.0


def measure_stream_costs(path: Path, model: ModelSpec, hw: HardwareSpec, threads: int,
                         kv_dtype: str) -> StreamCosts:
    """Serve the GGUF at `path` with `threads`, load it at each of LEVELS and fit the costs
    against the step model of `model` (its spec) on `hw` (with its whole-step factors) at
    `kv_dtype`."""
    with _server(path, threads) as url:
        runs = {c: _load(url, c) for c in LEVELS}
    return fit_stream_costs(model, hw, kv_dtype, runs)


def fit_stream_costs(model: ModelSpec, hw: HardwareSpec, kv_dtype: str,
                     runs: Mapping[int, Mapping[str, Any]]) -> StreamCosts:
    """The costs of the module docstring from load-test summaries (`kvlab loadtest --json`)
    by concurrency, against the step model's prediction of the same requests."""
    from kvlab.perf.serving import RequestSpec, predict_serving

    bare = replace(hw, stream=None)
    levels = []
    for c, run in sorted(runs.items()):
        done = max(int(run["completed"]), 1)
        specs = [RequestSpec(max(int(run["total_input_tokens"]) // done, 1),
                             max(int(run["total_output_tokens"]) // done, 1))] * done
        p = predict_serving(model, bare, specs, c, kv_dtype=kv_dtype)
        levels.append({"concurrency": c, "itl_p50": run["itl_ms"]["p50"] / 1e3,
                       "predicted_itl_p50": p.itl(0.5), "ttft_p50": run["ttft_ms"]["p50"] / 1e3,
                       "predicted_ttft_p50": p.ttft(0.5),
                       "output_tok_s": run["output_throughput"],
                       "predicted_output_tok_s": p.output_tok_s})
    gaps = [(lv["concurrency"], lv["itl_p50"] - lv["predicted_itl_p50"]) for lv in levels]
    (c1, g1), (c2, g2) = gaps[0], gaps[-1]
    token = max((g2 - g1) / (c2 - c1), 0.0) if c2 > c1 else 0.0
    step = max(g1 - c1 * token, 0.0)
    first = levels[0]
    request = max(first["ttft_p50"] - first["predicted_ttft_p50"] - step - c1 * token, 0.0)
    return StreamCosts(token, step, request, tuple(levels))


@contextmanager
def _server(path: Path, threads: int) -> Iterator[str]:
    """`kvlab serve` on the GGUF at `path` at a free local port, until the block ends."""
    port = _free_port()
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvlab.cli.main", "serve", "--model", str(path),
             "--port", str(port), "--threads", str(threads), "--log-level", "warning"],
            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(url, proc, log)
            yield url
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_healthy(url: str, proc: subprocess.Popen, log: Any) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            tail = log.read().decode(errors="replace")[-2000:]
            raise KvlabError(f"kvlab serve on the probed model exited ({proc.returncode}):"
                             f"\n{tail}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise KvlabError(f"kvlab serve on the probed model was not healthy in "
                     f"{START_TIMEOUT_S:.0f} s")


def _load(url: str, concurrency: int) -> dict[str, Any]:
    """`kvlab loadtest` at `concurrency` streams: its JSON summary."""
    cmd = [sys.executable, "-m", "kvlab.cli.main", "loadtest", "--url", url, "-c",
           str(concurrency), "-n", str(REQUESTS * concurrency), "--max-tokens", str(MAX_TOKENS),
           "--ignore-eos", "--json"]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ))
    if done.returncode != 0:
        raise KvlabError(f"kvlab loadtest against the probed model failed "
                         f"({done.returncode}): {done.stderr[-2000:]}")
    summary = json.loads(done.stdout)
    if not summary.get("completed"):
        raise KvlabError(f"kvlab loadtest against the probed model completed no request: "
                         f"{summary.get('errors')}")
    return summary
