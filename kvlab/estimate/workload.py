"""What is asked of the machine: prompt and reply lengths, concurrency, KV dtype, offload."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvlab.cost import KV_BYTES_PER_ELEMENT
from kvlab.errors import KvlabError

# Bytes per stored K or V value; q8_0 keeps one fp16 scale per 32 int8 values.
DEFAULT_EFFICIENCY = (0.6, 0.85)  # share of the decode ceiling real engines reach


@dataclass(frozen=True)
class Workload:
    """One request shape, served `concurrency` times at once."""

    prompt_tokens: int = 512
    output_tokens: int = 256
    concurrency: int = 1
    context: int | None = None  # KV reserved per sequence; None: prompt + output
    kv_dtype: str = "f16"
    offload_layers: int = 0  # layers whose weights and KV sit in the second, slower memory
    offload_bandwidth: float | None = None  # bytes/s of that memory
    efficiency: tuple[float, float] = DEFAULT_EFFICIENCY
    compute_dtype: str | None = None  # None: the hardware's default dtype
    logit_positions: int = 1  # prompt positions whose logits prefill computes
    usable_memory: float = 0.9  # share of memory for weights + KV; the rest: runtime, OS

    def __post_init__(self) -> None:
        _check_int("--prompt", self.prompt_tokens, minimum=1)
        _check_int("--output", self.output_tokens, minimum=0)
        _check_int("--concurrency", self.concurrency, minimum=1)
        _check_int("--offload-layers", self.offload_layers, minimum=0)
        _check_int("logit positions", self.logit_positions, minimum=1)
        if self.context is not None:
            _check_int("--context", self.context, minimum=1)
            if self.context < self.prompt_tokens + self.output_tokens:
                raise KvlabError(
                    f"--context {self.context} is shorter than prompt + output = "
                    f"{self.prompt_tokens + self.output_tokens}; give at least that")
        if self.kv_dtype not in KV_BYTES_PER_ELEMENT:
            raise KvlabError(f"unknown KV dtype {self.kv_dtype!r}; valid: "
                             f"{', '.join(KV_BYTES_PER_ELEMENT)}")
        self._check_offload()
        low, high = self.efficiency
        if not (0 < low <= high <= 1):
            raise KvlabError(f"--efficiency must be LOW HIGH with 0 < LOW <= HIGH <= 1, "
                             f"got {low} {high}")
        if not (0 < self.usable_memory <= 1):
            raise KvlabError(f"usable memory share must be in (0, 1], got {self.usable_memory}")

    def _check_offload(self) -> None:
        if self.offload_bandwidth is not None and not (
                math.isfinite(self.offload_bandwidth) and self.offload_bandwidth > 0):
            raise KvlabError(f"--offload-bandwidth must be a positive GB/s figure, got "
                             f"{self.offload_bandwidth / 1e9!r}")
        if self.offload_layers and self.offload_bandwidth is None:
            raise KvlabError("--offload-layers needs --offload-bandwidth GB/s (the speed of the "
                             "memory those layers sit in, e.g. 80 for dual-channel DDR5)")

    @property
    def context_tokens(self) -> int:
        return self.context or self.prompt_tokens + self.output_tokens

    @property
    def kv_bytes_per_element(self) -> float:
        return KV_BYTES_PER_ELEMENT[self.kv_dtype]

    @property
    def efficiency_mid(self) -> float:
        return sum(self.efficiency) / 2


def _check_int(flag: str, value: int, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise KvlabError(f"{flag} must be an integer >= {minimum}, got {value!r}")
