"""The policy loss of one packed micro-batch from its logits: the part every trainer backend shares.

A backend turns a ``PackedMicroBatch`` into ``[T, V]`` logits its own way (a transformers model, a
megatron-core ``GPTModel``) and hands them to ``micro_batch_loss``, which computes log-probs and
entropy (or takes them precomputed: under megatron's context parallel each rank scores its part of
the row and the ``[T]`` scores are gathered, see ``target_scores``), lays advantages and old/behaviour log-probs onto the packed row, and calls the built-in
policy loss (``learner.algorithms``) or a CUSTOM_LOSS plugin. ``prepare_step`` checks a step's inputs
once. Every value is reduced with the whole step's sample and token counts, so micro-batch losses
add up to the step's and gradients accumulate to the one big batch's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from learner.algorithms import (
    TISFunction,
    broadcast_to_tokens,
    compute_approx_kl,
    compute_value_loss,
    entropy_from_logits,
    group_mean_std,
    grpo_advantages,
    masked_whiten,
    policy_loss_function,
    reduce_masked,
    target_log_probs,
)
from learner.algorithms.token_advantages import gae, opd_penalty, ppo_token_rewards, shaped_advantages, whiten_tokens
from learner.batching import PackedMicroBatch, trained_token_counts, training_loss_mask
from learner.plugins import HookKind, Plugin, load_plugin
from learner.sample import Sample
from learner.slime_args import slime_args
from learner.to_device import to_device
from learner.trainers.custom_loss import call_custom_loss, response_spans, slime_loss_batch
from learner.trainers.train_config import TrainConfig

__all__ = [
    "StepInputs",
    "StepTotals",
    "TokenAdvantages",
    "all_finite",
    "compute_advantages",
    "entropy_in_loss",
    "micro_batch_loss",
    "prepare_step",
    "rollout_mask_sums",
    "shifted",
    "slime_pg_reduce",
    "slime_tis",
    "step_metrics",
    "target_scores",
    "token_advantages",
    "token_log_probs",
    "token_log_probs_and_entropy",
    "whiten_advantages",
]


def shifted(values: Tensor, cu_seqlens: Tensor) -> Tensor:
    """Move per-position values one step right (the logits at t - 1 predict token t); 0 at sample starts."""
    out = torch.cat([values.new_zeros(1), values[:-1]])
    starts = to_device(cu_seqlens[:-1].long(), values.device)
    return out.index_fill(0, starts, 0.0)


def entropy_in_loss(config: TrainConfig) -> bool:
    """Whether the entropy joins the graph (an entropy loss, while training); it is always reported."""
    return config.loss.entropy_coef != 0 and torch.is_grad_enabled()


def target_scores(
    logits: Tensor,
    targets: Tensor,
    *,
    temperature: Tensor | None = None,
    with_entropy: bool = True,
    entropy_grad: bool = False,
) -> tuple[Tensor, Tensor]:
    """Unshifted ``[T]`` float32 ``log p(targets[t])`` from ``[T, V]`` logits, with gradient, and the
    entropy at each position: zeros unless ``with_entropy``, with gradient when ``entropy_grad``.
    ``temperature``: ``[T]``, what each position's logits are divided by first (the distribution the
    rollout sampled from, slime's ``logits / rollout_temperature``); None: 1."""
    if temperature is not None:
        logits = logits / to_device(temperature, logits.device).to(logits.dtype)[:, None]
    log_probs, entropy = target_log_probs(logits, targets, with_entropy=with_entropy and not entropy_grad)
    if entropy_grad:
        entropy = entropy_from_logits(logits)
    return log_probs, entropy


