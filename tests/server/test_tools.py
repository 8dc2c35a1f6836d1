"""Tools and structured output through the official openai client, on the tiny random model: what the
grammar enforces (required and named calls, json_object, json_schema) must hold for every sample,
whatever the weights; the SDK's own helpers (stream assembly, parse) must accept the answers."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field
from transformers import AutoTokenizer

from learner.collect import feedback_sample
from storage import collect_feedback
from tests.server.conftest import Gateway

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 8}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
SAMPLES = 100  # outputs checked against their schema, per schema
BATCH = 16  # choices per request (n)
# Every string in the schemas has a maxLength and at most MAX_PARALLEL_CALLS calls fit one answer,
# so a complete answer always fits this budget: a cut-off one would be a bug, not bad luck.


def sampled_choices(client: OpenAI, gateway: Gateway, **kwargs: Any) -> list[Any]:
    """``SAMPLES`` sampled choices of one request shape, BATCH at a time with different seeds."""
    choices: list[Any] = []
    for seed in range(-(-SAMPLES // BATCH)):
        response = client.chat.completions.create(
            model=gateway.model, messages=ASK, n=BATCH, seed=seed, temperature=1.0, max_tokens=400, **kwargs
        )
        choices += response.choices
    return choices[:SAMPLES]


def test_required_tool_choice_always_calls_with_valid_arguments(client: OpenAI, gateway: Gateway) -> None:
    choices = sampled_choices(client, gateway, tools=TOOLS, tool_choice="required")
    names = set()
    for choice in choices:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None and choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
            names.add(call.function.name)
    assert names == set(SCHEMAS)  # both tools were chosen by some sample: the choice is the model's
    ids = [call.id for choice in choices for call in choice.message.tool_calls or []]
    assert len(set(ids)) == len(ids)


def test_named_tool_choice_calls_that_function(client: OpenAI, gateway: Gateway) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice in sampled_choices(client, gateway, tools=TOOLS, tool_choice=named):
        assert choice.finish_reason == "stop"  # as OpenAI answers a named tool_choice
        (call,) = choice.message.tool_calls or []
        assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), TIME)


def test_json_schema_response_format_always_matches(client: OpenAI, gateway: Gateway) -> None:
    format_ = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": WEATHER, "strict": True}}
    for choice in sampled_choices(client, gateway, response_format=format_):
        assert choice.finish_reason == "stop" and choice.message.tool_calls is None
        jsonschema.validate(json.loads(choice.message.content), WEATHER)


def test_without_parallel_calls_one_call(client: OpenAI, gateway: Gateway) -> None:
    response = client.chat.completions.create(
        model=gateway.model, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        n=BATCH, max_tokens=400, seed=7,
    )  # fmt: skip
    assert all(len(c.message.tool_calls or []) == 1 for c in response.choices)


def test_json_object_is_an_object(client: OpenAI, gateway: Gateway) -> None:
    response = client.chat.completions.create(
        model=gateway.model, messages=ASK, response_format={"type": "json_object"}, n=8, max_tokens=128, seed=3
    )
    for choice in response.choices:
        if choice.finish_reason == "stop":  # a random model may fill all 128 tokens inside one string
            assert isinstance(json.loads(choice.message.content), dict)
    assert any(c.finish_reason == "stop" for c in response.choices)


class Forecast(BaseModel):
    city: str = Field(max_length=12)
    days: int = Field(ge=1, le=7)
    sunny: bool


def test_parse_with_a_pydantic_model(client: OpenAI, gateway: Gateway) -> None:
    completion = client.chat.completions.parse(
        model=gateway.model, messages=ASK, response_format=Forecast, max_tokens=400, seed=1, n=4
    )
    for choice in completion.choices:
        assert isinstance(choice.message.parsed, Forecast)


def test_streamed_tool_calls_are_assembled_by_the_sdk(client: OpenAI, gateway: Gateway) -> None:
    kwargs: dict[str, Any] = {"model": gateway.model, "messages": ASK, "tools": TOOLS, "max_tokens": 400, "seed": 11}
    whole = client.chat.completions.create(tool_choice="required", **kwargs)
    with client.chat.completions.stream(tool_choice="required", **kwargs) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    calls = final.choices[0].message.tool_calls or []
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls or []
    ]
    assert final.choices[0].finish_reason == "tool_calls"
    done = [e for e in events if e.type == "tool_calls.function.arguments.done"]
    assert [e.name for e in done] == [c.function.name for c in calls]


def test_stream_deltas_are_openais(client: OpenAI, gateway: Gateway) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    chunks = list(
        client.chat.completions.create(
            model=gateway.model, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=400, seed=5, stream=True
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    first, *rest = [d.tool_calls[0] for d in deltas if d.tool_calls]
    assert first.index == 0 and first.id and first.type == "function"
    assert first.function is not None and first.function.name == "get_weather" and first.function.arguments == ""
    assert all(d.id is None and d.index == 0 for d in rest)
    arguments = "".join(d.function.arguments or "" for d in rest if d.function)
    jsonschema.validate(json.loads(arguments), WEATHER)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_full_tool_loop(client: OpenAI, gateway: Gateway) -> None:
    first = client.chat.completions.create(
        model=gateway.model, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=400, seed=2
    )
    message = first.choices[0].message
    assert message.tool_calls
    results = [{"role": "tool", "tool_call_id": c.id, "content": '{"forecast": "sunny"}'} for c in message.tool_calls]
    history = [*ASK, message.model_dump(exclude_none=True), *results]
    answer = client.chat.completions.create(
        model=gateway.model, messages=history, tools=TOOLS, tool_choice="none", max_tokens=8, seed=2
    )
    assert answer.choices[0].message.tool_calls is None
    assert isinstance(answer.choices[0].message.content, str)
    logged: dict[str, Any] = client.get(f"/completions/{answer.id}", cast_to=object)  # type: ignore[assignment]
    rendered = json.dumps(logged["request_messages"])
    # The tiny model's template cannot render tools: they are described in the system message, the
    # call is written as the model writes calls, the result is a tool response.
    assert "get_weather" in logged["request_messages"][0]["content"]
    assert "<tool_call>" in rendered and "<tool_response>" in rendered and "sunny" in rendered


def test_auto_lets_the_model_answer_in_text(client: OpenAI, gateway: Gateway) -> None:
    response = client.chat.completions.create(model=gateway.model, messages=ASK, tools=TOOLS, max_tokens=8, seed=4)
    choice = response.choices[0]
    # The random model writes no <tool_call>: its text is the content.
    assert choice.finish_reason in ("stop", "length") and choice.message.tool_calls is None
    assert choice.message.content


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]}, "tools.0.function.parameters"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"minLength": -1}}}}, "response_format.json_schema.json_schema.schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$schema": 5}}}},
            "response_format.json_schema.json_schema.schema",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
        ({"functions": [TOOLS[0]["function"]]}, "functions"),
        ({"response_format": {"type": "xml"}}, "response_format"),
    ],
)  # fmt: skip
def test_bad_tools_and_formats_are_400(gateway: Gateway, fields: dict[str, Any], param: str) -> None:
    body = {"model": gateway.model, "messages": ASK, "max_tokens": 4, **fields}
    headers = {"Authorization": f"Bearer {gateway.keys['acme']}"}
    response = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_a_schema_the_grammar_cannot_enforce_is_400(client: OpenAI, gateway: Gateway) -> None:
    schema = {"type": "string", "pattern": "(?<=a)b"}  # valid JSON Schema, but a look-behind no grammar has
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=gateway.model,
            messages=ASK,
            max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        )
    assert "schema" in str(caught.value)


def test_tool_turns_are_training_data_with_the_policys_tokens_only(client: OpenAI, gateway: Gateway) -> None:
    """A rated tool-call turn trains on the tokens the policy wrote (the call); a rated answer after a
    tool result has that result in its prompt, which is never trained on."""
    first = client.chat.completions.create(
        model=gateway.model, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=400, seed=21
    )
    message = first.choices[0].message
    results = [{"role": "tool", "tool_call_id": c.id, "content": "TOOL-RESULT-42"} for c in message.tool_calls or []]
    history = [*ASK, message.model_dump(exclude_none=True), *results]
    answer = client.chat.completions.create(model=gateway.model, messages=history, tools=TOOLS, max_tokens=8, seed=2)
    for completion_id in (first.id, answer.id):
        client.post("/feedback", body={"completion_id": completion_id, "rating": "up"}, cast_to=object)
    with gateway.sessions()() as session:
        items = {item.completion_id: item for item in collect_feedback(session, model=gateway.model, since=0).items}
    tokenizer = AutoTokenizer.from_pretrained(gateway.settings.engine.model)
    call_turn, answer_turn = feedback_sample(items[first.id]), feedback_sample(items[answer.id])
    written = tokenizer.decode(call_turn.response_token_ids, skip_special_tokens=True)
    assert [(c["name"], json.dumps(c["arguments"])) for c in json.loads(written)] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls or []
    ]
    assert call_turn.resolved_loss_mask() == [1] * call_turn.response_length
    assert "TOOL-RESULT-42" in tokenizer.decode(answer_turn.prompt_token_ids)
    assert "TOOL-RESULT-42" not in tokenizer.decode(answer_turn.response_token_ids)
