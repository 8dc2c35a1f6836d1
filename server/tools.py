"""Tools and structured output in chat completions: what the model is shown, what it may produce,
and how its text becomes OpenAI's ``tool_calls``.

- Prompt: the tools go to the chat template (``apply_chat_template(tools=...)``); a template that
  cannot render tools gets them described in a system message, in the format the parser reads.
- Constraint: ``tool_choice`` 'required' or a named function, and ``response_format`` json_object or
  json_schema, become one JSON Schema that the engine enforces token by token (``forced_schema``):
  the output is then the bare JSON (a named call's arguments, or a list of calls), always parseable.
- Reading: with ``tool_choice`` 'auto' the model writes calls in its family's format, read by a
  parser (Hermes/Qwen ``<tool_call>`` JSON, or Llama 3's JSON) chosen by the setting ``tool_parser``
  or, by default, from the chat template.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from server.schemas import ChatCompletionRequest, JsonObjectFormat, NamedToolChoice
from tandem.tool_calls import (
    ParsedCall,
    ToolCallParser,
    ToolOutput,
    calls_schema,
    read_call_list,
    read_json_arguments,
)

MAX_PARALLEL_CALLS = 8  # the most calls one forced turn may hold (a bound keeps the grammar finite)


def forced_schema(request: ChatCompletionRequest) -> str | None:
    """The JSON Schema the output must match, as text, or None when the output is free.

    A named function: its arguments. 'required': a list of calls ``[{"name", "arguments"}]`` of the
    given tools (one, or up to ``MAX_PARALLEL_CALLS`` with parallel_tool_calls). response_format:
    any JSON object, or the given schema.
    """
    choice = request.effective_tool_choice
    if isinstance(choice, NamedToolChoice):
        tool = next(t for t in request.tools or [] if t.function.name == choice.function.name)
        schema: dict[str, Any] = tool.parameters
    elif choice == "required":
        tools = [t.model_dump(exclude_none=True) for t in request.tools or []]
        schema = calls_schema(tools, MAX_PARALLEL_CALLS if request.parallel_tool_calls else 1)
    elif isinstance(request.json_format, JsonObjectFormat):
        schema = {"type": "object"}
    elif request.json_format is not None:
        schema = request.json_format.json_schema.schema_ or {}
    else:
        return None
    return json.dumps(schema, ensure_ascii=False)


class ToolReader:
    """Turns one request's output text into content and tool calls."""

    def __init__(self, request: ChatCompletionRequest, parser: ToolCallParser) -> None:
        self.choice = request.effective_tool_choice
        self.parser = parser

    def read(self, text: str) -> ToolOutput:
        choice = self.choice
        if isinstance(choice, NamedToolChoice):
            return ToolOutput(None, [ParsedCall(choice.function.name, read_json_arguments(text))])
        if choice == "required":
            calls = read_call_list(text)
            return ToolOutput(text, []) if calls is None else ToolOutput(None, calls)
        if choice == "auto":
            return self.parser.parse(text)
        return ToolOutput(text, [])

    def content_end(self, text: str) -> int:
        if self.choice == "auto":
            return self.parser.content_end(text)
        return len(text) if self.choice == "none" else 0

    def finish_reason(self, output: ToolOutput, finish_reason: str) -> str:
        # OpenAI answers a named tool_choice with 'stop', 'auto' and 'required' calls with 'tool_calls'.
        if finish_reason == "length" or not output.calls or isinstance(self.choice, NamedToolChoice):
            return finish_reason
        return "tool_calls"


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_calls_json(calls: list[ParsedCall]) -> list[dict[str, Any]]:
    """``message.tool_calls`` of a response."""
    return [
        {"id": tool_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls
    ]


def tool_call_deltas(calls: list[ParsedCall]) -> list[dict[str, Any]]:
    """Streamed calls as OpenAI sends them: per call, the id and name with empty arguments first,
    then the arguments."""
    deltas = []
    for index, call in enumerate(calls):
        head = {
            "index": index,
            "id": tool_call_id(),
            "type": "function",
            "function": {"name": call.name, "arguments": ""},
        }
        deltas.append({"tool_calls": [head]})
        deltas.append({"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]})
    return deltas