def token_log_probs_and_entropy(
    logits: Tensor, batch: PackedMicroBatch, *, entropy_grad: bool = False
) -> tuple[Tensor, Tensor]:
    """``[T]`` float32 ``log p(token t | the sample's tokens before t)`` from ``[T, V]`` logits, with
    gradient, and the ``[T]`` entropy of the distribution token t was drawn from (with gradient only
    when ``entropy_grad``); 0 at sample starts."""
    targets = to_device(batch.input_ids, logits.device).roll(-1)  # position t scores token t + 1
    log_probs, entropy = target_scores(logits, targets, temperature=batch.temperature, entropy_grad=entropy_grad)
    return shifted(log_probs, batch.cu_seqlens), shifted(entropy, batch.cu_seqlens)


def token_log_probs(logits: Tensor, batch: PackedMicroBatch) -> Tensor:
    """``token_log_probs_and_entropy``'s log-probs alone."""
    targets = to_device(batch.input_ids, logits.device).roll(-1)
    log_probs, _ = target_scores(logits, targets, temperature=batch.temperature, with_entropy=False)
    return shifted(log_probs, batch.cu_seqlens)


def all_finite(tensors: Iterable[Tensor]) -> bool:
    """Whether every element of ``tensors`` is finite: one max-abs reduction over all of them and one
    device sync (a check per weight tensor cost a sync each, hundreds per step)."""
    detached = [t.detach() for t in tensors if t.numel()]  # the max of nothing is undefined
    return not detached or bool(torch.nn.utils.get_total_norm(detached, norm_type=math.inf).isfinite())


def compute_advantages(samples: Sequence[Sample], config: TrainConfig) -> Tensor:
    """``[N]`` per-sample advantages from the rewards, grouped by ``group_index`` (None: a group of its
    own): GRPO's, REINFORCE++-baseline's ``r - mean``, REINFORCE++'s raw ``r``; whitened over the
    trained tokens when ``config.whitens`` (``whiten_advantages``), unless they become per-token ones
    (``token_advantages`` whitens those)."""
    rewards = torch.tensor([s.reward_value(config.reward_key) for s in samples], dtype=torch.float32)
    groups = torch.tensor([-1 - i if s.group_index is None else s.group_index for i, s in enumerate(samples)])
    if config.advantage_estimator in ("grpo", "gspo", "cispo"):  # slime normalises all three alike
        advantages = grpo_advantages(rewards, groups, std_normalization=config.grpo_std_normalization)
    elif config.advantage_estimator == "reinforce_plus_plus":
        advantages = rewards
    else:
        advantages = rewards - group_mean_std(rewards, groups)[0]
    return whiten_advantages(advantages, samples) if config.whitens and not config.token_level else advantages


