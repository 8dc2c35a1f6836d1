"""The torch training backend: log-probs of packed micro-batches and one GRPO/PPO optimizer step.

Works on any causal LM from transformers (CPU or GPU). Losses come from ``learner.algorithms`` (the
Megatron backend shares them), micro-batches from ``learner.batching``. One ``train_step`` is one
optimizer step over all the given samples; micro-batches only bound memory: every micro-batch loss is
reduced with the whole step's sample and token counts, so the accumulated gradient equals the one big
batch's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from learner.batching import PackedMicroBatch, collate_micro_batch, pack_samples
from learner.sample import Sample
from learner.trainers.critic import ValueHead, forward_logits_and_values, response_values
from learner.trainers.row_forward import forward_rows
from learner.trainers.step_loss import (
    StepTotals,
    all_finite,
    compute_advantages,
    micro_batch_loss,
    prepare_step,
    step_metrics,
    token_advantages,
    token_log_probs,
    token_log_probs_and_entropy,
)
from learner.trainers.train_config import AdvantageEstimator, TrainConfig, TrainingDiverged

__all__ = [
    "AdvantageEstimator",
    "TrainConfig",
    "TrainingDiverged",
    "compute_advantages",
    "compute_log_probs",
    "compute_log_probs_and_entropy",
    "forward_logits",
    "refuse_if_not_finite",
    "response_log_probs",
    "response_scores",
    "train_step",
]


# log-probs


def forward_logits(model: nn.Module, batch: PackedMicroBatch) -> Tensor:
    """``[T, V]`` logits of the packed row, each sample attending only to itself.

    The samples go in as one right-padded ``[B, L]`` batch under the model's own causal mask: one
    forward for the micro-batch, and SDPA keeps its fused causal kernel (a packed row would need a
    ``[T, T]`` block mask, which rules the flash kernel out).
    """
    rows, output = forward_rows(model, batch)
    return rows.packed(output.logits)


def compute_log_probs(model: nn.Module, batch: PackedMicroBatch) -> Tensor:
    """``[T]`` float32: ``log p(input_ids[t] | the sample's tokens before t)``, 0 at each sample's first token.

    Aligned with ``batch.loss_mask``, so the response tokens are where the mask is set.
    """
    return token_log_probs(forward_logits(model, batch), batch)


def compute_log_probs_and_entropy(model: nn.Module, batch: PackedMicroBatch) -> tuple[Tensor, Tensor]:
    """``compute_log_probs`` and the ``[T]`` entropy of the distribution each token was drawn from."""
    return token_log_probs_and_entropy(forward_logits(model, batch), batch)


@torch.no_grad()
def response_log_probs(model: nn.Module, samples: Sequence[Sample], max_tokens_per_micro_batch: int) -> list[Tensor]:
    """Each sample's ``[response_length]`` log-probs under ``model`` (no gradient), e.g. PPO's old log-probs
    computed once before several optimizer steps on the same samples."""
    return [lp for lp, _ in response_scores(model, samples, max_tokens_per_micro_batch, with_entropy=False)]


@torch.no_grad()
def response_scores(
    model: nn.Module, samples: Sequence[Sample], max_tokens_per_micro_batch: int, *, with_entropy: bool = True
) -> list[tuple[Tensor, Tensor]]:
    """Each sample's ``[response_length]`` log-probs and entropies under ``model`` (zeros without
    ``with_entropy``), no gradient: the drift guard's probe of a policy on its batch."""
    result: list[tuple[Tensor, Tensor] | None] = [None] * len(samples)
    for micro_batch in pack_samples(samples, max_tokens_per_micro_batch):
        batch = collate_micro_batch(samples, micro_batch)
        logits = forward_logits(model, batch)
        if with_entropy:
            log_probs, entropy = token_log_probs_and_entropy(logits, batch)
        else:
            log_probs = token_log_probs(logits, batch)
            entropy = torch.zeros_like(log_probs)
        log_probs, entropy = log_probs.cpu(), entropy.cpu()
        for index, (start, end) in zip(micro_batch.sample_indices, micro_batch.bounds(), strict=True):
            span = slice(start + samples[index].prompt_length, end)
            result[index] = (log_probs[span], entropy[span])
    return [r for r in result if r is not None]


# one step


