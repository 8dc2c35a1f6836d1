"""Rate limits on the request path: the counters' storage (Redis when several gateways share limits)."""

from __future__ import annotations

from limits.aio.storage import MemoryStorage, RedisStorage, Storage
from limits.aio.strategies import MovingWindowRateLimiter


def limiter_for(redis_url: str, key_prefix: str = "") -> MovingWindowRateLimiter:
    """Counters in Redis when the deployment has one (every gateway then shares them), else in memory."""
    storage: Storage = (
        RedisStorage(redis_url, implementation="redispy", key_prefix=f"{key_prefix}tandem-limits")
        if redis_url
        else MemoryStorage()
    )
    return MovingWindowRateLimiter(storage)
