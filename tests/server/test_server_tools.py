"""Tools the gateway runs itself (TANDEM_TOOLS), per tenant, on SmolLM2-135M-Instruct: the model
calls `get_weather` after examples in the history, the gateway runs it and generates again, and the
client gets the final answer, streamed or not; each step is in the log. Tenants without the tool,
clashing names, n > 1 and `tool_choice: "none"` are handled as documented (server/server_tools.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from server.app import StartupError, create_app
from server.auth import Identity
from server.schemas import ChatCompletionRequest
from server.server_tools import ServerTools
from tandem.models import resolve_model
from tandem.tool_calls import ParsedCall, ToolOutput
from tandem.tool_registry import ToolRegistry, load_tool
from tests.server.conftest import ADMIN_KEY, Gateway, gateway_settings, run_gateway
from tests.server.server_tool_fixtures import REPORTS

WEATHER_TOOL = "tests.server.server_tool_fixtures:get_weather"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def _turns(index: int, city: str, *, answered: bool) -> list[dict[str, Any]]:
    arguments = json.dumps({"city": city})
    call = {"id": f"call_{index}", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    turns = [
        {"role": "user", "content": f"What is the weather in {city}?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
    ]
    if answered:
        turns += [
            {"role": "tool", "tool_call_id": f"call_{index}", "content": f"{city}: {REPORTS[city]}"},
            {"role": "assistant", "content": f"In {city} it is {REPORTS[city]}."},
        ]
    return turns


# One example answered from the tool's result and two bare calls: what the 135M model needs to both
# call the tool (first turn) and answer from its result (second turn), greedy.
EXAMPLES = [*_turns(1, "Rome", answered=True), *_turns(2, "Oslo", answered=False), *_turns(3, "Tokyo", answered=False)]


def ask(city: str) -> list[Any]:
    return [*EXAMPLES, {"role": "user", "content": f"What is the weather in {city}?"}]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    model = resolve_model("smollm2-135m-instruct", Path.home() / ".cache" / "tandem-tests")
    settings = gateway_settings(
        tmp_path_factory.mktemp("server-tools"),
        model,
        torch_threads=2,
        admin_key=ADMIN_KEY,
        tools=f"{WEATHER_TOOL},python",
        tool_max_steps=2,
    )
    with run_gateway(settings, tenants=("acme", "globex")) as gateway:
        response = httpx.put(f"{gateway.url}/admin/tenants/acme/tools", json={"tools": ["get_weather"]}, headers=ADMIN)
        assert response.status_code == 200, response.text
        yield gateway


def logged(client: openai.OpenAI, completion_id: str) -> dict[str, Any]:
    return client.get(f"/completions/{completion_id}", cast_to=object)  # type: ignore[return-value]


@pytest.mark.parametrize("city", ["Paris", "London"])
def test_the_gateway_runs_the_tool_and_answers_from_its_result(smollm2: Gateway, city: str) -> None:
    client = smollm2.client(smollm2.keys["acme"])
    reply = client.chat.completions.create(model=smollm2.model, messages=ask(city), temperature=0, max_tokens=60)
    choice = reply.choices[0]
    temperature = REPORTS[city].split(", ")[1]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None, choice
    assert temperature in (choice.message.content or ""), choice.message.content
    step = logged(client, f"{reply.id}-step0")  # the tool-calling turn, logged as generated
    assert step["choices"][0]["text"].lstrip().startswith("<tool_call>")
    assert step["metadata"] == {"tool_loop": reply.id, "tool_step": "0"}
    answer = logged(client, reply.id)
    assert answer["metadata"] == {"tool_loop": reply.id, "tool_step": "1"}
    # The tool's result, as the model read it (this template renders results in a user turn).
    assert f"{city}: {REPORTS[city]}" in answer["request_messages"][-1]["content"]
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == step["prompt_tokens"] + answer["prompt_tokens"]


def test_a_streamed_answer_is_the_buffered_one_without_markup(smollm2: Gateway) -> None:
    client = smollm2.client(smollm2.keys["acme"])
    kwargs: dict[str, Any] = {"model": smollm2.model, "messages": ask("Paris"), "temperature": 0, "max_tokens": 60}
    whole = client.chat.completions.create(**kwargs)
    with client.chat.completions.stream(**kwargs) as stream:
        deltas = [event.delta for event in stream if event.type == "content.delta"]
        final = stream.get_final_completion()
    assert "".join(deltas) == whole.choices[0].message.content == final.choices[0].message.content
    assert "<tool" not in "".join(deltas)
    assert logged(client, f"{final.id}-step0")["metadata"]["tool_loop"] == final.id


def test_a_tenant_without_the_tool_gets_nothing_run(smollm2: Gateway) -> None:
    client = smollm2.client(smollm2.keys["globex"])
    reply = client.chat.completions.create(model=smollm2.model, messages=ask("Paris"), temperature=0, max_tokens=60)
    assert reply.choices[0].message.tool_calls is None
    with pytest.raises(openai.NotFoundError):
        logged(client, f"{reply.id}-step0")
    assert logged(client, reply.id)["metadata"] == {}


def test_tool_choice_none_keeps_the_servers_tools_out(smollm2: Gateway) -> None:
    client = smollm2.client(smollm2.keys["acme"])
    reply = client.chat.completions.create(
        model=smollm2.model, messages=ask("Paris"), tool_choice="none", temperature=0, max_tokens=60
    )
    with pytest.raises(openai.NotFoundError):
        logged(client, f"{reply.id}-step0")


def test_the_clients_own_tools_are_its_own(smollm2: Gateway) -> None:
    """A call of the client's tool goes back to the client; a tool of the server's name is refused."""
    client = smollm2.client(smollm2.keys["acme"])
    clock: Any = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    reply = client.chat.completions.create(
        model=smollm2.model, messages=ask("Paris"), tools=[clock], tool_choice="required", temperature=0
    )
    calls = reply.choices[0].message.tool_calls or []
    if calls:  # the model picked the client's tool: the calls are the answer
        assert {call.function.name for call in calls} == {"get_time"}
        assert reply.choices[0].finish_reason == "tool_calls"
    else:  # it picked the server's: run, then the next turn ('auto' now) answered
        assert logged(client, f"{reply.id}-step0")["metadata"]["tool_step"] == "0"
    weather: Any = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError, match="run by this server") as refused:
        client.chat.completions.create(model=smollm2.model, messages=ask("Paris"), tools=[weather])
    assert refused.value.code == "tool_name_taken"


def test_more_than_one_choice_is_refused_with_the_way_out(smollm2: Gateway) -> None:
    client = smollm2.client(smollm2.keys["acme"])
    with pytest.raises(openai.BadRequestError, match="tool_choice 'none'"):
        client.chat.completions.create(model=smollm2.model, messages=ask("Paris"), n=2)
    reply = client.chat.completions.create(model=smollm2.model, messages=ask("Paris"), n=2, tool_choice="none")
    assert len(reply.choices) == 2


def test_admin_lists_the_tools_and_who_has_them(smollm2: Gateway) -> None:
    admin = httpx.Client(base_url=smollm2.url, headers=ADMIN, timeout=30)
    listed = admin.get("/admin/tools").json()
    assert listed["max_steps"] == 2
    by_name = {tool["name"]: tool for tool in listed["data"]}
    assert by_name["get_weather"]["source"] == WEATHER_TOOL and by_name["get_weather"]["tenants"] == ["acme"]
    assert by_name["get_weather"]["parameters"]["required"] == ["city"]
    assert by_name["python"]["tenants"] == [] and "code" in by_name["python"]["parameters"]["properties"]
    unknown = admin.put("/admin/tenants/globex/tools", json={"tools": ["shell"]})
    assert unknown.status_code == 400 and "get_weather, python" in unknown.json()["error"]["message"]
    assert admin.put("/admin/tenants/nobody/tools", json={"tools": []}).status_code == 404
    tenant_key = {"Authorization": f"Bearer {smollm2.keys['globex']}"}
    assert httpx.get(f"{smollm2.url}/admin/tools", headers=tenant_key).status_code == 403
    assert admin.get("/admin/tenants/acme/tools").json() == {"tenant_id": "acme", "tools": ["get_weather"]}
    audit = admin.get("/admin/audit", params={"limit": 50}).json()["data"]
    assert any(entry["action"] == "tenant.tools.set" and entry["target"] == "acme" for entry in audit)


def test_a_tool_that_cannot_load_stops_the_start_with_one_line(tmp_path: Path, tiny_model: Path) -> None:
    settings = gateway_settings(tmp_path, tiny_model, tools="python,tests.server.no_such_module:tool")
    with pytest.raises(StartupError, match=r"TANDEM_TOOLS: tool 'tests.server.no_such_module:tool' cannot be loaded"):
        create_app(settings)


def _request(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    )


def test_what_a_request_is_offered() -> None:
    tools = ServerTools(ToolRegistry([load_tool(WEATHER_TOOL)]), max_steps=2)
    enabled, other = Identity("acme", server_tools=frozenset({"get_weather"})), Identity("globex")
    offered, names = tools.offer(_request(), enabled)
    assert names == {"get_weather"} and offered.tool_names == ["get_weather"]
    assert offered.effective_tool_choice == "auto"
    assert tools.offer(_request(), other) == (_request(), frozenset())
    for kept_out in ({"tool_choice": "none"}, {"response_format": {"type": "json_object"}}):
        assert tools.offer(_request(**kept_out), enabled)[1] == frozenset()
    clock = {"type": "function", "function": {"name": "get_time"}}
    named = _request(tools=[clock], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert tools.offer(named, enabled)[1] == frozenset()
    offered, _ = tools.offer(_request(tools=[clock], tool_choice="required"), enabled)
    assert offered.tool_names == ["get_time", "get_weather"]


def test_the_next_turn_carries_the_calls_and_results_and_may_answer() -> None:
    clock = {"type": "function", "function": {"name": "get_time"}}
    request = _request(tools=[clock], tool_choice="required")
    output = ToolOutput("Let me look.", [ParsedCall("get_weather", '{"city": "Oslo"}'), ParsedCall("get_time", "{}")])
    following = ServerTools.continuation(request, output, ["Oslo: snow", "noon"])
    assistant, *results = following.messages[1:]
    assert assistant.role == "assistant" and assistant.content == "Let me look."
    calls = assistant.tool_calls or []
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_weather", '{"city": "Oslo"}'),
        ("get_time", "{}"),
    ]
    assert [(r.tool_call_id, r.content) for r in results] == [
        (c.id, text) for c, text in zip(calls, ["Oslo: snow", "noon"], strict=True)
    ]
    assert following.tool_choice is None and following.effective_tool_choice == "auto"
    assert ServerTools.runs(output, frozenset({"get_weather"})) is False  # get_time is the client's
    assert ServerTools.runs(output, frozenset({"get_weather", "get_time"})) is True
    assert ServerTools.runs(ToolOutput("text", []), frozenset({"get_weather"})) is False
