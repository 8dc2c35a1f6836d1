"""Per-token advantages against hand computation: REINFORCE++, KL in the reward, distillation,
PPO's GAE and value loss."""

from __future__ import annotations

import pytest
import torch

from learner.algorithms import compute_value_loss, masked_whiten
from learner.algorithms.token_advantages import (
    discounted_returns,
    gae,
    opd_penalty,
    ppo_token_rewards,
    reinforce_plus_plus_returns,
    shaped_advantages,
    whiten_tokens,
)

KL = [torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0.4, 0.0])]
MASKS = [torch.tensor([1.0, 1.0, 0.0]), torch.tensor([1.0, 1.0])]


def test_discounted_returns() -> None:
    returns = discounted_returns(torch.tensor([1.0, 0.0, 2.0]), gamma=0.5)
    assert returns.tolist() == pytest.approx([1.0 + 0.5 * (0.5 * 2.0), 0.5 * 2.0, 2.0])


def test_reinforce_plus_plus_puts_the_score_on_the_last_trained_token() -> None:
    returns = reinforce_plus_plus_returns([1.0, -2.0], KL, MASKS, kl_coef=0.5, gamma=1.0)
    # sample 0: rewards -0.05, -0.1 + 1 (last trained token), 0 (masked): returns 0.85, 0.9, 0
    assert returns[0].tolist() == pytest.approx([0.85, 0.9, 0.0])
    # sample 1: rewards -0.2, 0 - 2: returns -2.2, -2
    assert returns[1].tolist() == pytest.approx([-2.2, -2.0])
    nothing = reinforce_plus_plus_returns([3.0], [torch.zeros(2)], [torch.zeros(2)], kl_coef=0.5, gamma=1.0)
    assert nothing[0].tolist() == [0.0, 0.0]  # a fully masked (removed) sample learns nothing


def test_shaping_per_estimator() -> None:
    baseline = shaped_advantages("reinforce_plus_plus_baseline", [1.0, -2.0], KL, MASKS, kl_coef=0.5, gamma=1.0)
    assert baseline[0].tolist() == pytest.approx([0.95, 0.9, 0.85]) and baseline[1].tolist() == pytest.approx(
        [-2.2, -2.0]
    )
    grpo = shaped_advantages("grpo", [1.0, -2.0], KL, MASKS, kl_coef=0.5, gamma=1.0)
    assert grpo[0].tolist() == [1.0, 1.0, 1.0] and grpo[1].tolist() == [-2.0, -2.0]  # slime's grpo ignores the KL


def test_distillation_subtracts_the_reverse_kl_to_the_teacher() -> None:
    advantages, reverse = opd_penalty(
        [torch.tensor([1.0, 1.0])], [torch.tensor([-1.0, -2.0])], [torch.tensor([-1.5, -1.0])], coef=2.0
    )
    assert reverse[0].tolist() == [0.5, -1.0] and advantages[0].tolist() == [0.0, 3.0]


def test_whitening_runs_over_every_trained_token() -> None:
    values = [torch.tensor([1.0, 2.0, 9.0]), torch.tensor([3.0, 4.0])]
    whitened = torch.cat(whiten_tokens(values, MASKS))
    expected = masked_whiten(torch.tensor([1.0, 2.0, 9.0, 3.0, 4.0]), torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0]))
    torch.testing.assert_close(whitened, expected)
    trained = whitened[torch.tensor([0, 1, 3, 4])]
    assert float(trained.mean()) == pytest.approx(0.0, abs=1e-6) and float(trained.std()) == pytest.approx(
        1.0, abs=1e-4
    )


def test_gae_by_hand() -> None:
    advantages, returns = gae([torch.tensor([0.0, 1.0])], [torch.tensor([0.5, 0.2])], gamma=0.9, lambd=0.8)
    # t=1: delta = 1 + 0.9 * 0 - 0.2 = 0.8; t=0: delta = 0 + 0.9 * 0.2 - 0.5 = -0.32, A = -0.32 + 0.72 * 0.8
    assert advantages[0].tolist() == pytest.approx([0.256, 0.8])
    assert returns[0].tolist() == pytest.approx([0.756, 1.0])


def test_ppo_rewards_put_the_score_on_the_last_token() -> None:
    rewards = ppo_token_rewards([2.0], [torch.tensor([0.1, 0.2])], kl_coef=0.5)
    assert rewards[0].tolist() == pytest.approx([-0.05, 1.9])


def test_the_value_loss_is_slimes_clipped_square() -> None:
    values, old, returns = torch.tensor([1.0, 0.1]), torch.tensor([0.5, 0.0]), torch.tensor([0.0, 1.0])
    loss, clipped = compute_value_loss(values, old, returns, value_clip=0.2)
    # token 0: V moved 0.5 > 0.2, clipped to 0.7: max(0.49, 1.0) = 1.0; token 1: inside the clip: 0.81
    assert loss.tolist() == pytest.approx([1.0, 0.81]) and clipped.tolist() == [1.0, 0.0]
