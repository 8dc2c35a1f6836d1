"""Real groups from feedback (learner.groups): rated answers + rollouts, filter and refill, normalisation."""

from __future__ import annotations

import statistics

import pytest

from learner.batching import training_loss_mask
from learner.groups import GroupSettings, build_groups
from learner.plugins import HookKind, load_plugin
from learner.rollout import RolloutConfig
from learner.sample import Sample
from learner.trainers.step_loss import compute_advantages
from learner.trainers.train_config import TrainConfig
from tests.learner import groups_rollouts

ROLLOUT = RolloutConfig(rollout_path="tests.learner.groups_rollouts:tied_then_varied")


def rated(group: int, reward: float) -> Sample:
    return Sample(prompt_token_ids=[1, group], response_token_ids=[5], group_index=group, reward=reward)


def score(fresh: list[Sample]) -> None:
    for sample in fresh:
        code = sample.response_token_ids[0] - 10
        sample.reward = code / 3 * 2 - 1 if code < 3 else 1.0  # codes 0..3 -> -1, -1/3, 1/3, 1


@pytest.fixture(autouse=True)
def _fresh_calls() -> None:
    groups_rollouts.CALLS.clear()
    groups_rollouts.ROLLOUT_IDS.clear()


def test_groups_are_rated_plus_fresh_normalised_per_group() -> None:
    batch = build_groups(
        [rated(0, 1.0), rated(1, -1.0)],
        GroupSettings(ROLLOUT),
        server_url="http://x",
        admin_key="k",
        score=score,
        args=None,
    )
    # Prompt 0's rollouts tied at 1/3 with its rated answer at 1 (they still vary): no refill needed.
    assert groups_rollouts.CALLS == [2]
    assert batch.metrics["groups"] == 2 and batch.metrics["groups_kept"] == 2 and batch.metrics["rollout_samples"] == 8
    assert len(batch.samples) == 10
    by_group: dict[int, list[float]] = {}
    for sample, advantage in zip(batch.samples, batch.advantages, strict=True):
        by_group.setdefault(sample.group_index or 0, []).append(advantage)
    for advantages in by_group.values():  # GRPO: each group centred and scaled by its own std
        assert statistics.fmean(advantages) == pytest.approx(0.0, abs=1e-9)
        assert statistics.stdev(advantages) == pytest.approx(1.0, abs=1e-4)
    rewards_0 = [s.reward for s in batch.samples if s.group_index == 0]
    assert rewards_0 == pytest.approx([1.0, 1 / 3, 1 / 3, 1 / 3, 1 / 3])


def test_a_group_that_does_not_vary_is_rolled_out_again_then_kept() -> None:
    batch = build_groups(
        [rated(0, 1 / 3), rated(1, -1.0)],
        GroupSettings(ROLLOUT),
        server_url="http://x",
        admin_key="k",
        score=score,
        args=None,
    )
    assert groups_rollouts.CALLS == [2, 1]  # only prompt 0 again; its second rollout varies
    assert batch.metrics["groups_refilled"] == 1 and batch.metrics["groups_kept"] == 2
    assert len(batch.samples) == 10


@pytest.mark.parametrize("verdict", ["scored", "unreadable"])
def test_no_refill_drops_the_flat_group_and_removed_samples_stay_untrained(verdict: str) -> None:
    """slime keeps a removed sample in the batch with a zero loss mask: scored, it counts in its
    group's statistics; without a reward (an unreadable judge verdict) its advantage is 0."""

    def score_and_remove(fresh: list[Sample]) -> None:
        score(fresh)
        fresh[-1].remove_sample = True  # group 1's last rollout, reward 1.0
        if verdict == "unreadable":
            fresh[-1].reward = None

    settings = GroupSettings(ROLLOUT, refill_attempts=0)
    batch = build_groups(
        [rated(0, 1 / 3), rated(1, -1.0)],
        settings,
        server_url="http://x",
        admin_key="k",
        score=score_and_remove,
        args=None,
    )
    assert batch.metrics["groups_kept"] == 1 and batch.metrics["removed_samples"] == 1
    assert batch.metrics["rollout/dynamic_filter/drop_zero_std_0.3"] == 1
    assert {s.group_index for s in batch.samples} == {1} and len(batch.samples) == 5  # rated + 4 rollouts
    [removed] = [s for s in batch.samples if s.remove_sample]
    assert training_loss_mask(removed) == [0]  # in the batch, trained on nothing
    rewards = [-1.0, -1.0, -1 / 3, 1 / 3] + ([1.0] if verdict == "scored" else [])
    mean, std = statistics.fmean(rewards), statistics.stdev(rewards)
    expected = {id(s): (s.reward_value() - mean) / (std + 1e-6) for s in batch.samples if s.reward is not None}
    assert batch.advantages == pytest.approx([expected.get(id(s), 0.0) for s in batch.samples], abs=1e-6)


