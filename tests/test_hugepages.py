"""Weight buffers in 2 MiB pages: the bytes a caller writes, huge pages where the system's
setting lets memory ask for them, and every page gone once the last view is."""

from __future__ import annotations

import gc
import re
from pathlib import Path

import pytest
import torch

from kvlab.kernels.hugepages import HUGE_PAGE, huge_page_bytes, weight_buffer

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_setting() -> str | None:
    try:
        return re.search(r"\[(\w+)\]", THP.read_text()).group(1)
    except (OSError, AttributeError):
        return None


def _mapped(address: int) -> bool:
    """Whether a mapping of this process covers `address` (/proc/self/maps). Unlike the
    process's RSS, this does not move with what other threads allocate meanwhile."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        lo, hi = (int(a, 16) for a in line.split()[0].split("-"))
        if lo <= address < hi:
            return True
    return False


@pytest.mark.parametrize("nbytes", [1, 4096, HUGE_PAGE - 1, HUGE_PAGE, 3 * HUGE_PAGE + 12345])
def test_buffer_has_its_size_and_keeps_what_is_written(nbytes):
    buf = weight_buffer(nbytes)
    assert buf.dtype == torch.uint8 and buf.numel() == nbytes and buf.is_contiguous()
    values = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    buf.copy_(values)
    assert torch.equal(buf, values)


@pytest.mark.skipif(_thp_setting() not in ("madvise", "always"),
                    reason="transparent huge pages are off here")
def test_buffer_is_in_huge_pages_and_freed_with_its_last_view():
    before_huge = huge_page_bytes()
    buf = weight_buffer(16 * HUGE_PAGE + 4096)
    address = buf.data_ptr()
    view = buf[HUGE_PAGE:].view(-1, 4096)  # views keep the mapping alive
    buf.fill_(1)
    del buf
    gc.collect()
    grown = huge_page_bytes() - before_huge
    assert grown >= 8 * HUGE_PAGE, f"only {grown} bytes of huge pages after touching 32 MiB"
    assert int(view.sum()) == view.numel()
    assert _mapped(address), "the mapping went while a view of it was alive"
    del view
    gc.collect()
    assert _mapped(address) is False, "the buffer's mapping outlived its last view"
