from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from server.engines.base import EngineError, EngineOverloaded, SamplingParams
from server.engines.local.engine import LocalEngine
from server.engines.local.weights import WeightLoadError
from tests.server.engines.helpers import collect, greedy, greedy_reference, reference_logprobs
from tests.support.polling import async_wait_until


@pytest.fixture(scope="module")
def prompt(tiny_model: Path) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello there, how are you?"}], add_generation_prompt=True, return_dict=False
    )


async def test_greedy_matches_transformers(engine: LocalEngine, tiny_model: Path, prompt: list[int]) -> None:
    result = await collect(engine, prompt, greedy(24))
    assert result.token_ids == greedy_reference(tiny_model, prompt, 24)
    assert result.finish is not None and result.finish.type == "length"
    reference = reference_logprobs(tiny_model, prompt, result.token_ids)
    assert max(abs(a - b) for a, b in zip(result.logprobs, reference, strict=True)) < 1e-4


async def test_concurrent_requests_of_different_lengths_are_batched_exactly(
    engine: LocalEngine, tiny_model: Path, prompt: list[int]
) -> None:
    prompts = [prompt, prompt[:4], prompt * 3, prompt[:2], prompt[3:]]
    results = await asyncio.gather(*(collect(engine, p, greedy(16 + i)) for i, p in enumerate(prompts)))
    for i, (p, result) in enumerate(zip(prompts, results, strict=True)):
        assert result.token_ids == greedy_reference(tiny_model, p, 16 + i)


async def test_session_prefix_is_reused_and_output_unchanged(
    engine: LocalEngine, tiny_model: Path, prompt: list[int]
) -> None:
    first = await collect(engine, prompt, greedy(12), session_key="s")
    assert first.cached_tokens == 0
    follow_up = prompt + first.token_ids + [2, 201, 1, 287, 201, 300, 2, 201, 1, 295, 201]
    second = await collect(engine, follow_up, greedy(12), session_key="s")
    # Everything but the last output token (never fed back) was cached.
    assert second.cached_tokens == len(prompt) + len(first.token_ids) - 1
    assert second.token_ids == greedy_reference(tiny_model, follow_up, 12)
    other = await collect(engine, follow_up, greedy(4), session_key="another")
    assert other.cached_tokens == 0


async def test_seeded_sampling_is_reproducible(engine: LocalEngine, prompt: list[int]) -> None:
    sampling = SamplingParams(max_new_tokens=16, temperature=1.2, top_p=0.9, top_k=40, seed=123, ignore_eos=True)
    runs = await asyncio.gather(*(collect(engine, prompt, sampling) for _ in range(3)))
    assert runs[0].token_ids == runs[1].token_ids == runs[2].token_ids
    other = await collect(engine, prompt, SamplingParams(max_new_tokens=16, temperature=1.2, seed=124, ignore_eos=True))
    assert other.token_ids != runs[0].token_ids


async def test_stop_token_ids_and_stop_strings(engine: LocalEngine, tiny_model: Path, prompt: list[int]) -> None:
    expected = greedy_reference(tiny_model, prompt, 20)
    stop_id = expected[5]
    result = await collect(
        engine, prompt, SamplingParams(max_new_tokens=20, temperature=0, stop_token_ids=(stop_id,), ignore_eos=True)
    )
    assert result.token_ids == expected[: expected.index(stop_id) + 1]
    assert result.finish is not None and result.finish.matched == stop_id

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    text = tokenizer.decode(expected)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    result = await collect(
        engine, prompt, SamplingParams(max_new_tokens=20, temperature=0, stop=(stop,), ignore_eos=True)
    )
    assert result.finish is not None and result.finish.type == "stop" and result.finish.matched == stop
    assert stop in tokenizer.decode(result.token_ids)
    assert stop not in tokenizer.decode(result.token_ids[:-1])


async def test_bad_prompts_are_rejected_with_400(engine: LocalEngine) -> None:
    for bad in ([], [10**6], [1] * 5000):
        with pytest.raises(EngineError) as error:
            await collect(engine, bad, greedy(1))
        assert error.value.status == 400


async def test_full_queue_answers_429(tiny_model: Path, prompt: list[int]) -> None:
    engine = await LocalEngine.open(tiny_model, torch_threads=1, max_batch_size=2, max_queued_requests=3)
    try:
        await engine.pause("in_place")
        waiting = [asyncio.create_task(collect(engine, prompt, greedy(4))) for _ in range(3)]
        await async_wait_until(lambda: engine.in_flight == 3, timeout_s=10, what="three requests are queued")
        with pytest.raises(EngineOverloaded):
            await collect(engine, prompt, greedy(4))
        await engine.resume()
        assert all(r.finish is not None for r in await asyncio.gather(*waiting))
    finally:
        await engine.close()


