"""The visualiser's verify events on a real engine with ngram speculative decoding, on the
default model: per step and user, the proposals verified and the ones kept, summing to the
request's own counts and to the server's /metrics counters."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvlab.engine import Engine, EngineConfig
from kvlab.server.apis import front_ends
from kvlab.server.core.app import create_app
from kvlab.server.core.async_engine import AsyncEngine

from net import serving

# a prompt that repeats itself, so prompt lookup finds continuations in it: some right,
# some not
REPEATS = "The cat sat on the mat. The dog sat on the log. The bird sat on the"
COUNTERS = ("kvlab:spec_decode_num_drafts_total", "kvlab:spec_decode_num_draft_tokens_total",
            "kvlab:spec_decode_num_accepted_tokens_total")


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    # a fixed k: every step proposes wherever the prompt has a match, whatever the timings
    engine = Engine.from_model(None, EngineConfig(kv_cache_gib=0.25, speculative="ngram",
                                                  speculative_adaptive=False))
    with (serving(create_app(AsyncEngine(engine), front_ends())) as url,
          httpx.Client(base_url=url, timeout=120) as c):
        yield c


def run(client: httpx.Client, **body: Any) -> list[dict[str, Any]]:
    with client.stream("POST", "/viz/api/run", json={"temperature": 0.0, **body}) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line) for line in r.iter_lines() if line]


def counters(client: httpx.Client) -> list[float]:
    text = client.get("/metrics").text
    return [sum(float(m) for m in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$",
                                             text, re.MULTILINE))
            for name in COUNTERS]


def check_user(events: list[dict[str, Any]], user: int) -> tuple[int, int, int]:
    """One user's verify events against its tokens and its done record; returns (runs,
    proposed, accepted)."""
    mine = [e for e in events if e.get("user") == user]
    tokens = [e for e in mine if e["event"] in ("prefill", "decode")]
    verifies = [e for e in mine if e["event"] == "verify"]
    (done,) = [e for e in mine if e["event"] == "done"]
    proposed = sum(v["proposed"] for v in verifies)
    accepted = sum(v["accepted"] for v in verifies)
    assert (proposed, accepted) == (done["draft_tokens"], done["accepted_tokens"])
    assert [t["token"]["id"] for t in tokens] == done["output_token_ids"]
    seen_drafted = seen_accepted = 0
    for v in verifies:
        assert 0 < v["proposed"] and 0 <= v["accepted"] <= v["proposed"]
        assert v["rejected"] == v["proposed"] - v["accepted"]
        seen_drafted, seen_accepted = seen_drafted + v["proposed"], seen_accepted + v["accepted"]
        assert (v["draft_tokens"], v["accepted_tokens"]) == (seen_drafted, seen_accepted)
        assert v["acceptance_rate"] == pytest.approx(seen_accepted / seen_drafted)
        # the step's kept proposals lead its tokens; the model's own token ends them
        step = tokens[v["index"] - v["accepted"]:v["index"] + 1]
        assert [t.get("proposal") for t in step] == ["accepted"] * v["accepted"] + [None]
    assert sum(t.get("proposal") == "accepted" for t in tokens) == accepted
    return len(verifies), proposed, accepted


def test_verify_events_sum_to_the_requests_counts(client: httpx.Client) -> None:
    before = counters(client)
    events = run(client, prompt=REPEATS, max_tokens=24, ignore_eos=True)
    runs, proposed, accepted = check_user(events, 0)
    assert 0 < accepted < proposed  # repeats were proposed: some kept, some not
    after = counters(client)
    assert [a - b for a, b in zip(after, before)] == [runs, proposed, accepted]
    order = [e["event"] for e in events]
    assert order.index("prefill") < order.index("verify") < order.index("done")


def test_each_user_has_its_own_verify_events(client: httpx.Client) -> None:
    before = counters(client)
    events = run(client, prompt=REPEATS, max_tokens=16, ignore_eos=True, users=3,
                 arrival="together")
    totals = [check_user(events, u) for u in range(3)]
    after = counters(client)
    assert [a - b for a, b in zip(after, before)] == [sum(t[i] for t in totals)
                                                      for i in range(3)]
    assert all(t[1] > 0 for t in totals)


def test_a_schema_run_keeps_proposals_before_forced_tokens(client: httpx.Client) -> None:
    schema = {"type": "object", "properties": {"animal": {"type": "string"}},
              "required": ["animal"]}
    events = run(client, prompt=f'{REPEATS} mat. As JSON: {{"animal": "cat"}} {{"animal": "dog"}}',
                 max_tokens=40, json_schema=schema)
    check_user(events, 0)
    (done,) = [e for e in events if e["event"] == "done"]
    assert json.loads(done["text"])["animal"]
