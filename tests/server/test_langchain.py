"""LangChain's OpenAI chat model against the gateway: bind_tools (invoke and stream) and
with_structured_output, as an agent framework drives them."""

from __future__ import annotations

import jsonschema
import pytest
from langchain_core.messages import AIMessageChunk, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, ConfigDict, Field

from tests.server.conftest import Gateway


class WeatherArgs(BaseModel):
    # Bounded and closed (no other keys), so that even the random model's arguments end within max_tokens.
    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=12)
    days: int = Field(ge=1, le=7)


@tool(args_schema=WeatherArgs)
def get_weather(city: str, days: int) -> str:
    """The weather forecast for a city."""
    return f"sunny in {city} for {days} days"


ARGS_SCHEMA = get_weather.tool_call_schema.model_json_schema()
QUESTION = [HumanMessage("What is the weather in Paris for the next 3 days?")]


class Forecast(BaseModel):
    """A forecast."""

    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=12)
    days: int = Field(ge=1, le=7)


@pytest.fixture(scope="module")
def llm(gateway: Gateway) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=f"{gateway.url}/v1",
        api_key=gateway.keys["acme"],  # type: ignore[arg-type]
        model=gateway.model,
        max_tokens=300,  # type: ignore[call-arg]
        seed=3,
        max_retries=0,
    )


def test_bind_tools_invoke_and_a_tool_loop(llm: ChatOpenAI) -> None:
    bound = llm.bind_tools([get_weather], tool_choice="get_weather", strict=True)
    message = bound.invoke(QUESTION)
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and call["id"]
    jsonschema.validate(call["args"], ARGS_SCHEMA)
    result = ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])
    answer = llm.bind_tools([get_weather]).invoke([*QUESTION, message, result])
    assert isinstance(answer.content, str) and not answer.tool_calls


def test_bind_tools_stream(llm: ChatOpenAI) -> None:
    bound = llm.bind_tools([get_weather], tool_choice="required", strict=True)
    chunks = list(bound.stream(QUESTION))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk
    assert isinstance(merged, AIMessageChunk) and merged.tool_calls
    for call in merged.tool_calls:
        assert call["name"] == "get_weather"
        jsonschema.validate(call["args"], ARGS_SCHEMA)


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_with_structured_output(llm: ChatOpenAI, method: str) -> None:
    structured = llm.with_structured_output(Forecast, method=method)  # type: ignore[arg-type]
    if method == "json_mode":  # the schema is not sent: any JSON object comes back, as OpenAI's
        raw = llm.with_structured_output(None, method="json_mode").invoke(QUESTION)
        assert isinstance(raw, dict)
        return
    forecast = structured.invoke(QUESTION)
    assert isinstance(forecast, Forecast)
