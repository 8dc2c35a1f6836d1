"""Tools by dotted path: schemas from type hints, calls checked against them, failures and timeouts
returned as the model's text, and the python tool running in the sandbox."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Literal

import jsonschema
import pytest

from tandem.sandbox import Sandbox, SandboxLimits
from tandem.tool_registry import Tool, ToolError, ToolRegistry, load_tool, python_tool, schema_from_hints, tool


def get_weather(city: str, days: int = 1, unit: Literal["celsius", "fahrenheit"] = "celsius") -> dict[str, object]:
    """The weather forecast for a city.

    Longer text that is not part of the description."""
    return {"city": city, "days": days, "unit": unit, "sky": "clear"}


async def slow(seconds: float) -> str:
    """Sleeps."""
    await asyncio.sleep(seconds)
    return "woke"


def broken() -> str:
    raise RuntimeError("the backend is down")


search = tool(
    lambda query: f"results for {query}",
    name="search",
    description="Search the web",
    parameters={"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
)


def registry(*extra: Tool) -> ToolRegistry:
    return ToolRegistry([tool(get_weather), tool(slow, timeout_s=0.5), tool(broken), search, *extra])


def run(coro: object) -> str:
    return asyncio.run(coro)  # type: ignore[arg-type]


def test_schema_and_description_from_the_function() -> None:
    made = tool(get_weather)
    assert made.name == "get_weather" and made.description == "The weather forecast for a city."
    schema = made.parameters
    assert schema["required"] == ["city"] and schema["additionalProperties"] is False
    assert schema["properties"]["days"] == {"type": "integer", "default": 1}
    assert schema["properties"]["unit"]["enum"] == ["celsius", "fahrenheit"]
    jsonschema.validate({"city": "Oslo", "unit": "fahrenheit"}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"city": "Oslo", "wind": True}, schema)
    assert made.openai() == {
        "type": "function",
        "function": {"name": "get_weather", "description": made.description, "parameters": schema},
    }


def test_loading_by_dotted_path() -> None:
    loaded = load_tool("tests.test_tool_registry:get_weather")
    assert loaded.name == "get_weather" and loaded.source == "tests.test_tool_registry:get_weather"
    assert load_tool("tests.test_tool_registry.search").description == "Search the web"
    for bad in ["tests.test_tool_registry:nope", "no_such_module.f", "tests.test_tool_registry:SLOW_VALUE"]:
        with pytest.raises(ToolError):
            load_tool(bad)


SLOW_VALUE = 3  # not callable: not a tool


def test_bad_tools_are_refused() -> None:
    def star(*args: int) -> None: ...

    with pytest.raises(ToolError, match="args"):
        schema_from_hints(star)
    with pytest.raises(ToolError, match="JSON Schema"):
        tool(broken, parameters={"type": "nope"})
    with pytest.raises(ToolError, match="two tools"):
        registry(tool(get_weather))


def test_calls_and_their_failures_are_text_for_the_model() -> None:
    tools = registry()
    assert json.loads(run(tools.call("get_weather", '{"city": "Oslo", "days": 3}'))) == {
        "city": "Oslo",
        "days": 3,
        "unit": "celsius",
        "sky": "clear",
    }
    assert run(tools.call("search", '{"query": "bwrap"}')) == "results for bwrap"
    assert run(tools.call("nope", "{}")).startswith("error: there is no tool named 'nope'")
    assert run(tools.call("get_weather", "{city")).startswith("error: the arguments are not JSON")
    assert "is a required property" in run(tools.call("get_weather", '{"days": 2}'))
    assert run(tools.call("broken", "{}")) == "error: broken failed: RuntimeError: the backend is down"
    started = time.perf_counter()
    assert run(tools.call("slow", '{"seconds": 30}')) == "error: slow did not finish within 0.5 s"
    assert time.perf_counter() - started < 10
    assert run(tools.call("slow", '{"seconds": 0}')) == "woke"
    assert [t["function"]["name"] for t in tools.openai_tools()] == ["get_weather", "slow", "broken", "search"]


def test_the_python_tool_runs_in_the_sandbox() -> None:
    tools = ToolRegistry([python_tool(Sandbox(SandboxLimits(wall_s=60)))])
    assert run(tools.call("python", json.dumps({"code": "print(sum(range(101)))"}))) == "5050"
    denied = run(tools.call("python", json.dumps({"code": "import socket; socket.create_connection(('1.1.1.1', 80))"})))
    assert "Network is unreachable" in denied and denied.endswith("[the code raised an error]")
    assert "code" in tools.openai_tools()[0]["function"]["parameters"]["properties"]