def token_advantages(
    samples: Sequence[Sample],
    config: TrainConfig,
    scores: Tensor,
    old_log_probs: Sequence[Tensor],
    ref_log_probs: Sequence[Tensor] | None,
    values: Sequence[Tensor] | None = None,
) -> TokenAdvantages:
    """Each sample's per-token advantages (``learner.algorithms.token_advantages``), PPO's returns,
    and their metrics.

    Args:
        scores: ``[N]`` the per-sample advantages the round gave (or ``compute_advantages``).
        old_log_probs: each sample's response log-probs under the policy before the update.
        ref_log_probs: the same under the reference policy, with ``config.kl_coef``.
        values: PPO: each sample's response values under the critic before the update.

    Raises:
        ValueError: distillation with no sample's teacher log-probs (samples without them, such as
            rated answers, get no distillation term); PPO without values.
        PluginError: a custom advantage function that sets no advantages of the right shapes.
    """
    masks = [torch.tensor(training_loss_mask(s), dtype=torch.float32) for s in samples]
    if ref_log_probs is not None and config.kl_coef != 0:
        kl = [
            compute_approx_kl(o, r, config.loss.kl_loss_type) for o, r in zip(old_log_probs, ref_log_probs, strict=True)
        ]
    else:
        kl = [torch.zeros(s.response_length) for s in samples]
    metrics: dict[str, float] = {}
    returns = None
    if config.custom_advantage_path is not None:
        advantages = _custom_advantages(samples, config, scores, old_log_probs, ref_log_probs, kl, masks)
    elif config.advantage_estimator == "ppo":
        if values is None:
            raise ValueError("ppo needs the critic's values")
        rewards = ppo_token_rewards(scores.tolist(), kl, kl_coef=config.kl_coef)
        advantages, returns = gae(rewards, values, gamma=config.gamma, lambd=config.lambd)
        metrics["values_mean"] = _masked_mean(values, masks)
    else:
        advantages = shaped_advantages(
            config.advantage_estimator, scores.tolist(), kl, masks, kl_coef=config.kl_coef, gamma=config.gamma
        )
    if config.kl_coef != 0:
        metrics["kl_in_reward"] = _masked_mean(kl, masks)
    if config.use_opd:
        # A rated answer was never scored by the teacher: only samples with teacher log-probs distil.
        taught = [i for i, s in enumerate(samples) if s.teacher_log_probs is not None]
        if not taught:
            raise ValueError("use_opd needs teacher_log_probs on the samples (a generate or reward plugin sets them)")
        teacher = [torch.tensor(samples[i].teacher_log_probs or []) for i in taught]
        penalised, reverse = opd_penalty(
            [advantages[i] for i in taught], [old_log_probs[i] for i in taught], teacher, config.opd_kl_coef
        )
        for i, value in zip(taught, penalised, strict=True):
            advantages[i] = value
        metrics["opd_reverse_kl"] = _masked_mean(reverse, [masks[i] for i in taught])
        metrics["opd_samples"] = float(len(taught))
    if config.whitens:
        advantages = whiten_tokens(advantages, masks)
    return TokenAdvantages(advantages, returns, metrics)


@dataclass(frozen=True, slots=True)
class TokenAdvantages:
    """``token_advantages``'s result: per-sample advantages, PPO's per-sample returns (else None), metrics."""

    advantages: list[Tensor]
    returns: list[Tensor] | None
    metrics: dict[str, float]


def _custom_advantages(
    samples: Sequence[Sample],
    config: TrainConfig,
    scores: Tensor,
    old_log_probs: Sequence[Tensor],
    ref_log_probs: Sequence[Tensor] | None,
    kl: list[Tensor],
    masks: list[Tensor],
) -> list[Tensor]:
    """slime's ``--custom-advantage-function-path``: ``f(args, rollout_data)`` fills in the advantages."""
    plugin = load_plugin(config.custom_advantage_path or "", HookKind.CUSTOM_ADVANTAGE)
    rollout_data: dict[str, Any] = {
        "rewards": scores.tolist(),
        "raw_reward": [s.reward_value(config.reward_key) if s.reward is not None else 0.0 for s in samples],
        "log_probs": list(old_log_probs),
        "ref_log_probs": None if ref_log_probs is None else list(ref_log_probs),
        "rollout_log_probs": [torch.tensor(_behaviour(s)) for s in samples],
        "teacher_log_probs": [
            None if s.teacher_log_probs is None else torch.tensor(s.teacher_log_probs) for s in samples
        ],
        "kl": kl,
        "loss_masks": masks,
        "response_lengths": [s.response_length for s in samples],
        "total_lengths": [s.total_length for s in samples],
        "values": None,
    }
    plugin.call(slime_args(config.slime_args()), rollout_data)
    advantages = rollout_data.get("advantages")
    if not isinstance(advantages, list) or [getattr(a, "shape", None) for a in advantages] != [m.shape for m in masks]:
        raise plugin.error("did not set rollout_data['advantages'] to one [response_length] tensor per sample")
    return [a.float() for a in advantages]


def _masked_mean(values: Sequence[Tensor], masks: Sequence[Tensor]) -> float:
    mask = torch.cat(list(masks))
    return float((torch.cat(list(values)).float() * mask).sum() / mask.sum().clamp_min(1))


