"""Timing helpers the probes share: best of repeated runs within a budget, medians over
interleaved rounds with their spread, torch's thread count held for a block."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import torch

ROUNDS = 3  # interleaved passes through a set of timers

Timer = Callable[[float], tuple[float, ...]]  # budget seconds -> best seconds of each piece


def best_seconds(fn: Callable[[], object], budget_s: float, max_runs: int,
                 min_runs: int = 3) -> tuple[float, int]:
    """Shortest of repeated runs of `fn` (at least `min_runs`) within the time budget."""
    best, runs, end = float("inf"), 0, time.perf_counter() + budget_s
    while runs < min_runs or (runs < max_runs and time.perf_counter() < end):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
        runs += 1
    return best, runs


def per_call_seconds(fn: Callable[[], object], calls: int, budget_s: float) -> float:
    """Best mean seconds of one call of a cheap `fn`, timed over `calls` calls in a row."""
    def batch() -> None:
        for _ in range(calls):
            fn()

    batch()  # warm-up
    return best_seconds(batch, budget_s, max_runs=10)[0] / calls


def spread_median(timers: dict[str, Timer], budget_s: float, rounds: int = ROUNDS
                  ) -> tuple[dict[str, tuple[float, ...]], dict[str, float]]:
    """Each timer's median times over `rounds` passes through all the timers in turn, and
    the spread of its first piece (interquartile range / median over the rounds)."""
    runs: dict[str, list[tuple[float, ...]]] = {}
    share = budget_s / rounds / max(len(timers), 1)
    for _ in range(rounds):
        for name, timer in timers.items():
            runs.setdefault(name, []).append(timer(share))
    medians = {name: tuple(float(np.median(piece)) for piece in zip(*times))
               for name, times in runs.items()}
    spreads = {}
    for name, times in runs.items():
        first = np.array([t[0] for t in times])
        q1, q3 = np.percentile(first, [25, 75])
        spreads[name] = float((q3 - q1) / np.median(first)) if np.median(first) > 0 else 0.0
    return medians, spreads


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count set to `n` inside the block, restored after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
