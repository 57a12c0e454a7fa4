#!/usr/bin/env python3
"""Hostile prompts and a long mixed soak against a real `kvlab serve` on 127.0.0.1.

    .venv/bin/python bench/server_soak.py [--requests 2000] [--concurrency 16] [-- serve flags]

1. Hostile prompts: while a 10 MB and a 1 MB prompt (and a deeply nested body) are sent and
   rejected, /health is polled every 20 ms; prints the worst /health latency (target < 1 s).
2. Soak: N mixed requests at a bounded concurrency: short and long prompts, completions and
   chat, streaming and not, a third of the streams dropped at a random chunk, some invalid;
   meanwhile a few streams are opened and never read (slow consumers). Prints the server's
   RSS at the start, at the end and its peak, 5xx answers, lost requests (an error where an
   answer was due, or a stream that did not end with [DONE]) and the KV blocks still held
   once the server is idle (0: every block free or held only by the prefix cache).

Exit status 1 if a target is missed: /health < 1 s, RSS growth < 5 %, no 5xx, none lost,
no blocks held.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
WORDS = ("apple", "river", "stone", "cloud", "engine", "garden", "silver", "market", "window",
         "forest", "candle", "bridge", "lantern", "harbor", "meadow", "copper", "violin",
         "desert", "thunder", "pocket", "mirror", "planet", "quartz")


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)  # (kind, status or outcome) -> count
    five_xx: int = 0
    lost: list[str] = field(default_factory=list)

    def add(self, kind: str, status: int | str) -> None:
        self.outcomes[(kind, status)] += 1
        if isinstance(status, int) and status >= 500:
            self.five_xx += 1


# ---- the server and its process ------------------------------------------------------------------


def start_server(port: int, flags: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvlab.cli.main", "serve", "--port", str(port),
           "--log-level", "warning", *flags]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=sys.stderr)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"kvlab serve exited with status {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    sys.exit("kvlab serve did not become healthy in 300 s")


def rss_mib(pid: int, key: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def sample_rss(pid: int, samples: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        samples.append(rss_mib(pid))
        await asyncio.sleep(0.25)


class HealthPoller(threading.Thread):
    """/health every 20 ms from a thread of its own, so the load's client cannot delay it."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.url = f"http://127.0.0.1:{port}/health"
        self.worst = 0.0
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self.stop.is_set():
                t0 = time.perf_counter()
                r = client.get(self.url)
                self.worst = max(self.worst, time.perf_counter() - t0)
                assert r.status_code in (200, 503), r.status_code
                time.sleep(0.02)

    def finish(self) -> float:
        self.stop.set()
        self.join()
        return self.worst


# ---- phase 1: hostile prompts --------------------------------------------------------------------


async def hostile(client: httpx.AsyncClient, port: int) -> tuple[float, list[str]]:
    """(worst /health seconds, one line per hostile request) while they are rejected."""
    bodies = {
        "10 MB prompt": json.dumps({"prompt": "hello " * 1_750_000, "max_tokens": 1}),
        "1 MB prompt": json.dumps({"prompt": "hello " * 175_000, "max_tokens": 1}),
        "nested 100k deep": "[" * 100_000 + "]" * 100_000,
    }
    poller = HealthPoller(port)
    poller.start()
    await asyncio.sleep(0.2)

    async def send(name: str, body: str) -> str:
        t0 = time.perf_counter()
        try:
            r = await client.post("/v1/completions", content=body.encode(), timeout=120,
                                  headers={"content-type": "application/json"})
            answer = f"{r.status_code} {r.json()['error']['message'][:90]}"
        except httpx.HTTPError as e:
            answer = f"connection error ({type(e).__name__})"
        return f"{name} ({len(body) / 1e6:.1f} MB): {answer} in {time.perf_counter() - t0:.2f} s"

    lines = await asyncio.gather(*(send(k, v) for k, v in bodies.items()))
    await asyncio.sleep(0.2)
    return poller.finish(), list(lines)


