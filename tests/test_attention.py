"""Paged attention's metadata and its fresh-prefill path (keys read as computed)."""

from __future__ import annotations

import dataclasses

import torch

from kvlab.models.attention import AttentionMetadata, SeqSpan, build_metadata, paged_attention
from kvlab.models.kv_store import FloatKV

CPU = torch.device("cpu")


def span(start: int, num_new: int, first_slot: int = 0) -> SeqSpan:
    return SeqSpan(start, num_new, torch.arange(first_slot, first_slot + start + num_new))


def test_only_a_prefill_without_cached_prefix_is_fresh():
    meta = build_metadata([span(0, 6), span(4, 3, 100), span(9, 1, 200)], None, CPU)
    assert [g.fresh for g in meta.groups_full] == [True, False, False]


def test_a_chunk_wider_than_the_window_is_not_fresh_on_sliding_layers():
    meta = build_metadata([span(0, 6), span(0, 3, 100)], 4, CPU)
    assert [g.fresh for g in meta.groups_full] == [True, True]
    assert [g.fresh for g in meta.groups_sliding] == [False, True]


def unfresh(meta: AttentionMetadata) -> AttentionMetadata:
    def plain(groups):
        return tuple(dataclasses.replace(g, fresh=False) for g in groups)
    return dataclasses.replace(meta, groups_full=plain(meta.groups_full),
                               groups_sliding=plain(meta.groups_sliding))


def test_fresh_prefill_equals_reading_the_cache():
    gen = torch.Generator().manual_seed(0)
    spans = [span(0, 7), span(3, 2, 50), span(5, 1, 90), span(0, 5, 120)]
    tokens = sum(s.num_new for s in spans)
    q = torch.randn(tokens, 4, 16, generator=gen)
    k, v = (torch.randn(tokens, 2, 16, generator=gen) for _ in range(2))
    for window in (None, 6):  # 6: the 5-token prefill is fresh, the 7-token one is not
        meta = build_metadata(spans, window, CPU)
        got, ref = [], []
        for m, out in ((meta, got), (unfresh(meta), ref)):
            cache = FloatKV(160, 2, 16, torch.float32, CPU)
            cache.k.zero_(), cache.v.zero_()  # earlier positions of the prefixed spans
            out.append(paged_attention(q, k, v, cache, m, sliding=window is not None,
                                       scale=0.25))
        assert torch.allclose(got[0], ref[0], atol=1e-6, rtol=1e-5)
