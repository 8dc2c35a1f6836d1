"""Per-token advantages in a training step: REINFORCE++ with KL in the reward, distillation, a custom
advantage function, PPO with a critic; each checked against a computation by hand on the tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from learner.algorithms import PolicyLossConfig
from learner.plugins import PluginError
from learner.sample import Sample
from learner.trainers import TrainConfig, response_log_probs, train_step
from learner.trainers.critic import ValueHead
from tests.learner.trainers.conftest import load_tiny, random_samples

EXAMPLES = "tests.learner.plugins_examples"


def nudged(base_dir: Path, seed: int = 0) -> PreTrainedModel:
    """The tiny model with its weights moved a little, so it differs from the reference."""
    model = load_tiny(base_dir)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.02)
    return model


def step(model: PreTrainedModel, samples: list[Sample], config: TrainConfig, **kwargs: object) -> dict[str, float]:
    return train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), samples, config, **kwargs)  # type: ignore[arg-type]


def on_policy_pg_loss(advantages: list[torch.Tensor]) -> float:
    """pg per token is -A on-policy (ratio 1): the mean over samples of each sample's token mean."""
    return sum(float(-a.mean()) for a in advantages) / len(advantages)


def test_reinforce_plus_plus_with_kl_in_the_reward_by_hand(base_dir: Path) -> None:
    samples = random_samples(4, seed=7)
    policy, ref = nudged(base_dir), load_tiny(base_dir)
    old, ref_lp = response_log_probs(policy, samples, 4096), response_log_probs(ref, samples, 4096)
    kl_coef, gamma = 0.1, 0.9
    by_hand = []
    for sample, o, r in zip(samples, old, ref_lp, strict=True):
        rewards = [-kl_coef * float(o[t] - r[t]) for t in range(sample.response_length)]
        rewards[-1] += sample.reward_value()  # REINFORCE++: the raw reward, no baseline
        returns, running = [], 0.0
        for value in reversed(rewards):
            running = value + gamma * running
            returns.insert(0, running)
        by_hand.append(torch.tensor(returns))
    flat = torch.cat(by_hand)
    whitened = (flat - flat.mean()) * torch.rsqrt(flat.var() + 1e-8)
    expected = list(whitened.split([s.response_length for s in samples]))
    config = TrainConfig(advantage_estimator="reinforce_plus_plus", kl_coef=kl_coef, gamma=gamma, clip_grad=None)
    metrics = step(policy, samples, config, ref_model=ref)
    assert metrics["pg_loss"] == pytest.approx(on_policy_pg_loss(expected), abs=1e-5)
    kl = torch.cat([o - r for o, r in zip(old, ref_lp, strict=True)])
    assert metrics["kl_in_reward"] == pytest.approx(float(kl.mean()), abs=1e-5)
    with pytest.raises(ValueError, match="kl_coef != 0 needs a ref_model"):
        step(policy, samples, config)


def test_distillation_penalises_the_reverse_kl_where_the_teacher_scored(base_dir: Path) -> None:
    samples = random_samples(4, seed=8)
    policy = nudged(base_dir, seed=1)
    old = response_log_probs(policy, samples, 4096)
    teacher = response_log_probs(load_tiny(base_dir), samples, 4096)
    for sample, t in zip(samples[:3], teacher, strict=False):  # the last one, like a rated answer, has none
        sample.teacher_log_probs = t.tolist()
    config = TrainConfig(use_opd=True, opd_kl_coef=0.5, clip_grad=None)
    metrics = step(policy, samples, config, advantages=torch.zeros(4))
    reverse = [old[i] - teacher[i] for i in range(3)]
    assert metrics["opd_reverse_kl"] == pytest.approx(float(torch.cat(reverse).mean()), abs=1e-5)
    assert metrics["opd_samples"] == 3
    penalties = [-0.5 * r for r in reverse] + [torch.zeros(samples[3].response_length)]
    assert metrics["pg_loss"] == pytest.approx(on_policy_pg_loss(penalties), abs=1e-5)
    for sample in samples:
        sample.teacher_log_probs = None
    with pytest.raises(ValueError, match="use_opd needs teacher_log_probs"):
        step(policy, samples, config)


