"""Replicas under Ray Serve on a tiny model: two replicas of one thread behind one ingress.

The routing key, the board, the metrics merge and the relay are checked as plain functions;
then `kvlab serve --replicas 2`, joined to one Ray instance per module, serves the OpenAI API
(completions, chat, streaming), routes equal prefixes to one replica, merges both replicas'
metrics and survives a killed replica.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from test_server import start_server

from tiny_models import build

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from kvlab.deploy import parse
from kvlab.server.replicas.board import ReplicaBoard, ReplicaReport
from kvlab.server.replicas.merge import merge_metrics
from kvlab.server.replicas.router import (
    PIN,
    is_busy,
    pinned_key,
    rendezvous_order,
    routing_key,
)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MODEL = "model.gguf"
CONTEXT = 2048
TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant: "


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


def test_routing_key_covers_the_first_full_blocks():
    long = "x" * 100 + "a" * 200
    key = routing_key(COMPLETIONS, body(prompt=long), block_chars=64, blocks=2)
    assert key == routing_key(COMPLETIONS, body(prompt=long[:128] + "other"), 64, 2)
    assert key != routing_key(COMPLETIONS, body(prompt="y" + long[1:]), 64, 2)
    assert routing_key(COMPLETIONS, body(prompt="short"), 64, 2) is None  # no full block
    assert routing_key(COMPLETIONS, b"{not json", 64, 2) is None
    assert routing_key("/v1/models", b"", 64, 2) is None
    messages = [{"role": "system", "content": "s" * 80}, {"role": "user", "content": "hi"}]
    chat = routing_key(CHAT, body(messages=messages), 64, 1)
    parts = [{"role": "system", "content": [{"type": "text", "text": "s" * 80}]}]
    assert chat is not None and chat == routing_key(CHAT, body(messages=parts), 64, 1)


def test_every_api_keys_a_shared_system_prompt_alike():
    """A long system prompt sent through any API's body keys its continuations together."""
    system, turn = "s" * 80, [{"role": "user", "content": "hi"}]
    keys = {api: routing_key(path, body(**fields), 64, 1) for api, (path, fields) in {
        "anthropic": ("/v1/messages", {"system": system, "messages": turn}),
        "anthropic blocks": ("/v1/messages", {"system": [{"type": "text", "text": system}],
                                              "messages": turn}),
        "responses": ("/v1/responses", {"instructions": system, "input": "hi"}),
        "ollama generate": ("/api/generate", {"system": system, "prompt": "hi"}),
    }.items()}
    assert None not in keys.values() and len(set(keys.values())) == 1, keys
    again = routing_key("/v1/messages", body(system=system, messages=[*turn, *turn]), 64, 1)
    assert again == keys["anthropic"]
    ollama = routing_key("/api/chat", body(messages=[{"role": "system", "content": system}]),
                         64, 1)
    assert ollama == routing_key(CHAT, body(messages=[{"role": "system", "content": system}]),
                                 64, 1)


def test_rendezvous_order_is_stable_and_spreads():
    ids = ["r1", "r2", "r3"]
    firsts = {rendezvous_order(f"k{i}", ids)[0] for i in range(64)}
    assert firsts == set(ids)
    order = rendezvous_order("k", ids)
    assert sorted(order) == ids and order == rendezvous_order("k", list(reversed(ids)))
    # a replica leaving moves only its own keys
    assert all(rendezvous_order(f"k{i}", ids)[0] == rendezvous_order(f"k{i}", ["r1", "r2"])[0]
               for i in range(64) if rendezvous_order(f"k{i}", ids)[0] != "r3")


def test_busy_means_imbalanced_or_full():
    assert not is_busy(None, least=0, capacity=8, imbalance=4)
    assert not is_busy(3, least=0, capacity=8, imbalance=4)
    assert is_busy(4, least=0, capacity=8, imbalance=4)
    assert is_busy(8, least=8, capacity=8, imbalance=4)


