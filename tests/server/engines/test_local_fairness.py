"""The local engine admits waiting requests fairly between tenants (cache salts).

The drill: one tenant sent 300 concurrent chats and another tenant's 8-token chats went from 0.02 s
to 7.9 s, queued behind the whole backlog.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from server.engines.local.engine import LocalEngine
from server.engines.local.fair_share import next_to_admit, preemption_victim
from tests.server.engines.helpers import greedy
from tests.support.polling import async_wait_until

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
            await async_wait_until(lambda: engine.in_flight == len(tasks), timeout_s=10, what=f"{name} is queued")
        await engine.resume()
        await asyncio.gather(*tasks)
        assert started[:2] == ["a0", "b0"]  # b0 takes the second slot of the first batch
        assert [name for name in started if name.startswith("a")] == [f"a{i}" for i in range(7)]  # FIFO per tenant
    finally:
        await engine.close()


async def test_a_tenant_arriving_at_a_full_batch_gets_a_slot_without_waiting_for_it_to_drain(
    tiny_model: Path,
) -> None:
    """Long requests admitted together finish together: without a retraction the newcomer would wait
    for all of them. One of the busy tenant's requests steps back and resumes where it stopped."""
    engine = await LocalEngine.open(tiny_model, torch_threads=1, max_batch_size=2)
    try:
        produced: dict[str, int] = {}

        async def run(name: str, salt: str, tokens: int) -> None:
            produced[name] = 0
            async for chunk in engine.generate(PROMPT, greedy(tokens), cache_salt=salt):
                produced[name] += len(chunk.token_ids)

        busy = [asyncio.create_task(run(f"a{i}", "tenant-a", 600)) for i in range(2)]
        await async_wait_until(
            lambda: engine.running == 2, timeout_s=30, what="tenant a fills the batch", interval_s=0.001
        )
        await run("b", "tenant-b", 3)
        assert produced["b"] == 3
        assert all(not task.done() for task in busy)  # b did not wait for the batch to drain
        await asyncio.gather(*busy)
        assert produced["a0"] == produced["a1"] == 600  # the retracted request resumed to its end
    finally:
        await engine.close()


def test_fair_share_picks_and_victims() -> None:
    @dataclass
    class Req:
        cache_salt: str
        priority: int = 0

    a, b = Req("a"), Req("b")
    assert next_to_admit([a, a, b], [a]) == 2  # b runs nothing yet
    assert next_to_admit([a, b], []) == 0  # oldest first among equals
    assert preemption_victim([b], [a, a, a], 3) == 2  # the newest of the tenant over its share
    assert preemption_victim([b], [a, a], 3) is None  # a free slot: no retraction
    assert preemption_victim([a], [a, a, a], 3) is None  # alone, a tenant uses every slot
    assert preemption_victim([Req("b", -1)], [a, a, a], 3) is None  # a rollout does not evict users
    assert preemption_victim([b], [a, Req("c"), b], 3) is None  # b holds a slot already


async def test_admissions_are_prefilled_a_token_budget_per_step_between_decode_steps(tiny_model: Path) -> None:
    """A wave of admissions waits its turn in budget-sized bites: the running batch keeps decoding
    (and a request of another tenant gets in) instead of waiting for every prefill of the wave."""

    async def order(max_prefill_tokens: int) -> list[tuple[str, int]]:
        engine = await LocalEngine.open(
            tiny_model, torch_threads=1, max_batch_size=4, max_prefill_tokens=max_prefill_tokens
        )
        events: list[tuple[str, int]] = []

        async def run(name: str) -> None:
            produced = 0
            async for chunk in engine.generate(PROMPT, greedy(3), cache_salt="tenant-a"):
                for _ in chunk.token_ids:
                    produced += 1
                    events.append((name, produced))

        try:
            await engine.pause("in_place")
            tasks = []
            for i in range(4):
                tasks.append(asyncio.create_task(run(f"a{i}")))
                await async_wait_until(lambda: engine.in_flight == len(tasks), timeout_s=10, what="queued")
            await engine.resume()
            await asyncio.gather(*tasks)
        finally:
            await engine.close()
        return events

    one_prompt = await order(max_prefill_tokens=len(PROMPT))
    assert one_prompt.index(("a0", 2)) < one_prompt.index(("a3", 1))  # a0 decoded while the wave waited
    every_prompt = await order(max_prefill_tokens=512)
    assert every_prompt.index(("a0", 2)) > every_prompt.index(("a3", 1))  # all four prefilled first
