"""Open the engine the settings ask for: the in-process local engine, or a pool over SGLang-speaking
servers (given by URL, or launched and supervised from a groups file)."""

from __future__ import annotations

from pathlib import Path

from server.engines.base import Engine
from server.engines.launch_plan import load_launch_config, plan, router_launch, serving_urls
from server.engines.local.engine import LocalEngine
from server.engines.supervisor import Supervisor
from server.router.pool import EnginePool, PoolConfig
from tandem.settings import Settings

__all__ = ["open_engine", "open_local_engine", "pool_config"]


async def open_engine(settings: Settings, model_path: Path | None = None, *, weight_version: str = "default") -> Engine:
    """A started engine: the in-process one on ``model_path``, or a pool over SGLang-speaking servers
    (``settings.engine.urls`` plus the managed ones ``settings.engine.config`` describes)."""
    if settings.engine.kind == "sglang":
        return await _open_pool(settings)
    if model_path is None:
        raise ValueError("the local engine needs a model folder")
    return await open_local_engine(settings, model_path, weight_version=weight_version)


async def open_local_engine(settings: Settings, model_path: Path, *, weight_version: str = "default") -> LocalEngine:
    """The in-process engine on ``model_path``, as the settings configure it."""
    return await LocalEngine.open(
        model_path,
        device=settings.engine.device,
        dtype=settings.engine.dtype,
        torch_threads=settings.engine.torch_threads,
        served_model_name=settings.engine.served_model_name or model_path.name,
        max_batch_size=settings.engine.max_batch_size,
        max_queued_requests=settings.engine.max_queued_requests,
        max_prefill_tokens=settings.engine.max_prefill_tokens,
        prefix_cache_bytes=settings.engine.prefix_cache_bytes,
        packed_linears=settings.engine.packed_linears,
        linear_weights=settings.engine.linear_weights,
        adapter_cache_bytes=settings.adapters.cache_bytes,
        weight_version=weight_version,
    )


def pool_config(settings: Settings) -> PoolConfig:
    return PoolConfig(
        policy=settings.routing.policy,
        load_factor=settings.routing.load_factor,
        load_floor=settings.routing.load_floor,
        health_interval_s=settings.routing.health_interval_s,
        health_timeout_s=settings.routing.health_timeout_s or settings.routing.health_interval_s,
        healthy_after=settings.routing.healthy_after,
        max_loaded_adapters=settings.adapters.max_loaded,
    )


async def _open_pool(settings: Settings) -> EnginePool:
    urls = list(settings.engine.urls)
    supervisor = None
    if settings.engine.config is not None:
        config = load_launch_config(settings.engine.config)
        python = settings.engine.sglang_interpreter
        router = router_launch(config, python=python)
        supervisor = Supervisor(
            [*plan(config, python=python), *([router] if router else [])], settings.storage.data_dir / "engines"
        )
        await supervisor.start()
        urls += serving_urls(config)
    if not urls:
        raise ValueError("engine=sglang needs an engine URL (--engine-url) or managed groups (--engine-config)")
    try:
        return await EnginePool.open(
            urls,
            pool_config(settings),
            start_timeout_s=settings.engine.start_timeout_s,
            request_timeout_s=settings.server.request_timeout_s,
            stall_timeout_s=settings.routing.stall_timeout_s,
            supervisor=supervisor,
        )
    except BaseException:
        if supervisor is not None:
            await supervisor.close()
        raise