def test_prefix_router_ranks_the_key_first_and_spills_when_busy():
    from collections import namedtuple
    from types import SimpleNamespace

    from kvlab.server.replicas.router import PrefixRouter

    replica_id = namedtuple("ReplicaID", "unique_id")
    replicas = [SimpleNamespace(replica_id=replica_id(f"r{i}"),
                                max_ongoing_requests=8) for i in range(3)]
    queue: dict = {}
    router = object.__new__(PrefixRouter)  # its choice alone, without Serve's machinery
    router.initialize_state(imbalance=4)
    router._replica_queue_len_cache = SimpleNamespace(get=queue.get)

    def ranks(key):
        request = SimpleNamespace(kwargs={"prefix_key": key})
        chosen = asyncio.run(router.choose_replicas(replicas, request))
        return [[r.replica_id.unique_id for r in rank] for rank in chosen]

    order = rendezvous_order("k", ["r0", "r1", "r2"])
    assert ranks("k") == [order[:1], order[1:]]
    queue.update({replicas[int(order[0][1])].replica_id: 4})  # 4 more than the idle ones
    assert ranks("k") == [order[:2], order[2:]]
    assert len(ranks(None)[0]) == 2  # no key: two at random, the less loaded wins
    assert ranks(PIN + "r2") == [["r2"]]  # a pinned request goes where its state is
    assert len(ranks(PIN + "gone")[0]) == 2  # its replica gone: by load (it will 404)


def test_requests_for_a_stored_response_are_pinned_to_its_replica():
    rid = "resp_r1_" + "ab" * 16
    assert pinned_key("/v1/responses", body(previous_response_id=rid, input="hi")) == PIN + "r1"
    for path in (f"/v1/responses/{rid}", f"/v1/responses/{rid}/input_items"):
        assert pinned_key(path, b"") == PIN + "r1"
        assert routing_key(path, b"", 64, 2) == PIN + "r1"
    long = {"instructions": "s" * 200, "input": "hi"}
    assert routing_key("/v1/responses", body(previous_response_id=rid, **long), 64, 2) \
        == PIN + "r1"  # the pin wins over the prefix
    assert pinned_key("/v1/responses", body(previous_response_id="resp_" + "ab" * 16)) is None
    assert pinned_key("/v1/responses", b"{previous_response_id") is None


def test_board_ages_replicas_out():
    board = ReplicaBoard(fresh_s=3, forget_s=30)
    board.update(ReplicaReport("a", {"status": "ok", "model": "m"}, ""), now=0)
    board.update(ReplicaReport("b", {"status": "ok", "model": "m"}, ""), now=5)
    health = board.health(now=6)
    assert health["replicas"] == {"healthy": 1, "total": 2} and health["status"] == "ok"
    assert [r["healthy"] for r in health["per_replica"]] == [False, True]
    assert board.health(now=40)["replicas"] == {"healthy": 0, "total": 0}


def test_merged_metrics_keep_names_and_label_replicas():
    text = ("# HELP kvlab:generation_tokens_total Tokens generated.\n"
            "# TYPE kvlab:generation_tokens_total counter\n"
            'kvlab:generation_tokens_total{model_name="m"} 3.0\n')
    out = merge_metrics({"a": text, "b": text}, healthy=1).decode()
    assert "# TYPE kvlab:generation_tokens_total counter" in out
    assert 'kvlab:generation_tokens_total{model_name="m",replica="a"} 3.0' in out
    assert 'kvlab:generation_tokens_total{model_name="m",replica="b"} 3.0' in out
    assert "kvlab:replicas_healthy 1.0" in out


def test_deploy_args_are_the_serve_flags(monkeypatch):
    monkeypatch.setenv("KVLAB_SERVE_ARGS", "--threads 1")
    ns = parse({"replicas": 3, "routing": "round-robin", "no_prefix_caching": True})
    assert (ns.replicas, ns.threads, ns.routing, ns.no_prefix_caching) == (3, 1, "round-robin",
                                                                           True)
    assert parse({})  # one replica by default


