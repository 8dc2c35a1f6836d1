"""The canary decision: the beta-binomial probability against sampling, and each way a verdict goes."""

from __future__ import annotations

import numpy as np
import pytest

from server.canary.decision import CanaryRules, judge, p_not_worse
from storage.canaries import Thumbs

RULES = CanaryRules(min_ratings=20, margin=0.05, confidence=0.95, max_duration_s=3600)


@pytest.mark.parametrize(
    ("canary", "control", "margin"),
    [(Thumbs(12, 8), Thumbs(10, 10), 0.0), (Thumbs(3, 30), Thumbs(20, 13), 0.05), (Thumbs(0, 0), Thumbs(40, 2), 0.1)],
)
def test_the_probability_matches_sampling_the_posteriors(canary: Thumbs, control: Thumbs, margin: float) -> None:
    rng = np.random.default_rng(0)
    draws = 400_000
    sampled_canary = rng.beta(canary.up + 1, canary.down + 1, draws)
    sampled_control = rng.beta(control.up + 1, control.down + 1, draws)
    sampled = float(np.mean(sampled_canary > sampled_control - margin))
    assert p_not_worse(canary, control, margin) == pytest.approx(sampled, abs=0.005)


def test_equal_tallies_without_a_margin_are_a_coin_toss_and_the_margin_favours_the_canary() -> None:
    assert p_not_worse(Thumbs(30, 30), Thumbs(30, 30), 0.0) == pytest.approx(0.5, abs=1e-3)
    assert p_not_worse(Thumbs(30, 30), Thumbs(30, 30), 0.1) > 0.75


def test_nothing_is_decided_before_both_sides_have_the_minimum() -> None:
    verdict = judge(Thumbs(19, 0), Thumbs(0, 40), RULES, elapsed_s=10)
    assert verdict.decision is None and verdict.reason.startswith("running: canary 19/19 up vs control 0/40 up")


def test_a_better_canary_is_promoted_and_a_worse_one_rolled_back() -> None:
    better = judge(Thumbs(20, 2), Thumbs(10, 12), RULES, elapsed_s=10)
    assert better.decision == "promoted" and better.reason.startswith("not worse: canary 20/22 up")
    assert better.numbers["canary"] == {"up": 20, "down": 2, "rate": round(21 / 24, 4)}
    assert better.numbers["p_not_worse"] > 0.99
    worse = judge(Thumbs(5, 17), Thumbs(18, 4), RULES, elapsed_s=10)
    assert worse.decision == "rolled_back" and worse.reason.startswith("worse: ")
    assert worse.numbers["p_not_worse"] < 0.01


def test_a_canary_as_good_as_its_control_is_promoted_once_the_margin_is_sure() -> None:
    # Equal rates: with 25 a side the margin is not yet sure, with 800 a side it is.
    assert judge(Thumbs(15, 10), Thumbs(15, 10), RULES, elapsed_s=10).decision is None
    assert judge(Thumbs(480, 320), Thumbs(480, 320), RULES, elapsed_s=10).decision == "promoted"


@pytest.mark.parametrize(("canary", "why"), [(Thumbs(3, 1), "fewer than 20"), (Thumbs(15, 10), "undecided")])
def test_an_undecided_canary_times_out_to_the_safe_side(canary: Thumbs, why: str) -> None:
    verdict = judge(canary, Thumbs(15, 10), RULES, elapsed_s=3600)
    assert verdict.decision == "rolled_back"
    assert verdict.reason.startswith("timed out after 1.0 h, ") and why in verdict.reason
