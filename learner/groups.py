"""Real GRPO groups from feedback: each rated prompt's logged answer(s) plus n fresh rollouts, scored.

    rated samples (rewards from the feedback mapping)
      -> one prompt per group -> n fresh samples each (``learner.rollout``, through the gateway)
      -> score the fresh ones (reward model, judge or a custom reward plugin)
      -> group = the rated answer(s) + the fresh samples
      -> dynamic-sampling filter (groups whose rewards do not vary teach nothing: roll them out again,
         up to ``refill_attempts`` times, then drop them)
      -> reward post-processing (group normalisation for the estimator, or the custom hook)
      -> samples marked ``remove`` stay in the batch and train nothing (a zero loss mask, slime's
         rule): with a reward they count in their group's statistics and the filter, as in slime;
         without one (an unreadable judge verdict) their advantage is 0
      -> buffer filter hook (slime's, over the groups) -> the samples to train and one advantage each
      -> with ``normalize_advantages``, and always for REINFORCE++ (slime requires it there): the
         advantages whitened over the batch's trained tokens, as the step loss does (per-token
         advantages, ``TrainConfig.token_level``, are whitened by the trainer once they are made)

Group indices are the rated samples' (``learner.collect`` numbers prompts 0..G-1 in order).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from learner.batching import apply_dynamic_filter, call_buffer_filter, check_reward_nonzero_std
from learner.plugins import Plugin
from learner.rewards import normalization_for, post_process_rewards
from learner.rollout import RolloutConfig, RolloutError, rollout_groups
from learner.sample import Sample
from learner.slime_args import SlimeArgs
from learner.trainers.step_loss import whiten_advantages

__all__ = ["GroupSettings", "GroupedBatch", "Scorer", "build_groups"]

Scorer = Callable[[list[Sample]], None]  # sets ``reward`` (or ``remove``) on each fresh sample


@dataclass(frozen=True, slots=True)
class GroupSettings:
    """How groups are built; plugins already loaded (``learner.plugins.load_plugin``)."""

    rollout: RolloutConfig
    advantage_estimator: str = "grpo"
    std_normalization: bool = True
    normalize_advantages: bool = False  # slime's --normalize-advantages (always for REINFORCE++-baseline)
    token_level: bool = False  # the trainer makes per-token advantages and whitens those instead
    refill_attempts: int = 1
    dynamic_filter: Plugin | None = None  # None: keep groups whose rewards vary
    reward_post_process: Plugin | None = None
    buffer_filter: Plugin | None = None


@dataclass(slots=True)
class GroupedBatch:
    samples: list[Sample] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)


def build_groups(
    rated: Sequence[Sample],
    settings: GroupSettings,
    *,
    server_url: str,
    admin_key: str,
    score: Scorer,
    args: SlimeArgs | None = None,
    rollout_id: int = 0,
) -> GroupedBatch:
    """Samples to train with their advantages (see the module docstring); ``args`` goes to plugins
    (its ``reward_key`` picks a dict reward's scalar), ``rollout_id`` (slime's: which rollout of the
    run this is) to a ROLLOUT plugin, refills included."""
    reward_key = None if args is None else args.reward_key
    by_group: dict[int, list[Sample]] = {}
    for sample in rated:
        by_group.setdefault(_group_of(sample), []).append(sample)
    prompts = [by_group[g][0] for g in sorted(by_group)]

    fresh = _fresh_groups(prompts, settings.rollout, server_url, admin_key, score, rollout_id, args)
    groups = {g: by_group[g] + fresh[i] for i, g in enumerate(sorted(by_group))}
    filter_fn = settings.dynamic_filter or check_reward_nonzero_std
    refills = 0
    for _ in range(settings.refill_attempts):
        flat = _scored(_kept(groups))
        dropped = apply_dynamic_filter(args, _as_groups(flat), filter_fn).dropped
        if not dropped:
            break
        retry = sorted({_group_of(group[0]) for group, _ in dropped})
        again = _fresh_groups(
            [by_group[g][0] for g in retry], settings.rollout, server_url, admin_key, score, rollout_id, args
        )
        for g, samples in zip(retry, again, strict=True):
            groups[g] = by_group[g] + samples
        refills += len(retry)

    result = apply_dynamic_filter(args, _as_groups(_scored(_kept(groups))), filter_fn)
    kept = [s for group in result.kept for s in group]
    kept_ids = {_group_of(s) for s in kept}
    unscored = [s for s in _kept(groups) if s.reward is None and s.remove_sample and _group_of(s) in kept_ids]
    batch = GroupedBatch(
        metrics={
            "groups": len(groups),
            "groups_kept": len(result.kept),
            "groups_refilled": refills,
            "rollout_samples": sum(len(f) for f in fresh),
            "removed_samples": sum(s.remove_sample for s in _kept(groups)),
            "rollout/raw_reward_mean": statistics.fmean(s.reward_value(reward_key) for s in kept) if kept else 0.0,
            **result.metrics(),
        }
    )
    if not kept:
        return batch
    normalization = normalization_for(settings.advantage_estimator, std_normalization=settings.std_normalization)
    processed = post_process_rewards(
        args, kept, normalization=normalization, plugin=settings.reward_post_process, reward_key=reward_key
    )
    advantage_of = {id(s): a for s, a in zip(kept, processed.rewards, strict=True)}
    advantage_of |= {id(s): 0.0 for s in unscored}
    kept = [s for g in sorted(kept_ids) for s in groups[g] if id(s) in advantage_of]
    if settings.buffer_filter is not None:
        selected = call_buffer_filter(settings.buffer_filter, args, rollout_id, _as_groups(kept))
        kept = [s for group in selected for s in group]
    batch.samples = kept
    batch.advantages = [advantage_of[id(s)] for s in kept]
    whitened = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")
    if (settings.advantage_estimator in whitened or settings.normalize_advantages) and not settings.token_level:
        batch.advantages = whiten_advantages(torch.tensor(batch.advantages), kept).tolist()
    return batch


def _fresh_groups(
    prompts: list[Sample],
    config: RolloutConfig,
    server_url: str,
    admin_key: str,
    score: Scorer,
    rollout_id: int,
    args: SlimeArgs | None,
) -> list[list[Sample]]:
    groups = rollout_groups(server_url, admin_key, prompts, config, rollout_id=rollout_id, args=args)
    if len(groups) != len(prompts):
        raise RolloutError(f"the rollout returned {len(groups)} groups for {len(prompts)} prompts")
    # A group belongs to the prompt whose group id it carries (a ROLLOUT plugin may reorder them, as
    # slime sorts its groups by sample index) when the groups name distinct prompts of this call;
    # otherwise (ids by position, or none) to the prompt at its place.
    by_id = {p.group_index: p for p in prompts}
    ids = [{s.group_index for s in group} for group in groups]
    named = [next(iter(i)) for i in ids if len(i) == 1]
    by_name = len(named) == len(groups) and len(set(named)) == len(named) and set(named) <= by_id.keys()
    owned: dict[int | None, list[Sample]] = {}
    for position, group in enumerate(groups):
        owner = by_id[named[position]] if by_name else prompts[position]
        for sample in group:
            sample.group_index = owner.group_index
            sample.user_id = owner.user_id
        owned.setdefault(owner.group_index, []).extend(group)
    ordered = [owned.get(p.group_index, []) for p in prompts]
    score([s for group in ordered for s in group])
    return ordered


def _group_of(sample: Sample) -> int:
    if sample.group_index is None:
        raise ValueError("rated samples need a group_index (learner.collect sets one)")
    return sample.group_index


def _scored(samples: list[Sample]) -> list[Sample]:
    # A removed sample may have no reward (an unreadable judge verdict): it cannot join statistics.
    return [s for s in samples if not (s.remove_sample and s.reward is None)]


def _kept(groups: dict[int, list[Sample]]) -> list[Sample]:
    return [s for g in sorted(groups) for s in groups[g]]


def _as_groups(samples: list[Sample]) -> list[list[Sample]]:
    grouped: dict[int, list[Sample]] = {}
    for sample in samples:
        grouped.setdefault(_group_of(sample), []).append(sample)
    return [grouped[g] for g in sorted(grouped)]