# ---- phase 2: the soak ---------------------------------------------------------------------------


def prompt_text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def invalid_body(rng: random.Random) -> tuple[str, bytes]:
    """(endpoint, body) of a request that must be refused with a 4xx."""
    choices = [
        b"{not json", b"[]", json.dumps({"prompt": "x", "max_tokens": "5"}).encode(),
        json.dumps({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}).encode(),
        json.dumps({"prompt": "x", "model": "no-such-model"}).encode(),
        json.dumps({"prompt": "x", "max_tokens": 10 ** 9}).encode(),
        b'{"prompt": "\\ud800", "max_tokens": 2}', b"[" * 5000 + b"]" * 5000,
        json.dumps({"prompt": [], "max_tokens": 2}).encode(),
    ]
    return "/v1/completions", rng.choice(choices)


def valid_body(rng: random.Random, stream: bool) -> tuple[str, dict]:
    long = rng.random() < 0.12
    text = prompt_text(rng, rng.randint(400, 900) if long else rng.randint(3, 40))
    body: dict = {"max_tokens": rng.randint(4, 24), "temperature": rng.choice([0, 0.8]),
                  "seed": rng.randint(0, 1000), "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.5:
        return "/v1/completions", {**body, "prompt": text}
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": text}]}


async def one_stream(client: httpx.AsyncClient, path: str, body: dict, drop_at: int | None,
                     tally: Tally, tag: str) -> None:
    async with client.stream("POST", path, json=body, timeout=300) as r:
        if r.status_code != 200:
            tally.add("stream", r.status_code)
            tally.lost.append(f"{tag}: stream answered {r.status_code}")
            return
        chunks, done = 0, False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            if '"error"' in line:
                tally.lost.append(f"{tag}: error event {line[:120]}")
            chunks += 1
            if drop_at is not None and chunks >= drop_at:
                tally.add("stream dropped", "dropped")
                return  # leaving the context manager closes the connection mid-stream
    tally.add("stream", 200 if done else "no [DONE]")
    if not done:
        tally.lost.append(f"{tag}: stream ended without [DONE]")


async def one_request(client: httpx.AsyncClient, rng: random.Random, i: int,
                      tally: Tally) -> None:
    tag = f"request {i}"
    roll = rng.random()
    try:
        if roll < 0.12:
            path, raw = invalid_body(rng)
            r = await client.post(path, content=raw, timeout=60,
                                  headers={"content-type": "application/json"})
            tally.add("invalid", r.status_code)
            if not 400 <= r.status_code < 500 or set(r.json()["error"]) != {
                    "message", "type", "param", "code"}:
                tally.lost.append(f"{tag}: invalid body answered {r.status_code} {r.text[:100]}")
        elif roll < 0.55:
            path, body = valid_body(rng, stream=True)
            drop_at = rng.randint(1, 8) if rng.random() < 1 / 3 else None
            await one_stream(client, path, body, drop_at, tally, tag)
        else:
            path, body = valid_body(rng, stream=False)
            r = await client.post(path, json=body, timeout=300)
            tally.add("whole", r.status_code)
            if r.status_code != 200 or not r.json()["choices"][0]["finish_reason"]:
                tally.lost.append(f"{tag}: answered {r.status_code} {r.text[:100]}")
    except httpx.HTTPError as e:
        tally.add("client error", type(e).__name__)
        tally.lost.append(f"{tag}: {type(e).__name__}: {e}")


async def stalled_stream(port: int, stop: asyncio.Event) -> None:
    """A client that asks for a long stream and never reads it."""
    _reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = json.dumps({"prompt": prompt_text(random.Random(7), 20), "max_tokens": 1500,
                       "stream": True, "ignore_eos": True}).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    await writer.drain()
    await stop.wait()
    writer.close()


async def soak(port: int, pid: int, n: int, concurrency: int, seed: int) -> dict:
    limits = httpx.Limits(max_connections=concurrency + 8)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=limits) as client:
        tally, rng = Tally(), random.Random(seed)
        for i in range(40):  # warm-up: the first requests allocate what the server keeps
            await one_request(client, rng, -i, Tally())
        stop, rss, poller = asyncio.Event(), [], HealthPoller(port)
        poller.start()
        side = [asyncio.ensure_future(sample_rss(pid, rss, stop)),
                *(asyncio.ensure_future(stalled_stream(port, stop)) for _ in range(3))]
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(n):
            queue.put_nowait(i)

        async def worker(wrng: random.Random) -> None:
            while not queue.empty():
                await one_request(client, wrng, queue.get_nowait(), tally)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(random.Random(seed * 1000 + w))
                               for w in range(concurrency)))
        seconds = time.perf_counter() - t0
        stop.set()
        await asyncio.gather(*side)
        health_worst = poller.finish()
        idle = await wait_idle(client)
    return {"tally": tally, "rss": rss, "seconds": seconds, "health_worst": health_worst,
            "idle": idle}


