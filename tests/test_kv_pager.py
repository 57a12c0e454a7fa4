"""The KV pager: KV pages made resident ahead of the writes that need them, bytes unchanged."""

from __future__ import annotations

import pytest
import torch

from kvlab.kernels import hugepages
from kvlab.runner.kv_pager import KVPager

pytestmark = pytest.mark.skipif(not hugepages.populate(torch.zeros(1)),
                                reason="no MADV_POPULATE_WRITE here (Linux 5.14 on)")


def anon_resident_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def test_populate_makes_pages_resident_and_keeps_their_bytes():
    b = hugepages.empty((16 << 20,), torch.uint8)
    b[:100] = 5  # resident already: must keep its bytes
    before = anon_resident_bytes()
    assert hugepages.populate(b[1 << 20:])
    assert anon_resident_bytes() - before >= 14 << 20
    assert (b[:100] == 5).all() and (b[100:] == 0).all()


def stores(slots: int) -> list[torch.Tensor]:
    """Two layer tensors of 32 KiB per slot (64 slots to a 2 MiB page)."""
    return [hugepages.empty((slots, 64, 128), torch.float32) for _ in range(2)]


def test_pager_keeps_a_page_of_slots_past_the_high_water_mark():
    bs, blocks = 16, 36
    main, window = stores((blocks + 1) * bs), stores(9 * bs)
    for t in main + window:
        t[:3] = 1.5
    pager = KVPager([main, window], [blocks * bs, 8 * bs], bs)
    assert pager.margin == 32  # half a page
    pager.follow([0, 0])
    assert pager.wait(30)
    assert pager.done == [32, 32]
    pager.follow([5, 100])  # the window pool has 8 blocks: its target stops there
    assert pager.wait(30)
    assert pager.done == [5 * bs + 32, 8 * bs]
    pager.follow([2, 0])  # a lower mark asks for nothing
    assert pager.wait(30) and pager.done == [5 * bs + 32, 8 * bs]
    pager.follow([blocks, 8])
    assert pager.wait(30) and pager.done == [blocks * bs, 8 * bs]
    assert all((t[:3] == 1.5).all() and (t[3:] == 0).all() for t in main + window)
    pager.close()
    pager._thread.join(5)
    assert not pager._thread.is_alive()


def tiny_engine(tmp_path):
    """A tiny Llama's engine: a 0.01 GiB KV pool in blocks of 4."""
    from kvlab.engine import Engine, EngineConfig

    from tiny_models import build

    build("llama", tmp_path)
    return Engine.from_model(str(tmp_path / "model.gguf"),
                             EngineConfig(block_size=4, kv_dtype="f32", kv_cache_gib=0.01))


def test_engine_pages_ahead_of_its_sequences(tmp_path):
    from kvlab.request import SamplingParams

    engine = tiny_engine(tmp_path)
    pager = engine.runner.pager
    slots = engine.kv.num_blocks * 4
    assert pager.wait(30) and pager.done == [min(pager.margin, slots)]  # before any request
    engine.add_request("r", list(range(1, 30)), SamplingParams(max_tokens=4, temperature=0))
    while engine.has_unfinished():
        engine.step()
    high = engine.kv.high_water()
    assert high == [8]  # 32 tokens in blocks of 4, from the front
    assert pager.wait(30) and pager.done == [min(8 * 4 + pager.margin, slots)]
    engine.close()
    pager._thread.join(5)
    assert not pager._thread.is_alive()


def test_a_dropped_engine_stops_its_pager_and_frees_the_kv_pool(tmp_path):
    import gc
    import weakref

    engine = tiny_engine(tmp_path)
    thread = engine.runner.pager._thread
    store = weakref.ref(engine.runner.kv_caches[0].k)
    del engine
    gc.collect()
    thread.join(5)
    assert not thread.is_alive() and store() is None


def test_pagers_stop_before_the_interpreter_exits():
    """The exit hook stops and joins every live pager's thread, so none is still running
    when the interpreter finalizes."""
    from kvlab.runner import kv_pager

    pager = KVPager([stores(4 * 16)], [4 * 16], 16)
    pager.follow([4])
    kv_pager._stop_all()
    assert not pager._thread.is_alive()


def test_close_returns_once_the_thread_has_ended():
    """The caller's reference to the pager then outlives the thread, so the thread never
    frees the KV tensors (their storage's deleter would take the GIL back on a thread the
    interpreter may be finalizing under)."""
    from kvlab.runner import kv_pager

    pager = KVPager([stores(8 * 16)], [8 * 16], 16)
    pager.follow([8])  # work under way as it is closed
    pager.close()
    assert not pager._thread.is_alive()
    assert pager._thread not in kv_pager._THREADS
