"""KV cache pages made resident ahead of the writes that need them.

The KV stores are mapped at start but a page becomes resident only when first written
(kvlab.models.kv_store), so a step whose K/V rows are the first in a page waits for the page
fault: on the KVM guests kvlab is measured on, a fresh 2 MiB page took 8-20 ms, and a step
writes one row per layer tensor, so a first request, and every sequence crossing into fresh
pages, paid that many faults inside a step (a Gemma 3 270M first token: 36 of them, 0.7 s).

The pager is one thread that keeps every store tensor resident up to a margin past the
highest block its pool has handed out (pools hand out never-used blocks in id order, so that
high-water mark is where fresh pages begin). It populates with MADV_POPULATE_WRITE
(kvlab.kernels.hugepages.populate), which leaves bytes as they are, so it may run while steps
write the same tensors; a step that outruns it faults its page in itself, as before. The
margin is half a page of the tensor with the fewest bytes per slot: a tensor's next page is
faulted in once sequences are half-way through its current one, and memory grows by at most
a page per tensor beyond what sequences wrote. The faults cost the same CPU time as before,
on the pager's thread: between requests (a chat user typing) that is time no one waits for,
during a busy step it competes for the cores. Where populate is unavailable the thread stops
at its first try and pages fault in as written.
"""

from __future__ import annotations

import atexit
import threading
import weakref

import torch

from kvlab.kernels import hugepages

# pagers whose thread may still run, and the threads themselves, stopped and joined before the
# interpreter finalizes: a daemon thread that takes the GIL back during finalization is ended
# by unwinding its stack, and where that stack holds C++ frames the process aborts. A pager
# thread must never drop the last reference to its pager: freeing the KV tensors runs their
# storage's deleter, which takes the GIL back, possibly during finalization (a pager being
# freed has already left _LIVE). So close() joins its thread and is required of every owner,
# and the exit hook joins any thread left
_LIVE: weakref.WeakSet[KVPager] = weakref.WeakSet()
_THREADS: set[threading.Thread] = set()


@atexit.register
def _stop_all() -> None:
    for pager in list(_LIVE):
        pager.close()
    for thread in list(_THREADS):
        thread.join(timeout=5)


class KVPager:
    """`follow(blocks)`: make slots [0, (blocks + margin) * block_size) of every tensor of pool
    p resident, blocks[p] being pool p's high-water mark; returns at once, a thread works."""

    def __init__(self, pools: list[list[torch.Tensor]], pool_slots: list[int],
                 block_size: int) -> None:
        self.pools, self.pool_slots, self.block_size = pools, pool_slots, block_size
        smallest = min(t[0].numel() * t.element_size() for ts in pools for t in ts)
        self.margin = max(1, hugepages.HUGE_PAGE // smallest // 2)  # half a page's slots
        self.done = [0] * len(pools)  # slots resident so far, per pool
        self._target = [0] * len(pools)
        self._wake = threading.Condition()
        self._closed = False
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name="kvlab-kv-pager", daemon=True)
        _LIVE.add(self)
        _THREADS.add(self._thread)
        self._thread.start()

    def follow(self, blocks: list[int]) -> None:
        target = [min(b * self.block_size + self.margin, n)
                  for b, n in zip(blocks, self.pool_slots)]
        if all(t <= s for t, s in zip(target, self._target)):
            return
        with self._wake:
            self._target = [max(t, s) for t, s in zip(target, self._target)]
            self._idle.clear()
            self._wake.notify()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every requested slot is resident (or the pager stopped)."""
        return self._idle.wait(timeout)

    def close(self) -> None:
        """Stop the thread and wait until it has ended (on any thread but its own), so that
        it never holds the last reference to the KV tensors."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)  # at most one margin of pages to finish
            if not self._thread.is_alive():
                _THREADS.discard(self._thread)

    def _run(self) -> None:
        # the last block of each store takes padding rows and positions behind a window
        if not all(hugepages.populate(t[-self.block_size:]) for ts in self.pools for t in ts):
            self._closed = True
            self._idle.set()
            return
        while True:
            with self._wake:
                while not self._closed and all(d >= t for d, t in zip(self.done, self._target)):
                    self._idle.set()
                    self._wake.wait()
                if self._closed:
                    self._idle.set()
                    return
                target = list(self._target)
            if not self._advance(target):
                self._closed = True  # no populate here: pages fault in as written
                self._idle.set()
                return

    def _advance(self, target: list[int]) -> bool:
        """One margin of slots further on every pool short of its target: all the layers'
        next page before any layer's page after it, as steps write every layer."""
        for p, tensors in enumerate(self.pools):
            first = self.done[p]
            last = min(target[p], first + self.margin)
            if last <= first:
                continue
            for t in tensors:
                if not hugepages.populate(t[first:last]):
                    return False
            self.done[p] = last
        return True