def whiten_advantages(advantages: Tensor, samples: Sequence[Sample]) -> Tensor:
    """slime's --normalize-advantages: whitened over every trained token of the batch (each sample
    weighted by its trained token count); unchanged when no token is trained."""
    counts = trained_token_counts(samples)
    return masked_whiten(advantages, counts) if counts.sum() > 0 else advantages


@dataclass(frozen=True, slots=True)
class StepInputs:
    """One step's checked inputs: per-sample advantages, old and behaviour log-probs, token count."""

    advantages: Tensor  # [N]
    old_log_probs: Sequence[Tensor | Sequence[float]] | None
    behaviour: Sequence[Sequence[float] | None] | None  # the TIS denominators, with use_tis
    num_tokens: int  # trained tokens over the whole step, at least 1 per sample (token_mean's denominator)
    custom: Plugin | None
    tis_plugin: Plugin | None = None  # slime's --custom-tis-function-path, replacing the built-in TIS
    pg_reducer: Plugin | None = None  # slime's --custom-pg-loss-reducer-function-path
    # Some sample of the step is supervised: every micro-batch then reports sft_loss (data-parallel
    # replicas sum the same named values, so a name must not depend on a micro-batch's samples).
    supervised: bool = False
    # slime's rollout_mask_sums [N]: each sample's loss denominator, its rollout's trained tokens
    # (samples sharing a rollout_id share them; a sample without one is a rollout of its own).
    rollout_mask_sums: Tensor = dataclasses.field(default_factory=lambda: torch.zeros(0))
    shared_rollouts: bool = False  # some rollout_id is shared: the reductions take rollout_mask_sums
    token_advantages: Sequence[Tensor] | None = None  # per sample, replacing the broadcast of ``advantages``
    returns: Sequence[Tensor] | None = None  # PPO: per sample, the value head's targets
    old_values: Sequence[Tensor] | None = None  # PPO: per sample, the values before the update (the clip's centre)


def prepare_step(
    samples: Sequence[Sample],
    config: TrainConfig,
    *,
    has_ref_model: bool,
    old_log_probs: Sequence[Tensor] | None,
    advantages: Tensor | None,
    token_advantages: Sequence[Tensor] | None = None,
    returns: Sequence[Tensor] | None = None,
    old_values: Sequence[Tensor] | None = None,
) -> StepInputs:
    """Check a step's inputs and fill in what was left to defaults (see ``torch_backend.train_step``).

    Raises:
        ValueError: no samples, a missing reference model or behaviour log-probs the config needs,
            advantages of the wrong shape.
    """
    if not samples:
        raise ValueError("train_step needs at least one sample")
    loss_config = config.loss
    if loss_config.kl_loss_coef != 0 and not has_ref_model:
        raise ValueError("kl_loss_coef != 0 needs a ref_model")
    needs_behaviour = loss_config.use_tis or (config.use_rollout_logprobs and old_log_probs is None)
    if needs_behaviour and any(s.rollout_log_probs is None and not s.supervised for s in samples):
        raise ValueError("use_tis / use_rollout_logprobs need rollout_log_probs on every sample")
    if advantages is None:
        advantages = compute_advantages(samples, config)
    if advantages.shape != (len(samples),):
        raise ValueError(f"advantages must have shape ({len(samples)},), got {tuple(advantages.shape)}")
    old: Sequence[Tensor | Sequence[float]] | None = old_log_probs
    if old is None and config.use_rollout_logprobs:
        old = [torch.tensor(_behaviour(s)) for s in samples]
    return StepInputs(
        advantages=advantages,
        old_log_probs=old,
        behaviour=[_behaviour(s) for s in samples] if loss_config.use_tis else None,
        # At least 1 per sample, as slime counts a fully masked (removed) sample's tokens.
        num_tokens=int(trained_token_counts(samples).clamp_min(1).sum()),
        custom=load_plugin(config.custom_loss_path, HookKind.CUSTOM_LOSS) if config.custom_loss_path else None,
        tis_plugin=load_plugin(config.custom_tis_path, HookKind.CUSTOM_TIS) if config.custom_tis_path else None,
        pg_reducer=(
            load_plugin(config.custom_pg_reducer_path, HookKind.CUSTOM_PG_REDUCER)
            if config.custom_pg_reducer_path
            else None
        ),
        supervised=any(s.supervised for s in samples),
        rollout_mask_sums=rollout_mask_sums(samples),
        shared_rollouts=len({s.rollout_id for s in samples if s.rollout_id is not None})
        < sum(s.rollout_id is not None for s in samples),
        token_advantages=token_advantages,
        returns=returns,
        old_values=old_values,
    )


