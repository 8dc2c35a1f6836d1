"""A pool of engine replicas that behaves like one engine: session affinity, health, failover."""

from server.router.pool import EnginePool, PoolConfig, RoutingPolicy

__all__ = ["EnginePool", "PoolConfig", "RoutingPolicy"]
