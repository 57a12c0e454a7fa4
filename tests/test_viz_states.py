"""The visualiser's view of a hybrid model's recurrent state rows, beside the KV blocks: the
engine's snapshot and stats, each request's slot, and the pool record the page draws."""

from __future__ import annotations

import httpx
import pytest

from kvlab.engine import Engine, EngineConfig
from kvlab.estimate.specs import architecture_from_config
from kvlab.models.loader import LoadOptions, load_model
from kvlab.request import SamplingParams
from kvlab.server.viz.events import LiveRequests, UserState, pool_record, pool_views
from kvlab.server.viz.predict import SERVED, model_for
from kvlab.tokenizer import load_gguf_tokenizer
from kvlab.weights.checkpoint import open_checkpoint

from fake_engine import run_on_app
from tiny_models import build, build_hybrid, byte_tokenizer_metadata

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
PROMPT = list(range(20, 45))  # 25 tokens: six full blocks of 4


def _engine(path, **kw) -> Engine:
    loaded = load_model(open_checkpoint(str(path)), LoadOptions())
    tokenizer = load_gguf_tokenizer(byte_tokenizer_metadata(96))
    return Engine(loaded, tokenizer, EngineConfig(**{"block_size": 4, "kv_dtype": "f32",
                                                     "max_num_seqs": 3,
                                                     "state_snapshot_blocks": 2, **kw}))


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    out = tmp_path_factory.mktemp("lfm2")
    build_hybrid("lfm2", out)
    return _engine(out / "hf")


def test_snapshot_describes_the_state_rows(hybrid: Engine) -> None:
    snap = hybrid.snapshot()
    assert snap.num_state_slots >= 3  # a row for every sequence that may run
    assert snap.state_bytes_per_seq == hybrid.loaded.config.state_bytes_per_seq() > 0
    assert snap.num_snapshot_rows > 0  # prefix caching keeps states at block boundaries


def test_pool_record_shows_each_slot_owner_and_snapshot_rows(hybrid: Engine) -> None:
    live = LiveRequests()
    for user, rid in enumerate(("a", "b")):
        hybrid.add_request(rid, PROMPT, GREEDY)
        live.users[rid] = ("run-1", UserState(user, rid, len(PROMPT)))
    hybrid.add_request("outside", [5, 6, 7], GREEDY)  # another client's request
    hybrid.step()
    stats, views = pool_views(hybrid, live.ids())
    record = pool_record(stats, live, views)
    states = record["states"]
    assert states["slots_total"] == hybrid.snapshot().num_state_slots
    assert states["slots_used"] == 3
    slots = {r["request_id"]: r["state_slot"] for r in record["requests"]}
    assert sorted(slots) == ["a", "b"] and slots["a"] != slots["b"]
    for rid, user in (("a", 0), ("b", 1)):
        assert states["slots"][slots[rid]] == {"request_id": rid, "run_id": "run-1",
                                               "user": user}
    others = [s for s in states["slots"] if s is not None and s["request_id"] is None]
    assert len(others) == 1
    assert states["snapshot_rows_total"] == hybrid.snapshot().num_snapshot_rows
    while hybrid.has_unfinished():
        hybrid.step()
    stats, views = pool_views(hybrid, [])
    after = pool_record(stats, live, views)["states"]
    assert after["slots_used"] == 0 and all(s is None for s in after["slots"])
    # the prompt's prefill saved states at every second block boundary, and they stay
    assert after["snapshots_saved"] >= 1
    assert after["snapshot_rows_used"] >= after["snapshots_saved"]


def test_model_without_recurrent_layers_has_no_state_record(tmp_path) -> None:
    build("qwen2", tmp_path)
    engine = _engine(tmp_path / "model.gguf")
    assert engine.snapshot().num_state_slots == 0
    assert engine.snapshot().state_bytes_per_seq == 0
    stats, views = pool_views(engine, [])
    assert pool_record(stats, LiveRequests(), views)["states"] is None


def test_viz_api_gives_the_state_rows(hybrid: Engine) -> None:
    """The page reads the slots' size from /viz/api/options and their owners from the pool
    record, which /viz/api/pool serves as the run's stream does."""
    async def body(client: httpx.AsyncClient, app: object) -> None:
        options = (await client.get("/viz/api/options")).json()
        assert options["state_slots"] == hybrid.snapshot().num_state_slots
        assert options["state_bytes_per_seq"] == hybrid.loaded.config.state_bytes_per_seq()
        states = (await client.get("/viz/api/pool")).json()["states"]
        assert states["slots_total"] == options["state_slots"]
        assert states["slots_used"] == 0

    run_on_app(hybrid, body)


def test_what_if_quantization_keeps_the_states(hybrid: Engine) -> None:
    """The served hybrid at another quantization: other weight bytes, the same caches."""
    served = hybrid.snapshot()
    what_if = model_for(SERVED, "q4_k_m", served.spec, architecture_from_config(served.model))
    assert what_if.weight_bytes < served.spec.weight_bytes
    assert what_if.state_bytes_per_seq() == served.state_bytes_per_seq > 0
    assert what_if.kv_bytes_per_token(4) == served.spec.kv_bytes_per_token(4)
