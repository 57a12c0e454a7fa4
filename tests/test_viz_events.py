"""The visualiser's endpoints over real HTTP, on the default model: the run's event stream
(NDJSON and SSE), its KV and pool records, prefix reuse between runs and users, errors,
disconnects, and the what-if estimate. No browser here (see test_viz_browser.py)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvlab.engine import Engine, EngineConfig, KVView
from kvlab.server.apis import front_ends
from kvlab.server.core.app import create_app
from kvlab.server.core.async_engine import AsyncEngine
from kvlab.server.viz.events import kv_record
from kvlab.server.viz.predict import this_machine

from net import free_port, serving

LONG = ("The paged KV cache keeps the keys and values of every token in fixed-size blocks, "
        "so that")  # 22 tokens: one full block can come from the prefix cache



@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    engine = Engine.from_model(None, EngineConfig(kv_cache_gib=0.25))
    with serving(create_app(AsyncEngine(engine), front_ends())) as url:
        yield url


@pytest.fixture()
def client(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=120) as c:
        yield c


def run(client: httpx.Client, **body: Any) -> list[dict[str, Any]]:
    body = {"max_tokens": 6, "temperature": 0.0, **body}
    with client.stream("POST", "/viz/api/run", json=body) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("application/x-ndjson")
        return [json.loads(line) for line in r.iter_lines() if line]


def of(events: list[dict[str, Any]], kind: str, user: int | None = None) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == kind and (user is None or e["user"] == user)]


# ---- the event stream --------------------------------------------------------------------------


def test_stream_order_tokens_and_exact_kv(client: httpx.Client) -> None:
    prompt = "Paged attention, test one: a block table maps positions to blocks because"
    events = run(client, prompt=prompt, max_tokens=7)
    start, done = events[0], of(events, "done")[0]
    assert start["event"] == "start" and events[-1]["event"] == "end"
    assert start["users"] == 1 and start["request_ids"] == [done["request_id"]]
    ids = start["prompt"]["token_ids"]
    assert len(start["prompt"]["tokens"]) == len(ids)
    assert start["prediction"]["prediction"] is True and start["prediction"]["ttft_s"] > 0

    tokens = of(events, "prefill") + of(events, "decode")
    assert [e["event"] for e in tokens] == ["prefill"] + ["decode"] * (len(tokens) - 1)
    assert [e["token"]["id"] for e in tokens] == done["output_token_ids"]
    assert [e["index"] for e in tokens] == list(range(len(tokens)))
    assert "".join(e["text_delta"] for e in tokens) == done["text"]
    bs, bpt = start["block_size"], start["kv_bytes_per_token"]
    for k, e in enumerate(tokens):
        kv = e["kv"]
        assert kv["tokens"] == len(ids) + k  # the newest token has no K/V yet
        assert kv["bytes"] == kv["tokens"] * bpt
        assert kv["blocks"] == math.ceil(kv["tokens"] / bs)
        assert len(kv["block_table"]) == kv["blocks"]
    first = tokens[0]
    assert first["prompt_tokens"] == len(ids) and first["cached_tokens"] == 0
    assert 0 < first["prefill_ms"] <= first["ttft_ms"]
    assert all(e["itl_ms"] > 0 for e in tokens[1:])

    m = done["metrics"]
    assert done["finish_reason"] == "length" and done["output_tokens"] == 7
    assert m["kv_tokens"] == done["kv"]["tokens"] == len(ids) + 6
    assert m["kv_bytes"] == done["kv"]["bytes"] == m["kv_tokens"] * bpt
    assert m["ttft_s"] * 1e3 == pytest.approx(first["ttft_ms"])
    assert m["itl_mean_ms"] == pytest.approx(sum(e["itl_ms"] for e in tokens[1:]) / 6)
    assert done["prediction"]["workload"]["output_tokens"] == 7


def test_same_tokens_and_usage_as_the_completions_api(client: httpx.Client) -> None:
    prompt = "Test two. The scheduler admits waiting requests when"
    events = run(client, prompt=prompt, max_tokens=8)
    done = of(events, "done")[0]
    api = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8,
                                               "temperature": 0}).json()
    assert api["choices"][0]["text"] == done["text"]
    assert api["usage"]["prompt_tokens"] == len(events[0]["prompt"]["token_ids"])
    assert api["usage"]["completion_tokens"] == done["output_tokens"]


def test_second_run_reuses_the_prompt_blocks(client: httpx.Client) -> None:
    prompt = "Test three. " + LONG
    first, second = run(client, prompt=prompt), run(client, prompt=prompt)
    n = len(first[0]["prompt"]["token_ids"])
    bs = first[0]["block_size"]
    p1, p2 = of(first, "prefill")[0], of(second, "prefill")[0]
    assert p1["cached_tokens"] == 0
    assert p2["cached_tokens"] == (n - 1) // bs * bs > 0
    assert p2["computed_tokens"] == n - p2["cached_tokens"]
    cached = p2["kv"]["cached_blocks"]
    assert cached == p2["cached_tokens"] // bs
    assert p2["kv"]["block_table"][:cached] == p1["kv"]["block_table"][:cached]
    assert of(second, "done")[0]["output_token_ids"] == of(first, "done")[0]["output_token_ids"]


def test_staggered_users_share_prefix_blocks_in_the_pool(client: httpx.Client) -> None:
    # long enough replies that a user still decodes when the next one's prefill lands: the
    # engine runs ahead of the token events the next arrival waits for
    events = run(client, prompt="Test four. " + LONG, users=3, max_tokens=24)
    assert len(of(events, "done")) == 3
    prefills = sorted(of(events, "prefill"), key=lambda e: e["user"])
    assert prefills[0]["cached_tokens"] == 0
    assert all(p["cached_tokens"] >= 16 for p in prefills[1:])
    shared = [e for e in of(events, "pool")
              if len({q["block_table"][0] for q in e["requests"] if q["block_table"]}) == 1
              and sum(1 for q in e["requests"] if q["block_table"]) >= 2]
    assert shared, "no pool record shows two users on the same first block"
    pool = shared[0]
    assert pool["blocks_used"] <= sum(len(q["block_table"]) for q in pool["requests"])
    assert client.get("/viz/api/pool").json()["requests"] == []


def test_users_arriving_together_find_nothing_cached_yet(client: httpx.Client) -> None:
    events = run(client, prompt="Test five. " + LONG, users=2, arrival="together")
    assert [p["cached_tokens"] for p in of(events, "prefill")] == [0, 0]


def test_sse_format(client: httpx.Client) -> None:
    with client.stream("POST", "/viz/api/run?format=sse",
                       json={"prompt": "Test six", "max_tokens": 2}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    blocks = [b for b in text.split("\n\n") if b]
    names = [b.split("\n")[0].removeprefix("event: ") for b in blocks]
    assert names[0] == "start" and names[-1] == "end" and "done" in names
    for b in blocks:
        name, data = b.split("\n")
        assert json.loads(data.removeprefix("data: "))["event"] == name.removeprefix("event: ")


def test_closing_the_stream_frees_the_blocks(client: httpx.Client) -> None:
    with client.stream("POST", "/viz/api/run",
                       json={"prompt": "Test seven, " + LONG, "max_tokens": 200,
                             "ignore_eos": True}) as r:
        for line in r.iter_lines():
            if json.loads(line)["event"] == "decode":
                break
    deadline = time.monotonic() + 10
    while True:
        pool = client.get("/viz/api/pool").json()
        if pool["blocks_used"] == 0 and pool["requests"] == []:
            break
        assert time.monotonic() < deadline, pool
        time.sleep(0.1)


@pytest.mark.parametrize("body, param", [
    ({"prompt": ""}, "prompt"),
    ({"prompt": "hi", "users": 99}, "users"),
    ({"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "hi", "max_token": 5}, "max_token"),
    ({"prompt": "hi", "arrival": "whenever"}, "arrival"),
])
def test_bad_bodies_are_400_with_the_field(client: httpx.Client, body: dict, param: str) -> None:
    r = client.post("/viz/api/run", json=body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == param


def test_engine_refusals_are_400_before_the_stream(client: httpx.Client) -> None:
    r = client.post("/viz/api/run", json={"prompt": "hi", "max_tokens": 10**7})
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"]
    r = client.post("/viz/api/run", json={"prompt": "hi", "temperature": -1.0})
    assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]


# ---- page, options, estimate -------------------------------------------------------------------


def test_page_and_static_files(client: httpx.Client) -> None:
    page = client.get("/viz")
    assert page.status_code == 200 and "/viz/static/viz.js" in page.text
    assert client.get("/viz/static/viz.js").headers["content-type"].startswith("text/javascript")
    assert client.get("/viz/static/viz.css").status_code == 200
    assert client.get("/viz/static/app.py").status_code == 404


def test_options(client: httpx.Client) -> None:
    o = client.get("/viz/api/options").json()
    assert o["block_size"] == 16 and o["kv_bytes_per_token"] > 0
    keys = [h["key"] for h in o["hardware"]]
    assert keys[0] == "this" and "h100" in keys and "m2-max" in keys
    assert o["this_machine"]["kind"] in ("probe", "quick", "part")
    assert o["models"][0]["key"] == "served"


def test_what_if_estimate(client: httpx.Client) -> None:
    q = {"model": "8b", "quant": "q4_k_m", "prompt_tokens": 22, "output_tokens": 32}
    gpu = client.get("/viz/api/estimate", params={**q, "hardware": "h100"}).json()
    cpu = client.get("/viz/api/estimate", params={**q, "hardware": "cpu-ddr4-laptop"}).json()
    assert gpu["prediction"] is True and gpu["fits"] is True
    assert gpu["hardware"]["source"] == "built-in table"
    assert gpu["decode_tok_s"] > 10 * cpu["decode_tok_s"]
    lo, hi = gpu["decode_tok_s_range"]
    assert lo < gpu["decode_tok_s"] < hi
    assert gpu["itl_ms"] == pytest.approx(1e3 / gpu["decode_tok_s"])
    assert gpu["total_s"] == pytest.approx(gpu["ttft_s"] + 31 * gpu["itl_ms"] / 1e3)
    big = client.get("/viz/api/estimate",
                     params={**q, "model": "70b", "quant": "f16", "hardware": "rtx-4090"}).json()
    assert big["fits"] is False
    served = client.get("/viz/api/estimate", params={"prompt": "Hello there"}).json()
    assert served["workload"]["prompt_tokens"] >= 2
    assert served["workload"]["kv_dtype"] == "f16"  # the served engine's own KV layout


@pytest.mark.parametrize("params, word", [
    ({"hardware": "h1000", "prompt_tokens": 5}, "unknown hardware"),
    ({"model": "8b", "quant": "file", "prompt_tokens": 5}, "only applies to the served"),
    ({"model": "9b", "quant": "q8_0", "prompt_tokens": 5}, "unknown model"),
    ({"quant": "q3", "prompt_tokens": 5}, "unknown quantization"),
    ({}, "prompt_tokens"),
])
def test_what_if_errors(client: httpx.Client, params: dict, word: str) -> None:
    r = client.get("/viz/api/estimate", params=params)
    assert r.status_code == 400 and word in r.json()["error"]["message"]


# ---- pieces without a server -------------------------------------------------------------------


def test_kv_record_cuts_the_table_to_its_own_token_count() -> None:
    view = KVView(block_table=[5, 9, 2, 7], num_tokens=50, num_cached_tokens=16,
                  block_size=16, bytes_per_token=100)
    r = kv_record(33, 16, view, 16, 100)
    assert r == {"tokens": 33, "bytes": 3300, "blocks": 3, "block_table": [5, 9, 2],
                 "cached_tokens": 16, "cached_blocks": 1}
    assert kv_record(16, 0, view, 16, 100)["block_table"] == [5]
    assert kv_record(3, 0, None, 16, 100)["block_table"] == []


def test_this_machine_without_a_probe_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVLAB_CACHE_DIR", str(tmp_path))
    part = this_machine(quick=False)
    assert part.kind == "part" and "kvlab probe" in part.label
    quick = this_machine(quick=True)
    assert quick.kind == "quick" and quick.hardware.bandwidth > 0
    assert "quick measurement" in quick.label


def test_cli_registers_viz() -> None:
    from kvlab.cli.main import build_parser

    args = build_parser().parse_args(["viz", "--port", "8123"])
    assert args.command == "viz" and args.port == 8123


@pytest.mark.slow
def test_kvlab_viz_prints_the_url_of_a_live_page() -> None:
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)}
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvlab.cli.main", "viz", "--port", str(port),
                             "--kv-cache-gib", "0.25"], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        url = f"http://127.0.0.1:{port}/viz"
        assert url in line, line
        deadline = time.monotonic() + 60
        while True:
            try:
                page = httpx.get(url, timeout=2)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "the page never came up"
                time.sleep(0.2)
        assert page.status_code == 200 and "<title>kvlab" in page.text
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def test_a_schema_run_marks_forced_tokens(client: httpx.Client) -> None:
    schema = {"type": "object", "properties": {"customer_account_number": {
        "type": "integer", "minimum": 0, "maximum": 999}}, "required": ["customer_account_number"]}
    events = run(client, prompt="An account as JSON:", max_tokens=40, json_schema=schema)
    tokens = [e for e in events if e["event"] in ("prefill", "decode")]
    assert all("structure" in e for e in tokens)
    forced = [e for e in tokens if e["structure"]["forced"]]
    sampled = [e["structure"]["allowed"] for e in tokens if not e["structure"]["forced"]]
    assert forced and sampled and all(0 < n < 262_144 for n in sampled)
    (done,) = of(events, "done")
    assert done["finish_reason"] == "stop"
    assert json.loads(done["text"])["customer_account_number"] <= 999
    r = client.post("/viz/api/run", json={"prompt": "x", "json_schema": {"type": "nope"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "json_schema"
