"""`tool_choice: "auto"` with a real model: SmolLM2-135M-Instruct (the quick start's model, whose
template cannot render tools) gets the default rendering, writes Hermes `<tool_call>`s after two
examples in the history, and the gateway reads them into `tool_calls`, streamed or not; a plain
answer stays content and streams as it is written."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from tandem.models import resolve_model
from tests.server.conftest import Gateway, gateway_settings, run_gateway

WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def _example(index: int, city: str) -> list[dict[str, Any]]:
    arguments = json.dumps({"city": city})
    call = {"id": f"call_{index}", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return [
        {"role": "user", "content": f"What is the weather in {city}?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
    ]


EXAMPLES = [*_example(1, "Rome"), *_example(2, "Oslo")]
CITIES = ["Paris", "London", "Tokyo"]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    model = resolve_model("smollm2-135m-instruct", Path.home() / ".cache" / "tandem-tests")
    settings = gateway_settings(tmp_path_factory.mktemp("smollm2"), model, torch_threads=2)
    with run_gateway(settings) as gateway:
        yield gateway


def ask(city: str) -> list[Any]:
    return [*EXAMPLES, {"role": "user", "content": f"What is the weather in {city}?"}]


@pytest.mark.parametrize("city", CITIES)
def test_auto_reads_the_models_call(smollm2: Gateway, city: str) -> None:
    client = smollm2.client()
    reply = client.chat.completions.create(
        model=smollm2.model, messages=ask(city), tools=[WEATHER], temperature=0, max_tokens=60
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": city}
    logged: dict[str, Any] = client.get(f"/completions/{reply.id}", cast_to=object)  # type: ignore[assignment]
    assert logged["choices"][0]["text"].lstrip().startswith("<tool_call>")  # the log keeps what the model wrote


def test_streamed_auto_calls_match_and_leak_no_markup(smollm2: Gateway) -> None:
    client: OpenAI = smollm2.client()
    kwargs: dict[str, Any] = {"model": smollm2.model, "tools": [WEATHER], "temperature": 0, "max_tokens": 60}
    whole = client.chat.completions.create(messages=ask("Paris"), **kwargs)
    with client.chat.completions.stream(messages=ask("Paris"), **kwargs) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    assert not "".join(e.delta for e in events if e.type == "content.delta")
    calls = final.choices[0].message.tool_calls or []
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls or []
    ]
    assert final.choices[0].finish_reason == "tool_calls"


def test_a_plain_answer_streams_as_content(smollm2: Gateway) -> None:
    client = smollm2.client()
    messages: Any = [{"role": "user", "content": "Say hello to Ada in one short sentence."}]
    kwargs: dict[str, Any] = {"model": smollm2.model, "messages": messages, "tools": [WEATHER], "temperature": 0}
    whole = client.chat.completions.create(max_tokens=24, **kwargs)
    chunks = list(client.chat.completions.create(max_tokens=24, stream=True, **kwargs))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert whole.choices[0].message.tool_calls is None and whole.choices[0].message.content
    assert "".join(pieces) == whole.choices[0].message.content
    assert len(pieces) > 3  # streamed as written, not held to the end
