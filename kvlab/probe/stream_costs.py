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
over every token gap and first token of each load. Since the costs change the steps the
prediction replays, the fit is repeated with the costs found so far in the prediction,
until what is left is small. Last, the busiest load's first tokens say how much of the
request cost is the server's intake, spent on one request at a time (requests sent together
then reach the engine's steps apart: kvlab.estimate.serving_replay).
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

from kvlab.cost import ModelSpec
from kvlab.errors import KvlabError
from kvlab.estimate.hardware import HardwareSpec, StreamCosts
from kvlab.estimate.serving_replay import RequestSpec, predict_serving

LEVELS = (1, 8)  # streams at once, in two loads
# requests per stream in each load: the 1-stream load sends the load test's first 16 prompts
# (its first tokens give the request cost), the 8-stream load the same 16 again, so each load
# has one kind of prompt (uncached, then served by the prefix cache up to its last block), as
# the fit's one average prompt per load assumes
REQUESTS = {1: 16, 8: 2}
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


SERIAL_SHARES = tuple(i / 10 for i in range(11))  # of the request cost, tried by the fit


def fit_stream_costs(model: ModelSpec, hw: HardwareSpec, kv_dtype: str,
                     runs: Mapping[int, Mapping[str, Any]]) -> StreamCosts:
    """The costs of the module docstring from load-test summaries (`kvlab loadtest --json`)
    by concurrency, against the step model's prediction of the same requests (the prompt
    tokens the server computed, less those its prefix cache served); then the share of the
    request cost the server spends on one request at a time, whichever of SERIAL_SHARES
    predicts the busiest load's TTFT p50 best (its requests are sent together: the share
    decides how many of them the first step takes)."""
    fits = [_fit(model, hw, kv_dtype, runs, share) for share in SERIAL_SHARES]
    return min(fits, key=lambda c: abs(c.levels[-1]["ttft_p50"]
                                       - c.levels[-1]["predicted_ttft_p50"]))


def _fit(model: ModelSpec, hw: HardwareSpec, kv_dtype: str,
         runs: Mapping[int, Mapping[str, Any]], serial: float, passes: int = 6) -> StreamCosts:
    """token, step and request at a given serial share. The costs move the predicted steps
    (a slower step, requests that reach different steps), so each pass predicts with the
    costs fitted so far and fits what is still unexplained on top."""
    costs = StreamCosts(0.0, 0.0, 0.0, serial=serial)
    for _ in range(passes):
        timed = replace(hw, stream=costs)
        levels = [_level(model, timed, kv_dtype, c, run) for c, run in sorted(runs.items())]
        gaps = [(lv["concurrency"], lv["itl_p50"] - lv["predicted_itl_p50"]) for lv in levels]
        (c1, g1), (c2, g2) = gaps[0], gaps[-1]
        token = (g2 - g1) / (c2 - c1) if c2 > c1 else 0.0
        step = g1 - c1 * token
        first = levels[0]
        request = first["ttft_p50"] - first["predicted_ttft_p50"] - step - c1 * token
        costs = StreamCosts(max(costs.token + token, 0.0), max(costs.step + step, 0.0),
                            max(costs.request + request, 0.0), tuple(levels), serial)
    return costs


def _level(model: ModelSpec, hw: HardwareSpec, kv_dtype: str, c: int,
           run: Mapping[str, Any]) -> dict[str, Any]:
    """One load's measured figures beside the step model's for the same requests."""
    done = max(int(run["completed"]), 1)
    computed = int(run["total_input_tokens"]) - int(run.get("total_cached_tokens", 0))
    specs = [RequestSpec(max(computed // done, 1),
                         max(int(run["total_output_tokens"]) // done, 1))] * done
    p = predict_serving(model, hw, specs, c, kv_dtype=kv_dtype)
    return {"concurrency": c, "itl_p50": run["itl_ms"]["p50"] / 1e3,
            "predicted_itl_p50": p.itl(0.5), "ttft_p50": run["ttft_ms"]["p50"] / 1e3,
            "predicted_ttft_p50": p.ttft(0.5), "output_tok_s": run["output_throughput"],
            "predicted_output_tok_s": p.output_tok_s}


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
           str(concurrency), "-n", str(REQUESTS[concurrency] * concurrency),
           "--max-tokens", str(MAX_TOKENS),
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
