"""The engine pool's rolling weight update on a real SGLang server: retract, load, continue."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from server.engines.base import TokenChunk
from server.router.pool import EnginePool, PoolConfig
from server.weight_delta import WeightDelta, materialise, read_checkpoint, write_delta
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


async def test_a_delta_reaches_sglang_as_the_checkpoint_built_from_it(
    sglang_url: str, tiny_model: Path, perturbed_model: Path, tmp_path: Path
) -> None:
    """SGLang has no delta API: the replica loads the whole checkpoint built from base + delta."""
    write_delta(
        read_checkpoint(tiny_model),
        read_checkpoint(perturbed_model),
        tmp_path / "delta",
        base_version="default",
        target_version="v-delta",
        files_from=perturbed_model,
    )
    delta = WeightDelta.open(tmp_path / "delta")
    full = materialise(delta, tiny_model, tmp_path / "delta.full")
    pool = await EnginePool.open([sglang_url], PoolConfig(health_interval_s=3600, health_timeout_s=30))
    try:
        client = pool.replicas[sglang_url].client
        assert client.weight_sources == {"disk"} and client.model_info().weight_version == "default"
        await pool.update_weights_from_delta(delta, str(full), "v-delta")
        assert (client.model_info().weight_version, client.model_info().model_path) == ("v-delta", str(full))
        after = [c async for c in pool.generate(PROMPT, greedy(12))]
        assert [t for c in after for t in c.token_ids] == greedy_reference(perturbed_model, PROMPT, 12)
    finally:
        await pool.update_weights(str(tiny_model), "default")
        await pool.close()
