"""Handing the C heap's free pages back to the system, where the C library is glibc.

Loading frees a good deal (the vocabulary's Python objects, conversion buffers) that glibc
keeps for reuse; a heap only shrinks from its top on its own, so one trim after loading
returns the rest. (A fixed mmap threshold, so that each step's activations go back when
freed, was measured and not kept: in this VM the page faults of re-mapping them every step
cost 15-25 % of a 512-token prefill.)

Stdlib only (ctypes); elsewhere than glibc the call does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


def trim() -> None:
    """Give the heap's free pages back to the system."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
