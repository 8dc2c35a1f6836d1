"""Tool calls in model text: the parsers of each model family's format, and how tools reach a chat
template (rendered by it, or described in the system message in the parser's format).

Shared by the gateway (``server.tools``: the chat API's tools) and the learner (``learner.tool_rollout``:
multi-turn tool rollouts), so both read and write calls the same way. Tools are OpenAI's ``tools``
entries (``{"type": "function", "function": {"name", "description", "parameters"}}``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from tandem.text import holdback

ParserName = Literal["hermes", "llama3_json"]


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


def _tool_json(tool: dict[str, Any]) -> str:
    return json.dumps(tool, ensure_ascii=False)


class ToolCallParser(Protocol):
    name: ParserName

    def parse(self, text: str) -> ToolOutput:
        """The calls written in ``text`` and the text around them (the content)."""
        ...

    def content_end(self, text: str) -> int:
        """How much of ``text`` (a prefix of the output) is surely content, so may be streamed."""
        ...

    def instructions(self, tools: list[dict[str, Any]]) -> str:
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

    def instructions(self, tools: list[dict[str, Any]]) -> str:
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

    def instructions(self, tools: list[dict[str, Any]]) -> str:
        listed = "\n\n".join(_tool_json(tool) for tool in tools)
        return (
            "You have access to the following functions. To call a function, respond only with JSON of the "
            'form {"name": function name, "parameters": dictionary of argument name and its value}. '
            f"Do not use variables.\n\n{listed}"
        )

    def write_call(self, name: str, arguments: Any) -> str:
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)


PARSERS: dict[ParserName, ToolCallParser] = {"hermes": HermesParser(), "llama3_json": Llama3JsonParser()}


def calls_schema(tools: list[dict[str, Any]], most: int) -> dict[str, Any]:
    """The JSON Schema of 1 to ``most`` calls of ``tools``, ``[{"name", "arguments"}, ...]``: what a
    constrained call turn writes and ``read_call_list`` reads."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                "arguments": t["function"].get("parameters") or {"type": "object"},  # OpenAI's default
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return {"type": "array", "items": {"anyOf": calls}, "minItems": 1, "maxItems": most}


def read_call_list(text: str) -> list[ParsedCall] | None:
    """The calls of a constrained ``[{"name", "arguments"}, ...]`` output; None if it is not one."""
    try:
        items = _loads(text)
    except ValueError:
        return None
    if not isinstance(items, list):
        return None
    calls = [_call(item, "arguments") for item in items]
    return None if any(call is None for call in calls) else [c for c in calls if c is not None]


def read_json_arguments(text: str) -> str:
    """A constrained arguments object, re-written as strict JSON; cut short (the output ran out of
    tokens) it stays as written, partial, as OpenAI sends it."""
    try:
        return _arguments_text(_loads(text))
    except ValueError:
        return text.strip()


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
    conversation: list[dict[str, Any]], tools: list[dict[str, Any]], *, template_renders: bool, parser: ToolCallParser
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
        return messages, tools
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
