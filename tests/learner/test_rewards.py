"""Feedback -> reward mapping, reward plugins (per sample and batched), post-processing and normalisation."""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from learner.plugins import HookKind, PluginError, load_plugin
from learner.rewards import (
    FeedbackRewardMapping,
    Normalization,
    RewardError,
    call_reward_post_process,
    feedback_reward,
    normalization_for,
    normalize_group_rewards,
    post_process_rewards,
    score_samples,
)
from learner.sample import Sample, SampleStatus
from storage.records import FeedbackRecord

EXAMPLES = "tests.learner.plugins_examples"


@dataclass
class Args:
    reward_key: str | None = None


def feedback(
    rating: str | None = None, score: float | None = None, corrected_answer: str | None = None
) -> FeedbackRecord:
    """A real feedback record as the gateway stores it (score is always set there; rating wins)."""
    resolved = score if score is not None else (1.0 if rating == "up" else -1.0)
    return FeedbackRecord(
        id="fb-1",
        completion_id="chatcmpl-1",
        tenant_id="t",
        choice_index=0,
        score=resolved,
        rating=rating,  # type: ignore[arg-type]
        comment=None,
        corrected_answer=corrected_answer,
        created_at=0.0,
    )


def rated_sample(**overrides: Any) -> Sample:
    values: dict[str, Any] = {
        "prompt_token_ids": [1, 2, 3],
        "response_token_ids": [4, 5],
        "group_index": 9,
        "index": 0,
        "prompt": [{"role": "user", "content": "2+2?"}],
        "response": "5",
        "rollout_log_probs": [-0.1, -0.2],
        "weight_versions": ["v1"],
        "status": SampleStatus.COMPLETED,
        "user_id": "u1",
        "session_id": "s1",
        "completion_id": "chatcmpl-1",
    }
    values.update(overrides)
    return Sample(**values)


# feedback mapping


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        (feedback(rating="up"), 1.0),
        (feedback(rating="down"), -1.0),
        (feedback(score=0.3), 0.3),
        (feedback(score=-1.0), -1.0),
    ],
)
def test_builtin_mapping(record: FeedbackRecord, expected: float) -> None:
    assert feedback_reward(record) == expected


def test_rating_mapping_is_configurable_and_wins_over_the_stored_score() -> None:
    mapping = FeedbackRewardMapping(up=1.0, down=0.0)
    assert feedback_reward(feedback(rating="down"), mapping) == 0.0  # the record's score is -1.0
    assert feedback_reward(feedback(score=-0.5), mapping) == -0.5  # scores are used as is


@dataclass
class PlainFeedback:
    rating: Any = None
    score: Any = None
    corrected_answer: str | None = None


