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
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from server.choice import holdback
from server.schemas import ChatCompletionRequest, FunctionTool, JsonObjectFormat, NamedToolChoice

ParserName = Literal["hermes", "llama3_json"]
MAX_PARALLEL_CALLS = 8  # the most calls one forced turn may hold (a bound keeps the grammar finite)


@dataclass(slots=True, frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI's function.arguments


@dataclass(slots=True, frozen=True)
class ToolOutput:
    content: str | None
    calls: list[ParsedCall]


def _loads(text: str) -> Any:
    # Grammar engines (SGLang's xgrammar among them) let raw control characters into JSON strings,
    # which strict JSON forbids: read them, and write them back escaped.
    return json.loads(text, strict=False)


def _arguments_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _call(obj: Any, arguments_key: str) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    if not isinstance(arguments, dict | str):
        return None
    return ParsedCall(obj["name"], _arguments_text(arguments))


def _tool_json(tool: FunctionTool) -> str:
    return json.dumps(tool.model_dump(exclude_none=True), ensure_ascii=False)


class ToolCallParser(Protocol):
    name: ParserName

    def parse(self, text: str) -> ToolOutput:
        """The calls written in ``text`` and the text around them (the content)."""
        ...

    def content_end(self, text: str) -> int:
        """How much of ``text`` (a prefix of the output) is surely content, so may be streamed."""
        ...

    def instructions(self, tools: list[FunctionTool]) -> str:
        """The system message that teaches a model whose template cannot render tools."""
        ...

    def write_call(self, name: str, arguments: Any) -> str:
        """A call from the history, in the text the model would have written."""
        ...


class HermesParser:
    """Hermes/Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number of them."""

    name: ParserName = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)

    def parse(self, text: str) -> ToolOutput:
        start = text.find(self.OPEN)
        if start < 0:
            return ToolOutput(text, [])
        calls, end = [], start
        for match in self._BLOCK.finditer(text, start):
            try:
                call = _call(_loads(match.group(1)), "arguments")
            except ValueError:
                call = None
            if call is None:  # not a call after all: the text stays content, as written
                return ToolOutput(text, [])
            calls.append(call)
            end = match.end()
        content = (text[:start] + text[end:]).strip()
        return ToolOutput(content or None, calls)

    def content_end(self, text: str) -> int:
        start = text.find(self.OPEN)
        end = start if start >= 0 else len(text) - holdback(text, (self.OPEN,))
        return len(text[:end].rstrip())

    def instructions(self, tools: list[FunctionTool]) -> str:
        listed = "\n".join(_tool_json(tool) for tool in tools)
        return (
            "You may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        )

    def write_call(self, name: str, arguments: Any) -> str:
        return f"{self.OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{self.CLOSE}"


class Llama3JsonParser:
    """Llama 3.1+: the whole answer is ``{"name": ..., "parameters": {...}}`` (several joined by ';'),
    optionally after ``<|python_tag|>``; any other answer is content."""

    name: ParserName = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str) -> ToolOutput:
        body = text.strip().removeprefix(self.TAG).lstrip()
        if not body.startswith("{"):
            return ToolOutput(text, [])
        decoder, calls, position = json.JSONDecoder(strict=False), [], 0
        while position < len(body):
            try:
                obj, position = decoder.raw_decode(body, position)
            except ValueError:
                return ToolOutput(text, [])
            call = _call(obj, "parameters")
            if call is None:
                return ToolOutput(text, [])
            calls.append(call)
            position = len(body) - len(body[position:].lstrip().removeprefix(";").lstrip())
        return ToolOutput(None, calls)

    def content_end(self, text: str) -> int:
        head = text.lstrip()
        if not head:
            return 0
        if head.startswith("{") or self.TAG.startswith(head[: len(self.TAG)]) or head.startswith(self.TAG):
            return 0  # may be a call: nothing is content until the answer is complete
        return len(text)

    def instructions(self, tools: list[FunctionTool]) -> str:
        listed = "\n\n".join(_tool_json(tool) for tool in tools)
        return (
            "You have access to the following functions. To call a function, respond only with JSON of the "
            'form {"name": function name, "parameters": dictionary of argument name and its value}. '
            f"Do not use variables.\n\n{listed}"
        )

    def write_call(self, name: str, arguments: Any) -> str:
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)


PARSERS: dict[ParserName, ToolCallParser] = {"hermes": HermesParser(), "llama3_json": Llama3JsonParser()}


def parser_for(setting: str, chat_template: str) -> ToolCallParser:
    """The parser named by the setting, or (``auto``) the one the chat template's format calls for:
    Llama 3's JSON where the template speaks of ``<|python_tag|>`` or the ipython role and has no
    ``<tool_call>``; Hermes otherwise (also the format of the default rendering)."""
    if setting != "auto":
        return PARSERS[setting]  # type: ignore[index]
    if "<tool_call>" not in chat_template and ("<|python_tag|>" in chat_template or "ipython" in chat_template):
        return PARSERS["llama3_json"]
    return PARSERS["hermes"]


def renders_tools(chat_template: str) -> bool:
    """Whether the template reads the ``tools`` variable (templates that can show tools all do)."""
    return re.search(r"\btools\b", chat_template) is not None


def _arguments_value(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def conversation_with_tools(
    conversation: list[dict[str, Any]], tools: list[FunctionTool], *, template_renders: bool, parser: ToolCallParser
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The conversation and the ``tools`` value for the template.

    A template that renders tools gets them, and earlier calls with their arguments as objects (what
    templates expect); another gets the parser's instructions as (the start of) the system message,
    earlier calls written as the model would write them and tool results as ``<tool_response>``s.
    """
    if template_renders:
        messages = [
            {
                **m,
                "tool_calls": [
                    {**c, "function": {**c["function"], "arguments": _arguments_value(c["function"]["arguments"])}}
                    for c in m["tool_calls"]
                ],
            }
            if m.get("tool_calls")
            else m
            for m in conversation
        ]
        return messages, [tool.model_dump(exclude_none=True) for tool in tools]
    out: list[dict[str, Any]] = []
    for m in conversation:
        if m.get("tool_calls"):
            calls = [
                parser.write_call(c["function"]["name"], _arguments_value(c["function"]["arguments"]))
                for c in m["tool_calls"]
            ]
            out.append({"role": "assistant", "content": "\n".join(filter(None, [m["content"], *calls]))})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            out.append(m)
    system = parser.instructions(tools)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}"}
    else:
        out.insert(0, {"role": "system", "content": system})
    return out, None


def _call_schema(tool: FunctionTool) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": tool.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


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
        calls = [_call_schema(t) for t in request.tools or []]
        most = MAX_PARALLEL_CALLS if request.parallel_tool_calls else 1
        schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1, "maxItems": most}
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

    @property
    def streams_content(self) -> bool:
        """Whether text may reach the client as content before the output is complete."""
        return self.choice in ("none", "auto")

    def read(self, text: str) -> ToolOutput:
        choice = self.choice
        if isinstance(choice, NamedToolChoice):
            # Cut short (finish_reason 'length'), the arguments are partial JSON, as OpenAI sends them.
            try:
                arguments = _arguments_text(_loads(text))
            except ValueError:
                arguments = text.strip()
            return ToolOutput(None, [ParsedCall(choice.function.name, arguments)])
        if choice == "required":
            try:
                calls = [_call(obj, "arguments") for obj in _loads(text)]
            except (ValueError, TypeError):
                return ToolOutput(text, [])
            return ToolOutput(None, [c for c in calls if c is not None])
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
