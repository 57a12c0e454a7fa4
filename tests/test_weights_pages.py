"""A GGUF file's pages released after load: RSS drops, and every tensor still reads the same
bytes (the map is file-backed, so a later read faults them back in)."""

from __future__ import annotations

import re

import torch

from kvlab.weights.checkpoint import open_checkpoint

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


def test_grouping_in_chunks_gives_the_same_bytes_and_reports_each_span(monkeypatch):
    from gguf import GGMLQuantizationType

    from kvlab.kernels import QuantizedWeight, ops, quantize

    w = quantize(torch.randn(48, 64), GGMLQuantizationType.Q8_0)
    whole = ops.group_rows(w)
    spans: list[tuple[int, int]] = []
    monkeypatch.setattr(ops, "GROUP_CHUNK_ROWS", 16)
    chunked = ops.group_rows(QuantizedWeight(w.qtype, w.shape, w.data),
                             lambda a, b: spans.append((a, b)))
    assert torch.equal(chunked.data, whole.data)
    row = w.data.shape[1]
    assert spans == [(0, 16 * row), (16 * row, 32 * row), (32 * row, 48 * row)]


def test_releasing_part_of_a_tensor_keeps_its_bytes(default_model_path):
    ckpt = open_checkpoint(default_model_path)
    name = "token_embd.weight"
    before = ckpt.read(name).data.clone()
    touched = _rss_kb()
    ckpt.release_pages(name, 0, before.numel() // 2)
    assert touched - _rss_kb() > 50_000  # half of the 178 MB embedding
    assert torch.equal(ckpt.read(name).data, before)


def test_dropping_the_vocabulary_keeps_the_rest_of_the_metadata(default_model_path):
    from kvlab.weights.checkpoint import GGUFCheckpoint

    ckpt = open_checkpoint(default_model_path)
    assert isinstance(ckpt, GGUFCheckpoint) and "tokenizer.ggml.tokens" in ckpt.metadata
    ckpt.drop_vocabulary()
    assert not any(k.startswith("tokenizer.ggml.") and isinstance(v, list)
                   for k, v in ckpt.metadata.items())
    assert "general.architecture" in ckpt.metadata