def rollout_mask_sums(samples: Sequence[Sample]) -> Tensor:
    """``[N]`` slime's ``rollout_mask_sums``: the trained tokens of each sample's rollout (the samples
    sharing its ``rollout_id``; a sample without one is a rollout of its own)."""
    counts = trained_token_counts(samples)
    keys = [("id", s.rollout_id) if s.rollout_id is not None else ("own", i) for i, s in enumerate(samples)]
    totals: dict[tuple[str, int], float] = {}
    for key, count in zip(keys, counts.tolist(), strict=True):
        totals[key] = totals.get(key, 0.0) + count
    return torch.tensor([totals[key] for key in keys], dtype=torch.float32)


def _behaviour(sample: Sample) -> list[float]:
    # A supervised sample (a user's corrected answer) was never sampled: no behaviour log-probs. Its
    # tokens take no policy gradient, so zeros only fill its place.
    if sample.rollout_log_probs is None:
        return [0.0] * sample.response_length
    return list(sample.rollout_log_probs)


def _packed_response_values(
    samples: Sequence[Sample],
    batch: PackedMicroBatch,
    values: Sequence[Tensor | Sequence[float] | None] | None,
    device: torch.device,
) -> Tensor | None:
    """Per-sample response values (``values[i]`` for ``samples[i]``) laid out on the packed row, 0 on prompts."""
    if values is None:
        return None
    parts = []
    for index in batch.sample_indices:
        sample = samples[index]
        parts += [torch.zeros(sample.prompt_length), torch.as_tensor(values[index], dtype=torch.float32)]
    return to_device(torch.cat(parts), device)


