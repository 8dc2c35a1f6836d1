"""Real GRPO groups from feedback: each rated prompt's logged answer(s) plus n fresh rollouts, scored.

    rated samples (rewards from the feedback mapping)
      -> one prompt per group -> n fresh samples each (``learner.rollout``, through the gateway)
      -> score the fresh ones (reward model, judge or a custom reward plugin)
      -> group = the rated answer(s) + the fresh samples
      -> dynamic-sampling filter (groups whose rewards do not vary teach nothing: roll them out again,
         up to ``refill_attempts`` times, then drop them)
      -> drop samples marked ``remove`` (e.g. an unreadable judge verdict)
      -> reward post-processing (group normalisation for the estimator, or the custom hook)
      -> buffer filter hook -> the samples to train and one advantage each

Group indices are the rated samples' (``learner.collect`` numbers prompts 0..G-1 in order).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from learner.batching import apply_dynamic_filter, call_buffer_filter, check_reward_nonzero_std
from learner.plugins import Plugin
from learner.rewards import normalization_for, post_process_rewards
from learner.rollout import RolloutConfig, rollout_groups
from learner.sample import Sample

__all__ = ["GroupSettings", "GroupedBatch", "Scorer", "build_groups"]

Scorer = Callable[[list[Sample]], None]  # sets ``reward`` (or ``remove``) on each fresh sample


@dataclass(frozen=True, slots=True)
class GroupSettings:
    """How groups are built; plugins already loaded (``learner.plugins.load_plugin``)."""

    rollout: RolloutConfig
    advantage_estimator: str = "grpo"
    std_normalization: bool = True
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
    args: object,
) -> GroupedBatch:
    """Samples to train with their advantages (see the module docstring); ``args`` goes to plugins."""
    by_group: dict[int, list[Sample]] = {}
    for sample in rated:
        by_group.setdefault(_group_of(sample), []).append(sample)
    prompts = [by_group[g][0] for g in sorted(by_group)]

    fresh = _fresh_groups(prompts, settings.rollout, server_url, admin_key, score)
    groups = {g: by_group[g] + fresh[i] for i, g in enumerate(sorted(by_group))}
    filter_fn = settings.dynamic_filter or check_reward_nonzero_std
    refills = 0
    for _ in range(settings.refill_attempts):
        flat = [s for s in _kept(groups) if not s.remove]
        dropped = apply_dynamic_filter(args, _as_groups(flat), filter_fn).dropped
        if not dropped:
            break
        retry = sorted({_group_of(group[0]) for group, _ in dropped})
        again = _fresh_groups([by_group[g][0] for g in retry], settings.rollout, server_url, admin_key, score)
        for g, samples in zip(retry, again, strict=True):
            groups[g] = by_group[g] + samples
        refills += len(retry)

    trainable = [s for s in _kept(groups) if not s.remove]
    result = apply_dynamic_filter(args, _as_groups(trainable), filter_fn)
    kept = [s for group in result.kept for s in group]
    batch = GroupedBatch(
        metrics={
            "groups": len(groups),
            "groups_kept": len(result.kept),
            "groups_refilled": refills,
            "rollout_samples": sum(len(f) for f in fresh),
            "removed_samples": sum(s.remove for s in _kept(groups)),
            "rollout/raw_reward_mean": statistics.fmean(s.reward_value() for s in kept) if kept else 0.0,
            **result.metrics(),
        }
    )
    if not kept:
        return batch
    normalization = normalization_for(settings.advantage_estimator, std_normalization=settings.std_normalization)
    processed = post_process_rewards(args, kept, normalization=normalization, plugin=settings.reward_post_process)
    advantage_of = {id(s): a for s, a in zip(kept, processed.rewards, strict=True)}
    if settings.buffer_filter is not None:
        kept = call_buffer_filter(settings.buffer_filter, args, kept)
    batch.samples = kept
    batch.advantages = [advantage_of[id(s)] for s in kept]
    return batch


def _fresh_groups(
    prompts: list[Sample], config: RolloutConfig, server_url: str, admin_key: str, score: Scorer
) -> list[list[Sample]]:
    groups = rollout_groups(server_url, admin_key, prompts, config)
    for prompt, group in zip(prompts, groups, strict=True):
        for sample in group:
            sample.group_index = prompt.group_index
            sample.user_id = prompt.user_id
    score([s for group in groups for s in group])
    return groups


def _group_of(sample: Sample) -> int:
    if sample.group_index is None:
        raise ValueError("rated samples need a group_index (learner.collect sets one)")
    return sample.group_index


def _kept(groups: dict[int, list[Sample]]) -> list[Sample]:
    return [s for g in sorted(groups) for s in groups[g]]


def _as_groups(samples: list[Sample]) -> list[list[Sample]]:
    grouped: dict[int, list[Sample]] = {}
    for sample in samples:
        grouped.setdefault(_group_of(sample), []).append(sample)
    return [grouped[g] for g in sorted(grouped)]
