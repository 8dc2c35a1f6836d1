"""The capability guard's measures and checks, from text and numbers alone (no model)."""

from __future__ import annotations

import pytest

from learner.evaluation.degeneration import answer_stats, distinct_2, is_echo, is_loop
from learner.evaluation.guard import GuardConfig, failed_checks, run_checks


@pytest.mark.parametrize(
    ("question", "answer", "echo"),
    [
        ("Tell me about people.", "People.", True),  # the collapsed SmolLM2's answer
        ("Why do ships matter?", "Why do ships matter?", True),
        ("Why do ships matter?", "why do ships matter? Why do ships matter?", True),  # opens with the question
        ("What is the capital of France?", "Paris.", False),
        ("What is the capital of France?", "The capital of France is Paris.", False),
        ("Say hi.", "", False),  # empty is counted as empty, not as an echo
    ],
)
def test_an_echo_adds_nothing_to_the_question(question: str, answer: str, echo: bool) -> None:
    assert is_echo(question, answer) is echo


def test_loops_and_distinct_bigrams_are_read_from_tokens() -> None:
    assert is_loop([1, 2, 3, 4] * 3)
    assert not is_loop([1, 2, 3, 4] * 2 + [5])
    assert not is_loop([1, 2])
    assert distinct_2([1, 2, 1, 2, 1]) == pytest.approx(2 / 4)
    assert distinct_2([7]) == 1.0


def test_answer_stats_are_shares_over_all_answers() -> None:
    stats = answer_stats(
        ["Tell me about people.", "Say hi.", "Count."],
        ["People.", " ", "one two"],
        [[5, 6], [9], [1, 2, 3, 4] * 3],
    )
    assert stats == {
        "answers": 3.0,
        "length_mean": pytest.approx((2 + 1 + 12) / 3),
        "empty_rate": pytest.approx(1 / 3),
        "echo_rate": pytest.approx(1 / 3),
        "loop_rate": pytest.approx(1 / 3),
        "distinct_2": pytest.approx((1.0 + 4 / 11) / 2),  # empty answers have no vocabulary to judge
    }
    with pytest.raises(ValueError, match="at least one answer"):
        answer_stats([], [], [])


HEALTHY = {
    "reference_loglik": -2.0,
    "kl_to_root": 0.0,
    "length_mean": 40.0,
    "distinct_2": 0.9,
    "loop_rate": 0.0,
    "echo_rate": 0.0,
    "empty_rate": 0.0,
}


def test_a_candidate_like_the_serving_version_passes_every_check() -> None:
    checks = run_checks(HEALTHY | {"kl_to_root": 0.1}, HEALTHY, GuardConfig())
    assert all(check.passed for check in checks)
    assert failed_checks(checks) is None
    assert {check.name for check in checks} == {
        "reference_loglik",
        "kl_to_root",
        "length_ratio",
        "length_ratio_max",
        "distinct_2",
        "loop_rate",
        "echo_rate",
        "empty_rate",
    }


def test_a_collapsed_candidate_is_held_back_naming_each_failed_check() -> None:
    collapsed = HEALTHY | {"length_mean": 3.0, "echo_rate": 0.5, "kl_to_root": 2.0, "reference_loglik": -2.5}
    reason = failed_checks(run_checks(collapsed, HEALTHY, GuardConfig()))
    assert reason is not None
    assert reason.startswith("held back by the capability guard: ")
    assert "kl_to_root 2.000 (must be <= 0.200)" in reason
    assert "length_ratio 0.075 (must be >= 0.500)" in reason
    assert "echo_rate 0.500 (must be <= 0.100, serving 0.000)" in reason
    assert "reference_loglik -2.500 (must be >= -2.300, serving -2.000)" in reason
    assert "distinct_2" not in reason and "empty_rate" not in reason


def test_bounds_are_relative_to_the_replaced_version() -> None:
    """A model that already echoed is not made worse by a candidate that echoes as often."""
    echoing = HEALTHY | {"echo_rate": 0.4}
    assert failed_checks(run_checks(echoing, echoing, GuardConfig())) is None
    assert "echo_rate" in (failed_checks(run_checks(echoing, HEALTHY, GuardConfig())) or "")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"guard": "maybe"}, "guard must be one of"),
        ({"max_kl": -1.0}, "bounds must be finite and >= 0"),
        ({"max_kl": float("nan")}, "bounds must be finite and >= 0"),
        ({"min_length_ratio": 3.0}, "min_length_ratio must not exceed max_length_ratio"),
        ({"max_tokens": 0}, "max_tokens >= 1"),
    ],
)
def test_a_wrong_guard_setting_fails_at_once(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GuardConfig(**changes)  # type: ignore[arg-type]
