"""`kvlab loadtest`: the statistics (vLLM's definitions), SSE parsing of servers with and without
usage, and end to end against a real `kvlab serve` (JSON fields, rate mode, sweep plot)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from kvlab.cli.main import main
from kvlab.errors import KvlabError
from kvlab.harness import loadtest as lt

# ---- statistics ----------------------------------------------------------------------------------


def test_distribution_and_tpot() -> None:
    d = lt.distribution_ms([0.1, 0.2, 0.3, 0.4])
    assert d["mean"] == pytest.approx(250) and d["p50"] == pytest.approx(250)
    assert d["p99"] == pytest.approx(397)
    assert lt.distribution_ms([]) == {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    r = lt.RequestResult(ok=True, output_tokens=5, ttft=0.2, latency=1.0)
    assert r.tpot == pytest.approx(0.2)  # (1.0 - 0.2) / (5 - 1): the first token excluded
    assert lt.RequestResult(ok=True, output_tokens=1, ttft=0.2, latency=0.2).tpot is None


def test_slos_and_goodput() -> None:
    assert lt.parse_slos(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    for bad in (["ttft"], ["itl:5"], ["ttft:-1"], ["ttft:abc"]):
        with pytest.raises(KvlabError):
            lt.parse_slos(bad)
    fast = lt.RequestResult(ok=True, prompt_tokens=10, output_tokens=11, ttft=0.1, latency=0.6,
                            itl=[0.05] * 10)
    slow = lt.RequestResult(ok=True, prompt_tokens=10, output_tokens=11, ttft=0.9, latency=1.4,
                            itl=[0.05] * 10)
    failed = lt.RequestResult(ok=False, error="HTTP 503")
    cfg = lt.LoadConfig(url="http://x", concurrency=2, num_requests=3)
    s = lt.summarize(cfg, "m", [fast, slow, failed], 2.0, {"ttft": 500, "tpot": 60})
    assert (s.completed, s.failed, s.errors) == (2, 1, ["HTTP 503"])
    assert s.request_throughput == 1.0 and s.goodput == 0.5
    assert s.output_throughput == 11.0 and s.total_token_throughput == 21.0
    assert s.tpot_ms["mean"] == pytest.approx(50) and s.itl_ms["p99"] == pytest.approx(50)
    assert "goodput      0.50 req/s" in lt.format_summary(s)
    assert lt.format_sweep([s]).splitlines()[1].split()[0] == "2"


def test_prompts_file(tmp_path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hi", "max_tokens": 3}\n\n'
                    '{"messages": [{"role": "user", "content": "yo"}]}\n')
    a, b = lt.load_prompts(path)
    assert a.as_messages() == [{"role": "user", "content": "hi"}] and a.max_tokens == 3
    assert b.as_text() == "yo"
    body = lt.request_body(lt.LoadConfig(url="u", endpoint="completions"), a, "m")
    assert body["prompt"] == "hi" and body["max_tokens"] == 3 and body["stream"]
    path.write_text('{"text": "no"}\n')
    with pytest.raises(KvlabError, match="p.jsonl:1"):
        lt.load_prompts(path)
    assert len(lt.builtin_prompts()) == 64


def test_json_schema_request_body(tmp_path) -> None:
    path = tmp_path / "s.json"
    path.write_text('{"type": "object", "properties": {"a": {"type": "integer"}}}')
    schema = lt.load_schema(path)
    body = lt.request_body(lt.LoadConfig(url="u", json_schema=schema), lt.Prompt(text="hi"), "m")
    assert body["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "reply", "schema": schema}}
    assert "response_format" not in lt.request_body(lt.LoadConfig(url="u"), lt.Prompt("hi"), "m")
    for text, problem in (("[1]", "a schema is a JSON object"), ("{", "not JSON")):
        path.write_text(text)
        with pytest.raises(KvlabError, match=problem):
            lt.load_schema(path)
    with pytest.raises(KvlabError, match="cannot be read"):
        lt.load_schema(tmp_path / "missing.json")


def test_forced_share_and_valid_replies() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    replies = [lt.RequestResult(ok=True, output_tokens=10, forced_tokens=6, text='{"a": 1}'),
               lt.RequestResult(ok=True, output_tokens=10, forced_tokens=2, text='{"a": "x"}'),
               lt.RequestResult(ok=True, output_tokens=20, forced_tokens=0, text='{"a": 2')]
    cfg = lt.LoadConfig(url="http://x", concurrency=1, json_schema=schema)
    s = lt.summarize(cfg, "m", replies, 1.0, {})
    assert s.forced_share == pytest.approx(8 / 40)
    pytest.importorskip("jsonschema")
    assert (s.valid, s.valid_check) == (1, "JSON schema")
    assert "forced 20.0% of output tokens   valid: 1/3 (JSON schema)" in lt.format_summary(s)
    plain = lt.summarize(lt.LoadConfig(url="http://x"), "m", [lt.RequestResult(ok=True)], 1.0, {})
    assert (plain.forced_share, plain.valid) == (None, None)
    assert "structured" not in lt.format_summary(plain)


# ---- SSE parsing against fake servers ------------------------------------------------------------


def _sse(*events: dict | str) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode()
                    for e in events)


def _send(body: bytes, endpoint: str = "chat", status: int = 200) -> lt.RequestResult:
    transport = httpx.MockTransport(lambda request: httpx.Response(status, content=body))

    async def go() -> lt.RequestResult:
        async with httpx.AsyncClient(transport=transport) as client:
            cfg = lt.LoadConfig(url="http://fake", endpoint=endpoint)
            return await lt.send(client, cfg, lt.Prompt(text="hi"), "m")

    return asyncio.run(go())


def test_chat_stream_with_usage() -> None:
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    tok = {"choices": [{"index": 0, "delta": {"content": "ab"}}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 4,
                                      "completion_tokens_details": {"forced_tokens": 1}}}
    r = _send(_sse(role, tok, tok, tok, usage, "[DONE]"))
    assert r.ok and (r.prompt_tokens, r.output_tokens, len(r.itl)) == (7, 4, 2)
    assert r.text == "ababab" and r.forced_tokens == 1
    assert 0 < r.ttft <= r.latency


def test_stream_without_usage_counts_chunks_and_errors_are_reported() -> None:
    tok = {"choices": [{"index": 0, "text": "x", "finish_reason": None}]}
    r = _send(_sse(tok, tok, tok, "[DONE]"), endpoint="completions")
    assert r.ok and r.output_tokens == 3 and r.prompt_tokens == 0 and r.forced_tokens is None
    bad = _send(_sse(tok, {"error": {"message": "engine failed"}}))
    assert not bad.ok and "engine failed" in bad.error
    refused = _send(b'{"error": {"message": "full"}}', status=503)
    assert not refused.ok and refused.error.startswith("HTTP 503")


# ---- end to end against kvlab serve --------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from test_server import start_server

    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with start_server(log, "--max-num-seqs", "4") as s:
        yield s


def _loadtest(capsys, *argv: str) -> tuple[int, dict]:
    code = main(["loadtest", *argv])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_loadtest_json_report(server, capsys) -> None:
    code, rep = _loadtest(capsys, "--url", server.url, "-c", "2", "-n", "4", "--max-tokens",
                          "8", "--endpoint", "completions", "--ignore-eos", "--json",
                          "--slo", "ttft:600000", "--slo", "tpot:600000")
    assert code == 0 and rep["model"] == "gemma-3-270m-q4_k_m.gguf"
    assert (rep["completed"], rep["failed"], rep["total_output_tokens"]) == (4, 0, 32)
    assert rep["goodput"] == pytest.approx(rep["request_throughput"])
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert set(rep[key]) == {"mean", "p50", "p90", "p99"} and rep[key]["mean"] > 0
    assert rep["output_throughput"] > 0 and rep["total_token_throughput"] > \
        rep["output_throughput"]


@pytest.mark.slow
def test_loadtest_rate_mode_chat_with_prompt_file(server, capsys, tmp_path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Hello"}\n{"messages": [{"role": "user", "content": '
                       '"Hi"}], "max_tokens": 3}\n')
    code, rep = _loadtest(capsys, "--url", server.url + "/v1", "--rate", "20", "-n", "3",
                          "--max-tokens", "4", "--prompts", str(prompts), "--json")
    assert code == 0 and rep["rate"] == 20 and rep["completed"] == 3
    code, rep = _loadtest(capsys, "--url", server.url, "--model", "nope", "-n", "2", "--json",
                          "--warmup", "0")
    assert code == 1 and rep["failed"] == 2 and "HTTP 404" in rep["errors"][0]


@pytest.mark.slow
def test_loadtest_sweep_writes_plot(server, capsys, tmp_path) -> None:
    png = tmp_path / "sweep.png"
    code, rep = _loadtest(capsys, "--url", server.url, "--sweep", "1,2", "-n", "2",
                          "--max-tokens", "4", "--plot", str(png), "--json")
    assert code == 0 and [r["concurrency"] for r in rep["sweep"]] == [1, 2]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_loadtest_json_schema_counts_valid_and_forced(server, capsys, tmp_path) -> None:
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({
        "type": "object", "required": ["customer_full_name", "quantity"],
        "properties": {"customer_full_name": {"type": "string", "maxLength": 12},
                       "quantity": {"type": "integer", "minimum": 1, "maximum": 9}}}))
    code, rep = _loadtest(capsys, "--url", server.url, "-n", "2", "--max-tokens", "48",
                          "--json-schema", str(schema), "--json")
    assert code == 0 and rep["completed"] == 2 and rep["valid"] == 2
    assert 0 < rep["forced_share"] < 1