def test_buffer_filter_and_post_process_hooks_apply() -> None:
    settings = GroupSettings(
        ROLLOUT,
        reward_post_process=load_plugin(
            "tests.learner.plugins_examples:post_process_list", HookKind.REWARD_POST_PROCESS
        ),
        buffer_filter=load_plugin("tests.learner.plugins_examples:buffer_keep_rated", HookKind.BUFFER_FILTER),
    )
    batch = build_groups(
        [rated(0, 1.0), rated(1, -1.0)], settings, server_url="http://x", admin_key="k", score=score, args=None
    )
    assert len(batch.samples) == len(batch.advantages) == 10
    assert batch.advantages == [2 * s.reward_value() for s in batch.samples]  # the hook's, not normalised


@pytest.mark.parametrize(("estimator", "normalize"), [("reinforce_plus_plus_baseline", False), ("grpo", True)])
def test_whitened_advantages_equal_the_step_losss(estimator: str, normalize: bool) -> None:
    """slime whitens the advantages over every trained token of the batch with --normalize-advantages
    (which REINFORCE++-baseline requires); a round's advantages and the step loss's own must agree."""
    long_rated = [
        Sample(prompt_token_ids=[1, 0], response_token_ids=[5] * 7, group_index=0, reward=1.0),
        Sample(prompt_token_ids=[1, 1], response_token_ids=[5] * 3, group_index=1, reward=-1.0),
    ]
    settings = GroupSettings(ROLLOUT, advantage_estimator=estimator, normalize_advantages=normalize)
    batch = build_groups(long_rated, settings, server_url="http://x", admin_key="k", score=score, args=None)
    config = TrainConfig(advantage_estimator=estimator, normalize_advantages=normalize)  # type: ignore[arg-type]
    assert batch.advantages == pytest.approx(compute_advantages(batch.samples, config).tolist(), abs=1e-6)
    # Whitened over tokens: weighted by each sample's token count, mean 0 and variance 1.
    weights = [s.response_length for s in batch.samples]
    mean = sum(a * w for a, w in zip(batch.advantages, weights, strict=True)) / sum(weights)
    variance = sum(w * (a - mean) ** 2 for a, w in zip(batch.advantages, weights, strict=True)) / (sum(weights) - 1)
    assert mean == pytest.approx(0.0, abs=1e-6) and variance == pytest.approx(1.0, abs=1e-4)


def test_groups_come_back_to_their_prompts_by_group_id_with_the_rollout_id() -> None:
    """A ROLLOUT plugin's groups, reordered and of unequal sizes, join the prompt whose id they carry."""
    settings = GroupSettings(RolloutConfig(rollout_path="tests.learner.groups_rollouts:reversed_groups"))
    batch = build_groups(
        [rated(3, 1.0), rated(7, -1.0)],
        settings,
        server_url="http://x",
        admin_key="k",
        score=score,
        args=None,
        rollout_id=5,
    )
    assert groups_rollouts.ROLLOUT_IDS == [5]
    for group, fresh in ((3, 2), (7, 3)):
        members = [s for s in batch.samples if s.group_index == group]
        assert len(members) == 1 + fresh and {tuple(s.prompt_token_ids) for s in members} == {(1, group)}
