"""The gateway in front of a real SGLang server, through the official openai client."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletion

from server.engines.sglang_client import SGLangClient
from tests.server.conftest import Gateway
from tests.server.engines.helpers import greedy_reference, reference_logprobs

pytestmark = pytest.mark.sglang

GREEDY: dict[str, Any] = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def client(sglang_gateway: Gateway) -> OpenAI:
    return sglang_gateway.client()


def chat(client: OpenAI, model: str, messages: list[dict[str, str]], max_tokens: int, **kwargs: Any) -> ChatCompletion:
    """A greedy completion of exactly ``max_tokens`` tokens unless a stop string ends it."""
    return client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, **GREEDY, **kwargs)  # type: ignore[arg-type,no-any-return]


def ask(client: OpenAI, model: str, content: str, max_tokens: int = 8, **kwargs: Any) -> ChatCompletion:
    return chat(client, model, [{"role": "user", "content": content}], max_tokens, **kwargs)


def logged(client: OpenAI, completion_id: str) -> dict[str, Any]:
    """The gateway's log of a completion: the prompt it sent and the tokens SGLang returned."""
    return client.get(f"/completions/{completion_id}", cast_to=object)  # type: ignore[return-value]


def test_chat_completion(client: OpenAI, sglang_gateway: Gateway, tiny_model: Path) -> None:
    reply = ask(client, sglang_gateway.model, "What is 2 + 3?", max_tokens=10)
    (choice,) = reply.choices
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert reply.model == sglang_gateway.model and reply.system_fingerprint == "default"
    log = logged(client, reply.id)
    prompt, output = log["prompt_token_ids"], log["choices"][0]["token_ids"]
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt), 10)
    assert reply.usage.total_tokens == len(prompt) + 10
    assert output == greedy_reference(tiny_model, prompt, 10)
    assert choice.message.content == log["choices"][0]["text"]

    # A stop string taken from that answer ends the next one right before it.
    text = choice.message.content or ""
    stop = text[len(text) // 2 :].strip()[:3]
    assert stop, text
    stopped = ask(client, sglang_gateway.model, "What is 2 + 3?", max_tokens=10, stop=[stop]).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.message.content == text[: text.index(stop)]


def test_streaming_matches_non_streaming(client: OpenAI, sglang_gateway: Gateway) -> None:
    whole = ask(client, sglang_gateway.model, "Tell me a story.", max_tokens=12)
    chunks = list(
        client.chat.completions.create(
            model=sglang_gateway.model,
            messages=[{"role": "user", "content": "Tell me a story."}],
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None and whole.usage is not None
    assert usage_chunk.usage.completion_tokens == 12
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].system_fingerprint == "default"


def test_logprobs_equal_a_transformers_forward_pass(client: OpenAI, sglang_gateway: Gateway, tiny_model: Path) -> None:
    reply = ask(client, sglang_gateway.model, "Count to five.", max_tokens=12, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    log = logged(client, reply.id)
    prompt, output = log["prompt_token_ids"], log["choices"][0]["token_ids"]
    reference = reference_logprobs(tiny_model, prompt, output)
    assert len(content) == len(output) == 12
    assert max(abs(entry.logprob - ref) for entry, ref in zip(content, reference, strict=True)) < 1e-3
    for entry in content:  # greedy: the chosen token is the most likely one, listed first
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)
        alternatives = [alt.logprob for alt in entry.top_logprobs]
        assert alternatives == sorted(alternatives, reverse=True)


def test_second_turn_of_a_session_hits_the_prefix_cache(client: OpenAI, sglang_gateway: Gateway) -> None:
    session = {"X-Session-Id": f"s-{uuid.uuid4().hex}"}
    history = [{"role": "user", "content": f"Remember the word {uuid.uuid4().hex}."}]
    first = chat(client, sglang_gateway.model, history, 8, extra_headers=session)
    history += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "Which word was it?"},
    ]
    second = chat(client, sglang_gateway.model, history, 8, extra_headers=session)
    assert first.usage is not None and second.usage is not None
    first_cached = first.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
    cached = second.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
    # The first turn's prompt is new apart from the chat template's opening tokens; the second turn
    # starts with the whole first prompt, which SGLang's radix cache still holds.
    assert first_cached < first.usage.prompt_tokens // 2
    assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens
    assert logged(client, second.id)["cached_tokens"] == cached


