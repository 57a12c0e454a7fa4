"""Host tensors sent to a device without waiting for its stream.

A copy from pageable host memory to a CUDA device first waits for everything queued on the
stream: where the engine schedules a step while the one before it runs, such a copy would
make the host wait for that step and the overlap would be lost. A copy from pinned memory
is queued like a kernel; torch's pinned allocator keeps the source until the copy has run.
"""

from __future__ import annotations

import torch
from torch import Tensor


def upload(t: Tensor, device: torch.device | str) -> Tensor:
    """t (on the host) on `device`; on CUDA queued behind the stream's work, not waited for."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
