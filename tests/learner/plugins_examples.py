"""Reference plugins for the contract tests: valid ones, invalid ones, and slime's legacy forms.

Each is loaded by dotted path (``tests.learner.plugins_examples:name``) exactly as a user's plugin
would be, and run through the same assertions in ``test_plugins.py``.
"""

from __future__ import annotations

from typing import Any

import torch

from learner.batching import DynamicFilterOutput
from learner.sample import Sample

# reward: async (args, sample) -> float | dict


async def reward_length(args: Any, sample: Sample) -> float:
    return float(sample.response_length)


async def reward_dict(args: Any, sample: Sample, **kwargs: Any) -> dict[str, float]:
    return {"score": 0.5, "length": float(sample.response_length)}


class RewardCallable:
    """An object with ``async def __call__`` counts as async."""

    async def __call__(self, args: Any, sample: Sample) -> float:
        return 1.0


reward_callable = RewardCallable()


def reward_sync(args: Any, sample: Sample) -> float:  # invalid: not async
    return 1.0


async def reward_three_params(args: Any, sample: Sample, judge: Any) -> float:  # invalid: extra required
    return 1.0


async def reward_keyword_only(args: Any, sample: Sample, *, judge: Any) -> float:  # invalid: kw-only required
    return 1.0


async def reward_one_param(sample: Sample) -> float:  # invalid: called with two
    return 1.0


async def reward_returns_text(args: Any, sample: Sample) -> str:  # invalid at runtime
    return "good"


async def reward_returns_bool(args: Any, sample: Sample) -> bool:  # invalid at runtime: almost always a bug
    return True


REWARD_CONSTANT = 3.0  # invalid: not callable


# batched reward: async (args, samples) -> list


async def batched_reward(args: Any, samples: list[Sample]) -> list[float]:
    return [float(s.index or 0) + 0.25 for s in samples]


async def batched_reward_short(args: Any, samples: list[Sample]) -> list[float]:  # invalid at runtime
    return [1.0]


# reward post-processing: (args, samples) -> list[float] | (raw, rewards) | None


def post_process_list(args: Any, samples: list[Sample]) -> list[float]:
    return [s.reward_value() * 2 for s in samples]


def post_process_in_place(args: Any, samples: list[Sample]) -> None:
    for s in samples:
        s.reward = s.reward_value() - 1.0


def post_process_slime(args: Any, samples: list[Sample]) -> tuple[list[float], list[float]]:  # legacy
    raw = [s.reward_value() for s in samples]
    return raw, [r + 1.0 for r in raw]


def post_process_wrong_length(args: Any, samples: list[Sample]) -> list[float]:  # invalid at runtime
    return [0.0]


async def post_process_async(args: Any, samples: list[Sample]) -> list[float]:  # invalid: async
    return [0.0 for _ in samples]


# dynamic-sampling filter: (args, samples) -> DynamicFilterOutput | bool


def filter_drop_flagged(args: Any, samples: list[Sample], **kwargs: Any) -> DynamicFilterOutput:
    keep = not any(s.metadata.get("drop") for s in samples)
    return DynamicFilterOutput(keep=keep, reason=None if keep else "drop_flag")


def filter_legacy_bool(args: Any, samples: list[Sample]) -> bool:  # legacy: bare bool
    return not any(s.metadata.get("drop") for s in samples)


def filter_returns_none(args: Any, samples: list[Sample]) -> None:  # invalid at runtime: forgot return
    return None


async def filter_async(args: Any, samples: list[Sample]) -> bool:  # invalid: the coroutine is always truthy
    return False


# buffer filter: (args, samples) -> list[Sample]


def buffer_keep_rated(
    args: Any, rollout_id: int | None, buffer: list[list[Sample]], num_samples: int
) -> list[list[Sample]]:
    return [[s for s in group if s.metadata.get("source") != "corrected_answer"] for group in buffer[:num_samples]]


def buffer_invents(
    args: Any, rollout_id: int | None, buffer: list[list[Sample]], num_samples: int
) -> list[list[Sample]]:  # invalid at runtime
    return [[Sample(prompt_token_ids=[1], response_token_ids=[2])]]


# custom generate: async (args, sample, sampling_params[, evaluation]) -> Sample | list[Sample]


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    sample.response_token_ids = [7, 8, 9]
    sample.status = Sample.Status.COMPLETED
    return sample


async def generate_with_evaluation(
    args: Any, sample: Sample, sampling_params: dict[str, Any], evaluation: bool = False
) -> Sample:
    sample.response_token_ids = [7]
    sample.metadata["evaluation"] = evaluation
    sample.status = Sample.Status.COMPLETED
    return sample


