"""The eval set: a stable holdout of prompts, and the JSONL prompts file with its errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from learner.evaluation import EvalSetError, is_held_out, read_eval_prompts, split_held_out
from learner.sample import Sample


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_holdout_is_a_stable_share_of_prompts() -> None:
    prompts = [user(f"question {i}") for i in range(5000)]
    held = [p for p in prompts if is_held_out(p, 0.1)]
    assert 0.085 < len(held) / len(prompts) < 0.115
    assert held == [p for p in prompts if is_held_out(p, 0.1)]  # the same every time
    # A larger share contains the smaller one: raising the fraction never returns prompts to training.
    assert all(is_held_out(p, 0.3) for p in held)
    assert not any(is_held_out(p, 0.0) for p in prompts)
    # Pinned: a change of the hash would put prompts that trained into every deployment's eval set.
    assert is_held_out(user("Name a colour."), 0.1) and not is_held_out(user("Say hi."), 0.1)


def test_holdout_reads_the_prompt_not_its_key_order_or_answers() -> None:
    message = {"role": "user", "content": "Name a colour."}
    assert is_held_out([{"content": message["content"], "role": "user"}], 0.1) == is_held_out([message], 0.1)
    samples = [
        Sample(prompt=user(text), response_token_ids=[i], index=i)
        for i, text in enumerate(["Name a colour.", "Say hi.", "Name a colour.", "Bye."])
    ]
    train, held = split_held_out(samples, 0.1)
    assert [s.index for s in held] == [0, 2]  # every answer to a held-out prompt, whatever it says
    assert [s.index for s in train] == [1, 3]


def write_lines(path: Path, *lines: object) -> Path:
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def test_prompts_file_gives_one_sample_per_answer_or_per_prompt(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "eval.jsonl",
        {
            "messages": user("2 + 2?"),
            "label": "4",
            "metadata": {"topic": "sums"},
            "answers": [{"content": "4", "reward": 1}, {"content": "5", "reward": -1}],
        },
        "",
        {"messages": user("Say hi.")},
    )
    samples = read_eval_prompts(path, needs_answers=False)
    assert [(s.group_index, s.response, s.reward, s.label) for s in samples] == [
        (0, "4", 1.0, "4"),
        (0, "5", -1.0, "4"),
        (1, "", None, None),
    ]
    assert samples[0].prompt == user("2 + 2?") and samples[0].metadata == {"topic": "sums"}
    assert samples[0].prompt_token_ids == []  # the process with the tokenizer fills them in


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("{not json", "line 2: not JSON"),
        ([1, 2], "line 2: expected a JSON object"),
        ({"messages": user("x"), "prompt": "x"}, r"line 2: unknown keys \['prompt'\]"),
        ({"messages": []}, "'messages' must be a non-empty list"),
        ({"messages": [{"role": "user"}]}, "'messages' must be a non-empty list"),
        ({"messages": user("x"), "label": 4}, "'label' must be a string"),
        ({"messages": user("x"), "metadata": []}, "'metadata' must be an object"),
        ({"messages": user("x"), "answers": [{"content": "a", "reward": True}]}, "'answers' must be a list"),
        ({"messages": user("x"), "answers": [{"content": "a", "reward": float("nan")}]}, "'answers' must be"),
        ({"messages": user("x"), "answers": [{"content": "a"}]}, "'answers' must be a list"),
    ],
)
def test_a_bad_line_is_reported_with_its_number(tmp_path: Path, line: object, match: str) -> None:
    path = write_lines(tmp_path / "eval.jsonl", {"messages": user("fine")}, line)
    with pytest.raises(EvalSetError, match=match):
        read_eval_prompts(path, needs_answers=False)


def test_answers_are_required_by_the_built_in_method_and_a_file_must_hold_prompts(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "eval.jsonl", {"messages": user("x"), "answers": [{"content": "a", "reward": 1}]})
    assert len(read_eval_prompts(path, needs_answers=True)) == 1
    write_lines(path, {"messages": user("x"), "answers": [{"content": "a", "reward": 1}]}, {"messages": user("y")})
    with pytest.raises(EvalSetError, match="line 2: no 'answers'"):
        read_eval_prompts(path, needs_answers=True)
    with pytest.raises(EvalSetError, match="no prompts"):
        read_eval_prompts(write_lines(path, "", "  "), needs_answers=False)
    with pytest.raises(EvalSetError, match="No such file"):
        read_eval_prompts(tmp_path / "missing.jsonl", needs_answers=False)
