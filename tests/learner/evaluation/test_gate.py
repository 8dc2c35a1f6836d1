"""The promotion rule at its boundaries."""

from __future__ import annotations

import pytest

from learner.evaluation import decide


@pytest.mark.parametrize(
    ("candidate", "serving", "margin", "passed"),
    [
        (1.0, 1.0, 0.0, True),  # as good: promoted
        (1.5, 1.0, 0.0, True),
        (0.75, 1.0, 0.25, True),  # worse by exactly the margin: still promoted
        (0.7499, 1.0, 0.25, False),
        (-2.0, -1.0, 0.5, False),
        (0.999, 1.0, 0.0, False),
    ],
)
def test_promoted_only_when_not_worse_than_serving_by_more_than_the_margin(
    candidate: float, serving: float, margin: float, passed: bool
) -> None:
    assert decide(candidate, serving, margin, method="loglik_margin", n=7).passed is passed


def test_the_reason_names_the_scores_margin_method_and_size() -> None:
    held = decide(0.1, 0.3, 0.05, method="loglik_margin", n=12)
    assert held.reason == (
        "held back by evaluation: candidate 0.1000 < serving 0.3000 - margin 0.05 (loglik_margin on 12 eval items)"
    )
    assert decide(0.3, 0.3, 0.0, method="m:f", n=1).reason.startswith("passed evaluation: candidate 0.3000 >= serving")
