"""`tandem generate` against a live gateway: a tool rollout over a prompt file, trajectories with
their messages, tokens, masks and rewards, and clear refusals of bad input."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tandem.cli import app
from tests.server.conftest import ADMIN_KEY, Gateway, gateway_settings, run_gateway, tiny_model

__all__ = ["tiny_model"]  # the shared fixture, visible here

PROMPTS = [
    {"messages": [{"role": "user", "content": "What is 2 + 3?"}], "label": "5"},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "7 * 6?"}], "label": 42},
    {"prompt": "What is 10 - 4?", "label": "6"},
]


@pytest.fixture(scope="module")
def gateway(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    settings = gateway_settings(tmp_path_factory.mktemp("generate"), tiny_model, admin_key=ADMIN_KEY)
    with run_gateway(settings) as gw:
        yield gw


def generate(gateway: Gateway, *args: str) -> object:
    return CliRunner().invoke(
        app, ["generate", *args, "--server", gateway.url], env={"TANDEM_ADMIN_KEY": ADMIN_KEY}, catch_exceptions=False
    )


def test_trajectories_of_a_tool_rollout(gateway: Gateway, tmp_path: Path) -> None:
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    result = generate(
        gateway,
        str(prompts),
        "--out", str(out),
        "--generate", "tests.slime_plugins.tool_rollout:generate",
        "--reward", "learner.verifiers:exact_math_answer",
        "--samples", "2",
        "--max-new-tokens", "120",
    )  # fmt: skip
    assert result.exit_code == 0, result.output  # type: ignore[attr-defined]
    assert "generated 6 trajectories from 3 prompts" in result.output  # type: ignore[attr-defined]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["group_index"] for line in lines] == [0, 0, 1, 1, 2, 2]
    for line, prompt in zip(lines, [p for p in PROMPTS for _ in range(2)], strict=True):
        first = prompt.get("messages") or [{"role": "user", "content": prompt["prompt"]}]
        assert line["messages"][: len(first)] == first
        roles = [m["role"] for m in line["messages"][len(first) :]]
        assert roles[:2] == ["assistant", "tool"] and roles[-1] == "assistant", roles
        assert len(line["loss_mask"]) == len(line["response_token_ids"]) == len(line["rollout_log_probs"])
        assert 0 in line["loss_mask"] and line["loss_mask"][0] == 1  # the tool result is not the policy's
        assert line["reward"] in (0.0, 1.0) and line["label"] == str(prompt["label"])
        assert line["metadata"]["tool_calls"] >= 1 and line["status"] in ("completed", "truncated")


@pytest.mark.parametrize(
    ("content", "says"),
    [("not json\n", "not JSON"), ('{"label": 1}\n', '"messages"'), ('{"messages": []}\n', '"messages"')],
)
def test_a_bad_prompt_file_is_refused(gateway: Gateway, tmp_path: Path, content: str, says: str) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(content)
    result = generate(gateway, str(prompts), "--out", str(tmp_path / "out.jsonl"))
    assert result.exit_code == 2 and says in result.output and "prompts.jsonl:1" in result.output  # type: ignore[attr-defined]


def test_a_bad_generate_function_is_refused(gateway: Gateway, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps(PROMPTS[0]) + "\n")
    result = generate(gateway, str(prompts), "--out", str(tmp_path / "o.jsonl"), "--generate", "no_such.module:fn")
    assert result.exit_code == 2 and "no_such" in result.output  # type: ignore[attr-defined]
