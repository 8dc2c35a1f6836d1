"""The local engine admits waiting user requests before waiting rollouts, and never preempts running ones."""

from __future__ import annotations

import asyncio
from pathlib import Path

from server.engines.base import DEFAULT_PRIORITY, ROLLOUT_PRIORITY
from server.engines.local.engine import LocalEngine
from tests.server.engines.helpers import greedy
from tests.support.polling import async_wait_until

PROMPT = [1, 2, 3, 4]


async def _run(engine: LocalEngine, name: str, priority: int, started: list[str], tokens: int = 3) -> None:
    """Generate; note ``name`` when the first token arrives (with one batch slot, that is the admission order)."""
    first = True
    async for chunk in engine.generate(PROMPT, greedy(tokens), priority=priority):
        if first and chunk.token_ids:
            started.append(name)
            first = False


async def test_waiting_users_go_before_waiting_rollouts(tiny_model: Path) -> None:
    engine = await LocalEngine.open(tiny_model, torch_threads=1, max_batch_size=1)
    try:
        await engine.pause("in_place")
        started: list[str] = []
        order = [("r1", ROLLOUT_PRIORITY), ("u1", DEFAULT_PRIORITY), ("r2", ROLLOUT_PRIORITY), ("u2", DEFAULT_PRIORITY)]
        tasks = []
        for name, priority in order:
            tasks.append(asyncio.create_task(_run(engine, name, priority, started)))
            await async_wait_until(lambda: engine.in_flight == len(tasks), timeout_s=10, what=f"{name} is queued")
        await engine.resume()
        await asyncio.gather(*tasks)
        # Users first, each class in arrival order.
        assert started == ["u1", "u2", "r1", "r2"]
    finally:
        await engine.close()


async def test_a_running_rollout_is_not_preempted(tiny_model: Path) -> None:
    engine = await LocalEngine.open(tiny_model, torch_threads=1, max_batch_size=1)
    try:
        started: list[str] = []
        rollout = asyncio.create_task(_run(engine, "rollout", ROLLOUT_PRIORITY, started, tokens=40))
        await async_wait_until(lambda: started, timeout_s=30, what="the rollout is decoding", interval_s=0.001)
        user = asyncio.create_task(_run(engine, "user", DEFAULT_PRIORITY, started))
        await asyncio.wait({rollout, user}, return_when=asyncio.FIRST_COMPLETED)
        assert rollout.done() and not user.done()  # the user waited for the batch slot
        await user
        assert started == ["rollout", "user"]
    finally:
        await engine.close()