def test_a_second_turn_reuses_the_whole_first_turn(client: OpenAI, sglang_gateway: Gateway) -> None:
    """The reply goes back into the next prompt as SGLang generated it, so the radix cache covers it."""
    session = {"X-Session-Id": f"s-{uuid.uuid4().hex}"}
    history = [{"role": "user", "content": "your of 33"}]  # 4 tokens, then the model stops itself
    first = client.chat.completions.create(
        model=sglang_gateway.model, messages=history, max_tokens=40, temperature=0, extra_headers=session
    )
    assert first.choices[0].finish_reason == "stop"
    history += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "and what else?"},
    ]
    second = chat(client, sglang_gateway.model, history, 4, extra_headers=session)
    first_log, second_log = logged(client, first.id), logged(client, second.id)
    generated = [*first_log["prompt_token_ids"], *first_log["choices"][0]["token_ids"]]
    assert second_log["prompt_token_ids"][: len(generated)] == generated
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens >= len(generated) - 1


async def test_update_weights_from_disk_shows_through_the_gateway(
    client: OpenAI, sglang_gateway: Gateway, sglang_url: str, tiny_model: Path, perturbed_model: Path
) -> None:
    question = "Which weights are these?"
    before = ask(client, sglang_gateway.model, question, max_tokens=10)
    log = logged(client, before.id)
    prompt = log["prompt_token_ids"]
    assert log["choices"][0]["token_ids"] == greedy_reference(tiny_model, prompt, 10)
    expected = greedy_reference(perturbed_model, prompt, 10)
    assert expected != log["choices"][0]["token_ids"]  # otherwise the test proves nothing

    sglang = await SGLangClient.open(sglang_url)
    try:
        await sglang.update_weights(str(perturbed_model), "perturbed-1")
        try:
            assert sglang.model_info().weight_version == "perturbed-1"
            after = ask(client, sglang_gateway.model, question, max_tokens=10)
            assert after.system_fingerprint == "perturbed-1"
            log = logged(client, after.id)
            assert log["choices"][0]["token_ids"] == expected
            assert log["weight_version"] == "perturbed-1"
            assert [(s["version"], s["start"], s["end"]) for s in log["choices"][0]["weight_versions"]] == [
                ("perturbed-1", 0, 10)
            ]
        finally:
            await sglang.update_weights(str(tiny_model), "default")
    finally:
        await sglang.close()
    restored = ask(client, sglang_gateway.model, question, max_tokens=10)
    assert restored.system_fingerprint == "default"
    assert restored.choices[0].message.content == before.choices[0].message.content


def test_forced_tool_calls_and_json_schema_are_enforced_by_sglang(client: OpenAI, sglang_gateway: Gateway) -> None:
    """SGLang's own json_schema sampling parameter holds the random model to the schema."""
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 10},
            "days": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    }
    tools: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": schema}}]
    messages: Any = [{"role": "user", "content": "Weather in Paris?"}]
    common: dict[str, Any] = {"model": sglang_gateway.model, "messages": messages, "max_tokens": 400, "n": 8}
    required = client.chat.completions.create(tools=tools, tool_choice="required", seed=1, **common)
    for choice in required.choices:
        assert choice.finish_reason == "tool_calls", repr(choice.message.content)
        for call in choice.message.tool_calls or []:
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), schema)
    response_format: Any = {"type": "json_schema", "json_schema": {"name": "weather", "schema": schema}}
    shaped = client.chat.completions.create(response_format=response_format, seed=2, **common)
    for choice in shaped.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content or ""), schema)
