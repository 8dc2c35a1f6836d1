"""The engine pool's rolling weight update on a real SGLang server: retract, load, continue."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from server.engines.base import TokenChunk
from server.router.pool import EnginePool, PoolConfig
from tests.server.engines.helpers import greedy, greedy_reference

pytestmark = pytest.mark.sglang

PROMPT = [1, 287, 201, 268, 318, 81, 638, 2, 201, 1, 295, 201]


async def test_a_weight_update_under_load_fails_no_request(
    sglang_url: str, tiny_model: Path, perturbed_model: Path
) -> None:
    pool = await EnginePool.open([sglang_url], PoolConfig(health_interval_s=3600, health_timeout_s=30))

    async def request(i: int) -> list[TokenChunk]:
        return [c async for c in pool.generate(PROMPT[i:], greedy(48), session_key=f"load-{i}")]

    try:
        running = [asyncio.create_task(request(i)) for i in range(4)]
        await asyncio.sleep(0.5)
        await pool.update_weights(str(perturbed_model), "v2")
        results = await asyncio.gather(*running)
        for chunks in results:
            assert sum(len(c.token_ids) for c in chunks) == 48
            finish = chunks[-1].finish
            assert finish is not None and finish.type == "length"
        assert pool.replicas[sglang_url].client.model_info().weight_version == "v2"
        after = [c async for c in pool.generate(PROMPT, greedy(12))]
        assert [t for c in after for t in c.token_ids] == greedy_reference(perturbed_model, PROMPT, 12)
        assert {c.weight_version for c in after} == {"v2"}
    finally:
        await pool.update_weights(str(tiny_model), "default")
        await pool.close()
