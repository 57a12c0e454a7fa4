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


def _rss_kb() -> int:
    return int(re.search(r"VmRSS:\s+(\d+)", open("/proc/self/status").read()).group(1))


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
    before_huge, before_rss = huge_page_bytes(), _rss_kb()
    buf = weight_buffer(16 * HUGE_PAGE + 4096)
    view = buf[HUGE_PAGE:].view(-1, 4096)  # views keep the mapping alive
    buf.fill_(1)
    del buf
    gc.collect()
    grown = huge_page_bytes() - before_huge
    assert grown >= 8 * HUGE_PAGE, f"only {grown} bytes of huge pages after touching 32 MiB"
    assert int(view.sum()) == view.numel()
    del view
    gc.collect()
    assert _rss_kb() - before_rss < 8 * 1024, "the buffer's pages outlived its last view"
