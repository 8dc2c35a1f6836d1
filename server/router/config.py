"""How a pool routes and watches its replicas."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

RoutingPolicy = Literal["affinity", "least_loaded", "round_robin"]


@dataclass(frozen=True, slots=True)
class PoolConfig:
    policy: RoutingPolicy = "affinity"
    load_factor: float = 0.25  # eps of the bounded load: a replica may hold (1 + eps) x the average
    load_floor: int = 8  # ... and never fewer than this many requests before its sessions move
    health_interval_s: float = 5.0
    health_timeout_s: float = 5.0  # at most the interval, so a dead replica leaves within two intervals
    healthy_after: int = 2  # passed probes in a row before an ejected replica takes traffic again
    max_loaded_adapters: int = 8  # LoRA adapters resident per SGLang replica (server.engines.sglang_adapters)

    def __post_init__(self) -> None:
        if self.load_factor <= 0:
            raise ValueError("load_factor must be > 0")
        if self.load_floor < 0:
            raise ValueError("load_floor must be >= 0")
        if not 0 < self.health_timeout_s <= self.health_interval_s:
            raise ValueError("health_timeout_s must be in (0, health_interval_s]")
        if self.healthy_after < 1:
            raise ValueError("healthy_after must be at least 1")
