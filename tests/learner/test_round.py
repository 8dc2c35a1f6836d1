"""The round's pure steps: feedback rewards and feedback-only advantages (the whole round is in tests/e2e)."""

from __future__ import annotations

from pathlib import Path

import pytest

from learner.baselines import RewardHistory, assign_feedback_rewards, feedback_baseline_advantages
from learner.rewards import FeedbackRewardMapping
from learner.round import RoundConfig
from learner.sample import Sample
from learner.training import TrainingRequest


def rated(group: int, rating: str | None, score: float | None = None) -> Sample:
    feedback = {"rating": rating, "score": score, "corrected_answer": None, "comment": None, "revision": 1}
    return Sample(
        prompt_token_ids=[group], response_token_ids=[7, 8], group_index=group, metadata={"feedback": feedback}
    )


def test_rewards_follow_the_builtin_mapping() -> None:
    samples = [rated(0, "up"), rated(1, "down"), rated(2, None, 0.25)]
    assert assign_feedback_rewards(samples, FeedbackRewardMapping()) == [1.0, -1.0, 0.25]
    assert [s.reward for s in samples] == [1.0, -1.0, 0.25]
    assert assign_feedback_rewards([rated(0, "up")], FeedbackRewardMapping(up=2.0, down=0.0)) == [2.0]


def test_advantages_use_real_groups_else_the_baseline() -> None:
    # Group 0 has two rated answers (a real group); groups 1 and 2 were rated alone.
    samples = [rated(0, "up"), rated(0, "down"), rated(1, "up"), rated(2, "down")]
    assign_feedback_rewards(samples, FeedbackRewardMapping())
    assert feedback_baseline_advantages(samples, 0.5) == [1.0, -1.0, 0.5, -1.5]
    lone = Sample(response_token_ids=[1], reward=1.0)  # no group at all: the baseline too
    assert feedback_baseline_advantages([lone], 0.25) == [0.75]


def test_training_request_carries_advantages(tmp_path: Path) -> None:
    samples = (Sample(prompt_token_ids=[1], response_token_ids=[2], reward=1.0),)
    request = TrainingRequest(base_model_dir=tmp_path, out_dir=tmp_path / "out", samples=samples, advantages=(0.5,))
    assert TrainingRequest.from_json(request.to_json()).advantages == (0.5,)
    with pytest.raises(ValueError, match="1 advantages for 2 samples"):
        TrainingRequest(base_model_dir=tmp_path, out_dir=tmp_path, samples=samples * 2, advantages=(0.5,))


def test_round_config_reports_every_problem(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as info:
        RoundConfig(server_url="localhost:8000", admin_key="", database_url="sqlite://", checkpoint_dir=tmp_path)
    assert "server_url" in str(info.value) and "TANDEM_ADMIN_KEY" in str(info.value)


def test_user_baseline_shrinks_a_users_mean_towards_everyones() -> None:
    history = RewardHistory.of([("ann", 1.0), ("ann", 1.0), ("bob", -1.0), ("bob", 0.0), (None, 0.5)])
    assert history.mean == pytest.approx(1.5 / 5)
    # ann: (2 + 4 * 0.3) / (2 + 4) ; bob: (-1 + 4 * 0.3) / (2 + 4); a new user and no user: everyone's mean
    assert history.baseline("ann") == pytest.approx(3.2 / 6)
    assert history.baseline("bob") == pytest.approx(0.2 / 6)
    assert history.baseline("carol") == history.baseline(None) == pytest.approx(0.3)
    assert history.baseline("ann", "global") == pytest.approx(0.3)
    assert history.baseline("ann", prior_strength=0) == pytest.approx(1.0)
    assert RewardHistory().baseline("ann") == 0.0


def test_per_sample_baselines_apply_to_lone_answers_only() -> None:
    samples = [rated(0, "up"), rated(0, "down"), rated(1, "up")]
    assign_feedback_rewards(samples, FeedbackRewardMapping())
    assert feedback_baseline_advantages(samples, [9.0, 9.0, 0.25]) == [1.0, -1.0, 0.75]