@pytest.mark.parametrize(
    ("record", "message"),
    [
        (PlainFeedback(), "neither a rating nor a score"),
        (PlainFeedback(rating="meh"), "unknown rating 'meh'"),
        (PlainFeedback(score=1.5), "score must be a number in \\[-1, 1\\], got 1.5"),
        (PlainFeedback(score=math.nan), "score must be a number in \\[-1, 1\\]"),
        (PlainFeedback(score=True), "score must be a number"),
    ],
)
def test_unusable_feedback_is_refused(record: PlainFeedback, message: str) -> None:
    with pytest.raises(RewardError, match=message):
        feedback_reward(record)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"up": math.inf}, "'up' must be a finite number"),
        ({"down": True}, "'down' must be a finite number"),
        ({"up": -1.0, "down": 1.0}, "'up' \\(-1.0\\) must exceed 'down' \\(1.0\\)"),
    ],
)
def test_mapping_is_validated(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(RewardError, match=message):
        FeedbackRewardMapping(**kwargs)


# reward plugins

IN_FLIGHT = {"now": 0, "peak": 0}


async def tracking_reward(args: Any, sample: Sample) -> float:
    IN_FLIGHT["now"] += 1
    IN_FLIGHT["peak"] = max(IN_FLIGHT["peak"], IN_FLIGHT["now"])
    await asyncio.sleep(0.01)
    IN_FLIGHT["now"] -= 1
    return float(sample.index or 0)


def unscored(n: int) -> list[Sample]:
    return [Sample(prompt_token_ids=[1], response_token_ids=[2] * (i + 1), index=i) for i in range(n)]


@pytest.mark.parametrize("bound", [1, 3])
async def test_per_sample_rewards_run_concurrently_within_the_bound(bound: int) -> None:
    IN_FLIGHT.update(now=0, peak=0)
    plugin = load_plugin(f"{__name__}:tracking_reward", HookKind.REWARD)
    samples = unscored(7)
    rewards = await score_samples(plugin, Args(), samples, max_concurrency=bound)
    assert rewards == [float(i) for i in range(7)]
    assert [s.reward for s in samples] == rewards
    assert IN_FLIGHT["peak"] == bound


async def test_only_missing_rewards_are_scored_by_default() -> None:
    plugin = load_plugin(f"{EXAMPLES}:reward_length", HookKind.REWARD)
    samples = unscored(3)
    samples[1].reward = -1.0  # e.g. from feedback
    assert await score_samples(plugin, Args(), samples) == [1.0, 3.0]
    assert [s.reward for s in samples] == [1.0, -1.0, 3.0]
    assert await score_samples(plugin, Args(), samples, only_missing=False) == [1.0, 2.0, 3.0]
    assert await score_samples(plugin, Args(), samples) == []


async def test_batched_rewards_come_from_one_call() -> None:
    plugin = load_plugin(f"{EXAMPLES}:batched_reward", HookKind.BATCHED_REWARD)
    samples = unscored(3)
    assert await score_samples(plugin, Args(), samples) == [0.25, 1.25, 2.25]
    assert [s.reward for s in samples] == [0.25, 1.25, 2.25]


async def test_dict_rewards_are_kept_and_read_by_key() -> None:
    plugin = load_plugin(f"{EXAMPLES}:reward_dict", HookKind.REWARD)
    samples = unscored(2)
    await score_samples(plugin, Args(), samples)
    assert [s.reward_value("length") for s in samples] == [1.0, 2.0]
    raw, _ = post_process_rewards(Args(), samples, reward_key="length", normalization=Normalization.NONE)
    assert raw == [1.0, 2.0]


async def test_score_samples_refuses_other_kinds_and_bad_bounds() -> None:
    not_a_reward = load_plugin(f"{EXAMPLES}:post_process_list", HookKind.REWARD_POST_PROCESS)
    with pytest.raises(PluginError, match="is not a reward plugin"):
        await score_samples(not_a_reward, Args(), unscored(1))
    reward = load_plugin(f"{EXAMPLES}:reward_length", HookKind.REWARD)
    with pytest.raises(ValueError, match="max_concurrency must be at least 1"):
        await score_samples(reward, Args(), unscored(1), max_concurrency=0)


# normalisation


def test_group_normalisation_by_hand() -> None:
    [mean_std] = normalize_group_rewards([[1.0, 0.0, 0.0, 1.0]], Normalization.MEAN_STD)
    std = math.sqrt(1 / 3)  # unbiased: sum of squares 1.0 over n - 1 = 3
    assert mean_std == pytest.approx([c / (std + 1e-6) for c in (0.5, -0.5, -0.5, 0.5)], rel=1e-12)
    assert normalize_group_rewards([[1.0, 0.0, 2.0]], Normalization.MEAN) == [[0.0, -1.0, 1.0]]
    assert normalize_group_rewards([[1.0, 0.0]], Normalization.NONE) == [[1.0, 0.0]]


def test_group_normalisation_matches_slimes_torch_formula() -> None:
    rng = random.Random(0)
    groups = [[rng.uniform(-1, 1) for _ in range(4)] for _ in range(5)]
    rewards = torch.tensor(groups, dtype=torch.float64)
    centred = rewards - rewards.mean(dim=-1, keepdim=True)
    expected = centred / (centred.std(dim=-1, keepdim=True) + 1e-6)
    ours = torch.tensor(normalize_group_rewards(groups, Normalization.MEAN_STD), dtype=torch.float64)
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)


