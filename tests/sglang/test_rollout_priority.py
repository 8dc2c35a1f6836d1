"""The managed CPU server runs with priority scheduling: a rollout's priority is taken, not refused."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from server.engines.base import ROLLOUT_PRIORITY
from server.engines.sglang_client import SGLangClient
from tests.server.engines.helpers import collect, greedy, greedy_reference, reference_logprobs

pytestmark = pytest.mark.sglang

PROMPT = [1, 2, 3, 4, 5]


async def test_rollout_and_user_priorities_both_serve(sglang_url: str, tiny_model: Path) -> None:
    client = await SGLangClient.open(sglang_url)
    try:
        rollout, user = await asyncio.gather(
            collect(client, PROMPT, greedy(8), priority=ROLLOUT_PRIORITY), collect(client, PROMPT, greedy(8))
        )
    finally:
        await client.close()
    expected = greedy_reference(tiny_model, PROMPT, 8)
    assert rollout.token_ids == user.token_ids == expected
    assert rollout.finish is not None and rollout.finish.type == "length"
    reference = reference_logprobs(tiny_model, PROMPT, expected)
    assert max(abs(a - b) for a, b in zip(rollout.logprobs, reference, strict=True)) < 1e-3
