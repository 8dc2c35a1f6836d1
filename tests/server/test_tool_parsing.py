"""Reading tool calls out of model text, the parser chosen per chat template, the forced schemas, and
how tools reach a template (rendered by it, or described in the system message)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from server.schemas import ChatCompletionRequest
from server.tools import MAX_PARALLEL_CALLS, ToolReader, forced_schema, tool_call_deltas
from tandem.tool_calls import (
    HermesParser,
    Llama3JsonParser,
    ParsedCall,
    ToolOutput,
    conversation_with_tools,
    parser_for,
    read_call_list,
    renders_tools,
)

hermes, llama = HermesParser(), Llama3JsonParser()
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time"}},
]
# Excerpts of real templates: Qwen2.5's writes <tool_call>, Llama 3.1's the ipython role and python tag.
QWEN_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}{%- for tool in tools %}{{- tool | tojson }}"
    "{%- endfor %}{{- '</tools>\\n<tool_call>...</tool_call><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' }}{%- if message.tool_calls %}"
    "{%- for call in message.tool_calls %}{{- '<tool_call>' + call.function.arguments | tojson + '</tool_call>' }}"
    "{%- endfor %}{%- else %}{{- message.content }}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
)
LLAMA_TEMPLATE = "{%- if tools %}{{- 'Environment: ipython' }}{%- endif %}{{- '<|python_tag|>' }}"
PLAIN_TEMPLATE = "{%- for message in messages %}{{- message.content }}{%- endfor %}"


def request(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    )


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("Just text.", "Just text.", []),
        (
            'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            "Let me check.",
            [ParsedCall("get_weather", '{"city": "Paris"}')],
        ),
        (
            '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": "{\\"x\\": 1}"}</tool_call>',
            None,
            [ParsedCall("a", "{}"), ParsedCall("b", '{"x": 1}')],
        ),
        # Cut off before its closing tag (the end-of-turn token ended it): still a call.
        ('<tool_call>{"name": "a", "arguments": {"q": "\\u00e9"}}', None, [ParsedCall("a", '{"q": "é"}')]),
        # Not JSON, or no name: the text stays content, as written.
        ("<tool_call>{oops}</tool_call>", "<tool_call>{oops}</tool_call>", []),
        ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ],
)
def test_hermes(text: str, content: str | None, calls: list[ParsedCall]) -> None:
    assert hermes.parse(text) == ToolOutput(content, calls)


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("The weather is fine.", "The weather is fine.", []),
        (
            '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
            None,
            [ParsedCall("get_weather", '{"city": "Oslo"}')],
        ),
        (
            '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"y": 2}}',
            None,
            [ParsedCall("a", "{}"), ParsedCall("b", '{"y": 2}')],
        ),
        ('{"city": "Oslo"}', '{"city": "Oslo"}', []),  # JSON, but not a call
        ('{"name": "a", "parameters": {', '{"name": "a", "parameters": {', []),  # cut off
    ],
)
def test_llama3_json(text: str, content: str | None, calls: list[ParsedCall]) -> None:
    assert llama.parse(text) == ToolOutput(content, calls)


@pytest.mark.parametrize(
    ("parser", "text", "end"),
    [
        (hermes, "Hello wor", 9),
        (hermes, "Hello <tool_c", 5),  # a tag may be starting: held back, with the space before it
        (hermes, "Hello <tool_call>{", 5),
        (hermes, "a < b", 5),
        (llama, "Sure, here", 10),
        (llama, "{", 0),
        (llama, "<|python", 0),
        (llama, "", 0),
    ],
)
def test_content_that_may_stream(parser: Any, text: str, end: int) -> None:
    assert parser.content_end(text) == end


def test_the_parser_follows_the_template_or_the_setting() -> None:
    assert parser_for("auto", QWEN_TEMPLATE).name == "hermes"
    assert parser_for("auto", LLAMA_TEMPLATE).name == "llama3_json"
    assert parser_for("auto", PLAIN_TEMPLATE).name == "hermes"  # the default rendering's format
    assert parser_for("llama3_json", QWEN_TEMPLATE).name == "llama3_json"
    assert renders_tools(QWEN_TEMPLATE) and renders_tools(LLAMA_TEMPLATE) and not renders_tools(PLAIN_TEMPLATE)


HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
        ],
    },
    {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
]


def test_a_template_that_renders_tools_gets_them_and_argument_objects() -> None:
    conversation, template_tools = conversation_with_tools(HISTORY, TOOLS, template_renders=True, parser=hermes)
    assert template_tools is not None and [t["function"]["name"] for t in template_tools] == ["get_weather", "get_time"]
    assert conversation[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Rome"}
    text = render_jinja_template([conversation], tools=template_tools, chat_template=QWEN_TEMPLATE)[0][0]
    assert '"name": "get_weather"' in text and '<tool_call>{"city": "Rome"}</tool_call>' in text


def test_other_templates_get_the_default_rendering() -> None:
    conversation, template_tools = conversation_with_tools(HISTORY, TOOLS, template_renders=False, parser=hermes)
    assert template_tools is None
    system = conversation[0]
    assert system["role"] == "system" and system["content"].startswith("Be brief.\n\n")
    assert '"name": "get_weather"' in system["content"] and "<tool_call>" in system["content"]
    assert conversation[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
    }
    assert conversation[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    # Without a system message, one is added; Llama 3's format teaches its own form.
    llama_conv, _ = conversation_with_tools(HISTORY[1:], TOOLS, template_renders=False, parser=llama)
    assert llama_conv[0]["role"] == "system" and '"parameters"' in llama_conv[0]["content"]
    assert llama_conv[2]["content"] == '{"name": "get_weather", "parameters": {"city": "Rome"}}'


def test_forced_schemas() -> None:
    assert forced_schema(request()) is None
    assert forced_schema(request(tools=TOOLS)) is None  # auto: free text
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert json.loads(forced_schema(request(tools=TOOLS, tool_choice=named)) or "") == WEATHER
    required = json.loads(forced_schema(request(tools=TOOLS, tool_choice="required")) or "")
    assert required["minItems"] == 1 and required["maxItems"] == MAX_PARALLEL_CALLS
    jsonschema.validate(
        [{"name": "get_weather", "arguments": {"city": "x"}}, {"name": "get_time", "arguments": {}}], required
    )
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "arguments": {"city": 1}, "extra": 1}], required)
    single = json.loads(forced_schema(request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)) or "")
    assert single["maxItems"] == 1
    assert json.loads(forced_schema(request(response_format={"type": "json_object"})) or "") == {"type": "object"}
    shaped = request(response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}})
    assert json.loads(forced_schema(shaped) or "") == WEATHER


def test_reading_forced_output() -> None:
    named = ToolReader(request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}), hermes)
    output = named.read('{"zone": "UTC"}')
    assert output == ToolOutput(None, [ParsedCall("get_time", '{"zone": "UTC"}')])
    assert named.finish_reason(output, "stop") == "stop"  # OpenAI's answer to a named choice
    assert named.read('{"zone": "U').calls[0].arguments == '{"zone": "U'  # cut off: partial, as OpenAI
    required = ToolReader(request(tools=TOOLS, tool_choice="required"), hermes)
    output = required.read('[{"name": "get_weather", "arguments": {"city": "a\tb"}}]')  # a raw tab
    assert output.calls == [ParsedCall("get_weather", '{"city": "a\\tb"}')]
    assert required.finish_reason(output, "stop") == "tool_calls"
    assert required.finish_reason(required.read("[{"), "length") == "length"
    assert required.content_end("[{") == 0
    assert read_call_list('[{"name": "a", "arguments": {}}, {"arguments": {}}]') is None  # an item that is no call
    assert read_call_list('{"name": "a", "arguments": {}}') is None  # not a list


def test_stream_deltas_carry_id_and_name_first() -> None:
    deltas = tool_call_deltas([ParsedCall("a", "{}"), ParsedCall("b", '{"x": 1}')])
    assert [d["tool_calls"][0]["index"] for d in deltas] == [0, 0, 1, 1]
    first, second = deltas[0]["tool_calls"][0], deltas[1]["tool_calls"][0]
    assert first["id"].startswith("call_") and first["function"] == {"name": "a", "arguments": ""}
    assert second == {"index": 0, "function": {"arguments": "{}"}}