async def test_cancelled_request_leaves_the_batch(engine: LocalEngine, tiny_model: Path, prompt: list[int]) -> None:
    stream = engine.generate(prompt, greedy(500))
    await anext(stream)
    await stream.aclose()
    result = await collect(engine, prompt, greedy(8))
    assert result.token_ids == greedy_reference(tiny_model, prompt, 8)


async def test_weight_swap_while_streaming_fails_nothing(
    engine: LocalEngine, tiny_model: Path, perturbed_model: Path, prompt: list[int]
) -> None:
    tasks = [asyncio.create_task(collect(engine, prompt[: 4 + i], greedy(60))) for i in range(6)]
    await asyncio.sleep(0.02)
    await engine.update_weights(str(perturbed_model), "v2")
    results = await asyncio.gather(*tasks)
    assert all(r.finish is not None and r.finish.type == "length" and len(r.token_ids) == 60 for r in results)
    # Each token names the version that produced it, and versions only ever move forward.
    for r in results:
        assert set(r.versions) <= {"default", "v2"}
        assert r.versions == sorted(r.versions, key=["default", "v2"].index)
    assert any("v2" in r.versions for r in results)
    after = await collect(engine, prompt, greedy(16))
    assert after.versions == ["v2"] * 16
    assert after.token_ids == greedy_reference(perturbed_model, prompt, 16)
    assert engine.model_info().weight_version == "v2"


async def test_incompatible_checkpoint_is_refused(engine: LocalEngine, tmp_path: Path) -> None:
    (tmp_path / "x.safetensors").write_bytes(b"")
    with pytest.raises(WeightLoadError, match="unreadable checkpoint"):
        await engine.update_weights(str(tmp_path), "broken")
    with pytest.raises(WeightLoadError, match=r"no \*\.safetensors"):
        await engine.update_weights(str(tmp_path / "missing"), "broken")
    assert engine.model_info().weight_version == "default"


async def test_pause_modes(engine: LocalEngine, tiny_model: Path, prompt: list[int]) -> None:
    running = asyncio.create_task(collect(engine, prompt, greedy(200)))
    await async_wait_until(lambda: engine.running == 1, timeout_s=10, what="the request is decoding")
    await engine.pause("abort")
    aborted = await running
    assert aborted.finish is not None and aborted.finish.type == "abort"
    queued = asyncio.create_task(collect(engine, prompt, greedy(8)))
    await async_wait_until(lambda: engine.in_flight == 1, timeout_s=10, what="the request is queued")
    # Each command runs at the start of a loop turn, so the second one runs only after the turn of
    # the first one, in which an unpaused engine would have admitted the request.
    await engine.flush_cache()
    await engine.flush_cache()
    # New requests wait while paused, they are not rejected.
    assert (engine.in_flight, engine.running, queued.done()) == (1, 0, False)
    await engine.resume()
    assert (await queued).token_ids == greedy_reference(tiny_model, prompt, 8)

    running = asyncio.create_task(collect(engine, prompt, greedy(40)))
    await async_wait_until(lambda: engine.running == 1, timeout_s=10, what="the request is decoding")
    await engine.pause("retract")
    await engine.resume()
    retracted = await running
    assert retracted.token_ids == greedy_reference(tiny_model, prompt, 40)


async def test_extreme_sampling_values_neither_fail_nor_disturb_the_batch(
    engine: LocalEngine, tiny_model: Path, prompt: list[int]
) -> None:
    extremes = [
        SamplingParams(max_new_tokens=8, temperature=5e-324, ignore_eos=True),  # greedy, not a division overflow
        SamplingParams(max_new_tokens=8, temperature=2.0, top_p=1e-300, ignore_eos=True),  # keeps the top token
        SamplingParams(max_new_tokens=8, temperature=2.0, top_k=10**6, ignore_eos=True),
    ]
    results = await asyncio.gather(*(collect(engine, prompt, s) for s in [*extremes, greedy(8)]))
    assert all(r.finish is not None and r.finish.type == "length" for r in results)
    expected = greedy_reference(tiny_model, prompt, 8)
    assert results[0].token_ids == results[1].token_ids == results[3].token_ids == expected
