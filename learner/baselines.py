"""Baselines for learning from feedback alone: what a rating is compared with.

A logged answer rated alone has no group to be normalised against, so its advantage is its reward
minus what was expected anyway: the running mean of the ratings so far. Users rate differently (one
rates everything up, another is hard to please), so the default is per user: a user's own mean,
shrunk towards everyone's mean by ``prior_strength`` pseudo-ratings, so a user's first ratings are
compared with the population and their own habit takes over as their ratings accumulate.

    baseline(user) = (sum of the user's rewards + k * global mean) / (count of the user's rewards + k)

With ``kind="global"`` every answer is compared with everyone's mean.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Literal

import torch

from learner.algorithms import feedback_advantages, group_mean_std
from learner.rewards import FeedbackRewardMapping, feedback_reward
from learner.sample import Sample

__all__ = ["BaselineKind", "RewardHistory", "assign_feedback_rewards", "feedback_baseline_advantages"]

BaselineKind = Literal["user", "global"]


@dataclass(slots=True)
class RewardHistory:
    """Sums and counts of rewards, overall and per user (None: requests without a user)."""

    total: float = 0.0
    count: int = 0
    by_user: dict[str | None, list[float]] = field(default_factory=lambda: defaultdict(lambda: [0.0, 0]))

    @classmethod
    def of(cls, rewards: Iterable[tuple[str | None, float]]) -> RewardHistory:
        history = cls()
        for user_id, reward in rewards:
            history.add(user_id, reward)
        return history

    def add(self, user_id: str | None, reward: float) -> None:
        self.total += reward
        self.count += 1
        entry = self.by_user[user_id]
        entry[0] += reward
        entry[1] += 1

    @property
    def mean(self) -> float:
        """Everyone's mean reward; 0 (neutral) before any rating."""
        return self.total / self.count if self.count else 0.0

    def baseline(self, user_id: str | None, kind: BaselineKind = "user", prior_strength: float = 4.0) -> float:
        """What an answer to ``user_id`` was expected to score (see the module docstring)."""
        if kind == "global" or user_id is None:
            return self.mean
        user_sum, user_count = self.by_user.get(user_id, (0.0, 0))
        return (user_sum + prior_strength * self.mean) / (user_count + prior_strength)


def assign_feedback_rewards(samples: Sequence[Sample], mapping: FeedbackRewardMapping) -> list[float]:
    """Set each feedback sample's reward from its rating (or score) with the built-in mapping."""
    rewards = []
    for sample in samples:
        sample.reward = feedback_reward(SimpleNamespace(**sample.metadata["feedback"]), mapping)
        rewards.append(sample.reward)
    return rewards


def feedback_baseline_advantages(samples: Sequence[Sample], baselines: Sequence[float] | float) -> list[float]:
    """Reward minus the group mean where several rated answers share a prompt, else minus the baseline.

    ``baselines``: one per sample (``RewardHistory.baseline`` of its user), or one for all.
    """
    rewards = torch.tensor([s.reward_value() for s in samples], dtype=torch.float64)
    fallback = torch.as_tensor(baselines, dtype=torch.float64).expand_as(rewards)
    # A sample without a group is a group of its own (negative ids never collide with real ones).
    groups = torch.tensor([-1 - i if s.group_index is None else s.group_index for i, s in enumerate(samples)])
    group_mean, _ = group_mean_std(rewards, groups)
    _, inverse, counts = torch.unique(groups, return_inverse=True, return_counts=True)
    return feedback_advantages(rewards, torch.where(counts[inverse] > 1, group_mean, fallback)).tolist()