def test_replica_relays_the_whole_response_of_its_app():
    from kvlab.server.replicas.replica import EngineReplica, Forwarded, ResponseStart

    read_one = asyncio.Event()  # set each time the caller has read a part

    async def app(scope, receive, send):  # done before the caller reads its first part
        assert (await receive())["body"] == b"in"
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        await send({"type": "http.response.body", "body": b"b"})

    async def paced(scope, receive, send):  # each part only once the one before was read
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for part in (b"a", b"b"):
            await read_one.wait()
            read_one.clear()
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await read_one.wait()
        await send({"type": "http.response.body", "body": b""})

    async def broken(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise RuntimeError("mid-stream")

    async def read(replica) -> list:
        parts = []
        async for part in replica.respond(Forwarded("POST", "/x", b"", [], b"in")):
            await asyncio.sleep(0.01)
            parts.append(part)
            read_one.set()
        return parts

    replica = object.__new__(EngineReplica)  # its app alone, without Serve
    replica.replica_id, replica.app = "r", app
    # parts already queued travel as one; a part sent alone is relayed without waiting
    assert asyncio.run(read(replica)) == [ResponseStart(201, [], "r"), b"ab"]
    replica.app = paced
    assert asyncio.run(read(replica)) == [ResponseStart(200, [], "r"), b"a", b"b"]
    replica.app = broken
    with pytest.raises(RuntimeError, match="mid-stream"):
        asyncio.run(read(replica))


def test_scaling_and_routing_options(monkeypatch):
    from kvlab.cli.serve import app_settings
    from kvlab.errors import KvlabError
    from kvlab.server.replicas.application import replica_options

    monkeypatch.delenv("KVLAB_SERVE_ARGS", raising=False)
    fixed = replica_options(app_settings(parse({"replicas": 2, "threads": 3})))
    assert fixed["num_replicas"] == 2 and fixed["ray_actor_options"] == {"num_cpus": 3}
    assert fixed["request_router_config"].request_router_class.endswith("router.PrefixRouter")
    auto = replica_options(app_settings(parse({"min_replicas": 1, "max_replicas": 4,
                                               "max_num_seqs": 8, "routing": "pow2"})))
    scaling = auto["autoscaling_config"]
    assert (scaling.min_replicas, scaling.max_replicas, scaling.target_ongoing_requests) == (
        1, 4, 4)
    assert "num_replicas" not in auto and "request_router_config" not in auto
    for bad in ({"replicas": 0}, {"min_replicas": 3, "max_replicas": 2}, {"max_replicas": 2}):
        with pytest.raises(KvlabError, match="replicas"):
            app_settings(parse(bad))


# ---- on Ray -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """`kvlab serve --replicas 2 --threads 1` on a tiny model, joined to this test's Ray.

    Joining (rather than letting the server start its own Ray) lets the tests kill a
    replica's actor; Ray and Serve are shut down at the end either way.
    """
    out: Path = tmp_path_factory.mktemp("replicas")
    build("llama", out, max_position_embeddings=CONTEXT)  # room for a long answer
    (out / "template.jinja").write_text(TEMPLATE)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with start_server(out / "serve.log", "--model", str(out / "model.gguf"),
                          "--replicas", "2", "--threads", "1", "--max-num-seqs", "4",
                          "--kv-cache-gib", "0.02", "--no-reserve-kv",
                          "--chat-template", str(out / "template.jinja"),
                          "--ray-address", ray.get_runtime_context().gcs_address) as server:
            wait_for(lambda: healthy_replicas(server.url) == 2, 180)
            yield server.url
    finally:
        serve.shutdown()
        ray.shutdown()


def healthy_replicas(url: str) -> int:
    try:
        return health(url)["replicas"]["healthy"]
    except (httpx.HTTPError, ValueError, KeyError):
        return -1


def health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=10).json()


def per_replica(url: str) -> dict[str, dict]:
    return {r["replica"]: r for r in health(url)["per_replica"]}


def wait_for(check, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail("timed out")
        time.sleep(0.5)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def test_openai_api_through_serve(cluster):
    c = client(cluster)
    done = c.completions.create(model=MODEL, prompt="hello", max_tokens=5, extra_body={
        "ignore_eos": True})
    assert done.usage.completion_tokens == 5 and done.choices[0].text
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                     max_tokens=4, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 4
    chunks = list(c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert sum(bool(ch.choices and ch.choices[0].delta.content) for ch in chunks) >= 2
    assert chunks[-1].usage.completion_tokens == 6
    assert [m.id for m in c.models.list().data] == ["model.gguf"]
    with pytest.raises(openai.BadRequestError):  # the replica's own validation, unchanged
        c.completions.create(model=MODEL, prompt="hi", max_tokens=-1)


def replica_of(url: str, prompt: str) -> str:
    r = httpx.post(url + COMPLETIONS, json={"model": MODEL, "prompt": prompt, "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.headers["x-kvlab-replica"]


def test_prefix_routing_keeps_a_prefix_on_one_replica(cluster):
    shared = "the same long system prompt, " * 5  # two full blocks of characters
    same = {replica_of(cluster, shared + f"question {i}") for i in range(6)}
    assert len(same) == 1
    spread = {replica_of(cluster, f"{i:03d} " * 40) for i in range(16)}
    assert len(spread) == 2
    target = same.pop()  # its prefix cache served the repeats
    wait_for(lambda: per_replica(cluster)[target]["prefix_hits"] > 0, 10)


def test_a_stored_response_is_continued_on_the_replica_that_keeps_it(cluster):
    """Stored responses live on one replica; continuations and reads of them go there,
    however different their prompts' leading text is."""
    c = client(cluster)
    for i in range(4):  # prompts that spread over both replicas
        first = c.responses.create(model=MODEL, input=f"{i:03d} " * 40, max_output_tokens=2)
        owner = first.id.split("_")[1]
        again = c.responses.with_raw_response.create(
            model=MODEL, input="and then?", previous_response_id=first.id,
            max_output_tokens=2)
        assert again.headers["x-kvlab-replica"] == owner
        assert again.parse().usage.input_tokens > first.usage.input_tokens
        got = c.responses.with_raw_response.retrieve(first.id)
        assert got.headers["x-kvlab-replica"] == owner and got.parse().id == first.id


def test_metrics_cover_both_replicas(cluster):
    for i in range(4):
        replica_of(cluster, f"{i:03d} " * 40)
    ids = [r["replica"] for r in health(cluster)["per_replica"]]

    def both() -> bool:
        text = httpx.get(cluster + "/metrics", timeout=10).text
        return all(f'replica="{rid}"' in text and "kvlab:generation_tokens_total" in text
                   for rid in ids)
    wait_for(both, 10)
    text = httpx.get(cluster + "/metrics", timeout=10).text
    assert "kvlab:replicas_healthy 2.0" in text and "kvlab:time_to_first_token_seconds" in text


def kill_replica(replica: str) -> None:
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].endswith("#" + replica)]
    assert len(names) == 1, names
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)


