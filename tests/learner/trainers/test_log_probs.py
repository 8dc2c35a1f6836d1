"""Packed log-probs and entropy equal each sample's own forward pass."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedModel

from learner.algorithms import entropy_from_logits
from learner.batching import collate_micro_batch, pack_samples
from learner.sample import Sample
from learner.trainers import compute_log_probs, compute_log_probs_and_entropy, response_log_probs
from tests.learner.trainers.conftest import load_tiny, random_samples


def alone(model: PreTrainedModel, sample: Sample, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Response log-probs and entropies from a plain, unpacked forward pass of one sample."""
    logits = model(input_ids=torch.tensor([sample.tokens])).logits[0].float() / temperature
    predicting = logits[sample.prompt_length - 1 : -1]  # the logits that predict each response token
    log_probs = torch.log_softmax(predicting, -1).gather(-1, torch.tensor(sample.response_token_ids)[:, None])[:, 0]
    return log_probs, entropy_from_logits(predicting)


def test_packed_equals_unpacked_per_sample(model: PreTrainedModel) -> None:
    samples = random_samples(7)
    (micro_batch,) = pack_samples(samples, 4096)
    batch = collate_micro_batch(samples, micro_batch)
    with torch.no_grad():
        log_probs, entropy = compute_log_probs_and_entropy(model, batch)
        assert torch.equal(compute_log_probs(model, batch), log_probs)
        for index, (start, end) in zip(micro_batch.sample_indices, micro_batch.bounds(), strict=True):
            sample = samples[index]
            expected_lp, expected_h = alone(model, sample)
            response = slice(start + sample.prompt_length, end)
            torch.testing.assert_close(log_probs[response], expected_lp, atol=1e-5, rtol=0)
            torch.testing.assert_close(entropy[response], expected_h, atol=1e-5, rtol=0)
            assert log_probs[start] == 0 and entropy[start] == 0  # a sample's first token has no prediction
    assert log_probs.shape == batch.loss_mask.shape


def test_eager_attention_gives_the_sdpa_result(base_dir: Path, model: PreTrainedModel) -> None:
    samples = random_samples(5, seed=1)
    batch = collate_micro_batch(samples, pack_samples(samples, 4096)[0])
    with torch.no_grad():
        eager = compute_log_probs(load_tiny(base_dir, "eager"), batch)
        torch.testing.assert_close(eager, compute_log_probs(model, batch), atol=1e-5, rtol=0)


def test_response_log_probs_are_per_sample_in_input_order(model: PreTrainedModel) -> None:
    samples = random_samples(6, seed=2)
    per_sample = response_log_probs(model, samples, max_tokens_per_micro_batch=20)  # several micro-batches
    for sample, log_probs in zip(samples, per_sample, strict=True):
        torch.testing.assert_close(log_probs, alone(model, sample)[0].detach(), atol=1e-5, rtol=0)


def test_logits_are_divided_by_each_samples_rollout_temperature(model: PreTrainedModel) -> None:
    """slime scores logits / rollout_temperature; a batch mixing temperatures scores each sample at its own."""
    samples = random_samples(3, seed=3)
    for sample, temperature in zip(samples, (0.7, 1.0, 1.3), strict=True):
        sample.rollout_temperature = temperature
    (micro_batch,) = pack_samples(samples, 4096)
    batch = collate_micro_batch(samples, micro_batch)
    with torch.no_grad():
        log_probs, entropy = compute_log_probs_and_entropy(model, batch)
        for index, (start, end) in zip(micro_batch.sample_indices, micro_batch.bounds(), strict=True):
            sample = samples[index]
            expected_lp, expected_h = alone(model, sample, sample.rollout_temperature)
            response = slice(start + sample.prompt_length, end)
            torch.testing.assert_close(log_probs[response], expected_lp, atol=1e-5, rtol=0)
            torch.testing.assert_close(entropy[response], expected_h, atol=1e-5, rtol=0)
            if sample.rollout_temperature != 1.0:  # the test can tell the two apart
                assert (log_probs[response] - alone(model, sample)[0]).abs().max() > 1e-2
    plain = [Sample(prompt_token_ids=[1], response_token_ids=[2])]
    assert collate_micro_batch(plain, pack_samples(plain, 4096)[0]).temperature is None  # no [T, V] copy
