"""Multi-turn tool rollouts: the model writes, a tool call in its text is run, the result goes back as
tokens, and the model goes on, until it answers without a call, or turns or tokens run out.

Token in, token out: every turn is sent as the token ids so far (the policy's own tokens exactly as it
produced them, never re-tokenised), and what comes back is appended with its log-probs and loss mask
1. The tool results and the chat template's glue between turns (end of the assistant turn, the tool
response turn, the next assistant header) are appended with loss mask 0: they came from the tools and
the template, not the policy. The calls are read by the same parsers as the chat API
(``tandem.tool_calls``) and run by a ``ToolRegistry`` (the ``python`` tool in the sandbox).

It is a slime generate function (``async def generate(args, sample, sampling_params)``): set
``custom_generate_path`` to ``learner.tool_rollout:generate`` (the python tool, up to 4 turns), or
build a ``ToolRollout`` with other tools and point the setting at its ``generate``. The round's reward
function scores the final sample (``sample.metadata["messages"]`` holds the conversation with its
calls and results; ``sample.metadata["tool_calls"]`` how many ran).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from transformers import AutoConfig, PreTrainedTokenizerBase

from learner.rollout import checkpoint_tokenizer
from learner.sample import Sample, SampleStatus
from learner.sglang_router import post_generate
from tandem.sandbox import Sandbox
from tandem.tool_calls import (
    ParsedCall,
    ToolCallParser,
    calls_schema,
    conversation_with_tools,
    parser_for,
    read_call_list,
    renders_tools,
)
from tandem.tool_registry import ToolRegistry, python_tool

MAX_FIRST_CALLS = 4  # calls a constrained first turn may hold
MARKER = "\ue000"  # a private-use character: where the assistant's turn sits in a rendered template


@dataclass(frozen=True)
class ToolRollout:
    """``first_turn`` "required" constrains the first turn to a JSON list of calls (as the chat API's
    ``tool_choice: "required"``), so even a weak model uses a tool once; later turns are free."""

    tools: ToolRegistry
    max_turns: int = 4
    first_turn: Literal["auto", "required"] = "auto"
    parser: str = "auto"

    async def generate(self, args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
        tokenizer = checkpoint_tokenizer(str(args.hf_checkpoint))
        template = tokenizer.get_chat_template()
        parser = parser_for(self.parser, template)
        tools = self.tools.openai_tools()
        messages = _messages(sample)
        conversation, template_tools = conversation_with_tools(
            messages, tools, template_renders=renders_tools(template), parser=parser
        )
        prompt: list[int] = tokenizer.apply_chat_template(  # type: ignore[assignment]
            conversation, tools=_for_template(template_tools), add_generation_prompt=True, return_dict=False
        )
        sample.tokens = list(prompt)
        budget = int(sampling_params.get("max_new_tokens", 128))
        history, ran = list(messages), 0
        for turn in range(self.max_turns):
            # What is left of the response budget, and of the model's context.
            room = min(budget - sample.response_length, _context_length(str(args.hf_checkpoint)) - len(sample.tokens))
            if room < 1:
                sample.status = SampleStatus.TRUNCATED
                break
            params = {**sampling_params, "max_new_tokens": room}
            forced = turn == 0 and self.first_turn == "required"
            if forced:
                params["json_schema"] = json.dumps(calls_schema(tools, MAX_FIRST_CALLS))
            body = {"input_ids": sample.tokens, "sampling_params": params, "return_logprob": True}
            output = await post_generate(args, body)
            finish = output["meta_info"]["finish_reason"]["type"]
            if finish == "abort":
                sample.status = SampleStatus.ABORTED
                return sample
            items = output["meta_info"]["output_token_logprobs"]
            tokens = [int(item[1]) for item in items]
            sample.append_response_tokens(
                args,
                tokens=tokens,
                log_probs=[float(item[0]) for item in items],
                meta_info=output["meta_info"],
                text=output["text"],
            )
            calls = (read_call_list(output["text"]) or []) if forced else parser.parse(output["text"]).calls
            if not calls or finish == "length":
                history.append({"role": "assistant", "content": output["text"]})
                break
            results = [await self.tools.call(call.name, call.arguments) for call in calls]
            ran += len(calls)
            turn_messages = _turn_messages(turn, calls, results)
            glue = _glue(tokenizer, parser, tools, template_tools is not None, turn_messages[1:], tokens[-1:])
            glue_ids = tokenizer.encode(glue, add_special_tokens=False)
            history += turn_messages
            if len(sample.tokens) + len(glue_ids) >= _context_length(str(args.hf_checkpoint)):
                sample.status = SampleStatus.TRUNCATED  # the results leave no room for another turn
                break
            sample.append_response_tokens(args, tokens=glue_ids, trainable=False, text=glue)
        else:
            sample.status = SampleStatus.TRUNCATED  # out of turns while still calling tools
        sample.metadata = {**sample.metadata, "messages": history, "tool_calls": ran}
        return sample


def _messages(sample: Sample) -> list[dict[str, Any]]:
    """The prompt's chat messages: the round's prompts carry them in metadata; a plugin's may be text."""
    messages = sample.metadata.get("messages")
    if isinstance(messages, list):
        return list(messages)
    if isinstance(sample.prompt, list):
        return list(sample.prompt)
    return [{"role": "user", "content": str(sample.prompt)}]


def _turn_messages(turn: int, calls: list[ParsedCall], results: list[str]) -> list[dict[str, Any]]:
    ids = [f"call_{turn}_{i}" for i in range(len(calls))]
    assistant = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": i, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for i, c in zip(ids, calls, strict=True)
        ],
    }
    return [assistant, *({"role": "tool", "tool_call_id": i, "content": r} for i, r in zip(ids, results, strict=True))]


def _glue(
    tokenizer: PreTrainedTokenizerBase,
    parser: ToolCallParser,
    tools: list[dict[str, Any]],
    template_renders: bool,
    results: list[dict[str, Any]],
    last_token: list[int],
) -> str:
    """The template's text between the end of the policy's turn and the start of its next: the end
    of the assistant turn (unless the policy wrote it), the tool results, the next assistant header."""
    around = [{"role": "user", "content": "?"}, {"role": "assistant", "content": MARKER}, *results]
    conversation, template_tools = conversation_with_tools(
        around, tools, template_renders=template_renders, parser=parser
    )
    text = tokenizer.apply_chat_template(
        conversation, tools=_for_template(template_tools), add_generation_prompt=True, tokenize=False
    )
    glue = str(text).split(MARKER, 1)[1]
    written = str(tokenizer.decode(last_token)) if last_token and last_token[0] in _end_ids(tokenizer) else ""
    return glue.removeprefix(written) if written and glue.startswith(written) else glue


@functools.cache
def _context_length(checkpoint: str) -> int:
    return int(getattr(AutoConfig.from_pretrained(checkpoint), "max_position_embeddings", 2048))


def _for_template(tools: list[dict[str, Any]] | None) -> list[dict[Any, Any] | Callable[..., Any]] | None:
    return list(tools) if tools else None  # transformers' annotation takes callables too


def _end_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    return {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()


@functools.cache
def _python_only() -> ToolRollout:
    return ToolRollout(ToolRegistry([python_tool(Sandbox())]))


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """slime's generate contract: the ``python`` tool (in the sandbox), up to 4 turns."""
    return await _python_only().generate(args, sample, sampling_params)
