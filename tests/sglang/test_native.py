"""SGLang's native API through tandem's SGLangClient: pause/continue, and the golden-output check."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from server.engines.base import Finish
from server.engines.local.engine import LocalEngine
from server.engines.sglang_client import SGLangClient
from tests.server.engines.helpers import collect, greedy, greedy_reference
from tests.support.polling import async_wait_until

pytestmark = pytest.mark.sglang

# Token ids of the tiny model's chat template around a few words, and two plain runs of ids.
PROMPTS = [
    [1, 287, 201, 268, 318, 81, 638, 2, 201, 1, 295, 201],
    [1, 287, 201, 1500, 42, 997, 7, 2, 201, 1, 295, 201],
    [5, 17, 300, 1024, 2000, 64],
]


@pytest.fixture
async def sglang(sglang_url: str) -> AsyncIterator[SGLangClient]:
    client = await SGLangClient.open(sglang_url)
    yield client
    await client.close()


async def test_pause_aborts_running_requests_and_holds_new_ones_until_continue(
    sglang: SGLangClient, tiny_model: Path
) -> None:
    started = asyncio.Event()
    finish: list[Finish | None] = []

    async def long_request() -> int:
        produced = 0
        async for chunk in sglang.generate(PROMPTS[0], greedy(1500)):
            produced += len(chunk.token_ids)
            started.set()
            if chunk.finish is not None:
                finish.append(chunk.finish)
        return produced

    running = asyncio.create_task(long_request())
    await asyncio.wait_for(started.wait(), 60)
    try:
        await sglang.pause("abort")
        produced = await asyncio.wait_for(running, 60)
        assert finish and finish[-1].type == "abort"
        assert 0 < produced < 1500

        waiting = asyncio.create_task(collect(sglang, PROMPTS[1], greedy(6)))
        await asyncio.sleep(1.5)
        assert not waiting.done(), "a request sent while paused must wait for continue"
    finally:
        await sglang.resume()
    result = await asyncio.wait_for(waiting, 60)
    assert result.finish is not None and result.finish.type == "length"
    assert result.token_ids == greedy_reference(tiny_model, PROMPTS[1], 6)
    # /health_generate runs a generation of its own, which can miss its deadline right after
    # continue_generation on a busy CPU; the server must be healthy again soon after.
    await async_wait_until(sglang.health, timeout_s=60, what="SGLang is healthy again", interval_s=1)


async def test_local_engine_sglang_and_transformers_agree(sglang: SGLangClient, tiny_model: Path) -> None:
    local = await LocalEngine.open(tiny_model, torch_threads=1, max_batch_size=4)
    try:
        for prompt in PROMPTS:
            reference = greedy_reference(tiny_model, prompt, 16)
            from_sglang = await collect(sglang, prompt, greedy(16))
            from_local = await collect(local, prompt, greedy(16))
            assert from_sglang.token_ids == reference, f"SGLang differs from transformers on {prompt}"
            assert from_local.token_ids == reference, f"the local engine differs from transformers on {prompt}"
            assert from_sglang.versions == ["default"] * 16
    finally:
        await local.close()


async def test_context_length_comes_from_the_server(sglang: SGLangClient) -> None:
    # SGLang's /model_info lacks it; the gateway must not need the model folder on its own disk.
    assert await sglang._served_context_length() == 2048
    assert sglang.model_info().context_length == 2048


async def test_the_radix_cache_is_partitioned_by_cache_salt(sglang: SGLangClient) -> None:
    """The tenant salt the gateway sends (server.cache_scope) keeps one tenant's cached prefix from
    another's: without it, SGLang's radix cache reports a shared prefix to anyone who sends it."""
    prompt = [9, 1400, 77, 1800, 3, 650, 1201, 44, 980, 1600, 12, 1999, 501, 8, 733, 1066]
    await collect(sglang, prompt, greedy(2), cache_salt="tenant-a")
    assert (await collect(sglang, prompt, greedy(2), cache_salt="tenant-b")).cached_tokens == 0
    assert (await collect(sglang, prompt, greedy(2))).cached_tokens == 0
    assert (await collect(sglang, prompt, greedy(2), cache_salt="tenant-a")).cached_tokens >= len(prompt) // 2
    assert (await collect(sglang, prompt, greedy(2))).cached_tokens >= len(prompt) // 2  # unsalted: shared
