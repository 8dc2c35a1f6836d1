"""slime's loss contracts: shared rollout denominators, the custom-loss batch, slime's log-prob helper."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from learner.batching import collate_micro_batch, pack_samples
from learner.plugins import load_function
from learner.sample import Sample
from learner.slime_args import slime_args
from learner.trainers import TrainConfig, train_step
from learner.trainers.custom_loss import response_spans, slime_loss_batch
from learner.trainers.step_loss import rollout_mask_sums, token_log_probs_and_entropy
from tests.learner.trainers.conftest import load_tiny, random_samples

get_log_probs_and_entropy = load_function("slime.backends.megatron_utils.loss.get_log_probs_and_entropy")


def test_rollout_mask_sums_add_the_trained_tokens_of_a_rollout() -> None:
    samples = [
        Sample(prompt_token_ids=[1], response_token_ids=[2, 3, 4], rollout_id=7),
        Sample(prompt_token_ids=[1], response_token_ids=[2, 3], rollout_id=7, loss_mask=[1, 0]),
        Sample(prompt_token_ids=[1], response_token_ids=[2, 3]),  # a rollout of its own
        Sample(prompt_token_ids=[1], response_token_ids=[5], rollout_id=3, remove_sample=True),  # trains nothing
        Sample(prompt_token_ids=[1], response_token_ids=[6, 6], rollout_id=3),
    ]
    assert rollout_mask_sums(samples).tolist() == [4.0, 4.0, 2.0, 2.0, 2.0]


def test_samples_of_one_rollout_add_up_to_one_mean(base_dir: Path) -> None:
    """On-policy pg per token is -A: a sample's pg_loss is -A * (its trained tokens / its rollout's)."""
    samples = random_samples(4, seed=2)
    advantages = torch.tensor([1.0, 1.0, -0.5, 2.0])

    def pg_loss(batch: list[Sample]) -> float:
        model = load_tiny(base_dir)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return train_step(model, optimizer, batch, TrainConfig(clip_grad=None), advantages=advantages)["pg_loss"]

    assert pg_loss(samples) == pytest.approx(-advantages.mean().item(), abs=1e-6)
    shared = [dataclasses.replace(s, rollout_id=0 if i < 2 else None) for i, s in enumerate(samples)]
    n0, n1 = samples[0].response_length, samples[1].response_length
    expected = (-1.0 * n0 / (n0 + n1) - 1.0 * n1 / (n0 + n1) + 0.5 - 2.0) / 4
    assert pg_loss(shared) == pytest.approx(expected, abs=1e-6)


def test_slimes_log_prob_helper_matches_the_trainer_at_each_samples_temperature(base_dir: Path) -> None:
    samples = random_samples(3, seed=4)
    for sample, temperature in zip(samples, (1.0, 0.7, 1.3), strict=True):
        sample.rollout_temperature = temperature
    [micro] = pack_samples(samples, 4096)
    batch = collate_micro_batch(samples, micro)
    model = load_tiny(base_dir)
    with torch.no_grad():
        logits = model(batch.input_ids.unsqueeze(0), position_ids=batch.position_ids.unsqueeze(0)).logits[0]
        ours, entropy = token_log_probs_and_entropy(logits, batch)
    args = slime_args(sample_temperatures=[s.rollout_temperature for s in samples], rollout_temperature=1.0)
    _, theirs = get_log_probs_and_entropy(
        logits.unsqueeze(0),
        args=args,
        unconcat_tokens=[torch.tensor(s.tokens) for s in samples],
        total_lengths=[s.total_length for s in samples],
        response_lengths=[s.response_length for s in samples],
        with_entropy=True,
    )
    for (start, end), log_probs, entropies in zip(
        response_spans(samples, batch), theirs["log_probs"], theirs["entropy"], strict=True
    ):
        torch.testing.assert_close(log_probs, ours[start:end], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(entropies, entropy[start:end], atol=1e-5, rtol=1e-5)


def test_the_custom_loss_batch_is_slimes_per_sample_layout() -> None:
    samples = [
        Sample(
            prompt_token_ids=[1, 2], response_token_ids=[3, 4, 5], rollout_id=1, teacher_log_probs=[-1.0, -2.0, -3.0]
        ),
        Sample(prompt_token_ids=[6], response_token_ids=[7], rollout_id=1, loss_mask=[0]),
    ]
    [micro] = pack_samples(samples, 4096)
    batch = collate_micro_batch(samples, micro)
    per_token = torch.arange(7, dtype=torch.float32)
    packed = {
        "input_ids": batch.input_ids,
        "loss_mask": batch.loss_mask,
        "advantages": per_token,
        "old_log_probs": -per_token,
        "ref_log_probs": None,
        "rollout_log_probs": None,
        "supervised": torch.zeros(7),
    }
    out = slime_loss_batch(samples, batch, packed, rollout_mask_sums(samples))
    assert out["tokens"].tolist() == [[1, 2, 3, 4, 5, 6, 7]]
    assert [t.tolist() for t in out["unconcat_tokens"]] == [[1, 2, 3, 4, 5], [6, 7]]
    assert out["total_lengths"] == [5, 2] and out["response_lengths"] == [3, 1]
    assert [m.tolist() for m in out["loss_masks"]] == [[1.0, 1.0, 1.0], [0.0]]
    assert [a.tolist() for a in out["advantages"]] == [[2.0, 3.0, 4.0], [6.0]]
    assert [lp.tolist() for lp in out["log_probs"]] == [[-2.0, -3.0, -4.0], [-6.0]]
    assert [t.tolist() for t in out["teacher_log_probs"]] == [[-1.0, -2.0, -3.0], [0.0]]
    assert out["rollout_mask_sums"].tolist() == [3.0, 3.0]
    assert out["ref_log_probs"] is None and out["values"] is None and out["returns"] is None
