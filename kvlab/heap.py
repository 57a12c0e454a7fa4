"""The C heap's hold on freed memory, where the C library is glibc.

A prefill step allocates tens of MB of activations and frees them at its end. glibc serves
blocks above its mmap threshold with their own mappings, returned to the system on free, but
raises that threshold to the largest block freed so far (up to 32 MiB): after the first
step, every step's activations come from the heap, and a heap only shrinks from its top, so
the process keeps its largest step's worth of memory for good. A fixed threshold keeps large
blocks mapped (their pages are faulted in again each step, a few ms against a step's
hundreds), and a trim after loading hands back what the load left free.

Stdlib only (ctypes); elsewhere than glibc both calls do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

M_MMAP_THRESHOLD = -3  # mallopt parameter number in glibc's malloc.h
MMAP_THRESHOLD_BYTES = 2 << 20  # a decode step's logits (vocab x 4 bytes) stay below it


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "mallopt") else None


def keep_large_blocks_mapped() -> None:
    """Blocks of 2 MiB and more get their own mappings, given back when freed."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)


def trim() -> None:
    """Give the heap's free pages back to the system."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