def micro_batch_loss(
    config: TrainConfig,
    inputs: StepInputs,
    samples: Sequence[Sample],
    batch: PackedMicroBatch,
    logits: Tensor | None,
    *,
    ref_log_probs: Tensor | None = None,
    token_scores: tuple[Tensor, Tensor] | None = None,
    values: Tensor | None = None,
) -> tuple[Tensor, Mapping[str, Tensor | float]]:
    """The scalar loss to back-propagate for ``batch`` (packed from ``samples``) and its reduced parts
    (detached tensors, or a CUSTOM_LOSS plugin's numbers: sum them in a ``StepTotals``).

    With PPO's critic (``inputs.returns``), ``values`` are the value head's ``[T]`` values with
    gradient (``learner.trainers.critic``): slime's clipped value loss joins the loss (it trains the
    head alone) and ``value_loss``, ``value_clipfrac`` the parts.

    ``logits`` is ``[T, V]`` with gradient; ``ref_log_probs`` the frozen reference's ``[T]`` log-probs
    when the KL loss is on. ``token_scores``: the ``(log_probs, entropy)`` that
    ``token_log_probs_and_entropy(logits, batch, entropy_grad=entropy_in_loss(config))`` gives,
    computed elsewhere (megatron's context parallel); ``logits`` may then be None unless a CUSTOM_LOSS
    plugin needs them.

    Raises:
        ValueError: neither logits nor token scores, or a CUSTOM_LOSS plugin without logits.
    """
    loss_config = config.loss
    if token_scores is None:
        if logits is None:
            raise ValueError("micro_batch_loss needs the logits or the token scores")
        # Entropy is always reported (train/entropy_loss); it joins the graph only when it is in the loss.
        token_scores = token_log_probs_and_entropy(logits, batch, entropy_grad=entropy_in_loss(config))
    log_probs, entropy = token_scores
    device = log_probs.device
    # Host tensors are copied without blocking (``to_device``) and the offsets stay on the host (the reductions build
    # their segment ids there): nothing here waits for the forward pass to finish on the device.
    cu_seqlens, loss_mask = batch.cu_seqlens, to_device(batch.loss_mask, device)
    if inputs.token_advantages is None:
        sample_advantages = to_device(inputs.advantages[list(batch.sample_indices)], device)
        token_advantages = broadcast_to_tokens(sample_advantages, loss_mask, cu_seqlens)
    else:
        packed_advantages = _packed_response_values(samples, batch, inputs.token_advantages, device)
        assert packed_advantages is not None
        token_advantages = packed_advantages * loss_mask
    old = _packed_response_values(samples, batch, inputs.old_log_probs, device)
    rollout = _packed_response_values(samples, batch, inputs.behaviour, device)
    supervised = None
    if inputs.supervised:
        supervised = torch.zeros_like(loss_mask) if batch.supervised is None else to_device(batch.supervised, device)
    denominators = inputs.rollout_mask_sums[list(batch.sample_indices)] if inputs.shared_rollouts else None
    if inputs.custom is not None:
        if logits is None:
            raise ValueError("a CUSTOM_LOSS plugin is handed the [T, V] logits; none were given")
        packed = {
            "input_ids": to_device(batch.input_ids, device),
            "loss_mask": loss_mask,
            "advantages": token_advantages,
            "old_log_probs": log_probs.detach() if old is None else old,
            "ref_log_probs": ref_log_probs,
            "rollout_log_probs": rollout,
            "supervised": torch.zeros_like(loss_mask) if supervised is None else supervised,
        }
        at = torch.cat([torch.arange(start, end) for start, end in response_spans(samples, batch)]).to(device)

        def sum_of_sample_mean(values: Tensor) -> Tensor:  # slime's: values over the responses, end to end
            row = torch.zeros(loss_mask.shape, dtype=values.dtype, device=device).index_put((at,), values)
            return reduce_masked(
                row,
                loss_mask,
                loss_config.reduction,
                num_samples=len(samples),
                num_tokens=inputs.num_tokens,
                cu_seqlens=cu_seqlens,
                denominators=denominators,
            )

        chosen = [samples[i] for i in batch.sample_indices]
        args = slime_args(
            config.slime_args(),
            rollout_temperature=chosen[0].rollout_temperature,  # slime's one temperature ...
            sample_temperatures=[s.rollout_temperature for s in chosen],  # ... tandem's, one per sample
        )
        loss_batch = slime_loss_batch(samples, batch, packed, inputs.rollout_mask_sums)
        loss_batch["values"] = _per_sample(inputs.old_values, batch)
        loss_batch["returns"] = _per_sample(inputs.returns, batch)
        loss, parts = call_custom_loss(inputs.custom, args, loss_batch, logits.unsqueeze(0), sum_of_sample_mean)
        critic = _value_loss(config, inputs, samples, batch, values, loss_mask, denominators)
        return (loss, parts) if critic is None else (loss + critic[0], {**parts, **_floats(critic[1])})
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
        num_tokens=inputs.num_tokens,
        cu_seqlens=cu_seqlens,
        surrogate=config.surrogate,
        supervised=supervised,
        tis_function=None if inputs.tis_plugin is None else slime_tis(inputs.tis_plugin, config, samples, batch),
        denominators=denominators,
        pg_reduce=None
        if inputs.pg_reducer is None
        else slime_pg_reduce(inputs.pg_reducer, config, inputs, samples, batch),
    )
    critic = _value_loss(config, inputs, samples, batch, values, loss_mask, denominators)
    if critic is None:
        return result.loss, result.parts()
    return result.loss + critic[0], {**result.parts(), **critic[1]}


