"""Advantages against hand-computed values, plus the properties every batch relies on."""

from __future__ import annotations

import pytest
import torch

from learner.algorithms import (
    broadcast_to_tokens,
    feedback_advantages,
    grpo_advantages,
    masked_whiten,
    reinforce_plus_plus_baseline_advantages,
    segment_ids,
)

# Two groups, interleaved and with arbitrary ids:
#   group 7: rewards 1, 2, 3 -> mean 2, deviations -1, 0, 1, unbiased var (1 + 0 + 1) / 2 = 1, std 1
#   group 3: rewards 0, 4    -> mean 2, deviations -2, 2,    unbiased var (4 + 4) / 1 = 8, std 2*sqrt(2)
REWARDS = torch.tensor([1.0, 0.0, 2.0, 3.0, 4.0])
GROUPS = torch.tensor([7, 3, 7, 7, 3])


def test_grpo_hand_computed() -> None:
    expected = torch.tensor(
        [
            -1 / (1 + 1e-6),  # group 7: -1 / (std 1 + eps)
            -2 / (2 * 2**0.5 + 1e-6),  # group 3: -2 / 2.828427 = -0.707107
            0.0,
            1 / (1 + 1e-6),
            2 / (2 * 2**0.5 + 1e-6),
        ]
    )
    torch.testing.assert_close(grpo_advantages(REWARDS, GROUPS), expected)
    torch.testing.assert_close(grpo_advantages(REWARDS, GROUPS)[1], torch.tensor(-0.707107), atol=1e-6, rtol=0)


def test_grpo_without_std_normalization_only_centres() -> None:
    # r - group mean: 1-2, 0-2, 2-2, 3-2, 4-2
    expected = torch.tensor([-1.0, -2.0, 0.0, 1.0, 2.0])
    torch.testing.assert_close(grpo_advantages(REWARDS, GROUPS, std_normalization=False), expected)


def test_grpo_is_zero_mean_per_group() -> None:
    rewards = torch.rand(40, generator=torch.Generator().manual_seed(0))
    groups = torch.arange(40) % 5
    advantages = grpo_advantages(rewards, groups)
    for g in range(5):
        assert abs(float(advantages[groups == g].mean())) < 1e-6
        # unit unbiased std within the group, up to the epsilon
        assert float(advantages[groups == g].std()) == pytest.approx(1.0, abs=1e-4)


def test_grpo_identical_rewards_and_singletons_give_zero_not_nan() -> None:
    rewards = torch.tensor([0.5, 0.5, 0.5, 1.0, -1.0])
    groups = torch.tensor([0, 0, 0, 1, 2])  # group 0 has no variance; groups 1 and 2 have one sample each
    for std_normalization in (True, False):
        advantages = grpo_advantages(rewards, groups, std_normalization=std_normalization)
        assert torch.isfinite(advantages).all()
        torch.testing.assert_close(advantages, torch.zeros(5))


def test_grpo_accepts_integer_rewards_and_refuses_nan() -> None:
    torch.testing.assert_close(
        grpo_advantages(torch.tensor([0, 2]), torch.tensor([0, 0]), std_normalization=False),
        torch.tensor([-1.0, 1.0]),
    )
    with pytest.raises(ValueError, match="finite"):
        grpo_advantages(torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="shape"):
        grpo_advantages(torch.tensor([1.0, 2.0]), torch.tensor([0, 0, 0]))


def test_reinforce_plus_plus_baseline_hand_computed() -> None:
    # group 0: 1, 3 -> mean 2 -> -1, 1; group 1: 0, 2, 4 -> mean 2 -> -2, 0, 2
    # batch of centred values -1, 1, -2, 0, 2: mean 0, unbiased var (1 + 1 + 4 + 0 + 4) / 4 = 2.5
    # A = centred / sqrt(2.5 + 1e-8) = centred * 0.632456
    rewards = torch.tensor([1.0, 3.0, 0.0, 2.0, 4.0])
    groups = torch.tensor([0, 0, 1, 1, 1])
    expected = torch.tensor([-0.632456, 0.632456, -1.264911, 0.0, 1.264911])
    torch.testing.assert_close(reinforce_plus_plus_baseline_advantages(rewards, groups), expected)


