"""Multi-turn tool rollouts on the tiny model through a live gateway's router: the policy's tokens
carry loss and their log-probs, the tool results and template glue carry none, and what the engine
saw is exactly the token ids kept (token in, token out)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

from transformers import AutoTokenizer

from learner.sample import Sample
from learner.tool_rollout import ToolRollout
from tandem.sandbox import Sandbox, SandboxLimits
from tandem.tool_calls import PARSERS, conversation_with_tools
from tandem.tool_registry import ToolRegistry, python_tool, tool
from tests.server.conftest import tiny_model
from tests.server.engines.helpers import reference_logprobs

__all__ = ["tiny_model"]  # the shared fixture, visible here

QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]
SAMPLING = {"temperature": 1.0, "max_new_tokens": 200, "sampling_seed": 11}


def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


ADD = tool(
    add,
    parameters={
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 99},
            "b": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["a", "b"],
        "additionalProperties": False,
    },
)


def rollout(router_args: SimpleNamespace, tools: ToolRegistry, seed: int = 11) -> Sample:
    sample = Sample(prompt_token_ids=[1], metadata={"messages": QUESTION})
    runner = ToolRollout(tools, max_turns=2, first_turn="required")
    return asyncio.run(runner.generate(router_args, sample, {**SAMPLING, "sampling_seed": seed}))


def runs(mask: list[int]) -> list[tuple[int, int]]:
    """(value, length) of each run of equal values."""
    out: list[tuple[int, int]] = []
    for value in mask:
        if out and out[-1][0] == value:
            out[-1] = (value, out[-1][1] + 1)
        else:
            out.append((value, 1))
    return out


def test_masks_log_probs_and_tokens_of_a_tool_turn_are_exact(router_args: SimpleNamespace, tiny_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    sample = rollout(router_args, ToolRegistry([ADD]))
    tools = [ADD.openai()]
    conversation, _ = conversation_with_tools(QUESTION, tools, template_renders=False, parser=PARSERS["hermes"])
    prompt = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, return_dict=False)
    assert sample.prompt_token_ids == prompt  # the tools are in the prompt, as the chat API shows them

    (call_turn, first), (glue_mask, glue_length), (answer_mask, answer) = runs(sample.resolved_loss_mask())
    assert (call_turn, glue_mask, answer_mask) == (1, 0, 1)
    response = sample.response_token_ids
    calls = json.loads(tokenizer.decode(response[:first]))
    assert [c["name"] for c in calls] == ["add"] * len(calls) and sample.metadata["tool_calls"] == len(calls)
    results = [str(c["arguments"]["a"] + c["arguments"]["b"]) for c in calls]
    # The glue: the end of the assistant turn (the constrained turn ends without it), the results as
    # the template shows tool responses, the next assistant header; tokenised, never the policy's.
    glue = tokenizer.decode(response[first : first + glue_length])
    expected = "<|im_end|>\n" + "".join(
        f"<|im_start|>user\n<tool_response>\n{r}\n</tool_response><|im_end|>\n" for r in results
    )
    assert glue == expected + "<|im_start|>assistant\n"
    log_probs = sample.rollout_log_probs or []
    assert all(lp == 0.0 for lp in log_probs[first : first + glue_length])
    assert all(lp <= 0.0 for lp in log_probs) and any(lp < 0.0 for lp in log_probs[:first])
    # The free answer was sampled from exactly these tokens: its log-probs are the model's given them.
    start = first + glue_length
    reference = reference_logprobs(tiny_model, sample.tokens[: len(prompt) + start], response[start:])
    assert max(abs(a - b) for a, b in zip(log_probs[start:], reference, strict=True)) < 1e-3
    assert len(response) == first + glue_length + answer
    messages = sample.metadata["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", *["tool"] * len(calls), "assistant"]
    assert [m["content"] for m in messages if m["role"] == "tool"] == results


def test_the_python_tool_runs_in_the_sandbox(router_args: SimpleNamespace, tiny_model: Path) -> None:
    sandbox = Sandbox(SandboxLimits(wall_s=60))
    # Short code, so that the random model's string ends within the turn's tokens.
    sample = rollout(router_args, ToolRegistry([python_tool(sandbox, max_code_chars=24)]), seed=3)
    tool_messages = [m for m in sample.metadata["messages"] if m["role"] == "tool"]
    assert tool_messages and sample.metadata["tool_calls"] == len(tool_messages)
    # The random model's code does not run cleanly; the sandbox's report of it is the tool result.
    assert all("[" in m["content"] for m in tool_messages), tool_messages
    glue = AutoTokenizer.from_pretrained(tiny_model).decode(
        [t for t, m in zip(sample.response_token_ids, sample.resolved_loss_mask(), strict=True) if m == 0]
    )
    assert all(m["content"] in glue for m in tool_messages)


def test_results_that_outgrow_the_context_end_the_rollout(router_args: SimpleNamespace) -> None:
    def flood() -> str:
        """Returns far more text than the model's context holds."""
        return "word " * 5000

    closed = {"type": "object", "properties": {}, "additionalProperties": False}
    sample = rollout(router_args, ToolRegistry([tool(flood, parameters=closed)]))
    assert sample.status.value == "truncated" and sample.metadata["tool_calls"] >= 1
    assert set(sample.resolved_loss_mask()) == {1}  # the call is kept; the results that cannot fit are not
    assert sample.metadata["messages"][-1]["role"] == "tool"


def test_a_budget_beyond_the_context_is_cut_to_it(router_args: SimpleNamespace) -> None:
    sample = Sample(prompt_token_ids=[1], metadata={"messages": QUESTION})
    runner = ToolRollout(ToolRegistry([ADD]), max_turns=1)
    done = asyncio.run(runner.generate(router_args, sample, {**SAMPLING, "max_new_tokens": 10**6}))
    assert len(done.tokens) <= 2048 and done.response_length >= 1  # the tiny model's context


def test_without_calls_the_rollout_is_one_turn(router_args: SimpleNamespace) -> None:
    sample = Sample(prompt_token_ids=[1], metadata={"messages": QUESTION})
    runner = ToolRollout(ToolRegistry([ADD]), max_turns=3)  # auto: the random model writes no <tool_call>
    done = asyncio.run(runner.generate(router_args, sample, {**SAMPLING, "max_new_tokens": 12}))
    assert set(done.resolved_loss_mask()) == {1} and done.metadata["tool_calls"] == 0
    assert [m["role"] for m in done.metadata["messages"]] == ["user", "assistant"]
