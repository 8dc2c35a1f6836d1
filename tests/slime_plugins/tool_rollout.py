"""A tool rollout for the tests: the python tool with short code (so that the random model's string
ends within the turn), its first turn a constrained call, then one free turn."""

from learner.tool_rollout import ToolRollout
from tandem.sandbox import Sandbox
from tandem.tool_registry import ToolRegistry, python_tool

generate = ToolRollout(
    ToolRegistry([python_tool(Sandbox(), max_code_chars=24)]), max_turns=2, first_turn="required"
).generate