def _value_loss(
    config: TrainConfig,
    inputs: StepInputs,
    samples: Sequence[Sample],
    batch: PackedMicroBatch,
    values: Tensor | None,
    loss_mask: Tensor,
    denominators: Tensor | None,
) -> tuple[Tensor, dict[str, Tensor]] | None:
    """PPO's clipped value loss over the micro-batch and its metrics; None without a critic."""
    if inputs.returns is None:
        return None
    if values is None:
        raise ValueError("PPO's value loss needs the value head's values; none were given")
    device = values.device
    returns = _packed_response_values(samples, batch, inputs.returns, device)
    old = _packed_response_values(samples, batch, inputs.old_values, device)
    assert returns is not None and old is not None
    per_token, clipped = compute_value_loss(values, old, returns, config.value_clip)

    def reduce(x: Tensor) -> Tensor:
        return reduce_masked(
            x,
            loss_mask,
            config.loss.reduction,
            num_samples=len(samples),
            num_tokens=inputs.num_tokens,
            cu_seqlens=batch.cu_seqlens,
            denominators=denominators,
        )

    loss = reduce(per_token)
    return loss, {"value_loss": loss.detach(), "value_clipfrac": reduce(clipped).detach()}


def _per_sample(values: Sequence[Tensor] | None, batch: PackedMicroBatch) -> list[Tensor] | None:
    return None if values is None else [values[i] for i in batch.sample_indices]


def _floats(parts: Mapping[str, Tensor]) -> dict[str, float]:
    return {name: float(value) for name, value in parts.items()}


def slime_pg_reduce(
    plugin: Plugin, config: TrainConfig, inputs: StepInputs, samples: Sequence[Sample], batch: PackedMicroBatch
) -> Callable[[Tensor, Tensor], Tensor]:
    """A CUSTOM_PG_REDUCER plugin as ``policy_loss_function``'s ``pg_reduce`` on one micro-batch.

    slime's contract: ``f(total_lengths, response_lengths, loss_masks, calculate_per_token_loss)``
    gives a reducer of the pg values over the responses' tokens, end to end, in slime's scale (a sum
    over the samples, or over the tokens per token); divided here by the step's sample (or token)
    count, as slime scales the loss by the step's size, so micro-batches add up to the step.

    Raises:
        PluginError: a result that is not callable, or a reducer that gives no scalar.
    """
    spans = response_spans(samples, batch)
    at = torch.cat([torch.arange(start, end) for start, end in spans])
    per_token = config.loss.reduction == "token_mean"
    scale = inputs.num_tokens if per_token else len(samples)

    def reduce(values: Tensor, mask: Tensor) -> Tensor:
        masks = [mask[start:end] for start, end in spans]
        totals = [samples[i].total_length for i in batch.sample_indices]
        reducer = plugin.call(totals, [end - start for start, end in spans], masks, per_token)
        if not callable(reducer):
            raise plugin.error(f"returned a {type(reducer).__name__}, not a reducer")
        result = reducer(values[at.to(values.device)])
        if not isinstance(result, Tensor) or result.dim() != 0:
            raise plugin.error("its reducer gave no scalar tensor")
        return result / max(scale, 1)

    return reduce


