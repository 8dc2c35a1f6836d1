"""SGLang's own update_weights_from_distributed, fed over gloo by tandem's trainer side on the CPU.

The pool pauses the server (retract), this process broadcasts the perturbed weights as rank 0 in
several buckets (inside begin/end_weight_update, as 0.5.23 requires), and the server must then serve
the new version with greedy output equal to a transformers reference on the perturbed checkpoint.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from learner.weight_broadcast import BroadcastConfig, EngineTarget, broadcast_weights
from server.engines.base import TokenChunk
from server.engines.sglang_client import SGLangClient
from server.router.pool import EnginePool, PoolConfig
from server.weight_delta import read_checkpoint
from tests.server.engines.helpers import greedy, greedy_reference

pytestmark = pytest.mark.sglang

PROMPT = [1, 287, 201, 268, 318, 81, 638, 2, 201, 1, 295, 201]


async def test_a_trainer_broadcasts_weights_into_sglang_over_gloo_and_no_request_fails(
    sglang_url: str, tiny_model: Path, perturbed_model: Path
) -> None:
    # The server runs in float32; the trainer sends float32 so the greedy reference matches exactly.
    trained = [(name, t.to(torch.float32)) for name, t in read_checkpoint(perturbed_model).items()]
    config = BroadcastConfig(backend="gloo", bucket_bytes=256 << 10, timeout_s=120)
    pool = await EnginePool.open([sglang_url], PoolConfig(health_interval_s=3600, health_timeout_s=30))

    async def broadcast(clients: list[SGLangClient]) -> None:
        engines = [EngineTarget(client.url, await client.ranks()) for client in clients]
        stats = await asyncio.to_thread(broadcast_weights, engines, trained, "v-dist", config)
        assert stats.buckets > 3 and engines[0].ranks == 1

    async def request(i: int) -> list[TokenChunk]:
        return [c async for c in pool.generate(PROMPT[i:], greedy(32), session_key=f"dist-{i}")]

    try:
        running = [asyncio.create_task(request(i)) for i in range(3)]
        await asyncio.sleep(0.5)
        await pool.update_weights_together(str(perturbed_model), "v-dist", broadcast)
        for chunks in await asyncio.gather(*running):
            assert sum(len(c.token_ids) for c in chunks) == 32
            finish = chunks[-1].finish
            assert finish is not None and finish.type == "length"
        assert pool.target == (str(perturbed_model), "v-dist")
        after = [c async for c in pool.generate(PROMPT, greedy(12))]
        assert [t for c in after for t in c.token_ids] == greedy_reference(perturbed_model, PROMPT, 12)
        assert {c.weight_version for c in after} == {"v-dist"}
    finally:
        await pool.update_weights(str(tiny_model), "default")
        await pool.close()
