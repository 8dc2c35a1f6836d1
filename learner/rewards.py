"""From what users said to one number per sample: feedback mapping, reward plugins, post-processing.

Built-in mapping (``feedback_reward``): a rating ``up``/``down`` gives ``+1``/``-1`` (configurable);
a ``score`` in [-1, 1] is used as is.

A ``corrected_answer`` is not a reward: it is trained by likelihood (``learner.corrections``).

Reward plugins (``score_samples``) are slime's ``--custom-rm-path``: ``async (args, sample) -> float
| dict`` called per sample under a concurrency bound, or the batched ``async (args, samples) ->
list`` when loaded as ``HookKind.BATCHED_REWARD`` (chosen explicitly, never guessed).

Post-processing (``post_process_rewards``) is slime's ``_post_process_rewards``: a custom hook
replaces it; otherwise rewards are centred on their group's mean and, for GRPO-like estimators,
divided by ``std + 1e-6`` (unbiased std, as torch's default). Two deliberate differences: groups are
the samples sharing a ``group_index`` (slime reshapes by ``n_samples_per_prompt``; tandem's groups
vary in size: n rollouts + the rated answer(s)), and a group of one is not
divided by its (undefined) std, which slime gets by switching std normalisation off when
``n_samples_per_prompt == 1``. Centring a group of one gives 0: use ``Normalization.NONE`` or a
baseline for single rated answers. Sums run in Python floats (double), not torch float32.
"""

from __future__ import annotations

import asyncio
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Any, Literal, NamedTuple, Protocol, cast

from learner.plugins import HookKind, Plugin, load_plugin
from learner.sample import Sample, SampleError

__all__ = [
    "NORMALIZATION_BY_ESTIMATOR",
    "FeedbackRewardMapping",
    "Normalization",
    "PostProcessedRewards",
    "RewardError",
    "Verdict",
    "call_reward_post_process",
    "feedback_reward",
    "normalization_for",
    "normalize_group_rewards",
    "post_process_rewards",
    "score_samples",
]

GRPO_STD_EPSILON = 1e-6  # slime's


class RewardError(ValueError):
    """Feedback or rewards that cannot be turned into a training signal."""


class Verdict(Protocol):
    """What the mapping reads from a rating (``storage.feedback_collect.RatingRecord`` fits)."""

    @property
    def rating(self) -> Literal["up", "down"] | None: ...
    @property
    def score(self) -> float | None: ...


