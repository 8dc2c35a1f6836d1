"""Tools a model can call: Python functions with a JSON Schema, found by dotted path, run with a timeout.

A tool is a plain function, sync or async, whose parameters are JSON values. Its schema is the one
given, or derived from the type hints (pydantic), and its description the docstring's first
paragraph. ``ToolRegistry`` lists them in OpenAI's ``tools`` form (what the chat API takes) and calls
them from a model's call (``name`` plus ``arguments`` JSON): arguments are checked against the schema
first, a sync function runs on a worker thread, and a failure, a bad argument or a timeout comes back
as the tool's text result (``error: ...``) for the model to read, never as an exception.

The built-in ``python`` tool runs code in the sandbox (``tandem.sandbox``), never in this process.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, get_type_hints

import jsonschema
from pydantic import create_model

from tandem.sandbox import Sandbox

DEFAULT_TIMEOUT_S = 30.0


class ToolError(ValueError):
    """A tool that cannot be registered: a bad path, a duplicate name, a schema that is not one."""


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    function: Callable[..., Any]
    timeout_s: float = DEFAULT_TIMEOUT_S
    source: str = field(default="", compare=False)  # the dotted path it was loaded from, if any

    def openai(self) -> dict[str, Any]:
        """The tool as the chat API's ``tools`` entry."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


def tool(
    function: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    parameters: dict[str, Any] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Any:
    """``function`` as a ``Tool``; usable as a decorator, with or without arguments."""

    def make(fn: Callable[..., Any]) -> Tool:
        schema = parameters if parameters is not None else schema_from_hints(fn)
        try:
            jsonschema.Draft202012Validator.check_schema(schema)
        except jsonschema.SchemaError as exc:
            raise ToolError(f"tool {fn.__name__!r}: not a valid JSON Schema: {exc.message}") from None
        text = description if description is not None else (inspect.getdoc(fn) or "").split("\n\n")[0]
        return Tool(name or fn.__name__, " ".join(text.split()), schema, fn, timeout_s)

    return make(function) if function is not None else make


def schema_from_hints(function: Callable[..., Any]) -> dict[str, Any]:
    """The parameters' JSON Schema from the signature: annotated types, defaults make a field optional."""
    fields: dict[str, Any] = {}
    hints = get_type_hints(function)  # resolves string annotations (``from __future__ import annotations``)
    for parameter in inspect.signature(function).parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise ToolError(f"tool {function.__name__!r}: *args and **kwargs cannot be described as JSON")
        annotation = hints.get(parameter.name, Any)
        default = ... if parameter.default is parameter.empty else parameter.default
        fields[parameter.name] = (annotation, default)
    model = create_model(f"{function.__name__}_arguments", **fields)
    schema = model.model_json_schema()
    schema.pop("title", None)
    for prop in schema.get("properties", {}).values():
        prop.pop("title", None)
    schema["additionalProperties"] = False
    return schema


def load_tool(path: str) -> Tool:
    """The tool at ``module:attribute`` or ``module.attribute``: a ``Tool``, or a function made one."""
    module_name, _, attribute = path.replace(":", ".").rpartition(".")
    try:
        target = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ToolError(f"tool {path!r} cannot be loaded: {exc}") from exc
    made = target if isinstance(target, Tool) else tool(target) if callable(target) else None
    if made is None:
        raise ToolError(f"tool {path!r} is neither a function nor a Tool")
    return Tool(made.name, made.description, made.parameters, made.function, made.timeout_s, source=path)


class ToolRegistry:
    def __init__(self, tools: Iterable[Tool] = ()) -> None:
        self._tools: dict[str, Tool] = {}
        for item in tools:
            self.register(item)

    def register(self, item: Tool) -> None:
        if item.name in self._tools:
            raise ToolError(f"two tools are named {item.name!r}")
        self._tools[item.name] = item

    def __contains__(self, name: str) -> bool:
        return name in self._tools

    def __iter__(self) -> Any:
        return iter(self._tools.values())

    def openai_tools(self) -> list[dict[str, Any]]:
        return [item.openai() for item in self._tools.values()]

    async def call(self, name: str, arguments: str) -> str:
        """Run one call; whatever happens, the text the model reads back."""
        item = self._tools.get(name)
        if item is None:
            return f"error: there is no tool named {name!r}; the tools are {', '.join(sorted(self._tools))}"
        try:
            values = json.loads(arguments or "{}")
            jsonschema.validate(values, item.parameters)
        except ValueError as exc:
            return f"error: the arguments are not JSON: {exc}"
        except jsonschema.ValidationError as exc:
            return f"error: bad arguments for {name}: {exc.message}"
        try:
            result = await asyncio.wait_for(_invoke(item.function, values), timeout=item.timeout_s)
        except TimeoutError:
            return f"error: {name} did not finish within {item.timeout_s:g} s"
        except Exception as exc:  # the tool's own failure is the model's to read
            return f"error: {name} failed: {type(exc).__name__}: {exc}"
        return result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str)


async def _invoke(function: Callable[..., Any], values: dict[str, Any]) -> Any:
    if inspect.iscoroutinefunction(function):
        return await function(**values)
    return await asyncio.to_thread(function, **values)


MAX_CODE_CHARS = 16_000


def python_tool(sandbox: Sandbox, *, max_code_chars: int = MAX_CODE_CHARS) -> Tool:
    """The built-in ``python`` tool: the code (at most ``max_code_chars``) runs in ``sandbox``; its
    output is the result."""

    async def python(code: str) -> str:
        """Run Python code (standard library only, no network, no files but its own) and return what
        it prints. Print what you want to see."""
        return (await sandbox.run_python(code)).as_tool_result()

    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "maxLength": max_code_chars, "description": "Python source"}},
        "required": ["code"],
        "additionalProperties": False,
    }
    # The sandbox enforces its own wall clock; the registry's timeout is only a backstop.
    return tool(python, parameters=parameters, timeout_s=sandbox.limits.wall_s + 5)  # type: ignore[no-any-return]


def registry_of(names: Iterable[str]) -> ToolRegistry:
    """The tools named by a setting: ``python`` (the built-in, with a sandbox of its own) or dotted paths."""
    return ToolRegistry(python_tool(Sandbox()) if name == "python" else load_tool(name) for name in names)