def slime_tis(plugin: Plugin, config: TrainConfig, samples: Sequence[Sample], batch: PackedMicroBatch) -> TISFunction:
    """A CUSTOM_TIS plugin as ``policy_loss_function``'s ``tis_function`` on one packed micro-batch.

    slime's contract: ``f(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks,
    total_lengths, response_lengths) -> (pg_loss, loss_masks, metrics)``, with ``pg_loss`` flat over
    the samples' response tokens, the others one ``[response_length]`` tensor per sample, and
    per-token metrics flat like ``pg_loss``. ``args`` carries the train and loss settings by slime's
    names (``tis_clip``, ``tis_clip_low``, ...).

    Raises:
        PluginError: a result that is not that triple of matching shapes.
    """
    spans = response_spans(samples, batch)
    lengths = [end - start for start, end in spans]
    totals = [samples[i].total_length for i in batch.sample_indices]
    args = slime_args(config.slime_args())

    def tis(pg: Tensor, old: Tensor, rollout: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        at = torch.cat([torch.arange(start, end) for start, end in spans]).to(pg.device)
        result = plugin.call(
            args,
            pg_loss=pg[at],
            train_log_probs=list(old[at].split(lengths)),
            rollout_log_probs=list(rollout[at].split(lengths)),
            loss_masks=list(mask[at].split(lengths)),
            total_lengths=totals,
            response_lengths=lengths,
        )
        if not (isinstance(result, tuple) and len(result) == 3):
            raise plugin.error(f"returned {type(result).__name__}, not (pg_loss, loss_masks, metrics)")
        new_pg, new_masks, metrics = result
        flat = [new_pg, *(new_masks if isinstance(new_masks, list) else []), *dict(metrics or {}).values()]
        if not all(isinstance(t, Tensor) for t in flat) or new_pg.shape != at.shape or len(new_masks) != len(spans):
            raise plugin.error("returned values of other shapes than it was given")
        masks = torch.cat([m.to(mask.dtype) for m in new_masks])
        per_token = {name: torch.zeros_like(pg).index_copy(0, at, v.to(pg.dtype)) for name, v in metrics.items()}
        return pg.index_copy(0, at, new_pg), mask.index_copy(0, at, masks), per_token

    return tis


class StepTotals:
    """A step's micro-batch losses and loss parts, summed on the device and read back once.

    Reading each micro-batch's values as they come would make the host wait for that micro-batch's
    forward pass before it could queue the backward: the device would idle while the host catches up.
    """

    def __init__(self) -> None:
        self._loss: Tensor | None = None
        self._tensors: dict[str, Tensor] = {}
        self._numbers: dict[str, float] = {}  # a CUSTOM_LOSS plugin's metrics

    def add(self, loss: Tensor, parts: Mapping[str, Tensor | float], weight: float = 1.0) -> None:
        """Count one micro-batch (``weight`` 0: a filler that only keeps replicas in step)."""
        value = loss.detach() * weight
        self._loss = value if self._loss is None else self._loss + value
        for name, part in parts.items():
            if isinstance(part, Tensor):
                part = part * weight
                self._tensors[name] = part if name not in self._tensors else self._tensors[name] + part
            else:
                self._numbers[name] = self._numbers.get(name, 0.0) + part * weight

    def read(self) -> tuple[float, dict[str, float]]:
        """``(summed loss, summed parts)`` as numbers: one device sync; the loss is 0.0 with nothing added."""
        if self._loss is None:
            return 0.0, dict(self._numbers)
        names = list(self._tensors)
        values = torch.stack([t.float() for t in (self._loss, *(self._tensors[n] for n in names))]).tolist()
        return values[0], self._numbers | dict(zip(names, values[1:], strict=True))


def step_metrics(
    samples: Sequence[Sample], totals: dict[str, float], grad_norm: float, elapsed: float
) -> dict[str, float]:
    """A step's reported metrics: the summed loss parts, the gradient norm, throughput and the lengths of
    the policy's own answers (not corrections or removed samples: later rounds' drift check reads them)."""
    tokens = sum(s.total_length for s in samples)
    lengths = [s.response_length for s in samples if not (s.supervised or s.remove_sample)] or [0]
    return {
        **totals,
        "grad_norm": grad_norm,
        "perf/tokens_per_sec": tokens / max(elapsed, 1e-9),
        "rollout/response_length_mean": sum(lengths) / len(lengths),
        "rollout/response_length_max": float(max(lengths)),
    }
