"""`tandem learn` says when the evaluation gate could not compare answers (an empty or unrated eval set),
which is a small deployment's normal state and would otherwise pass unnoticed."""

from __future__ import annotations

import pytest

from tandem.commands.learn import _unchecked_preference


@pytest.mark.parametrize(
    ("reason", "why"),
    [
        ("promoted without evaluation: the eval set is empty", "the eval set is empty"),
        (
            "preference not evaluated: the eval set has no answer with a non-zero reward; capability guard passed (8 checks)",
            "the eval set has no answer with a non-zero reward",
        ),
        (
            "held back by the capability guard: kl_to_root 0.251 (must be <= 0.200); preference not evaluated: the eval set is empty",
            "the eval set is empty",
        ),
    ],
)
def test_an_unchecked_preference_is_said(reason: str, why: str) -> None:
    warning = _unchecked_preference(reason)
    assert warning is not None and f"not checked ({why})" in warning and "TANDEM_EVAL_PROMPTS" in warning


@pytest.mark.parametrize(
    "reason", ["", "passed evaluation: candidate 1.9 >= serving 1.8 - margin 0.05 (loglik_margin on 4 eval items)"]
)
def test_a_checked_preference_says_nothing(reason: str) -> None:
    assert _unchecked_preference(reason) is None