def test_killed_replica_ends_begun_streams_cleanly_and_retries_the_rest(cluster):
    prompt = "a long answer please " * 4  # answers of ~2000 tokens take seconds
    long = {"prompt": prompt, "max_tokens": CONTEXT - 100, "ignore_eos": True}
    with httpx.stream("POST", cluster + COMPLETIONS, timeout=60,
                      json={**long, "stream": True}) as r:
        victim = r.headers["x-kvlab-replica"]
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        whole: dict = {}
        waiting = threading.Thread(target=lambda: whole.update(
            r=httpx.post(cluster + COMPLETIONS, timeout=60, json=long)))
        waiting.start()
        time.sleep(0.3)
        kill_replica(victim)
        rest = [line for line in lines if line.startswith("data:")]
        waiting.join()
    assert "choices" in first
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][5:])["error"]["type"] == "service_unavailable_error"
    # the whole answer had sent nothing yet: it went to the other replica instead
    assert whole["r"].status_code == 200, whole["r"].text
    assert whole["r"].headers["x-kvlab-replica"] != victim
    assert whole["r"].json()["usage"]["completion_tokens"] == CONTEXT - 100
    # the other replica serves on, and Serve brings the count back to two
    assert replica_of(cluster, "x" * 10) != victim
    wait_for(lambda: health(cluster)["replicas"]["healthy"] == 2
             and not per_replica(cluster).get(victim, {}).get("healthy"), 120)