def generate_sync(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:  # invalid: not async
    return sample


# rollout and eval rollout: (args, rollout_id, data_source, evaluation=False)


def rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> list[list[Sample]]:
    return [[Sample(prompt_token_ids=[1], response_token_ids=[rollout_id], reward=1.0)]]


async def rollout_async(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> list[list[Sample]]:
    return []


def rollout_without_evaluation(args: Any, rollout_id: int, data_source: Any) -> list[list[Sample]]:  # invalid
    return []


# custom loss: (args, batch, logits, sum_of_sample_mean) -> (loss, metrics)


def custom_loss(args: Any, batch: Any, logits: Any, sum_of_sample_mean: Any) -> tuple[Any, dict[str, Any]]:
    return sum_of_sample_mean(logits), {}


def custom_loss_three_params(args: Any, batch: Any, logits: Any) -> tuple[Any, dict[str, Any]]:  # invalid
    return logits, {}


# custom loss: (args, batch, logits, sum_of_sample_mean) -> (loss, metrics)


def loss_vanilla_policy_gradient(
    args: Any, batch: dict[str, Any], logits: Any, sum_of_sample_mean: Any
) -> tuple[Any, dict[str, float]]:
    """-A * log p, which on-policy has the built-in clipped loss's gradient; written as slime's losses
    are (its log-prob helper, per-sample lists, sum_of_sample_mean over the responses)."""
    from slime.backends.megatron_utils.loss import get_log_probs_and_entropy

    _, scores = get_log_probs_and_entropy(
        logits,
        args=args,
        unconcat_tokens=batch["unconcat_tokens"],
        total_lengths=batch["total_lengths"],
        response_lengths=batch["response_lengths"],
    )
    log_probs = torch.cat(scores["log_probs"])
    loss = sum_of_sample_mean(-torch.cat(batch["advantages"]) * log_probs)
    return loss, {"custom_loss": float(loss.detach())}


def loss_not_a_tuple(
    args: Any, batch: dict[str, Any], logits: Any, sum_of_sample_mean: Any
) -> Any:  # invalid at runtime
    return sum_of_sample_mean(torch.cat(batch["log_probs"]))


# CUSTOM_TIS: slime's contract, written as slime's vanilla_tis_function and icepop_function are.


def tis_vanilla(
    args: Any, *, pg_loss: Any, train_log_probs: Any, rollout_log_probs: Any, loss_masks: Any, **kwargs: Any
) -> tuple[Any, Any, dict[str, Any]]:
    tis = torch.exp(torch.cat(train_log_probs) - torch.cat(rollout_log_probs))
    weights = torch.clamp(tis, min=args.tis_clip_low, max=args.tis_clip)
    return pg_loss * weights, loss_masks, {"custom_tis": tis, "custom_tis_clipfrac": (weights != tis).float()}


def tis_drop_first_tokens(
    args: Any, *, pg_loss: Any, train_log_probs: Any, rollout_log_probs: Any, loss_masks: Any, **kwargs: Any
) -> tuple[Any, Any, dict[str, Any]]:
    """Masks out every sample's first response token (a mask change, as icepop-like filters make)."""
    masks = [torch.cat([m[:1] * 0, m[1:]]) for m in loss_masks]
    return pg_loss, masks, {}


def tis_wrong_shape(args: Any, **kwargs: Any) -> tuple[Any, Any, dict[str, Any]]:  # invalid at runtime
    return kwargs["pg_loss"][:1], kwargs["loss_masks"], {}


# custom advantage: slime's (args, rollout_data) -> None, setting advantages and returns per sample


def advantages_broadcast(args: Any, rollout_data: dict[str, Any]) -> None:
    """What slime's grpo branch does: each sample's score on every response token."""
    rollout_data["advantages"] = [
        torch.ones_like(kl) * r for kl, r in zip(rollout_data["kl"], rollout_data["rewards"], strict=True)
    ]
    rollout_data["returns"] = rollout_data["advantages"]


def advantages_missing(args: Any, rollout_data: dict[str, Any]) -> None:  # invalid at runtime
    rollout_data["returns"] = []


# custom pg-loss reducer: slime's (total_lengths, response_lengths, loss_masks, calculate_per_token_loss) -> reducer


def pg_reducer_sample_mean(
    total_lengths: list[int], response_lengths: list[int], loss_masks: list[Any], calculate_per_token_loss: bool
) -> Any:
    """slime's own sum_of_sample_mean, written out: each sample's masked mean, summed."""

    def reduce(values: Any) -> Any:
        parts = values.split(response_lengths)
        return sum((p * m).sum() / m.sum().clamp_min(1) for p, m in zip(parts, loss_masks, strict=True))

    return reduce


def pg_reducer_longest_only(
    total_lengths: list[int], response_lengths: list[int], loss_masks: list[Any], calculate_per_token_loss: bool
) -> Any:
    """Only the longest response's tokens count (a reducer that changes the loss)."""
    longest = max(range(len(response_lengths)), key=response_lengths.__getitem__)

    def reduce(values: Any) -> Any:
        return values.split(response_lengths)[longest].sum()

    return reduce
