"""A GGUF file's pages released after load: RSS drops, and every tensor still reads the same
bytes (the map is file-backed, so a later read faults them back in)."""

from __future__ import annotations

import re

import torch

from kvlab.weights import open_checkpoint

from tiny_models import build


def _rss_kb() -> int:
    return int(re.search(r"VmRSS:\s+(\d+)", open("/proc/self/status").read()).group(1))


def test_released_pages_read_back_the_same_bytes(tmp_path):
    build("llama", tmp_path)
    ckpt = open_checkpoint(tmp_path / "model.gguf")
    before = {n: ckpt.read(n).data.clone() for n in ckpt.names()}
    for name in sorted(before)[:3]:
        ckpt.release_pages(name)
    ckpt.release_pages()
    assert all(torch.equal(ckpt.read(n).data, t) for n, t in before.items())


def test_releasing_a_touched_file_lowers_the_rss(default_model_path):
    ckpt = open_checkpoint(default_model_path)
    total = sum(int(ckpt.read(n).data.sum()) for n in ckpt.names())  # every page resident
    touched = _rss_kb()
    ckpt.release_pages()
    assert total > 0 and touched - _rss_kb() > 100_000  # the ~240 MB file, less any noise
