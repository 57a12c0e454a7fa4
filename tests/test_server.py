"""`kvlab serve` end to end on the real default model, driven by the official `openai` client:
completions, chat, streaming with usage, n, seeds, logprobs, stops, OpenAI-shaped errors,
disconnects freeing KV blocks, /metrics, concurrency, prefix caching and graceful shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from net import free_port

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
MODEL = "gemma-3-270m-q4_k_m.gguf"


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log: Path

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()



@contextlib.contextmanager
def start_server(log: Path, *flags: str) -> Iterator[Server]:
    """A `kvlab serve` subprocess on a free port; waits for /health, kills it at the end."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvlab.cli.main", "serve", "--port", str(port),
           "--log-level", "warning", *flags]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    server = Server(f"http://127.0.0.1:{port}", proc, log)
    try:
        _wait_healthy(server)
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_healthy(server: Server, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            pytest.fail(f"kvlab serve exited early:\n{server.log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    pytest.fail(f"kvlab serve did not become healthy:\n{server.log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with start_server(log, "--max-num-seqs", "4", "--max-waiting", "16") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


GREEDY = {"model": MODEL, "temperature": 0, "max_tokens": 8}
CHAT = [{"role": "user", "content": "Name three colors."}]


def test_models_lists_the_file_name(client) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion(client) -> None:
    r = client.completions.create(prompt="The capital of France is", **GREEDY)
    assert r.object == "text_completion" and r.model == MODEL
    assert r.choices[0].text and r.choices[0].finish_reason in ("length", "stop")
    u = r.usage
    assert u.prompt_tokens > 3 and 1 <= u.completion_tokens <= 8
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens >= 0
    echoed = client.completions.create(prompt="The capital of France is", echo=True, **GREEDY)
    assert echoed.choices[0].text == "The capital of France is" + r.choices[0].text


def test_chat(client) -> None:
    r = client.chat.completions.create(messages=CHAT, model=MODEL, temperature=0,
                                       max_completion_tokens=8)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.usage.completion_tokens <= 8


def test_streams_equal_whole_answers_and_end_with_usage(client) -> None:
    whole = client.chat.completions.create(messages=CHAT, **GREEDY)
    chunks = list(client.chat.completions.create(
        messages=CHAT, stream=True, stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == \
        whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        whole.usage.completion_tokens
    plain = list(client.completions.create(prompt="Once upon a time", stream=True, **GREEDY))
    assert all(c.usage is None for c in plain) and "".join(c.choices[0].text for c in plain)


def test_n_choices_are_indexed(client) -> None:
    r = client.completions.create(prompt="My favourite food is", n=2, seed=1, temperature=1.0,
                                  max_tokens=6, model=MODEL)
    assert sorted(c.index for c in r.choices) == [0, 1]
    chunks = list(client.chat.completions.create(messages=CHAT, n=2, stream=True, **GREEDY))
    assert {c.choices[0].index for c in chunks} == {0, 1}


def test_seed_reproduces_sampling(client) -> None:
    kw = {"prompt": "Tell me a story:", "model": MODEL, "temperature": 1.0, "max_tokens": 12, "seed": 1234}
    first, second = (client.completions.create(**kw).choices[0].text for _ in range(2))
    assert first == second


def test_logprobs(client) -> None:
    r = client.completions.create(prompt="One, two, three,", logprobs=2, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == r.usage.completion_tokens
    assert all(x <= 0 for x in lp.token_logprobs)
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text
    c = client.chat.completions.create(messages=CHAT, logprobs=True, top_logprobs=3, **GREEDY)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 for t in content)
    # greedy: the chosen token is the most likely one
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)


def test_stop_string(client) -> None:
    kw = {"prompt": "1, 2, 3, 4, 5,", "model": MODEL, "temperature": 0, "max_tokens": 16}
    full = client.completions.create(**kw).choices[0].text
    stop = full.split()[1]  # the second word: it cuts the answer short
    r = client.completions.create(stop=[stop], **kw)
    assert r.choices[0].text == full[:full.index(stop)]
    assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("kwargs", [
    {"prompt": "hi", "max_tokens": "5"},  # wrong type
    {"prompt": "hi", "temperature": -1},
    {"prompt": "hi", "top_p": 0},
    {"prompt": ""},
    {"prompt": "hi", "max_tokens": 10**6},  # beyond the context
    {"prompt": [10**9]},  # not a token id
    {"prompt": "hi", "n": 0},
])
def test_bad_completion_requests_are_400(client, kwargs) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, **kwargs)
    err = e.value.response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]


def test_bad_chat_requests_and_unknown_model(client, server) -> None:
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard",
                                                               "content": "hi"}])
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=CHAT)
    assert e.value.response.json()["error"]["code"] == "model_not_found"
    r = httpx.post(server.url + "/v1/chat/completions", content=b'{"messages": [',
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_disconnect_mid_stream_frees_blocks(server) -> None:
    body = {"model": MODEL, "prompt": "Write a long essay about the sea.", "max_tokens": 2000,
            "ignore_eos": True, "stream": True}
    start = time.monotonic()
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n == 6:
                assert server.health()["kv_blocks_used"] > 0
                break  # leaving the iterator closes the connection
    _assert_idle_soon(server)
    assert time.monotonic() - start < 30  # far sooner than 2000 tokens take
    with pytest.raises(httpx.ReadTimeout):  # a whole-answer request whose client gives up
        httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, timeout=1.5)
    _assert_idle_soon(server)
    metrics = httpx.get(server.url + "/metrics").text
    assert f'kvlab:request_success_total{{model_name="{MODEL}",finished_reason="abort"}} 2' \
        in metrics


