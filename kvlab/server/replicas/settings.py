"""What one replicated application is made of, as plain picklable data.

`AppSettings` travels to every Ray worker (it is the deployments' constructor argument), so
it holds only dataclasses and strings: the EngineConfig, the ServerLimits and the way the
replicas are scaled and routed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvlab.engine import EngineConfig
from kvlab.errors import KvlabError
from kvlab.server.core.guard import ServerLimits

ROUTINGS = ("prefix", "round-robin", "pow2")


@dataclass(frozen=True)
class AppSettings:
    model: str | None  # a .gguf file or HF directory; None: the default model
    engine: EngineConfig  # per replica; engine.threads = torch/kernel threads per replica
    limits: ServerLimits = field(default_factory=ServerLimits)
    max_waiting: int = 128
    reserve_kv: bool = True
    replicas: int = 1  # fixed count, unless min_replicas / max_replicas autoscale
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None  # autoscaling target; None: half a batch
    routing: str = "prefix"
    prefix_blocks: int = 4  # leading KV blocks hashed into the routing key
    chars_per_token: int = 4  # the key is hashed from characters, not tokens (see router)
    imbalance: int = 4  # requests more than the least loaded replica before spilling over

    def __post_init__(self) -> None:
        if self.routing not in ROUTINGS:
            raise KvlabError(f"--routing must be one of {', '.join(ROUTINGS)}, "
                             f"got {self.routing!r}")
        if self.replicas < 1:
            raise KvlabError(f"--replicas must be >= 1, got {self.replicas}")
        lo, hi = self.min_replicas, self.max_replicas
        if (lo is None) != (hi is None):
            raise KvlabError("--min-replicas and --max-replicas go together; give both")
        if lo is not None and hi is not None and not 0 <= lo <= hi or hi == 0:
            raise KvlabError(f"need 0 <= --min-replicas <= --max-replicas and "
                             f"--max-replicas >= 1, got {lo} and {hi}")

    @property
    def autoscaling(self) -> bool:
        return self.max_replicas is not None

    @property
    def most_replicas(self) -> int:
        return self.max_replicas if self.max_replicas is not None else self.replicas

    @property
    def threads(self) -> int:
        return self.engine.threads or 1

    @property
    def block_chars(self) -> int:
        """Characters taken to stand for one KV block of tokens."""
        return self.engine.block_size * self.chars_per_token
