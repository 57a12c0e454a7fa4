"""Large transient products (a prefill's gate|up) are written into one kept buffer per
thread; the logits are the same bits as with fresh outputs."""

from __future__ import annotations

import threading

import pytest
import torch
from test_decode_c import quantized_engine

from kvlab.kernels import fused, scratch

from tiny_models import build


def test_take_is_none_below_the_threshold_and_reuses_its_buffer():
    rows = scratch.MIN_BYTES // 4 // 1024
    assert scratch.take(rows - 1, 1024) is None
    a = scratch.take(rows, 1024)
    assert a.shape == (rows, 1024) and a.dtype == torch.float32 and a.is_contiguous()
    assert scratch.take(rows, 1024).data_ptr() == a.data_ptr()
    bigger = scratch.take(rows + 8, 1024)
    assert bigger.shape == (rows + 8, 1024)
    assert scratch.take(rows, 1024).data_ptr() == bigger.data_ptr()  # the grown buffer kept


def test_each_thread_has_its_own_buffer():
    rows = scratch.MIN_BYTES // 4 // 1024
    here = scratch.take(rows, 1024).data_ptr()
    there = []
    t = threading.Thread(target=lambda: there.append(scratch.take(rows, 1024).data_ptr()))
    t.start()
    t.join()
    assert there and there[0] != here


@pytest.mark.skipif(not fused.ENABLED, reason="needs kvlab's C extension")
def test_a_prefill_through_the_scratch_buffer_gives_the_same_logits(tmp_path, monkeypatch):
    build("llama", tmp_path)
    ids = list(range(3, 40))
    fresh = quantized_engine(tmp_path, "q8_0").teacher_forced_logprobs(ids, 30)
    monkeypatch.setattr(scratch, "MIN_BYTES", 0)  # every transient product into the buffer
    used, take = [], scratch.take
    monkeypatch.setattr(scratch, "take", lambda r, c: used.append((r, c)) or take(r, c))
    kept = quantized_engine(tmp_path, "q8_0").teacher_forced_logprobs(ids, 30)
    assert used and used[0][0] == 30  # the prefill's gate|up went through it
    assert torch.equal(kept, fresh)
