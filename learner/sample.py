"""One trainable trajectory: the learner's ``Sample``, close to slime's on purpose.

slime users bring reward functions, filters and rollout plugins that read and write a ``Sample``
(``slime/utils/types.py``); the names here are slime's wherever the meaning is the same, so such
plugins run unchanged when they only touch those fields: ``group_index``, ``index``, ``rollout_id``,
``prompt``, ``response``, ``label``, ``reward``, ``loss_mask``, ``rollout_log_probs``,
``weight_versions``, ``status`` (``Sample.Status``), ``metadata``, ``session_id``, ``remove_sample``,
``response_length``, ``tokens``, ``effective_response_length`` and ``get_reward_value(args)``.

Where it differs, and why:

- Token ids are stored split, ``prompt_token_ids`` and ``response_token_ids``; slime stores
  ``tokens`` (prompt + response) and a separate ``response_length``. The gateway logs the two parts
  apart (token in, token out) and one list plus a length that must be kept in step is a source of
  silent off-by-n bugs. ``tokens`` and ``response_length`` are read-only properties here: a slime
  generate plugin that assigns them must assign ``prompt_token_ids`` / ``response_token_ids``.
- The exclusion flag is ``remove`` (``remove_sample`` is an alias, read and write).
- ``rollout_temperature`` is added: slime divides the logits by one ``--rollout-temperature`` before
  scoring; a tandem round mixes logged answers sampled at each request's temperature with fresh
  rollouts, so each sample carries the temperature its response was drawn at (greedy: 1).
- ``supervised`` is added: a sample trained by likelihood (the SFT term, ``loss.sft_coef``) instead of
  by its advantage, such as a user's corrected answer (``learner.corrections``).
- ``user_id`` and ``completion_id`` are added: feedback comes from users (per-user baselines) and
  every trajectory traces back to the logged completion it came from (idempotent rounds).
- Slotted: a misspelt attribute raises instead of silently creating a new one; per-sample extras go
  in ``metadata``. slime's multimodal, routed-expert, top-p replay, speculative-decoding and timing
  fields are left out (nothing in tandem produces them).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

__all__ = ["Sample", "SampleError", "SampleStatus", "scored_temperature"]

# Below this a temperature is greedy: engines (SGLang, the local one) then log the log-probs at 1.
_GREEDY_BELOW = 1e-5


def scored_temperature(temperature: float) -> float:
    """The temperature whose distribution an engine's logged log-probs are of: the sampling
    temperature, or 1 for a greedy request (dividing by ~0 would overflow the logits)."""
    return temperature if temperature >= _GREEDY_BELOW else 1.0


class SampleError(ValueError):
    """A sample whose parts do not fit together (lengths, mask values, missing reward)."""


class SampleStatus(Enum):
    """How generation ended; the values are slime's."""

    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"  # recoverable failure (tool error, parse error): may hold partial output


