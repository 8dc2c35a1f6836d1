"""EngineAdmin, the admin API's way to the serving engine: over a pool of two real `tandem engine`
servers and over the in-process local engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from server.engine_admin import EngineAdmin
from server.engines.local.engine import LocalEngine
from server.errors import ApiError
from server.metrics import GatewayMetrics
from server.router.config import PoolConfig
from server.router.pool import EnginePool


@pytest.fixture
async def pool(engine_urls: list[str]) -> AsyncIterator[EnginePool]:
    pool = await EnginePool.open(engine_urls, PoolConfig(health_interval_s=3600, health_timeout_s=30))
    yield pool
    await pool.close()


async def test_replicas_and_an_unknown_one(pool: EnginePool, engine_urls: list[str]) -> None:
    admin = EngineAdmin(pool, GatewayMetrics())
    assert [(s.name, s.healthy, s.drained) for s in await admin.replicas()] == [(u, True, False) for u in engine_urls]
    assert (await admin.replica(engine_urls[1])).weight_version == "default"
    assert admin.cache_hit_ratio(engine_urls[0]) is None  # nothing sent yet
    with pytest.raises(ApiError) as error:
        await admin.replica("http://nowhere")
    assert (error.value.status, error.value.code) == (404, "replica_not_found")


async def test_drain_undrain_and_the_last_replica_in_rotation(pool: EnginePool, engine_urls: list[str]) -> None:
    admin = EngineAdmin(pool, GatewayMetrics())
    first, second = engine_urls
    with admin.set_drained(first, True) as before:
        assert before is False
    assert pool.replicas[first].drained
    with pytest.raises(ApiError) as error, admin.set_drained(second, True):
        pass
    assert (error.value.status, error.value.code) == (409, "cannot_drain")
    assert not pool.replicas[second].drained
    with admin.set_drained(first, False) as before:
        assert before is True
    assert not pool.replicas[first].drained


async def test_a_change_whose_block_fails_is_undone(pool: EnginePool, engine_urls: list[str]) -> None:
    admin = EngineAdmin(pool, GatewayMetrics())
    with pytest.raises(RuntimeError), admin.set_drained(engine_urls[0], True):
        assert pool.replicas[engine_urls[0]].drained
        raise RuntimeError("the audit could not be written")
    assert not pool.replicas[engine_urls[0]].drained


async def test_the_local_engine_cannot_be_drained(tiny_model: Path) -> None:
    engine = await LocalEngine.open(tiny_model, torch_threads=1)
    try:
        admin = EngineAdmin(engine, GatewayMetrics())
        for name, status in ((engine.replica, 409), ("http://nowhere", 404)):
            with pytest.raises(ApiError) as error, admin.set_drained(name, True):
                pass
            assert error.value.status == status
        assert [s.name for s in await admin.replicas()] == [engine.replica]
    finally:
        await engine.close()
