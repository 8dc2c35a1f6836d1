"""Verifier rewards: the final number against the label, and the answer's code against the label's
unit tests in the sandbox."""

from __future__ import annotations

import asyncio

import pytest

from learner.sample import Sample
from learner.verifiers import answer_code, exact_math_answer, final_number, unit_tests_pass


def scored(reward: object, response: str, label: str) -> float:
    sample = Sample(prompt_token_ids=[1], response=response, label=label)
    return asyncio.run(reward(None, sample))  # type: ignore[operator,no-any-return]


@pytest.mark.parametrize(
    ("text", "number"),
    [
        ("The answer is 42.", 42.0),
        ("First 3, then 1,250.5 in total", 1250.5),
        ("So \\boxed{-7} and not 8", -7.0),
        ("x = 2.5e3", 2500.0),
        ("no digits here", None),
    ],
)
def test_final_number(text: str, number: float | None) -> None:
    assert final_number(text) == number


def test_exact_math_answer() -> None:
    assert scored(exact_math_answer, "2 + 3 = 5, so the answer is 5", "5") == 1.0
    assert scored(exact_math_answer, "the answer is 5.0", "#### 5") == 1.0
    assert scored(exact_math_answer, "I think 6", "5") == 0.0
    assert scored(exact_math_answer, "I cannot tell", "5") == 0.0


def test_unit_tests_run_the_answers_code_in_the_sandbox() -> None:
    answer = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."
    assert answer_code(answer) == "def add(a, b):\n    return a + b\n"
    assert scored(unit_tests_pass, answer, "assert add(2, 3) == 5") == 1.0
    assert scored(unit_tests_pass, answer, "assert add(2, 3) == 6") == 0.0
    escape = "```python\nimport socket\nsocket.create_connection(('1.1.1.1', 80))\n```"
    assert scored(unit_tests_pass, escape, "") == 0.0  # no network: the code fails there