def test_a_custom_advantage_function_with_slimes_contract(base_dir: Path) -> None:
    samples = random_samples(6, seed=9)
    advantages = torch.tensor([1.0, -1.0, 0.5, 0.0, 2.0, -0.5])
    built_in = step(load_tiny(base_dir), samples, TrainConfig(clip_grad=None), advantages=advantages)
    custom = TrainConfig(clip_grad=None, custom_advantage_path=f"{EXAMPLES}:advantages_broadcast")
    assert step(load_tiny(base_dir), samples, custom, advantages=advantages)["pg_loss"] == pytest.approx(
        built_in["pg_loss"], abs=1e-6
    )
    missing = TrainConfig(custom_advantage_path=f"{EXAMPLES}:advantages_missing")
    with pytest.raises(PluginError, match="did not set rollout_data\\['advantages'\\]"):
        step(load_tiny(base_dir), samples, missing, advantages=advantages)


def test_settings_that_cannot_go_together_are_refused() -> None:
    with pytest.raises(ValueError, match="exclude each other"):
        TrainConfig(kl_coef=0.1, loss=PolicyLossConfig(kl_loss_coef=0.1))
    with pytest.raises(ValueError, match="torch backend only"):
        TrainConfig(advantage_estimator="reinforce_plus_plus", backend="megatron")
    with pytest.raises(ValueError, match="gamma and lambd in \\[0, 1\\]"):
        TrainConfig(gamma=1.5)


def test_ppo_trains_a_critic_by_gae_and_slimes_value_loss(base_dir: Path, tmp_path: Path) -> None:
    samples = random_samples(4, seed=10)
    model = load_tiny(base_dir)
    critic = ValueHead(model.config.hidden_size)
    optimizer = torch.optim.AdamW(
        [{"params": model.parameters(), "lr": 0.0}, {"params": critic.parameters(), "lr": 0.05}]
    )
    scores = torch.tensor([1.0, -1.0, 0.5, 2.0])
    config = TrainConfig(advantage_estimator="ppo", clip_grad=None)
    first = train_step(model, optimizer, samples, config, advantages=scores, critic=critic)
    # A fresh critic values every state 0: with gamma = lambd = 1 and no KL, every token's advantage
    # and return is its sample's score; the value loss is (0 - score)^2.
    assert first["pg_loss"] == pytest.approx(-float(scores.mean()), abs=1e-6)
    assert first["value_loss"] == pytest.approx(float((scores**2).mean()), abs=1e-5)
    assert first["values_mean"] == 0.0 and first["value_clipfrac"] == 0.0
    second = train_step(model, optimizer, samples, config, advantages=scores, critic=critic)
    assert second["values_mean"] != 0.0 and second["value_loss"] < first["value_loss"]  # the critic learns
    critic.save(tmp_path)
    again = ValueHead.load(tmp_path, model.config.hidden_size)
    torch.testing.assert_close(again.linear.weight, critic.linear.weight)
    assert ValueHead.load(tmp_path / "nowhere", 8).linear.weight.abs().sum() == 0  # none saved: a fresh head
    with pytest.raises(ValueError, match="a critic goes with advantage_estimator 'ppo'"):
        train_step(model, optimizer, samples, config, advantages=scores)


def test_a_custom_pg_loss_reducer_with_slimes_contract(base_dir: Path) -> None:
    samples = random_samples(5, seed=11)
    advantages = torch.tensor([1.0, -1.0, 0.5, 0.25, 2.0])
    built_in = step(load_tiny(base_dir), samples, TrainConfig(clip_grad=None), advantages=advantages)
    same = TrainConfig(clip_grad=None, custom_pg_reducer_path=f"{EXAMPLES}:pg_reducer_sample_mean")
    written_out = step(
        load_tiny(base_dir),
        samples,
        same,
        advantages=advantages,
    )
    assert written_out["pg_loss"] == pytest.approx(built_in["pg_loss"], abs=1e-6)
    assert written_out["pg_clipfrac"] == built_in["pg_clipfrac"]  # the metrics keep the built-in reduction
    longest = TrainConfig(clip_grad=None, custom_pg_reducer_path=f"{EXAMPLES}:pg_reducer_longest_only")
    i = max(range(5), key=lambda k: samples[k].response_length)
    expected = -float(advantages[i]) * samples[i].response_length / 5  # on-policy pg is -A per token
    assert step(load_tiny(base_dir), samples, longest, advantages=advantages)["pg_loss"] == pytest.approx(
        expected, abs=1e-5
    )
