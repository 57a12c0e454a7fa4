"""The visualiser in a real browser: a `kvlab serve` subprocess on the default model, Debian's
Chromium driven headless by Playwright. What the page shows (token chips, KV counters,
metrics, prefix reuse, the pool seen from a second tab, the what-if figures) must equal what
the API returned for the same request. Writes artifacts/viz.png.

Needs `apt-get install chromium` (/usr/bin/chromium) and `pip install playwright`; no
`playwright install`: the system Chromium is used.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from net import free_port

CHROMIUM = "/usr/bin/chromium"
if not os.path.exists(CHROMIUM):
    pytest.skip(f"{CHROMIUM} is absent (apt-get install chromium): no browser to drive",
                allow_module_level=True)
from playwright import sync_api  # a browser is here, so playwright must be too

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "artifacts"
BROWSER_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync"]
PROMPT = ("The paged KV cache keeps the keys and values of every token in fixed-size blocks, "
          "so that")
MAX_TOKENS = 12
RUN_DONE = "() => { const s = window.vizState; return s.run && s.run.ended && !s.abort; }"

pytestmark = pytest.mark.slow



@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with kvlab_serve() as url:
        yield url


@pytest.fixture(scope="module")
def spec_server() -> Iterator[str]:
    # a fixed k: every step proposes wherever the prompt has a match, whatever the timings
    with kvlab_serve("--speculative", "ngram", "--speculative-adaptive", "off") as url:
        yield url


@contextmanager
def kvlab_serve(*flags: str) -> Iterator[str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvlab.cli.main", "serve", "--host", "127.0.0.1", "--port",
         str(port), "--kv-cache-gib", "0.25", "--log-level", "warning", *flags],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url)
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _wait_healthy(proc: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvlab serve exited with {proc.returncode}: "
                               f"{proc.stderr.read().decode()[-2000:] if proc.stderr else ''}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError("kvlab serve did not become healthy within 120 s")


@pytest.fixture(scope="module")
def browser(server: str) -> Iterator[Any]:  # closed before the server stops
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
        try:
            yield b
        finally:
            b.close()


def open_page(browser: Any, server: str) -> Any:
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.errors = errors
    page.goto(f"{server}/viz")
    page.wait_for_function("() => window.vizState && window.vizState.options")
    page.fill("#prompt", PROMPT)
    page.fill("#max-tokens", str(MAX_TOKENS))
    page.fill("#temperature", "0")
    return page


def run_in_page(page: Any, button: str = "#run") -> list[dict[str, Any]]:
    """Press the button; return the NDJSON events the page itself received."""
    with page.expect_response(lambda r: r.url.endswith("/viz/api/run")) as info:
        page.click(button)
    page.wait_for_function(RUN_DONE, timeout=120_000)
    return [json.loads(line) for line in info.value.text().splitlines() if line]


def of(events: list[dict[str, Any]], kind: str, user: int = 0) -> dict[str, Any]:
    return next(e for e in events if e["event"] == kind and e.get("user", 0) == user)


def number(text: str) -> float:
    match = re.search(r"-?[\d,]*\.?\d+", text)
    assert match, f"no number in {text!r}"
    return float(match.group(0).replace(",", ""))


def assert_shown(page: Any, selector: str, value: float, decimals: int) -> None:
    """The page shows `value` rounded to `decimals` places."""
    shown = number(page.inner_text(selector))
    assert abs(shown - value) <= 0.51 * 10**-decimals + 1e-9, (selector, shown, value)


def chip_ids(page: Any, selector: str) -> list[int]:
    return [int(i) for i in page.eval_on_selector_all(selector, "els => els.map(e => e.dataset.id)")]


def shown_token(text: str) -> str:
    return text.replace(" ", "·").replace("\n", "↵").replace("\t", "⇥") or "∅"


def check_page_matches_record(page: Any, events: list[dict[str, Any]]) -> None:
    start, done = events[0], of(events, "done")
    prompt_ids = start["prompt"]["token_ids"]
    assert chip_ids(page, "#prompt-chips .chip") == prompt_ids
    texts = page.eval_on_selector_all("#prompt-chips .chip .t", "els => els.map(e => e.textContent)")
    assert texts == [shown_token(t) for t in start["prompt"]["tokens"]]
    assert chip_ids(page, '.lane[data-user="0"] .chip') == done["output_token_ids"]
    lane_text = page.eval_on_selector('.lane[data-user="0"] .lane-text', "e => e.textContent")
    assert lane_text == done["text"]

    kv, m = done["kv"], done["metrics"]
    assert kv["tokens"] == m["kv_tokens"] == len(prompt_ids) + done["output_tokens"] - 1
    assert kv["bytes"] == m["kv_bytes"] == kv["tokens"] * start["kv_bytes_per_token"]
    assert number(page.inner_text("#kv-tokens")) == kv["tokens"]
    assert number(page.inner_text("#kv-bytes")) == kv["bytes"]
    assert number(page.inner_text("#kv-blocks")) == kv["blocks"] == math.ceil(
        kv["tokens"] / start["block_size"])
    blocks = page.eval_on_selector_all("#block-table .bt", "els => els.map(e => e.dataset.block)")
    assert len(blocks) == kv["blocks"]
    assert [int(b) for b in blocks[:len(kv["block_table"])]] == kv["block_table"]

    assert_shown(page, "#m-ttft", m["ttft_s"] * 1e3, 1)
    assert_shown(page, "#m-prefill", m["prefill_tok_s"], 1)
    assert_shown(page, "#m-decode", m["decode_tok_s"], 1)
    assert_shown(page, "#m-itl", m["itl_mean_ms"], 1)
    assert_shown(page, "#m-total", m["total_s"], 3)
    p = done["prediction"]
    assert_shown(page, "#p-ttft", p["ttft_s"] * 1e3, 1)
    assert_shown(page, "#p-decode", p["decode_tok_s"], 1)
    assert_shown(page, "#p-total", p["total_s"], 3)


def test_page_shows_what_the_api_returned(browser: Any, server: str) -> None:
    page = open_page(browser, server)
    first = run_in_page(page)
    check_page_matches_record(page, first)
    done = of(first, "done")
    api = httpx.post(f"{server}/v1/completions", timeout=120, json={
        "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}).json()
    assert api["usage"]["prompt_tokens"] == page.locator("#prompt-chips .chip").count()
    assert api["usage"]["completion_tokens"] == page.locator('.lane[data-user="0"] .chip').count()
    assert api["choices"][0]["text"] == done["text"]
    assert "from the `kvlab probe` cache" in page.inner_text("#machine-line") or \
        "quick measurement" in page.inner_text("#machine-line") or \
        "named part" in page.inner_text("#machine-line")

    # the same prompt again: its full prompt blocks come from the prefix cache
    second = run_in_page(page)
    check_page_matches_record(page, second)
    bs, n = second[0]["block_size"], len(second[0]["prompt"]["token_ids"])
    cached = of(second, "prefill")["cached_tokens"]
    assert cached == (n - 1) // bs * bs > 0
    assert int(page.get_attribute("#prefill-cached", "data-value")) == cached
    assert number(page.inner_text("#kv-cached")) == cached
    reused = page.eval_on_selector_all("#prompt-chips .blk.cached .blk-label",
                                       "els => els.map(e => e.textContent)")
    assert len(reused) == cached // bs
    first_table = of(first, "done")["kv"]["block_table"]
    assert reused == [f"block #{b} ♻ prefix cache" for b in first_table[:cached // bs]]
    assert page.locator("#prompt-chips .chip.cached").count() == cached
    assert page.locator("#block-table .bt.cached").count() == cached // bs
    assert "from the prefix cache" in page.inner_text('.lane[data-user="0"] .lane-head')

    # what if: the figures shown are the estimate endpoint's
    page.select_option("#wi-hw", "h100")
    page.select_option("#wi-model", "8b")
    page.select_option("#wi-quant", "q4_k_m")
    page.click("#wi-go")
    page.wait_for_selector("#wi-ttft")
    want = httpx.get(f"{server}/viz/api/estimate", params={
        "hardware": "h100", "model": "8b", "quant": "q4_k_m", "prompt_tokens": n,
        "output_tokens": of(second, "done")["output_tokens"]}).json()
    assert float(page.get_attribute("#wi-ttft", "data-value")) == pytest.approx(want["ttft_s"])
    assert float(page.get_attribute("#wi-decode", "data-value")) == pytest.approx(
        want["decode_tok_s"])
    assert "prediction" in page.inner_text("#whatif-panel").lower()

    # N users: lanes, shared prompt blocks, a screenshot while they run
    page.fill("#max-tokens", "24")
    page.fill("#users", "3")
    with page.expect_response(lambda r: r.url.endswith("/viz/api/run")) as info:
        page.click("#send-users")
    page.wait_for_function("() => { const r = window.vizState.run; return r && r.users.length === 3"
                           " && r.users.every(u => u.first); }", timeout=120_000)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "viz.png"), full_page=True)
    page.wait_for_function(RUN_DONE, timeout=120_000)
    users = [json.loads(line) for line in info.value.text().splitlines() if line]
    assert page.locator(".lane").count() == 3
    for u in range(3):
        done_u = of(users, "done", u)
        assert chip_ids(page, f'.lane[data-user="{u}"] .chip') == done_u["output_token_ids"]
        assert done_u["cached_tokens"] == cached  # every user found the prompt blocks
    assert page.errors == []


def test_second_tab_sees_the_first_tabs_blocks(browser: Any, server: str) -> None:
    a, b = open_page(browser, server), open_page(browser, server)
    # long enough that tab A still holds its blocks when tab B's first pool view arrives: 40
    # tokens took well under a second on a quiet machine, and B could miss them
    a.fill("#max-tokens", "400")
    a.click("#run")
    a.wait_for_function("() => { const r = window.vizState.run; return r && r.users[0].first; }",
                        timeout=120_000)
    run_a = a.evaluate("() => window.vizState.run.id")
    b.fill("#prompt", PROMPT + " the second tab")
    b.fill("#max-tokens", "4")
    b.click("#run")
    b.wait_for_function(
        "(id) => { const p = window.vizState.pool; return p && p.requests.some("
        "q => q.run_id === id && q.block_table.length); }", arg=run_a, timeout=60_000)
    assert "other tab / run" in b.inner_text("#pool-legend")
    b.wait_for_function(RUN_DONE, timeout=120_000)
    a.wait_for_function(RUN_DONE, timeout=120_000)
    b_prefill = b.evaluate("() => window.vizState.run.users[0].first.cached_tokens")
    assert b_prefill > 0  # tab B's prompt starts with tab A's: its first blocks were reused
    assert a.errors == [] and b.errors == []


def test_speculative_proposals_are_marked(browser: Any, spec_server: str) -> None:
    page = open_page(browser, spec_server)
    # some of prompt lookup's continuations are right, some not
    page.fill("#prompt", "The cat sat on the mat. The dog sat on the log. The bird sat on the")
    page.fill("#max-tokens", "24")
    events = run_in_page(page)
    verifies = [e for e in events if e["event"] == "verify"]
    done = of(events, "done")
    accepted = sum(v["accepted"] for v in verifies)
    rejected = sum(v["rejected"] for v in verifies)
    assert accepted > 0 and rejected > 0 and accepted + rejected == done["draft_tokens"]
    lane = '.lane[data-user="0"]'
    assert chip_ids(page, f"{lane} .chip") == done["output_token_ids"]
    marked = chip_ids(page, f"{lane} .chip.accepted")
    assert marked == [e["token"]["id"] for e in events if e.get("proposal") == "accepted"]
    assert len(marked) == accepted == done["accepted_tokens"]
    # each rejected proposal is a mark right after the token the model put in its place
    marks = page.eval_on_selector_all(f"{lane} .rej", """els => els.map(e => {
        let p = e.previousElementSibling;
        while (!p.classList.contains("chip")) p = p.previousElementSibling;
        return [Number(e.dataset.index), Number(p.dataset.id)]; })""")
    ids = done["output_token_ids"]
    assert [tuple(m) for m in marks] == [(v["index"], ids[v["index"]]) for v in verifies
                                         for _ in range(v["rejected"])]
    head = page.inner_text(f"{lane} .lane-head")
    shown = re.search(r"proposals: (\d+) of (\d+) accepted \((\d+) %\)", head)
    assert shown, head
    assert [int(g) for g in shown.groups()[:2]] == [done["accepted_tokens"],
                                                    done["draft_tokens"]]
    assert abs(int(shown.group(3)) - 100 * accepted / done["draft_tokens"]) <= 0.5
    assert page.is_visible("#spec-legend")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "viz-speculative.png"), full_page=True)
    assert page.errors == []
