"""learner.reward_model on the tiny model: learns a preference its hidden states show, not shuffled labels."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from learner.reward_model import FittedRewardModel, RewardModelConfig, RewardModelError, fit_reward_model
from learner.sample import Sample
from tests.fixtures.tiny_model import VOCAB_SIZE, tiny_model_path

VOCAB = list(range(3, VOCAB_SIZE))  # no special tokens


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model_path()


@pytest.fixture(scope="module")
def liked(model_dir: Path) -> frozenset[int]:
    """The half of the vocabulary whose token, read alone, the model places on one side of a random direction.

    A random half by token id is not something a linear head over a 64-wide random model can see (held-out
    accuracy 0.55-0.62 over seeds 0-4); users' preferences in a real model are what its states encode.
    """
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        states = lm(input_ids=torch.tensor(VOCAB)[:, None], output_hidden_states=True).hidden_states[-1][:, 0]
    direction = torch.randn(states.shape[1], generator=torch.Generator().manual_seed(1234))
    projection = states @ direction
    return frozenset(t for t, p in zip(VOCAB, projection.tolist(), strict=True) if p > projection.median())


def rated(seed: int, n: int, liked: frozenset[int]) -> tuple[list[Sample], list[float]]:
    """Random-token answers to 60 prompts, each with its own share of liked tokens; +1 when most are liked."""
    rng = random.Random(seed)
    liked_ids, other_ids = sorted(liked), sorted(set(VOCAB) - liked)
    prompts = [[rng.choice(VOCAB) for _ in range(rng.randint(4, 12))] for _ in range(60)]
    samples, rewards = [], []
    for _ in range(n):
        share = rng.random()
        response = [rng.choice(liked_ids if rng.random() < share else other_ids) for _ in range(rng.randint(16, 48))]
        samples.append(Sample(prompt_token_ids=rng.choice(prompts), response_token_ids=response))
        rewards.append(1.0 if sum(t in liked for t in response) > len(response) / 2 else -1.0)
    return samples, rewards


def sign_accuracy(scores: list[float], rewards: list[float]) -> float:
    return sum((s > 0) == (r > 0) for s, r in zip(scores, rewards, strict=True)) / len(rewards)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_learns_a_preference_it_can_see(model_dir: Path, liked: frozenset[int], seed: int) -> None:
    samples, rewards = rated(seed, 300, liked)
    fitted = fit_reward_model(model_dir, samples, rewards, seed=seed, num_threads=1)
    # seeds 0-19: held-out accuracy 0.79-0.88 (chance about 0.5), fresh samples 0.76-0.93
    assert fitted.metrics["cv_accuracy"] > 0.72
    assert fitted.metrics["cv_accuracy_chance"] < 0.6
    assert fitted.trusted and fitted.quality > 0.5
    assert fitted.metrics["n"] == 300 and fitted.metrics["alpha"] in RewardModelConfig().alphas
    fresh, fresh_rewards = rated(1000 + seed, 100, liked)
    assert sign_accuracy(fitted.score(fresh), fresh_rewards) > 0.7


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_shuffled_labels_stay_near_chance_and_untrusted(model_dir: Path, liked: frozenset[int], seed: int) -> None:
    samples, rewards = rated(seed, 300, liked)
    random.Random(seed).shuffle(rewards)
    fitted = fit_reward_model(model_dir, samples, rewards, seed=seed, num_threads=1)
    # seeds 0-19: held-out accuracy 0.44-0.57, rank correlation -0.18..0.04
    assert fitted.metrics["cv_accuracy"] < 0.62
    assert not fitted.trusted


def test_save_load_round_trip_gives_identical_scores(model_dir: Path, liked: frozenset[int], tmp_path: Path) -> None:
    samples, rewards = rated(7, 120, liked)
    fitted = fit_reward_model(model_dir, samples, rewards)
    probe, _ = rated(8, 40, liked)
    scores = fitted.score(probe)
    assert all(-1.0 <= s <= 1.0 for s in scores) and len(set(scores)) > 1
    fitted.save(tmp_path / "rm")
    loaded = FittedRewardModel.load(tmp_path / "rm")
    assert loaded.score(probe) == scores
    assert loaded.metrics == fitted.metrics and loaded.config == fitted.config and loaded.model_dir == model_dir
    with pytest.raises(RewardModelError, match="no readable reward head"):
        FittedRewardModel.load(tmp_path / "nothing-here")


def test_batched_features_equal_one_sample_at_a_time(model_dir: Path, liked: frozenset[int]) -> None:
    samples, rewards = rated(3, 64, liked)
    # small batches force several padded forward passes of mixed lengths
    config = RewardModelConfig(min_samples=10, max_tokens=40, batch_tokens=100)
    fitted = fit_reward_model(model_dir, samples, rewards, config=config)
    no_answer = Sample(prompt_token_ids=[5, 6, 7])
    long_one = Sample(prompt_token_ids=list(range(10, 30)), response_token_ids=list(range(100, 130)))
    # over max_tokens: the last 40 tokens are read, as if the prompt had been shorter
    cut = Sample(prompt_token_ids=list(range(20, 30)), response_token_ids=list(range(100, 130)))
    probe = [*samples[:8], no_answer, long_one]
    together = fitted.score(probe)
    alone = [fitted.score([s])[0] for s in probe]
    assert together == pytest.approx(alone, abs=1e-6)
    assert fitted.score([cut]) == pytest.approx(fitted.score([long_one]), abs=1e-6)


def test_refuses_what_it_cannot_fit(model_dir: Path, liked: frozenset[int]) -> None:
    samples, rewards = rated(4, 40, liked)
    with pytest.raises(RewardModelError, match="at least 32"):
        fit_reward_model(model_dir, samples[:20], rewards[:20])
    with pytest.raises(RewardModelError, match="nothing to tell apart"):
        fit_reward_model(model_dir, samples, [1.0] * len(samples))
    with pytest.raises(RewardModelError, match="40 samples but 39 rewards"):
        fit_reward_model(model_dir, samples, rewards[:-1])
    with pytest.raises(ValueError, match="folds"):
        RewardModelConfig(folds=1)
