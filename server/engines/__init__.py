"""Engine backends behind one interface (see base.py): in-process local, or SGLang's HTTP API."""

from __future__ import annotations

from pathlib import Path

from server.engines.base import Engine
from server.engines.local.engine import LocalEngine
from server.router.pool import EnginePool, PoolConfig
from tandem.settings import Settings

__all__ = ["Engine", "open_engine"]


async def open_engine(settings: Settings, model_path: Path | None = None, *, weight_version: str = "default") -> Engine:
    """A started engine: the in-process one on ``model_path``, or a pool over ``settings.engine_urls``."""
    if settings.engine == "sglang":
        if not settings.engine_urls:
            raise ValueError("engine=sglang needs at least one engine URL (TANDEM_ENGINE_URLS or --engine-url)")
        return await EnginePool.open(
            settings.engine_urls,
            pool_config(settings),
            start_timeout_s=settings.engine_start_timeout_s,
            request_timeout_s=settings.request_timeout_s,
            stall_timeout_s=settings.engine_stall_timeout_s,
        )
    if model_path is None:
        raise ValueError("the local engine needs a model folder")
    return await LocalEngine.open(
        model_path,
        device=settings.device,
        dtype=settings.dtype,
        torch_threads=settings.torch_threads,
        served_model_name=settings.served_model_name or model_path.name,
        max_batch_size=settings.max_batch_size,
        max_queued_requests=settings.max_queued_requests,
        prefix_cache_bytes=settings.prefix_cache_bytes,
        weight_version=weight_version,
    )


def pool_config(settings: Settings) -> PoolConfig:
    return PoolConfig(
        policy=settings.routing,
        load_factor=settings.routing_load_factor,
        health_interval_s=settings.health_interval_s,
        health_timeout_s=settings.health_timeout_s or settings.health_interval_s,
        healthy_after=settings.healthy_after,
    )