def refuse_if_not_finite(what: str, number: float, optimizer: torch.optim.Optimizer) -> None:
    """Raise ``TrainingDiverged`` for a non-finite ``number``, dropping the step's gradients."""
    if not math.isfinite(number):
        optimizer.zero_grad(set_to_none=True)  # a later step must not apply these gradients
        raise TrainingDiverged(f"{what} is {number}: step refused, weights left as they were")


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    samples: Sequence[Sample],
    config: TrainConfig,
    *,
    ref_model: nn.Module | None = None,
    old_log_probs: Sequence[Tensor] | None = None,
    advantages: Tensor | None = None,
    critic: ValueHead | None = None,
) -> dict[str, float]:
    """One optimizer step of the policy loss over ``samples`` (token-capped micro-batches, accumulated).

    Args:
        model: the policy, trainable.
        optimizer: over ``model``'s parameters.
        samples: scored samples; removed ones (``remove``) are kept in the denominators but train nothing.
        config: the step's knobs.
        ref_model: frozen reference policy, required when ``config.loss.kl_loss_coef > 0``.
        old_log_probs: per-sample response log-probs before this rollout's first step
            (``response_log_probs``); None: the behaviour log-probs with ``use_rollout_logprobs``, else
            the current ones (on-policy, ratio 1).
        advantages: ``[N]`` per-sample advantages; None: ``compute_advantages`` from the rewards.
        critic: PPO's value head (``learner.trainers.critic``), required with ``ppo``; its parameters
            must be in ``optimizer``.

    Returns:
        slime's ``train/`` metrics (loss, pg_loss, pg_clipfrac, ppo_kl, entropy_loss, kl_loss, tis...,
        grad_norm), ``perf/tokens_per_sec`` and ``rollout/response_length_{mean,max}``.

    Raises:
        TrainingDiverged: a non-finite loss or gradient norm (the optimizer is not stepped), or a
            non-finite weight after the step.
        ValueError: a missing reference model or behaviour log-probs the config needs.
    """
    if (config.advantage_estimator == "ppo") != (critic is not None):
        raise ValueError("a critic goes with advantage_estimator 'ppo', and only with it")
    per_token = None
    if config.token_level:
        per_token = _token_advantages(model, samples, config, ref_model, old_log_probs, advantages, critic)
    inputs = prepare_step(
        samples,
        config,
        has_ref_model=ref_model is not None,
        old_log_probs=old_log_probs,
        advantages=advantages,
        token_advantages=None if per_token is None else per_token.advantages,
        returns=None if per_token is None else per_token.returns,
        old_values=None if per_token is None or critic is None else per_token.values,
    )
    started = time.perf_counter()
    model.train()
    optimizer.zero_grad(set_to_none=True)
    totals = StepTotals()
    for micro_batch in pack_samples(samples, config.max_tokens_per_micro_batch):
        batch = collate_micro_batch(samples, micro_batch)
        ref_log_probs = None
        if ref_model is not None and config.loss.kl_loss_coef != 0:
            with torch.no_grad():
                ref_log_probs = compute_log_probs(ref_model, batch)
        values = None
        if critic is not None:
            logits, values = forward_logits_and_values(model, critic, batch)
        else:
            logits = forward_logits(model, batch)
        loss, parts = micro_batch_loss(
            config, inputs, samples, batch, logits, ref_log_probs=ref_log_probs, values=values
        )
        loss.backward()
        # Every part is reduced over the whole step's counts, so micro-batch values add up to the step's.
        totals.add(loss, parts)
    # Checked once the step's gradients are in (a non-finite micro-batch makes the sum non-finite):
    # reading a loss per micro-batch would stall the device between micro-batches.
    loss_sum, parts_sum = totals.read()
    refuse_if_not_finite("loss", loss_sum, optimizer)

    parameters = [p for p in model.parameters() if p.grad is not None]
    max_norm = config.clip_grad if config.clip_grad is not None else math.inf
    grad_norm = float(torch.nn.utils.clip_grad_norm_(parameters, max_norm))
    refuse_if_not_finite("grad_norm", grad_norm, optimizer)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        # An enormous learning rate can overflow weights from finite gradients.
        if not all_finite(model.parameters()):
            raise TrainingDiverged("a weight became non-finite in the optimizer step")
    extra = {} if per_token is None else per_token.metrics
    return step_metrics(samples, parts_sum, grad_norm, time.perf_counter() - started) | extra


def _token_advantages(
    model: nn.Module,
    samples: Sequence[Sample],
    config: TrainConfig,
    ref_model: nn.Module | None,
    old_log_probs: Sequence[Tensor] | None,
    advantages: Tensor | None,
    critic: ValueHead | None,
) -> _PerToken:
    """``token_advantages`` with the policy's pre-update log-probs (one forward, no gradient, when no
    old log-probs were given), the reference's for KL in the reward, and the critic's values for PPO.

    Raises:
        ValueError: ``kl_coef`` without a reference model.
    """
    if config.kl_coef != 0 and ref_model is None:
        raise ValueError("kl_coef != 0 needs a ref_model")
    cap = config.max_tokens_per_micro_batch
    old = list(old_log_probs) if old_log_probs is not None else response_log_probs(model, samples, cap)
    ref = response_log_probs(ref_model, samples, cap) if ref_model is not None and config.kl_coef != 0 else None
    values = None if critic is None else response_values(model, critic, samples, cap)
    scores = advantages if advantages is not None else compute_advantages(samples, config)
    result = token_advantages(samples, config, scores, old, ref, values)
    return _PerToken(result.advantages, result.returns, values, result.metrics)


@dataclass(frozen=True, slots=True)
class _PerToken:
    advantages: list[Tensor]
    returns: list[Tensor] | None
    values: list[Tensor] | None  # PPO: the critic's before the update
    metrics: dict[str, float]