def _assert_idle_soon(server: Server, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = server.health()
        if h["num_requests"] == 0 and h["kv_blocks_used"] == 0:
            break
        time.sleep(0.1)
    assert h["num_requests"] == 0 and h["kv_blocks_used"] == 0 and h["num_running"] == 0


def test_metrics_parse(server, client) -> None:
    client.completions.create(prompt="Hello", **GREEDY)
    text = httpx.get(server.url + "/metrics").text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    count = f'kvlab:time_to_first_token_seconds_count{{model_name="{MODEL}"}}'
    assert samples[count] >= 1
    for name in ("kvlab:inter_token_latency_seconds_sum", "kvlab:e2e_request_latency_seconds_sum",
                 "kvlab:request_queue_time_seconds_sum", "kvlab:request_prefill_time_seconds_sum",
                 "kvlab:request_decode_time_seconds_sum", "kvlab:prompt_tokens_total",
                 "kvlab:generation_tokens_total", "kvlab:prompt_tokens_cached_total",
                 "kvlab:num_requests_running", "kvlab:num_requests_waiting",
                 "kvlab:kv_cache_usage_perc", "kvlab:prefix_cache_hit_rate"):
        assert f'{name}{{model_name="{MODEL}"}}' in samples, name
    parser = pytest.importorskip("prometheus_client.parser")
    families = {f.name: f for f in parser.text_string_to_metric_families(text)}
    assert families["kvlab:time_to_first_token_seconds"].type == "histogram"
    assert families["kvlab:generation_tokens"].type == "counter"


def test_concurrent_requests_all_complete(server) -> None:
    async def main() -> list:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        calls = [client.completions.create(prompt=f"Fact number {i}:", **GREEDY)
                 for i in range(10)]  # more than --max-num-seqs 4: some wait
        return await asyncio.gather(*calls)

    results = asyncio.run(main())
    assert all(r.choices[0].finish_reason in ("length", "stop") for r in results)
    assert all(1 <= r.usage.completion_tokens <= 8 for r in results)
    assert server.health()["num_requests"] == 0


def test_prefix_cache_reports_cached_tokens(client) -> None:
    prompt = " ".join(f"word{i}" for i in range(150)) + " The end."
    first = client.completions.create(prompt=prompt, **GREEDY)
    second = client.completions.create(prompt=prompt, **GREEDY)
    assert first.usage.prompt_tokens > 100
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens - 16 <= cached < first.usage.prompt_tokens
    # the text may differ: the short uncached tail runs a small-batch kernel that rounds
    # differently from the one-chunk prefill of the first request


def test_graceful_shutdown_finishes_streams(tmp_path) -> None:
    with start_server(tmp_path / "serve.log", "--shutdown-timeout", "60") as s:
        body = {"model": MODEL, "prompt": "Count:", "max_tokens": 24, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        lines = []
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line and not lines:
                    s.proc.send_signal(signal.SIGINT)  # mid-stream
                lines.append(line)
        assert s.proc.wait(timeout=30) in (0, 130)  # 130: exited on SIGINT, as Ctrl-C does
    data = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert "data: [DONE]" in lines
    assert data[-1]["usage"]["completion_tokens"] == 24


def test_slow_consumer_does_not_hold_the_engine(server) -> None:
    body = json.dumps({"model": MODEL, "prompt": "Tell a long story.", "max_tokens": 1500,
                       "ignore_eos": True, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1]))) as stalled:
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: "
                        b"application/json\r\nContent-Length: " + str(len(body)).encode()
                        + b"\r\n\r\n" + body)  # ... and never read
        time.sleep(1.0)
        start = time.monotonic()
        r = server.client().completions.create(prompt="Hi", **GREEDY)
        assert r.usage.completion_tokens >= 1 and time.monotonic() - start < 10
    _assert_idle_soon(server)  # the hang-up aborted the stalled stream


