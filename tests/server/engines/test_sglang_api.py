"""`tandem engine`'s SGLang-native API, driven through our SGLang client (the gateway's path)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
from transformers import AutoTokenizer

from server.engines.base import EngineError, EngineUnavailable, SamplingParams
from server.engines.local.engine import LocalEngine
from server.engines.sglang_client import SGLangClient
from server.engines.sglang_protocol import sampling_from_json
from server.engines.sglang_server import create_engine_app
from tests.server.engines.helpers import collect, greedy, greedy_reference, reference_logprobs
from tests.support.uvicorn_thread import serve_in_thread

PROMPT = [1, 287, 201, 268, 318, 81, 638, 2, 201, 1, 295, 201]


@pytest.fixture(scope="module")
def engine_url(tiny_model: Path) -> Iterator[str]:
    app = create_engine_app(lambda: LocalEngine.open(tiny_model, torch_threads=1, max_batch_size=8))
    with serve_in_thread(app) as url:
        yield url


@pytest.fixture
async def client(engine_url: str) -> AsyncIterator[SGLangClient]:
    client = await SGLangClient.open(engine_url)
    yield client
    await client.close()


async def test_model_info(client: SGLangClient, tiny_model: Path) -> None:
    info = client.model_info()
    assert info.model_path == str(tiny_model)
    assert info.weight_version == "default"
    assert info.context_length == 2048


@pytest.mark.parametrize("stream", [True, False])
async def test_generate_matches_transformers(client: SGLangClient, tiny_model: Path, stream: bool) -> None:
    result = await collect(client, PROMPT, greedy(20), stream=stream)
    assert result.token_ids == greedy_reference(tiny_model, PROMPT, 20)
    reference = reference_logprobs(tiny_model, PROMPT, result.token_ids)
    assert max(abs(a - b) for a, b in zip(result.logprobs, reference, strict=True)) < 1e-4
    assert result.finish is not None and result.finish.type == "length"


async def test_raw_generate_shapes_follow_sglang(engine_url: str) -> None:
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 3, "temperature": 0},
        "return_logprob": True,
        "top_logprobs_num": 2,
    }
    async with aiohttp.ClientSession() as http, http.post(engine_url + "/generate", json=body) as response:
        assert response.status == 200
        data = await response.json()
    meta = data["meta_info"]
    assert len(data["output_ids"]) == meta["completion_tokens"] == 3
    assert meta["prompt_tokens"] == len(PROMPT) and meta["cached_tokens"] == 0
    assert meta["finish_reason"] == {"type": "length", "length": 3}
    assert [entry[1] for entry in meta["output_token_logprobs"]] == data["output_ids"]
    assert all(len(alts) == 2 for alts in meta["output_top_logprobs"])
    assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": 3}]
    assert isinstance(data["text"], str)


@pytest.mark.parametrize(
    "body",
    [
        {"input_ids": "nope"},
        {"input_ids": [[1, 2], [3]]},
        {"input_ids": []},
        {"input_ids": [1], "sampling_params": {"temperature": -1}},
        {"input_ids": [1], "sampling_params": {"max_new_tokens": "x"}},
        {"input_ids": [1], "logprob_start_len": 0},
        # Strings are not booleans: "false" used to read as true.
        {"input_ids": [1], "sampling_params": {"ignore_eos": "false"}},
        {"input_ids": [1], "stream": "false"},
        {"input_ids": [1], "return_logprob": "no"},
        # Only json_schema constrains here, and as SGLang takes it: a string.
        {"input_ids": [1], "sampling_params": {"regex": "[ab]+"}},
        {"input_ids": [1], "sampling_params": {"ebnf": 'root ::= "a"'}},
        {"input_ids": [1], "sampling_params": {"json_schema": {"type": "object"}}},
        {"input_ids": [1], "sampling_params": {"json_schema": '{"type": "nope"}'}},
        [1, 2],
    ],
)
async def test_bad_generate_bodies_get_400(engine_url: str, body: object) -> None:
    async with aiohttp.ClientSession() as http, http.post(engine_url + "/generate", json=body) as response:
        assert response.status == 400
        assert (await response.json())["error"]["message"]


@pytest.mark.parametrize("stream", [True, False])
async def test_json_schema_is_enforced_over_http(client: SGLangClient, tiny_model: Path, stream: bool) -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    sampling = SamplingParams(max_new_tokens=64, seed=4, json_schema=json.dumps(schema))
    result = await collect(client, PROMPT, sampling, stream=stream)
    text = AutoTokenizer.from_pretrained(tiny_model).decode(result.token_ids)
    assert set(json.loads(text)) == {"n"} and isinstance(json.loads(text)["n"], int)


async def test_client_raises_400_for_bad_prompts(client: SGLangClient) -> None:
    with pytest.raises(EngineError) as error:
        await collect(client, [10**7], greedy(1))
    assert error.value.status == 400


async def test_health_pause_continue_flush(client: SGLangClient) -> None:
    assert await client.health()
    running = client.generate(PROMPT, greedy(300))
    first = await anext(running)  # under way (a request arriving after the pause would wait for resume)
    await client.pause("abort")
    chunks = [first, *[chunk async for chunk in running]]
    assert chunks[-1].finish is not None and chunks[-1].finish.type == "abort"
    await client.resume()
    assert await client.flush_cache()
    assert (await collect(client, PROMPT, greedy(2))).finish is not None


async def test_update_weights_from_disk(client: SGLangClient, tiny_model: Path, perturbed_model: Path) -> None:
    await client.update_weights(str(perturbed_model), "v2")
    try:
        assert client.model_info().weight_version == "v2"
        result = await collect(client, PROMPT, greedy(12))
        assert result.versions == ["v2"] * 12
        assert result.token_ids == greedy_reference(perturbed_model, PROMPT, 12)
        with pytest.raises(EngineError, match=r"no \*\.safetensors"):
            await client.update_weights(str(tiny_model / "missing"), "v3")
    finally:
        await client.update_weights(str(tiny_model), "default")


async def test_unreachable_server_is_unavailable() -> None:
    with pytest.raises(EngineUnavailable):
        await SGLangClient.open("http://127.0.0.1:9")
    client = SGLangClient("http://127.0.0.1:9")
    with pytest.raises(EngineUnavailable):
        await collect(client, PROMPT, SamplingParams(max_new_tokens=1))
    assert not await client.health()
    await client.close()


async def test_a_cache_salt_keeps_a_session_prefix_to_its_own_namespace(client: SGLangClient) -> None:
    """The gateway's tenant salt reaches `tandem engine` as SGLang's cache_salt and keys its cache."""
    await collect(client, PROMPT, greedy(2), session_key="shared-id", cache_salt="tenant-a")
    other = await collect(client, PROMPT, greedy(2), session_key="shared-id", cache_salt="tenant-b")
    same = await collect(client, PROMPT, greedy(2), session_key="shared-id", cache_salt="tenant-a")
    assert other.cached_tokens == 0
    assert same.cached_tokens == len(PROMPT) - 1


def test_boolean_sampling_fields_are_parsed_not_coerced() -> None:
    assert sampling_from_json({"ignore_eos": False}).ignore_eos is False
    assert sampling_from_json({"ignore_eos": True}).ignore_eos is True
    assert sampling_from_json({}).ignore_eos is False
    with pytest.raises(ValueError, match="ignore_eos must be true or false"):
        sampling_from_json({"ignore_eos": "false"})