def test_constant_and_single_groups_become_zero_without_nan() -> None:
    assert normalize_group_rewards([[0.7, 0.7, 0.7], [0.3], []], Normalization.MEAN_STD) == [[0.0, 0.0, 0.0], [0.0], []]


def test_post_process_groups_by_group_index_in_any_order() -> None:
    samples = [
        Sample(group_index=1, reward=1.0),
        Sample(group_index=2, reward=5.0),
        Sample(group_index=1, reward=3.0),
        Sample(group_index=None, reward=7.0),
        Sample(group_index=2, reward=1.0),
        Sample(group_index=None, reward=9.0),
    ]
    raw, rewards = post_process_rewards(Args(), samples, normalization=Normalization.MEAN)
    assert raw == [1.0, 5.0, 3.0, 7.0, 1.0, 9.0]
    assert rewards == [-1.0, 2.0, 1.0, 0.0, -2.0, 0.0]  # ungrouped samples are groups of one


def test_post_process_needs_rewards() -> None:
    with pytest.raises(RewardError, match="has no reward yet"):
        post_process_rewards(Args(), [Sample(index=3)])


@pytest.mark.parametrize(
    ("estimator", "switches", "expected"),
    [
        ("grpo", {}, Normalization.MEAN_STD),
        ("gspo", {}, Normalization.MEAN_STD),
        ("cispo", {"std_normalization": False}, Normalization.MEAN),
        ("reinforce_plus_plus_baseline", {}, Normalization.MEAN),
        ("reinforce_plus_plus", {}, Normalization.NONE),
        ("ppo", {}, Normalization.NONE),
        ("grpo", {"rewards_normalization": False}, Normalization.NONE),
    ],
)
def test_normalization_per_estimator_follows_slime(estimator: str, switches: dict[str, bool], expected: str) -> None:
    assert normalization_for(estimator, **switches) is expected


def test_unknown_estimator() -> None:
    with pytest.raises(RewardError, match="unknown advantage estimator 'dpo'"):
        normalization_for("dpo")


# post-processing hook


def scored(*rewards: float) -> list[Sample]:
    return [Sample(group_index=0, index=i, reward=r) for i, r in enumerate(rewards)]


@pytest.mark.parametrize(
    ("name", "raw", "processed"),
    [
        ("post_process_list", [1.0, 2.0], [2.0, 4.0]),
        ("post_process_in_place", [1.0, 2.0], [0.0, 1.0]),
        ("post_process_slime", [1.0, 2.0], [2.0, 3.0]),
    ],
)
def test_each_post_process_form(name: str, raw: list[float], processed: list[float]) -> None:
    plugin = load_plugin(f"{EXAMPLES}:{name}", HookKind.REWARD_POST_PROCESS)
    assert call_reward_post_process(plugin, Args(), scored(1.0, 2.0)) == (raw, processed)


def test_a_post_process_hook_replaces_normalisation() -> None:
    plugin = load_plugin(f"{EXAMPLES}:post_process_list", HookKind.REWARD_POST_PROCESS)
    result = post_process_rewards(Args(), scored(1.0, 2.0), normalization=Normalization.MEAN_STD, plugin=plugin)
    assert result.raw_rewards == [1.0, 2.0] and result.rewards == [2.0, 4.0]


def test_post_process_refuses_other_kinds() -> None:
    plugin = load_plugin(f"{EXAMPLES}:filter_legacy_bool", HookKind.DYNAMIC_FILTER)
    with pytest.raises(PluginError, match="is not a reward post-processing plugin"):
        call_reward_post_process(plugin, Args(), scored(1.0))