def test_api_key_body_limit_and_deadline(tmp_path) -> None:
    with start_server(tmp_path / "serve.log", "--api-key", "sekrit", "--request-timeout", "2",
                      "--max-request-bytes", "100000") as s:
        with pytest.raises(openai.AuthenticationError):
            s.client().models.list()
        good = openai.OpenAI(base_url=s.url + "/v1", api_key="sekrit", max_retries=0)
        assert [m.id for m in good.models.list().data] == [MODEL]
        assert httpx.get(s.url + "/health").status_code == 200  # open without the key
        with pytest.raises(openai.APIStatusError) as e:
            good.completions.create(prompt="x" * 200_000, **GREEDY)
        assert e.value.status_code == 413
        start = time.monotonic()
        r = good.completions.create(prompt="Count:", model=MODEL, max_tokens=20000,
                                    extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length" and time.monotonic() - start < 10
        assert 0 < r.usage.completion_tokens < 20000
        _assert_idle_soon(s)


def test_sigterm_aborts_what_cannot_finish_in_the_shutdown_timeout(tmp_path) -> None:
    with start_server(tmp_path / "serve.log", "--shutdown-timeout", "2") as s:
        body = {"model": MODEL, "prompt": "Count:", "max_tokens": 20000, "ignore_eos": True,
                "stream": True}
        lines = []
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line and not lines:
                    s.proc.send_signal(signal.SIGTERM)
                    start = time.monotonic()
                lines.append(line)
        # -15: uvicorn re-raises the signal once it has shut down, as a default handler would
        assert s.proc.wait(timeout=30) in (0, -signal.SIGTERM)
        assert time.monotonic() - start < 15
    data = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert 1 < len(data) < 20000 and [x for x in lines if x][-1] == "data: [DONE]"
    assert data[-1]["choices"][0]["finish_reason"] == "abort"  # ended, not cut


def test_logit_bias_acts_and_bad_biases_are_refused(client) -> None:
    prompt, forced = "The capital of France is", 1000
    text = client.completions.create(prompt=[forced], echo=True, **{**GREEDY, "max_tokens": 1}
                                     ).choices[0].text  # the token's own text, then one more
    plain = client.completions.create(prompt=prompt, **{**GREEDY, "max_tokens": 1})
    biased = client.completions.create(prompt=prompt, logit_bias={str(forced): 100},
                                       **{**GREEDY, "max_tokens": 1})
    assert text.startswith(biased.choices[0].text) and biased.choices[0].text
    assert biased.choices[0].text != plain.choices[0].text
    for bias, match in (({"not-a-token": 1}, "token ids"), ({"5": "x"}, "logit_bias"),
                        ({"99999999": 5}, "outside the vocabulary"), ({"5": 101}, "-100, 100")):
        with pytest.raises(openai.BadRequestError, match=match):
            client.completions.create(prompt=prompt, logit_bias=bias, **GREEDY)
