"""The torch training backend: log-probs of packed micro-batches and one GRPO/PPO optimizer step.

Works on any causal LM from transformers (CPU or GPU). Losses come from ``learner.algorithms`` (the
Megatron backend shares them), micro-batches from ``learner.batching``. One ``train_step`` is one
optimizer step over all the given samples; micro-batches only bound memory: every micro-batch loss is
reduced with the whole step's sample and token counts, so the accumulated gradient equals the one big
batch's.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
from torch import Tensor, nn

from learner.algorithms import (
    PolicyLossConfig,
    broadcast_to_tokens,
    entropy_from_logits,
    grpo_advantages,
    policy_loss_function,
    reduce_masked,
    reinforce_plus_plus_baseline_advantages,
)
from learner.batching import PackedMicroBatch, block_causal_mask, collate_micro_batch, pack_samples, training_loss_mask
from learner.plugins import HookKind, Plugin, load_plugin
from learner.sample import Sample

__all__ = [
    "AdvantageEstimator",
    "TrainConfig",
    "TrainingDiverged",
    "compute_advantages",
    "compute_log_probs",
    "compute_log_probs_and_entropy",
    "response_log_probs",
    "train_step",
]

AdvantageEstimator = Literal["grpo", "reinforce_plus_plus_baseline"]


class TrainingDiverged(RuntimeError):
    """A non-finite loss, gradient or weight: the step is refused and the model must not be exported."""


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """One training step's knobs (slime's flag names where they exist).

    ``use_rollout_logprobs``: the PPO ratio's old log-probs are the behaviour log-probs logged at
    serving time instead of the trainer's own (slime's ``--use-rollout-logprobs``; not with TIS).
    """

    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    advantage_estimator: AdvantageEstimator = "grpo"
    grpo_std_normalization: bool = True
    reward_key: str | None = None
    max_tokens_per_micro_batch: int = 4096
    clip_grad: float | None = 1.0  # slime's --clip-grad; None: no clipping (the norm is still reported)
    use_rollout_logprobs: bool = False
    custom_loss_path: str | None = None  # slime's --custom-loss-function-path (see ``custom_loss``)

    def __post_init__(self) -> None:
        errors = []
        if self.advantage_estimator not in get_args(AdvantageEstimator):
            errors.append(f"advantage_estimator must be one of {get_args(AdvantageEstimator)}")
        if self.max_tokens_per_micro_batch < 1:
            errors.append(f"max_tokens_per_micro_batch must be >= 1, got {self.max_tokens_per_micro_batch}")
        if self.clip_grad is not None and not self.clip_grad > 0:
            errors.append(f"clip_grad must be > 0 or None, got {self.clip_grad}")
        if self.use_rollout_logprobs and self.loss.use_tis:
            errors.append("use_rollout_logprobs and use_tis exclude each other (TIS corrects the trainer's log-probs)")
        if errors:
            raise ValueError("invalid train config: " + "; ".join(errors))
        if self.custom_loss_path is not None:
            load_plugin(self.custom_loss_path, HookKind.CUSTOM_LOSS)  # a wrong path fails now, not in the child


# log-probs


def _forward_logits(model: nn.Module, batch: PackedMicroBatch) -> Tensor:
    """``[T, V]`` logits of the packed row, each sample attending only to itself."""
    device = next(model.parameters()).device
    ids, positions = batch.input_ids.to(device), batch.position_ids.to(device)
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        # SDPA takes a boolean 4-D mask as is: one forward for the whole row.
        mask = block_causal_mask(batch.cu_seqlens.to(device))[None, None]
        return model(input_ids=ids[None], position_ids=positions[None], attention_mask=mask).logits[0]
    # Eager attention adds the mask to the scores (a bool mask would be wrong): one sample at a time.
    bounds = batch.cu_seqlens.tolist()
    return torch.cat(
        [
            model(input_ids=ids[None, a:b], position_ids=positions[None, a:b]).logits[0]
            for a, b in itertools.pairwise(bounds)
        ]
    )


def _shifted(values: Tensor, cu_seqlens: Tensor) -> Tensor:
    """Move per-position values one step right (the logits at t - 1 predict token t); 0 at sample starts."""
    out = torch.cat([values.new_zeros(1), values[:-1]])
    starts = cu_seqlens[:-1].long().to(values.device)
    return out.index_fill(0, starts, 0.0)


def _token_log_probs(logits: Tensor, batch: PackedMicroBatch) -> Tensor:
    targets = batch.input_ids.to(logits.device).roll(-1)  # position t scores token t + 1
    log_probs = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[:, None])[:, 0]
    return _shifted(log_probs, batch.cu_seqlens)


def compute_log_probs(model: nn.Module, batch: PackedMicroBatch) -> Tensor:
    """``[T]`` float32: ``log p(input_ids[t] | the sample's tokens before t)``, 0 at each sample's first token.

    Aligned with ``batch.loss_mask``, so the response tokens are where the mask is set.
    """
    return _token_log_probs(_forward_logits(model, batch), batch)


def compute_log_probs_and_entropy(model: nn.Module, batch: PackedMicroBatch) -> tuple[Tensor, Tensor]:
    """``compute_log_probs`` and the ``[T]`` entropy of the distribution each token was drawn from."""
    logits = _forward_logits(model, batch)
    return _token_log_probs(logits, batch), _shifted(entropy_from_logits(logits), batch.cu_seqlens)


@torch.no_grad()
def response_log_probs(model: nn.Module, samples: Sequence[Sample], max_tokens_per_micro_batch: int) -> list[Tensor]:
    """Each sample's ``[response_length]`` log-probs under ``model`` (no gradient), e.g. PPO's old log-probs
    computed once before several optimizer steps on the same samples."""
    result: list[Tensor | None] = [None] * len(samples)
    for micro_batch in pack_samples(samples, max_tokens_per_micro_batch):
        log_probs = compute_log_probs(model, collate_micro_batch(samples, micro_batch)).cpu()
        for index, (start, end) in zip(micro_batch.sample_indices, micro_batch.bounds(), strict=True):
            result[index] = log_probs[start + samples[index].prompt_length : end]
    return [r for r in result if r is not None]


# one step


def compute_advantages(samples: Sequence[Sample], config: TrainConfig) -> Tensor:
    """``[N]`` per-sample advantages from the rewards, grouped by ``group_index`` (None: a group of its own)."""
    rewards = torch.tensor([s.reward_value(config.reward_key) for s in samples], dtype=torch.float32)
    groups = torch.tensor([-1 - i if s.group_index is None else s.group_index for i, s in enumerate(samples)])
    if config.advantage_estimator == "grpo":
        return grpo_advantages(rewards, groups, std_normalization=config.grpo_std_normalization)
    counts = torch.tensor([sum(training_loss_mask(s)) for s in samples], dtype=torch.float32)
    return reinforce_plus_plus_baseline_advantages(rewards, groups, token_counts=counts)


def _packed_response_values(
    samples: Sequence[Sample],
    batch: PackedMicroBatch,
    values: Sequence[Tensor | Sequence[float]] | None,
    device: torch.device,
) -> Tensor | None:
    """Per-sample response values (``values[i]`` for ``samples[i]``) laid out on the packed row, 0 on prompts."""
    if values is None:
        return None
    parts = []
    for index in batch.sample_indices:
        sample = samples[index]
        parts += [torch.zeros(sample.prompt_length), torch.as_tensor(values[index], dtype=torch.float32)]
    return torch.cat(parts).to(device)


def call_custom_loss(
    plugin: Plugin,
    config: TrainConfig,
    batch: dict[str, Tensor | None],
    logits: Tensor,
    sum_of_sample_mean: Callable[[Tensor], Tensor],
) -> tuple[Tensor, dict[str, float]]:
    """A CUSTOM_LOSS plugin's ``(loss, metrics)`` for one packed micro-batch, checked.

    slime's contract ``(args, batch, logits, sum_of_sample_mean)``; here ``args`` is the ``TrainConfig``,
    ``batch`` holds the packed row's per-token tensors (``input_ids``, ``position_ids``, ``cu_seqlens``,
    ``loss_mask``, ``log_probs`` with gradient, ``old_log_probs``, ``advantages``, and
    ``rollout_log_probs`` / ``ref_log_probs`` or None), ``logits`` is ``[T, V]``, and
    ``sum_of_sample_mean`` reduces per-token values exactly as the built-in loss does over the whole
    step (so micro-batch losses add up to the step's).

    Raises:
        PluginError: the result is not a scalar tensor and a dict of numbers.
    """
    result = plugin.call(config, batch, logits, sum_of_sample_mean)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise plugin.error(f"returned {type(result).__name__}, not (loss, metrics)")
    loss, metrics = result
    if not isinstance(loss, Tensor) or loss.dim() != 0 or not isinstance(metrics, dict):
        raise plugin.error("returned a loss that is not a scalar tensor, or metrics that are not a dict")
    return loss, {name: float(value) for name, value in metrics.items()}


def _refuse_if_not_finite(what: str, value: Tensor | float, optimizer: torch.optim.Optimizer) -> None:
    number = float(value.detach()) if isinstance(value, Tensor) else value
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

    Returns:
        slime's ``train/`` metrics (loss, pg_loss, pg_clipfrac, ppo_kl, entropy_loss, kl_loss, tis...,
        grad_norm), ``perf/tokens_per_sec`` and ``rollout/response_length_{mean,max}``.

    Raises:
        TrainingDiverged: a non-finite loss or gradient norm (the optimizer is not stepped), or a
            non-finite weight after the step.
        ValueError: a missing reference model or behaviour log-probs the config needs.
    """
    if not samples:
        raise ValueError("train_step needs at least one sample")
    loss_config = config.loss
    if loss_config.kl_loss_coef != 0 and ref_model is None:
        raise ValueError("kl_loss_coef != 0 needs a ref_model")
    needs_behaviour = loss_config.use_tis or (config.use_rollout_logprobs and old_log_probs is None)
    if needs_behaviour and any(s.rollout_log_probs is None for s in samples):
        raise ValueError("use_tis / use_rollout_logprobs need rollout_log_probs on every sample")
    if advantages is None:
        advantages = compute_advantages(samples, config)
    if advantages.shape != (len(samples),):
        raise ValueError(f"advantages must have shape ({len(samples)},), got {tuple(advantages.shape)}")
    if old_log_probs is None and config.use_rollout_logprobs:
        old_log_probs = [torch.tensor(s.rollout_log_probs) for s in samples]
    behaviour = [s.rollout_log_probs for s in samples] if loss_config.use_tis else None

    custom = load_plugin(config.custom_loss_path, HookKind.CUSTOM_LOSS) if config.custom_loss_path else None
    started = time.perf_counter()
    device = next(model.parameters()).device
    num_tokens = sum(sum(training_loss_mask(s)) for s in samples)
    model.train()
    optimizer.zero_grad(set_to_none=True)
    totals: dict[str, float] = {}
    for micro_batch in pack_samples(samples, config.max_tokens_per_micro_batch):
        batch = collate_micro_batch(samples, micro_batch)
        cu_seqlens, loss_mask = batch.cu_seqlens.to(device), batch.loss_mask.to(device)
        logits = _forward_logits(model, batch)
        log_probs = _token_log_probs(logits, batch)
        # Entropy is always reported (train/entropy_loss); it joins the graph only when it is in the loss.
        with torch.set_grad_enabled(loss_config.entropy_coef != 0):
            entropy = _shifted(entropy_from_logits(logits), batch.cu_seqlens)
        ref_log_probs = None
        if ref_model is not None and loss_config.kl_loss_coef != 0:
            with torch.no_grad():
                ref_log_probs = compute_log_probs(ref_model, batch)

        token_advantages = broadcast_to_tokens(advantages[list(batch.sample_indices)].to(device), loss_mask, cu_seqlens)
        old = _packed_response_values(samples, batch, old_log_probs, device)
        rollout = _packed_response_values(samples, batch, behaviour, device)
        if custom is not None:
            tensors = {
                "input_ids": batch.input_ids.to(device),
                "position_ids": batch.position_ids.to(device),
                "cu_seqlens": cu_seqlens,
                "loss_mask": loss_mask,
                "log_probs": log_probs,
                "old_log_probs": log_probs.detach() if old is None else old,
                "advantages": token_advantages,
                "rollout_log_probs": rollout,
                "ref_log_probs": ref_log_probs,
            }

            def sum_of_sample_mean(values: Tensor, mask: Tensor = loss_mask, cu: Tensor = cu_seqlens) -> Tensor:
                return reduce_masked(
                    values, mask, loss_config.reduction, num_samples=len(samples), num_tokens=num_tokens, cu_seqlens=cu
                )

            loss, parts = call_custom_loss(custom, config, tensors, logits, sum_of_sample_mean)
        else:
            result = policy_loss_function(
                loss_config,
                log_probs,
                token_advantages,
                loss_mask,
                old_log_probs=old,
                ref_log_probs=ref_log_probs,
                rollout_log_probs=rollout,
                entropy=entropy,
                num_samples=len(samples),
                num_tokens=num_tokens,
                cu_seqlens=cu_seqlens,
            )
            loss, parts = result.loss, result.metrics()
        _refuse_if_not_finite("loss", loss, optimizer)
        loss.backward()
        # Every part is reduced over the whole step's counts, so micro-batch values add up to the step's.
        for name, value in parts.items():
            totals[name] = totals.get(name, 0.0) + value

    parameters = [p for p in model.parameters() if p.grad is not None]
    max_norm = config.clip_grad if config.clip_grad is not None else math.inf
    grad_norm = float(torch.nn.utils.clip_grad_norm_(parameters, max_norm))
    _refuse_if_not_finite("grad_norm", grad_norm, optimizer)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        # An enormous learning rate can overflow weights from finite gradients.
        if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
            raise TrainingDiverged("a weight became non-finite in the optimizer step")
    elapsed = time.perf_counter() - started
    tokens = sum(s.total_length for s in samples)
    lengths = [s.response_length for s in samples]
    return {
        **totals,
        "grad_norm": grad_norm,
        "perf/tokens_per_sec": tokens / max(elapsed, 1e-9),
        "rollout/response_length_mean": sum(lengths) / len(lengths),
        "rollout/response_length_max": float(max(lengths)),
    }
