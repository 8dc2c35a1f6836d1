"""The local engine admits waiting requests fairly between tenants (cache salts).

The drill: one tenant sent 300 concurrent chats and another tenant's 8-token chats went from 0.02 s
to 7.9 s, queued behind the whole backlog.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from server.engines.local.engine import LocalEngine
from tests.server.engines.helpers import greedy

PROMPT = [1, 2, 3, 4]


async def _run(engine: LocalEngine, name: str, salt: str, started: list[str]) -> None:
    async for chunk in engine.generate(PROMPT, greedy(3), cache_salt=salt):
        if chunk.token_ids:
            started.append(name)
            return


async def test_another_tenants_request_is_admitted_before_one_tenants_backlog(tiny_model: Path) -> None:
    engine = await LocalEngine.open(tiny_model, torch_threads=1, max_batch_size=2)
    try:
        await engine.pause("in_place")
        started: list[str] = []
        queued = [(f"a{i}", "tenant-a") for i in range(6)] + [("b0", "tenant-b"), ("a6", "tenant-a")]
        tasks = []
        for name, salt in queued:
            tasks.append(asyncio.create_task(_run(engine, name, salt, started)))
            await asyncio.sleep(0.01)  # queued in this order
        await engine.resume()
        await asyncio.gather(*tasks)
        assert started[:2] == ["a0", "b0"]  # b0 takes the second slot of the first batch
        assert [name for name in started if name.startswith("a")] == [f"a{i}" for i in range(7)]  # FIFO per tenant
    finally:
        await engine.close()