@dataclass(frozen=True, slots=True)
class FeedbackRewardMapping:
    """Rewards for the built-in mapping from feedback."""

    up: float = 1.0
    down: float = -1.0

    def __post_init__(self) -> None:
        for name in ("up", "down"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise RewardError(f"feedback reward {name!r} must be a finite number, got {value!r}")
        if self.up <= self.down:
            raise RewardError(f"feedback reward 'up' ({self.up}) must exceed 'down' ({self.down})")


def feedback_reward(feedback: Verdict, mapping: FeedbackRewardMapping | None = None) -> float:
    """The reward of a rated answer: its rating mapped, else its score as is.

    Raises:
        RewardError: neither a rating nor a score, an unknown rating, or a score outside [-1, 1].
    """
    mapping = mapping or FeedbackRewardMapping()
    if feedback.rating is not None:
        if feedback.rating == "up":
            return float(mapping.up)
        if feedback.rating == "down":
            return float(mapping.down)
        raise RewardError(f"unknown rating {feedback.rating!r}: expected 'up' or 'down'")
    score = feedback.score
    if score is None:
        raise RewardError("feedback has neither a rating nor a score")
    if isinstance(score, bool) or not isinstance(score, int | float) or not -1.0 <= score <= 1.0:
        raise RewardError(f"feedback score must be a number in [-1, 1], got {score!r}")
    return float(score)


# reward plugins


def _checked_reward(plugin: Plugin, value: object, what: str) -> float | dict[str, Any]:
    if isinstance(value, dict):
        return value
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise plugin.error(f"returned {value!r} for {what}, not a finite number or dict")
    return float(value)


async def score_samples(
    plugin: Plugin,
    args: object,
    samples: Sequence[Sample],
    *,
    max_concurrency: int = 16,
    only_missing: bool = True,
) -> list[float | dict[str, Any]]:
    """Score samples with a reward plugin and store each result in ``sample.reward``.

    Args:
        plugin: a ``REWARD`` or ``EVAL`` plugin (called once per sample, at most ``max_concurrency``
            at a time; a sample's own ``custom_rm_path`` replaces it for that sample, as in slime) or
            a ``BATCHED_REWARD`` plugin (slime's group reward model: called once per group, the
            samples sharing a ``group_index``, groups one after the other).
        args: passed through to the plugin.
        samples: the samples to score.
        max_concurrency: bound on concurrent per-sample calls (a judge or remote model has limits).
        only_missing: skip samples that already have a reward (slime: a generate function or the
            feedback mapping may have set it).

    Returns:
        The rewards of the samples scored now, in order.

    Raises:
        PluginError: a plugin of another kind, a non-numeric result, or a batch of the wrong length.
        ValueError: ``max_concurrency`` below 1.
    """
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be at least 1, got {max_concurrency}")
    todo = [s for s in samples if s.reward is None] if only_missing else list(samples)
    if not todo:
        return []
    if plugin.kind is HookKind.BATCHED_REWARD:
        groups: dict[int | None, list[Sample]] = {}
        for sample in todo:
            groups.setdefault(sample.group_index, []).append(sample)
        for group in groups.values():
            results = await plugin.call(args, group)
            if not isinstance(results, list | tuple) or len(results) != len(group):
                got = len(results) if isinstance(results, list | tuple) else type(results).__name__
                raise plugin.error(f"returned {got} rewards for {len(group)} samples")
            for sample, result in zip(group, results, strict=True):
                sample.reward = _checked_reward(plugin, result, f"sample {sample.index}")
    elif plugin.kind in (HookKind.REWARD, HookKind.EVAL):
        gate = asyncio.Semaphore(max_concurrency)

        async def one(sample: Sample) -> None:
            own = plugin if sample.custom_rm_path is None else load_plugin(sample.custom_rm_path, HookKind.REWARD)
            async with gate:
                sample.reward = _checked_reward(own, await own.call(args, sample), f"sample {sample.index}")

        await asyncio.gather(*(one(s) for s in todo))
    else:
        raise plugin.error("is not a reward plugin")
    return [cast(float | dict[str, Any], s.reward) for s in todo]  # every one set above


# post-processing


class Normalization(StrEnum):
    """Group normalisation of rewards before they become advantages."""

    NONE = "none"
    MEAN = "mean"  # r - mean(group)
    MEAN_STD = "mean_std"  # (r - mean(group)) / (std(group) + 1e-6)


# slime's choice per advantage estimator (``_post_process_rewards``)
NORMALIZATION_BY_ESTIMATOR = MappingProxyType(
    {
        "grpo": Normalization.MEAN_STD,
        "gspo": Normalization.MEAN_STD,
        "cispo": Normalization.MEAN_STD,
        "reinforce_plus_plus_baseline": Normalization.MEAN,
        "reinforce_plus_plus": Normalization.NONE,
        "ppo": Normalization.NONE,
    }
)


def normalization_for(
    estimator: str, *, rewards_normalization: bool = True, std_normalization: bool = True
) -> Normalization:
    """slime's normalisation for an estimator and its two switches.

    Raises:
        RewardError: an estimator slime does not know.
    """
    if estimator not in NORMALIZATION_BY_ESTIMATOR:
        raise RewardError(f"unknown advantage estimator {estimator!r}; known: {sorted(NORMALIZATION_BY_ESTIMATOR)}")
    mode = NORMALIZATION_BY_ESTIMATOR[estimator] if rewards_normalization else Normalization.NONE
    if mode is Normalization.MEAN_STD and not std_normalization:
        return Normalization.MEAN
    return mode


def normalize_group_rewards(
    groups: Sequence[Sequence[float]], mode: Normalization, *, eps: float = GRPO_STD_EPSILON
) -> list[list[float]]:
    """Normalise each group's rewards on its own (see the module docstring for groups of one)."""
    mode = Normalization(mode)
    out: list[list[float]] = []
    for group in groups:
        values = [float(r) for r in group]
        if mode is Normalization.NONE or not values:
            out.append(values)
            continue
        mean = statistics.mean(values)  # exact (fractions): a constant group centres to exactly 0
        centred = [r - mean for r in values]
        if mode is Normalization.MEAN_STD and len(values) > 1:
            std = statistics.stdev(values)
            centred = [c / (std + eps) for c in centred]
        out.append(centred)
    return out


class PostProcessedRewards(NamedTuple):
    """slime's ``(raw_rewards, rewards)``, one entry per sample in the order given."""

    raw_rewards: list[float]
    rewards: list[float]


def _raw_rewards(samples: Sequence[Sample], reward_key: str | None) -> list[float]:
    try:
        return [s.reward_value(reward_key) for s in samples]
    except SampleError as exc:
        raise RewardError(str(exc)) from exc


def _group_positions(samples: Sequence[Sample]) -> list[list[int]]:
    # a sample without a group index is a group of its own
    groups: dict[object, list[int]] = {}
    for i, sample in enumerate(samples):
        key = ("group", sample.group_index) if sample.group_index is not None else ("alone", i)
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def _float_list(plugin: Plugin, values: object, n: int, what: str) -> list[float]:
    if not isinstance(values, list | tuple) or len(values) != n:
        got = len(values) if isinstance(values, list | tuple) else type(values).__name__
        raise plugin.error(f"returned {got} {what} for {n} samples")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise plugin.error(f"returned {v!r} among the {what}, not a finite number")
        out.append(float(v))
    return out


def call_reward_post_process(
    plugin: Plugin, args: object, samples: Sequence[Sample], *, reward_key: str | None = None
) -> PostProcessedRewards:
    """Run a post-processing hook and accept each of its result forms.

    ``list[float]``: the processed rewards; ``(raw_rewards, rewards)``: slime's form; ``None``: the
    hook set ``sample.reward`` in place (the rewards before the call are the raw ones).

    Raises:
        PluginError: a plugin of another kind, or a result of another shape or length.
        RewardError: a sample without a usable reward, before or after an in-place hook.
    """
    if plugin.kind is not HookKind.REWARD_POST_PROCESS:
        raise plugin.error("is not a reward post-processing plugin")
    raw = _raw_rewards(samples, reward_key)
    result = plugin.call(args, list(samples))
    n = len(samples)
    if result is None:
        return PostProcessedRewards(raw, _raw_rewards(samples, reward_key))
    if isinstance(result, tuple) and len(result) == 2 and all(isinstance(part, list | tuple) for part in result):
        slime_raw, rewards = result
        return PostProcessedRewards(
            _float_list(plugin, slime_raw, n, "raw rewards"), _float_list(plugin, rewards, n, "rewards")
        )
    return PostProcessedRewards(raw, _float_list(plugin, result, n, "rewards"))


def post_process_rewards(
    args: object,
    samples: Sequence[Sample],
    *,
    normalization: Normalization = Normalization.MEAN_STD,
    reward_key: str | None = None,
    plugin: Plugin | None = None,
    eps: float = GRPO_STD_EPSILON,
) -> PostProcessedRewards:
    """Raw and processed rewards, one per sample: the hook if given, else group normalisation.

    Raises:
        RewardError: a sample without a usable reward.
        PluginError: see ``call_reward_post_process``.
    """
    if plugin is not None:
        return call_reward_post_process(plugin, args, samples, reward_key=reward_key)
    raw = _raw_rewards(samples, reward_key)
    positions = _group_positions(samples)
    normalised = normalize_group_rewards([[raw[i] for i in group] for group in positions], normalization, eps=eps)
    rewards = [0.0] * len(samples)
    for group, values in zip(positions, normalised, strict=True):
        for i, value in zip(group, values, strict=True):
            rewards[i] = value
    return PostProcessedRewards(raw, rewards)
