"""Weight and KV cache buffers in 2 MiB pages: what a decode step streams, it streams without
4 KiB stalls.

A batch-1 decode step reads every weight once, front to back, so it runs at the speed memory
streams; at depth it reads the KV cache too, a head's row from each slot. With 4 KiB pages
that stream stalls at every page: the CPU's prefetchers stop at a page boundary, and each new
page costs a TLB walk. Linux's transparent huge pages map 2 MiB at once,
but where the system setting is `madvise` (a common default) only memory that asks for them
gets them, and torch's allocations do not ask.

`weight_buffer(n)` is a private anonymous mapping that asks: the 2 MiB-aligned span inside it
is advised MADV_HUGEPAGE before anything touches it. The front slack up to that alignment is
never touched, so it costs address space only; the tail after the last whole 2 MiB page is
left to 4 KiB pages, so no buffer holds more than its bytes' pages. The buffer lives as long
as any tensor viewing it and is unmapped with the last one. Where the mapping or the advice
is not available (not Linux, THP off) it is a plain torch buffer; the bytes are the same.

`populate(t)` makes a tensor's pages resident without writing them (MADV_POPULATE_WRITE,
Linux 5.14 on), so it is safe while other threads write the same tensor: kvlab.runner.kv_pager
runs it ahead of the KV cache's writes.
"""

from __future__ import annotations

import ctypes
import math
import mmap

import torch

HUGE_PAGE = 2 << 20
_ADVICE = getattr(mmap, "MADV_HUGEPAGE", None)
_POPULATE_WRITE = 23  # linux/mman.h; Python's mmap module does not name it
_SMALL_PAGE = mmap.PAGESIZE


def weight_buffer(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 tensor of `nbytes`, in huge pages where the system gives them."""
    if nbytes < HUGE_PAGE or _ADVICE is None:  # a smaller buffer could hold no huge page
        return torch.empty(nbytes, dtype=torch.uint8)
    try:
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, AttributeError, ValueError):
        return torch.empty(nbytes, dtype=torch.uint8)
    whole = torch.frombuffer(region, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE  # the mapping's address is 4 KiB-aligned
    huge = nbytes // HUGE_PAGE * HUGE_PAGE
    try:
        region.madvise(_ADVICE, start, huge)
    except OSError:  # THP compiled out or set to never: 4 KiB pages, same bytes
        pass
    return whole[start:start + nbytes]


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous tensor in weight_buffer's pages: pages become resident
    only when written, in 2 MiB steps where they are huge."""
    return weight_buffer(math.prod(shape) * dtype.itemsize).view(dtype).view(shape)


def _madvise() -> ctypes._CFuncPtr | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


_MADVISE = _madvise() if _ADVICE is not None else None


def populate(t: torch.Tensor) -> bool:
    """Fault in the pages under a contiguous CPU tensor as if written, leaving its bytes as
    they are; False where the system cannot (not Linux, a kernel before 5.14). The call
    releases the GIL. Bytes of neighbouring data that share its first or last page are made
    resident too, and keep their values as well."""
    if _MADVISE is None or t.numel() == 0 or not t.is_contiguous() or t.device.type != "cpu":
        return False
    first = t.data_ptr() // _SMALL_PAGE * _SMALL_PAGE
    end = t.data_ptr() + t.numel() * t.element_size()
    return _MADVISE(first, end - first, _POPULATE_WRITE) == 0


def huge_page_bytes() -> int:
    """This process's anonymous memory in huge pages (Linux's smaps_rollup; 0 elsewhere)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