@dataclass(slots=True, eq=False)
class Sample:
    """One prompt and one response, with what training needs to learn from it.

    ``loss_mask`` and ``rollout_log_probs`` run over the response tokens only; ``loss_mask`` None
    means every response token is trained (slime's default). ``weight_versions`` lists the weight
    versions that produced the response, in order (one entry per engine response, as in slime).
    """

    Status = SampleStatus  # slime spells it ``Sample.Status.COMPLETED``

    prompt_token_ids: list[int] = field(default_factory=list)
    response_token_ids: list[int] = field(default_factory=list)
    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None  # samples sharing one share a loss denominator (slime)
    prompt: str | list[dict[str, Any]] = ""
    response: str = ""
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    rollout_log_probs: list[float] | None = None
    rollout_temperature: float = 1.0  # training divides this sample's logits by it (see the module doc)
    supervised: bool = False  # trained by likelihood (SFT), not by its advantage (see the module doc)
    weight_versions: list[str] = field(default_factory=list)
    status: SampleStatus = SampleStatus.PENDING
    remove: bool = False
    user_id: str | None = None
    session_id: str | None = None
    completion_id: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    # slime-compatible views

    @property
    def tokens(self) -> list[int]:
        """Prompt then response token ids (a new list: assigning to it changes nothing)."""
        return [*self.prompt_token_ids, *self.response_token_ids]

    @property
    def response_length(self) -> int:
        return len(self.response_token_ids)

    @property
    def prompt_length(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def total_length(self) -> int:
        """Tokens the sample occupies in a packed micro-batch."""
        return len(self.prompt_token_ids) + len(self.response_token_ids)

    @property
    def effective_response_length(self) -> int:
        """Response tokens that carry loss (slime: the loss-mask sum; ``remove`` is applied at batching)."""
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length

    @property
    def remove_sample(self) -> bool:
        return self.remove

    @remove_sample.setter
    def remove_sample(self, value: bool) -> None:
        self.remove = value

    def resolved_loss_mask(self) -> list[int]:
        """The loss mask with slime's default (all ones) filled in."""
        return list(self.loss_mask) if self.loss_mask is not None else [1] * self.response_length

    # rewards

    def reward_value(self, key: str | None = None) -> float:
        """The scalar reward; ``key`` picks one entry of a dict reward (slime's ``--reward-key``).

        Raises:
            SampleError: no reward yet, a dict reward without ``key`` or without that entry, or a
                value that is not a finite number.
        """
        reward = self.reward
        if reward is None:
            raise SampleError(f"sample {self.index} has no reward yet")
        if isinstance(reward, dict):
            if key is None:
                raise SampleError(f"sample {self.index} has a dict reward {sorted(reward)}; set a reward key")
            if key not in reward:
                raise SampleError(f"sample {self.index}: reward key {key!r} not in {sorted(reward)}")
            reward = reward[key]
        elif key is not None:
            raise SampleError(f"sample {self.index}: reward key {key!r} given but the reward is not a dict")
        return _finite_float(reward, f"sample {self.index} reward")

    def get_reward_value(self, args: object) -> float:
        """slime's accessor: the key comes from ``args.reward_key`` when ``args`` has one."""
        return self.reward_value(getattr(args, "reward_key", None))

    # consistency

    def validate(self) -> None:
        """Check that per-token fields match the response length.

        Raises:
            SampleError: a loss mask or log-prob list of the wrong length, or mask values other than 0/1.
        """
        n = self.response_length
        if self.loss_mask is not None:
            if len(self.loss_mask) != n:
                raise SampleError(f"sample {self.index}: loss_mask has {len(self.loss_mask)} entries, response {n}")
            if any(m not in (0, 1) for m in self.loss_mask):
                raise SampleError(f"sample {self.index}: loss_mask values must be 0 or 1")
        if self.rollout_log_probs is not None and len(self.rollout_log_probs) != n:
            raise SampleError(
                f"sample {self.index}: rollout_log_probs has {len(self.rollout_log_probs)} entries, response {n}"
            )
        if not self.rollout_temperature > 0:
            raise SampleError(f"sample {self.index}: rollout_temperature must be > 0, got {self.rollout_temperature}")
        if not isinstance(self.status, SampleStatus):
            raise SampleError(f"sample {self.index}: status must be a Sample.Status, got {self.status!r}")

    # plain data, for saving a round's batch and replaying it

    def to_dict(self) -> dict[str, Any]:
        """A deep copy as plain data (the status by its value), e.g. to save a round's batch as JSON."""
        data = {name: copy.deepcopy(getattr(self, name)) for name in _FIELD_NAMES}
        data["status"] = self.status.value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sample:
        """Inverse of ``to_dict``.

        Raises:
            SampleError: unknown keys (a newer or foreign format) or an unknown status.
        """
        unknown = set(data) - set(_FIELD_NAMES)
        if unknown:
            raise SampleError(f"unknown sample fields {sorted(unknown)}")
        values = dict(data)
        if "status" in values:
            try:
                values["status"] = SampleStatus(values["status"])
            except ValueError as exc:
                raise SampleError(f"unknown sample status {values['status']!r}") from exc
        return cls(**values)


_FIELD_NAMES: tuple[str, ...] = tuple(Sample.__dataclass_fields__)


def _finite_float(value: object, what: str) -> float:
    # bool is an int: a reward function returning True is almost always a bug, so refuse it
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SampleError(f"{what} must be a number, got {type(value).__name__}")
    result = float(value)
    if not math.isfinite(result):
        raise SampleError(f"{what} must be finite, got {result}")
    return result