def test_reinforce_plus_plus_baseline_weights_by_token_count() -> None:
    # centred -1, 1, -2, 0, 2 with token counts 3, 1, 1, 1, 2 (8 tokens):
    # mean (-3 + 1 - 2 + 0 + 4) / 8 = 0; mean square (3 + 1 + 4 + 0 + 8) / 8 = 2;
    # var 2 * 8 / 7 = 16 / 7; A = centred / sqrt(16 / 7) = centred * 0.661438
    rewards = torch.tensor([1.0, 3.0, 0.0, 2.0, 4.0])
    groups = torch.tensor([0, 0, 1, 1, 1])
    counts = torch.tensor([3, 1, 1, 1, 2])
    expected = torch.tensor([-0.661438, 0.661438, -1.322876, 0.0, 1.322876])
    advantages = reinforce_plus_plus_baseline_advantages(rewards, groups, token_counts=counts)
    torch.testing.assert_close(advantages, expected)
    # the same as whitening the advantages repeated over their tokens (what slime does per token)
    per_token = masked_whiten(torch.tensor([-1.0] * 3 + [1.0, -2.0, 0.0, 2.0, 2.0]), torch.ones(8))
    torch.testing.assert_close(advantages.repeat_interleave(counts), per_token)


def test_masked_whiten_ignores_masked_entries_and_can_keep_the_mean() -> None:
    # selected 1, 3: mean 2, var ((1 + 9) / 2 - 4) * 2 / 1 = 2; whitened (x - 2) / sqrt(2)
    values = torch.tensor([1.0, 100.0, 3.0])
    mask = torch.tensor([1.0, 0.0, 1.0])
    torch.testing.assert_close(masked_whiten(values, mask)[[0, 2]], torch.tensor([-0.707107, 0.707107]))
    torch.testing.assert_close(
        masked_whiten(values, mask, shift_mean=False)[[0, 2]], torch.tensor([2 - 0.707107, 2 + 0.707107])
    )
    with pytest.raises(ValueError, match="selects nothing"):
        masked_whiten(values, torch.zeros(3))


def test_feedback_advantages_subtract_the_baseline() -> None:
    rewards = torch.tensor([1.0, -1.0, 0.5])
    # per-sample baselines (e.g. each user's running mean): 1 - 0.2, -1 - 0.2, 0.5 - (-0.5)
    torch.testing.assert_close(
        feedback_advantages(rewards, torch.tensor([0.2, 0.2, -0.5])), torch.tensor([0.8, -1.2, 1.0])
    )
    # one global baseline
    torch.testing.assert_close(feedback_advantages(rewards, 0.25), torch.tensor([0.75, -1.25, 0.25]))
    with pytest.raises(ValueError, match="baselines"):
        feedback_advantages(rewards, torch.tensor([0.0, 0.0]))


def test_broadcast_to_tokens_zeroes_masked_tokens() -> None:
    advantages = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    expected = torch.tensor([[2.0, 2.0, 0.0], [0.0, -1.0, -1.0]])
    torch.testing.assert_close(broadcast_to_tokens(advantages, mask), expected)
    with pytest.raises(ValueError):
        broadcast_to_tokens(advantages, torch.ones(3, 3))


def test_broadcast_to_tokens_over_a_packed_row() -> None:
    # sample 0 = tokens 0-2 (prompt, response, response), sample 1 = tokens 3-4 (prompt, response)
    advantages = torch.tensor([2.0, -1.0])
    cu_seqlens = torch.tensor([0, 3, 5])
    mask = torch.tensor([0, 1, 1, 0, 1])
    torch.testing.assert_close(
        broadcast_to_tokens(advantages, mask, cu_seqlens), torch.tensor([0.0, 2.0, 2.0, 0.0, -1.0])
    )
    with pytest.raises(ValueError, match="cu_seqlens"):
        broadcast_to_tokens(advantages, mask[:4], cu_seqlens)


@pytest.mark.parametrize("offsets", [[0, 3, 3, 7, 10], [0, 4], [0, 0, 2, 2], [0, 2, 2], [0]])
def test_segment_ids_name_each_tokens_sample_empty_samples_included(offsets: list[int]) -> None:
    cu_seqlens = torch.tensor(offsets, dtype=torch.int32)
    lengths = cu_seqlens.diff().long()
    expected = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    assert torch.equal(segment_ids(cu_seqlens), expected)