async def wait_idle(client: httpx.AsyncClient, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        health = (await client.get("/health")).json()
        if health["num_requests"] == 0 and health["num_running"] == 0 or \
                time.monotonic() > deadline:
            return health
        await asyncio.sleep(0.2)


# ---- report --------------------------------------------------------------------------------------


def report(worst_hostile: float, hostile_lines: list[str], result: dict, n: int) -> bool:
    tally, rss, idle = result["tally"], result["rss"], result["idle"]
    start, end, peak = rss[0], rss[-1], max(rss)
    growth = (end - start) / start
    print("hostile prompts (each answered while /health was polled every 20 ms):")
    for line in hostile_lines:
        print(f"  {line}")
    print(f"  worst /health latency meanwhile: {worst_hostile * 1000:.1f} ms (target < 1000)")
    print(f"soak: {n} requests in {result['seconds']:.1f} s; worst /health latency "
          f"{result['health_worst'] * 1000:.1f} ms")
    for (kind, status), count in sorted(tally.outcomes.items(), key=str):
        print(f"  {kind:15s} {status!s:10s} {count}")
    print(f"  server RSS: start {start:.1f} MiB, end {end:.1f} MiB, peak {peak:.1f} MiB; "
          f"growth {growth * 100:+.2f} % (target < 5 %)")
    print(f"  5xx answers: {tally.five_xx}; lost requests: {len(tally.lost)}")
    for line in tally.lost[:10]:
        print(f"    {line}")
    print(f"  idle afterwards: {idle['num_requests']} requests live, {idle['kv_blocks_used']} of "
          f"{idle['kv_blocks_total']} KV blocks held by sequences (prefix-cached blocks count "
          "as free)")
    return (worst_hostile < 1.0 and growth < 0.05 and tally.five_xx == 0 and not tally.lost
            and idle["num_requests"] == 0 and idle["kv_blocks_used"] == 0)


async def main_async(args: argparse.Namespace, port: int, pid: int) -> bool:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        worst, lines = await hostile(client, port)
    if args.requests == 0:  # the hostile prompts only
        print("\n".join(lines), f"\nworst /health latency: {worst * 1000:.1f} ms", sep="")
        return worst < 1.0
    result = await soak(port, pid, args.requests, args.concurrency, args.seed)
    return report(worst, lines, result, args.requests)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=2000, help="0: the hostile prompts only")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8311)
    p.add_argument("serve_flags", nargs="*", help="after --: flags for kvlab serve")
    args = p.parse_args()
    flags = args.serve_flags or ["--threads", "2", "--request-timeout", "120"]
    proc = start_server(args.port, flags)
    try:
        ok = asyncio.run(main_async(args, args.port, proc.pid))
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    print("all targets met" if ok else "TARGET MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
