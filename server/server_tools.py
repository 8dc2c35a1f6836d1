"""Tools the gateway runs itself (``TANDEM_TOOLS``) for the tenants an operator enabled them for.

A request of such a tenant is offered the enabled tools beside its own ``tools``. When a turn calls
only gateway tools, the gateway runs them (in parallel, each within its timeout; ``python`` in the
sandbox), appends the call and the results to the conversation and generates again, up to
``max_steps`` tool-calling turns; the client gets the final answer. A turn that calls any of the
client's own tools goes back to the client whole, as OpenAI's ``tool_calls``, and so does the last
turn allowed. ``tool_choice: "none"``, a JSON ``response_format`` or a named function keeps the gateway's
tools out of a request; ``n`` above 1 with them is refused (each choice would need a loop of its own).

Every step is logged: each tool-calling turn as a completion of its own (id ``<answer id>-step<k>``,
metadata ``tool_loop`` and ``tool_step``), each executed call as a ``tool call run`` line.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from server.auth import Identity
from server.errors import ApiError
from server.schemas import AssistantMessage, ChatCompletionRequest, FunctionTool, NamedToolChoice, ToolMessage
from server.tools import tool_call_id
from tandem.tool_calls import ParsedCall, ToolOutput
from tandem.tool_registry import ToolRegistry

logger = logging.getLogger(__name__)


class ServerTools:
    def __init__(self, registry: ToolRegistry, *, max_steps: int) -> None:
        self.registry = registry
        self.max_steps = max_steps
        self._offers = {item.name: FunctionTool.model_validate(item.openai()) for item in registry}

    def offer(self, request: ChatCompletionRequest, identity: Identity) -> tuple[ChatCompletionRequest, frozenset[str]]:
        """The request with the tenant's gateway tools added, and their names (none: the request as it is)."""
        names = frozenset(name for name in identity.server_tools if name in self._offers)
        if (
            not names
            or request.tool_choice == "none"
            or request.json_format is not None
            or isinstance(request.tool_choice, NamedToolChoice)
        ):
            return request, frozenset()
        if clash := sorted(names & set(request.tool_names)):
            raise ApiError(
                400,
                f"The tool '{clash[0]}' is run by this server for your tenant; give your own tool another name.",
                param="tools",
                code="tool_name_taken",
            )
        if request.n > 1:
            raise ApiError(
                400,
                "This server runs tools for your tenant, which answers one choice per request: send n=1, or "
                "tool_choice 'none' to leave the server's tools out.",
                param="n",
            )
        tools = [*(request.tools or []), *(self._offers[name] for name in sorted(names))]
        return request.model_copy(update={"tools": tools}), names

    @staticmethod
    def runs(output: ToolOutput, names: frozenset[str]) -> bool:
        """Whether the gateway runs this turn's calls: there are some, and all are its own."""
        return bool(output.calls) and all(call.name in names for call in output.calls)

    async def run(self, calls: list[ParsedCall], *, completion_id: str, step: int) -> list[str]:
        """Each call's result text, run concurrently; every call is logged with its outcome."""

        async def one(call: ParsedCall) -> str:
            started = time.perf_counter()
            result = await self.registry.call(call.name, call.arguments)
            logger.info(
                "tool call run",
                extra={
                    "completion_id": completion_id,
                    "tool_step": step,
                    "tool": call.name,
                    "arguments_chars": len(call.arguments),
                    "result_chars": len(result),
                    "failed": result.startswith("error:"),
                    "duration_ms": round((time.perf_counter() - started) * 1000, 1),
                },
            )
            return result

        return list(await asyncio.gather(*(one(call) for call in calls)))

    @staticmethod
    def continuation(request: ChatCompletionRequest, output: ToolOutput, results: list[str]) -> ChatCompletionRequest:
        """The request of the next turn: the conversation plus the calls and their results. A turn that
        had to call a tool ('required') is followed by turns that may answer ('auto')."""
        ids = [tool_call_id() for _ in output.calls]
        assistant: dict[str, Any] = {
            "role": "assistant",
            "content": output.content,
            "tool_calls": [
                {"id": id_, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
                for id_, call in zip(ids, output.calls, strict=True)
            ],
        }
        messages = [
            *request.messages,
            AssistantMessage.model_validate(assistant),
            *(
                ToolMessage.model_validate({"role": "tool", "content": result, "tool_call_id": id_})
                for id_, result in zip(ids, results, strict=True)
            ),
        ]
        choice = None if request.tool_choice == "required" else request.tool_choice
        return request.model_copy(update={"messages": messages, "tool_choice": choice})
