"""Many tenants on two replicas: prefix-aware routing against round robin, and a killed replica.

    .venv/bin/python bench/replicas_multitenant.py [--tenants 8] [--users 8] [--words 700]
        [--replicas 2] [--threads 1] [--kv-cache-gib 0.1] [--max-num-seqs 4] [-c 4]
        [--no-kill]

Each tenant has its own system prompt of about 1,000 tokens; each of its users sends that
prompt followed by a short question of their own, and all requests are shuffled together.
With a KV pool that holds only some tenants' prompts per replica, routing decides the prefix
cache's hit rate: a tenant pinned to one replica stays cached there, while round robin
spreads every tenant over both and evicts. For each routing the script starts
`kvlab serve --replicas R --routing X`, runs `kvlab loadtest` over the shuffled requests,
and prints the prompt tokens served from the prefix caches, the hit rate and the TTFT.

Then, unless --no-kill, it runs the same load with prefix routing and kills one engine
replica's process part-way (SIGKILL, as a crash would): it prints how many requests
failed (those in flight on that replica) and how long the service took to be back to R
healthy replicas by itself.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

KVLAB = [sys.executable, "-m", "kvlab.cli.main"]
PORT = 8094
WORDS = (
    "account", "billing", "support", "policy", "refund", "shipping", "order", "customer",
    "product", "service", "warranty", "invoice", "payment", "delivery", "schedule", "contract",
    "renewal", "upgrade", "discount", "plan", "device", "network", "storage", "backup",
    "security", "password", "login", "profile", "report", "analytics", "dashboard", "export",
    "import", "sync", "mobile", "desktop", "release", "version", "feature", "request",
)


def tenant_prompt(tenant: int, words: int) -> str:
    """A system prompt of its own for each tenant: seeded sentences of domain words."""
    rng = random.Random(1000 + tenant)
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    return (f"You are the assistant of company number {tenant}. Follow its handbook below "
            f"exactly.\n{body}\n")


def requests_file(tenants: int, users: int, words: int, out: Path) -> int:
    rows = [{"prompt": tenant_prompt(t, words) + f"Customer {u}: what is step {u + 1}?\n"}
            for t in range(tenants) for u in range(users)]
    random.Random(7).shuffle(rows)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return len(rows)


def healthy(replicas: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=5) as resp:
            body = json.load(resp)
    except (OSError, ValueError):
        return False
    return body.get("replicas", {}).get("healthy") == replicas


def wait_healthy(replicas: int, timeout_s: float) -> float | None:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if healthy(replicas):
            return time.monotonic() - start
        time.sleep(0.5)
    return None


def start_server(args: argparse.Namespace, routing: str) -> subprocess.Popen:
    cmd = KVLAB + ["serve", "--port", str(PORT), "--replicas", str(args.replicas),
                   "--threads", str(args.threads), "--routing", routing,
                   "--kv-cache-gib", str(args.kv_cache_gib),
                   "--max-num-seqs", str(args.max_num_seqs), "--log-level", "warning"]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    if wait_healthy(args.replicas, 600) is None:
        stop_server(server)
        raise SystemExit(f"kvlab serve --routing {routing} did not become healthy")
    return server


def stop_server(server: subprocess.Popen) -> None:
    server.send_signal(signal.SIGINT)
    try:
        server.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)


def loadtest(args: argparse.Namespace, prompts: Path, n: int) -> subprocess.Popen:
    cmd = KVLAB + ["loadtest", "--url", f"http://127.0.0.1:{PORT}", "--endpoint", "completions",
                   "--prompts", str(prompts), "-n", str(n), "-c", str(args.c), "--max-tokens",
                   "8", "--ignore-eos", "--warmup", "0", "--timeout", "600", "--json"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


def summary(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"kvlab loadtest failed ({proc.returncode})")
    return json.loads(out)


def engine_replica_pids() -> list[int]:
    """PIDs of the Ray worker processes running an engine replica (not the ingress)."""
    ps = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True,
                        check=True).stdout
    return [int(line.split()[0]) for line in ps.splitlines()
            if "ray::ServeReplica" in line and "KvlabEngine" in line]


def routing_run(args: argparse.Namespace, prompts: Path, n: int, routing: str) -> dict:
    server = start_server(args, routing)
    try:
        s = summary(loadtest(args, prompts, n))
    finally:
        stop_server(server)
    hit = s["total_cached_tokens"] / s["total_input_tokens"] if s["total_input_tokens"] else 0
    print(f"{routing:12s} | {s['total_input_tokens']:>8,} | {s['total_cached_tokens']:>9,} | "
          f"{hit:7.1%} | {s['ttft_ms']['mean']:9.0f} | {s['ttft_ms']['p50']:8.0f} | "
          f"{s['failed']}", flush=True)
    return {"hit_rate": hit, **s}


def kill_run(args: argparse.Namespace, prompts: Path, n: int) -> None:
    server = start_server(args, "prefix")
    try:
        load = loadtest(args, prompts, n)
        time.sleep(args.kill_after)
        pids = engine_replica_pids()
        if not pids:
            ray = [line for line in subprocess.run(["ps", "-eo", "pid=,args="], check=True,
                   capture_output=True, text=True).stdout.splitlines() if "ray::" in line]
            raise SystemExit("no engine replica process found to kill among: " + "; ".join(ray))
        os.kill(pids[0], signal.SIGKILL)
        killed = time.monotonic()
        print(f"killed engine replica pid {pids[0]} {args.kill_after:.0f} s into the load",
              flush=True)
        back = wait_healthy(args.replicas, 600)
        s = summary(load)
        back_s = "not back" if back is None else f"{time.monotonic() - killed:.0f} s"
    finally:
        stop_server(server)
    print(f"requests: {s['completed']} completed, {s['failed']} failed of {s['num_requests']}; "
          f"errors: {s['errors']}")
    print(f"back to {args.replicas} healthy replicas after the kill: {back_s}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--users", type=int, default=8, help="requests per tenant")
    p.add_argument("--words", type=int, default=1000, help="words per system prompt")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kv-cache-gib", type=float, default=0.1,
                   help="per replica: room for some tenants' prompts, not all")
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("-c", type=int, default=4, help="requests in flight")
    p.add_argument("--kill-after", type=float, default=20.0, help="seconds into the kill run")
    p.add_argument("--no-kill", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        prompts = Path(tmp) / "tenants.jsonl"
        n = requests_file(args.tenants, args.users, args.words, prompts)
        print(f"# {args.tenants} tenants x {args.users} users = {n} requests, shuffled; "
              f"{args.replicas} replicas x {args.threads} threads, --kv-cache-gib "
              f"{args.kv_cache_gib}, -c {args.c}; load {os.getloadavg()[0]:.2f}")
        print("routing      | prompt tk | cached tk | hit rate | TTFT mean | TTFT p50 | failed")
        runs = {r: routing_run(args, prompts, n, r) for r in ("prefix", "round-robin")}
        rr = runs["round-robin"]["hit_rate"]
        ratio = runs["prefix"]["hit_rate"] / rr if rr else float("inf")
        print(f"# prefix-aware hit rate / round robin's: {ratio:.2f}x; mean TTFT "
              f"{runs['prefix']['ttft_ms']['mean'] / runs['round-robin']['ttft_ms']['mean']:.2f}x")
        if not args.no_kill:
            kill_run(args, prompts, n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
