"""One trainable trajectory: the learner's ``Sample``, slime's (``slime/utils/types.py``) field for field.

slime users bring reward functions, filters and rollout plugins that read and write a ``Sample``;
every field of slime's is here with its name, type, default and mutability, in slime's order, so
such plugins run unchanged: a generate function may assign ``tokens`` and ``response_length``,
extend ``tokens`` in place, set attributes of its own, and call ``update_from_meta_info`` with
SGLang's ``meta_info``. ``Sample.Status`` has slime's values.

tandem adds, after slime's fields:

- ``prompt_token_ids`` / ``response_token_ids``: the two parts of ``tokens`` as views (read and
  write; a new list each read). The constructor takes either form: ``tokens`` with
  ``response_length``, or the two parts (the gateway logs them apart, token in, token out); give
  one form, not both.
- ``rollout_temperature``: slime divides the logits by one ``--rollout-temperature`` before
  scoring; a tandem round mixes logged answers sampled at each request's temperature with fresh
  rollouts, so each sample carries the temperature its response was drawn at (greedy: 1).
- ``supervised``: trained by likelihood (the SFT term, ``loss.sft_coef``) instead of by its
  advantage, such as a user's corrected answer (``learner.corrections``).
- ``user_id`` and ``completion_id``: feedback comes from users (per-user baselines) and every
  trajectory traces back to the logged completion it came from (idempotent rounds).

Training reads text only: a sample with ``multimodal_train_inputs`` is refused at batching;
``rollout_top_p_token_ids`` / ``_offsets`` and ``rollout_routed_experts`` are carried but not used
(tandem's engines report neither), and ``append_response_tokens`` does not read them from meta_info.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, overload

__all__ = ["PrefixCacheInfo", "Sample", "SampleError", "SampleStatus", "SpecInfo", "scored_temperature"]

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


class _TokenPart:
    """``prompt_token_ids`` or ``response_token_ids``: a read-write view of one part of ``tokens``.

    A descriptor-typed dataclass field, so the constructor takes the parts too; assigned after
    ``tokens`` and ``response_length`` (declared after them), and not given (None) it changes nothing.
    Reading gives a new list: change the parts by assigning them.
    """

    def __init__(self, *, response: bool) -> None:
        self._response = response

    @overload
    def __get__(self, sample: None, owner: type | None = None) -> None: ...
    @overload
    def __get__(self, sample: Sample, owner: type | None = None) -> list[int]: ...
    def __get__(self, sample: Sample | None, owner: type | None = None) -> list[int] | None:
        if sample is None:
            return None  # the dataclass default: the part not given
        cut = sample.prompt_length
        return sample.tokens[cut:] if self._response else sample.tokens[:cut]

    def __set__(self, sample: Sample, ids: list[int] | None) -> None:
        if ids is None:
            return
        cut = sample.prompt_length
        prompt, response = (sample.tokens[:cut], list(ids)) if self._response else (list(ids), sample.tokens[cut:])
        sample.tokens = [*prompt, *response]
        sample.response_length = len(response)


_FINISH_STATUS = {"length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED, "stop": SampleStatus.COMPLETED}


@dataclass(eq=False)
class Sample:
    """One prompt and one response, with what training needs to learn from it.

    ``tokens`` is prompt then response; the last ``response_length`` of them are the response.
    ``loss_mask`` and ``rollout_log_probs`` run over the response tokens only; ``loss_mask`` None
    means every response token is trained (slime's default). ``weight_versions`` lists the weight
    versions that produced the response, in order (one entry per engine response, as in slime).
    """

    Status = SampleStatus  # slime spells it ``Sample.Status.COMPLETED``

    @dataclass
    class SpecInfo:
        """Speculative-decoding counters summed over a sample's engine responses (slime's ``Sample.SpecInfo``)."""

        spec_accept_token_num: int = 0
        spec_draft_token_num: int = 0
        spec_verify_ct: int = 0
        completion_token_num: int = 0

        @property
        def spec_accept_rate(self) -> float:
            return self.spec_accept_token_num / self.spec_draft_token_num if self.spec_draft_token_num else 0.0

        @property
        def spec_accept_length(self) -> float:
            return self.completion_token_num / self.spec_verify_ct if self.spec_verify_ct else 0.0

        def add(self, meta_info: dict[str, Any]) -> None:
            self.spec_accept_token_num += meta_info.get("spec_accept_token_num", 0)
            self.spec_draft_token_num += meta_info.get("spec_draft_token_num", 0)
            self.spec_verify_ct += meta_info.get("spec_verify_ct", 0)
            self.completion_token_num += meta_info.get("completion_tokens", 0)

        def to_dict(self) -> dict[str, int]:
            return asdict(self)

        @staticmethod
        def from_dict(data: dict[str, Any]) -> Sample.SpecInfo:
            return Sample.SpecInfo(**{name: data.get(name, 0) for name in Sample.SpecInfo.__dataclass_fields__})

    @dataclass
    class PrefixCacheInfo:
        """Prompt tokens the engine found cached, summed over a sample's engine responses (slime's)."""

        cached_tokens: int = 0
        total_prompt_tokens: int = 0

        @property
        def prefix_cache_hit_rate(self) -> float:
            return self.cached_tokens / self.total_prompt_tokens if self.total_prompt_tokens else 0.0

        def add(self, meta_info: dict[str, Any]) -> None:
            self.cached_tokens += meta_info.get("cached_tokens", 0)
            self.total_prompt_tokens += meta_info.get("prompt_tokens", 0)

        def to_dict(self) -> dict[str, int]:
            return asdict(self)

        @staticmethod
        def from_dict(data: dict[str, Any]) -> Sample.PrefixCacheInfo:
            return Sample.PrefixCacheInfo(
                **{name: data.get(name, 0) for name in Sample.PrefixCacheInfo.__dataclass_fields__}
            )

    # slime's fields, in slime's order (slime 624b824, slime/utils/types.py)
    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None  # samples sharing one share a loss denominator
    prompt: str | list[dict[str, Any]] = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    multimodal_train_input_id: str | None = None
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_top_p_token_ids: list[int] | None = None
    rollout_top_p_token_offsets: list[int] | None = None
    rollout_routed_experts: list[list[int]] | None = None
    remove_sample: bool = False
    teacher_log_probs: list[float] | None = None
    status: SampleStatus = SampleStatus.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    generate_function_path: str | None = None  # this sample's own generate plugin (slime's)
    custom_rm_path: str | None = None  # this sample's own reward plugin (slime's)
    train_metadata: dict[str, Any] | None = None
    session_id: str | None = None
    non_generation_time: float = 0.0
    spec_info: SpecInfo = field(default_factory=SpecInfo)
    prefix_cache_info: PrefixCacheInfo = field(default_factory=PrefixCacheInfo)
    # tandem's (see the module doc)
    rollout_temperature: float = 1.0
    supervised: bool = False
    user_id: str | None = None
    completion_id: str | None = None
    # The split form: views of ``tokens`` that the constructor takes too (``_TokenPart``).
    prompt_token_ids: _TokenPart = _TokenPart(response=False)
    response_token_ids: _TokenPart = _TokenPart(response=True)

    def __post_init__(self) -> None:
        self.validate()

    # views

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def total_length(self) -> int:
        """Tokens the sample occupies in a packed micro-batch."""
        return len(self.tokens)

    @property
    def effective_response_length(self) -> int:
        """Response tokens that carry loss (slime: the loss-mask sum; ``remove_sample`` is applied at batching)."""
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length

    def resolved_loss_mask(self) -> list[int]:
        """The loss mask with slime's default (all ones) filled in."""
        return list(self.loss_mask) if self.loss_mask is not None else [1] * self.response_length

    def append_response_tokens(
        self,
        args: object = None,
        *,
        tokens: list[int] | None = None,
        log_probs: list[float] | None = None,
        trainable: bool = True,
        meta_info: dict[str, Any] | None = None,
        text: str | None = None,
        update_terminal_info: bool = True,
    ) -> None:
        """Append one turn to the response, keeping the mask and log-probs in step (slime's method).

        The model's tokens come with their log-probs and carry loss; tool or user text
        (``trainable=False``) gets loss-mask 0 and log-prob 0. ``meta_info`` (SGLang's) updates the
        status, weight versions and cache counters unless ``update_terminal_info`` is False.

        Raises:
            SampleError: log-probs of another length, trainable tokens without log-probs (or after
                response tokens that had none), log-probs for non-trainable tokens.
        """
        tokens = [int(t) for t in tokens or []]
        if log_probs is not None and len(log_probs) != len(tokens):
            raise SampleError(f"sample {self.index}: {len(log_probs)} log_probs for {len(tokens)} tokens")
        if tokens and trainable and log_probs is None:
            raise SampleError(f"sample {self.index}: trainable response tokens need their rollout log-probs")
        if tokens and not trainable:
            if log_probs is not None:
                raise SampleError(f"sample {self.index}: non-trainable tokens take no log-probs")
            log_probs = [0.0] * len(tokens)
        if text is not None:
            self.response += text
        before = self.response_length
        if tokens:
            self.tokens += tokens
            self.response_length += len(tokens)
            self.loss_mask = [*(self.loss_mask if self.loss_mask is not None else [1] * before)]
            self.loss_mask += [int(trainable)] * len(tokens)
        if log_probs is not None:
            if self.rollout_log_probs is None:
                if trainable and before:
                    raise SampleError(
                        f"sample {self.index}: cannot append log-probs after {before} response tokens without any"
                    )
                self.rollout_log_probs = [0.0] * before
            self.rollout_log_probs += [float(lp) for lp in log_probs]
        if meta_info is not None and update_terminal_info and "finish_reason" in meta_info:
            self.update_from_meta_info(args, meta_info)
        self.validate()

    def update_from_meta_info(self, args: object, meta_info: dict[str, Any]) -> None:
        """Fold one SGLang ``/generate`` answer's ``meta_info`` in, as slime does: cache and (with
        ``args.sglang_speculative_algorithm``) speculation counters, the weight version, the status."""
        if getattr(args, "sglang_speculative_algorithm", None):
            self.spec_info.add(meta_info)
        self.prefix_cache_info.add(meta_info)
        if "weight_version" in meta_info:
            self.weight_versions.append(meta_info["weight_version"])
        status = _FINISH_STATUS.get(meta_info["finish_reason"]["type"])
        if status is not None:
            self.status = status

    # rewards

    def reward_value(self, key: str | None = None) -> float:
        """The scalar reward; ``key`` picks one entry of a dict reward (slime's ``--reward-key``). A
        number is its own scalar whatever the key: a round's groups mix rated answers (rewards from
        the ratings) with rollouts a plugin scored with dicts.

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
        return _finite_float(reward, f"sample {self.index} reward")

    def get_reward_value(self, args: object) -> float:
        """slime's accessor: the key comes from ``args.reward_key`` when ``args`` has one."""
        return self.reward_value(getattr(args, "reward_key", None) or None)

    # consistency

    def validate(self) -> None:
        """Check that the per-token fields match the response length.

        Raises:
            SampleError: a response longer than the tokens, a loss mask or log-prob list of the wrong
                length, mask values other than 0/1, a temperature <= 0 or a status of another type.
        """
        n = self.response_length
        if not 0 <= n <= len(self.tokens):
            raise SampleError(f"sample {self.index}: response_length {n} outside [0, {len(self.tokens)} tokens]")
        if self.loss_mask is not None:
            if len(self.loss_mask) != n:
                raise SampleError(f"sample {self.index}: loss_mask has {len(self.loss_mask)} entries, response {n}")
            if any(m not in (0, 1) for m in self.loss_mask):
                raise SampleError(f"sample {self.index}: loss_mask values must be 0 or 1")
        for name in ("rollout_log_probs", "teacher_log_probs"):
            values = getattr(self, name)
            if values is not None and len(values) != n:
                raise SampleError(f"sample {self.index}: {name} has {len(values)} entries, response {n}")
        if not self.rollout_temperature > 0:
            raise SampleError(f"sample {self.index}: rollout_temperature must be > 0, got {self.rollout_temperature}")
        if not isinstance(self.status, SampleStatus):
            raise SampleError(f"sample {self.index}: status must be a Sample.Status, got {self.status!r}")

    # plain data, for saving a round's batch and replaying it

    def to_dict(self) -> dict[str, Any]:
        """A deep copy as plain data, like slime's: every attribute (a plugin's own too), the status by
        its value, the counters as dicts; e.g. to save a round's batch as JSON."""
        data = copy.deepcopy(vars(self))
        data["status"] = self.status.value
        data["spec_info"] = self.spec_info.to_dict()
        data["prefix_cache_info"] = self.prefix_cache_info.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sample:
        """Inverse of ``to_dict``; keys that are not fields become attributes, as in slime (older saved
        batches with ``prompt_token_ids`` / ``response_token_ids`` load too).

        Raises:
            SampleError: an unknown status, or parts that do not fit together.
        """
        values = dict(data)
        if "status" in values:
            try:
                values["status"] = SampleStatus(values["status"])
            except ValueError as exc:
                raise SampleError(f"unknown sample status {values['status']!r}") from exc
        values["spec_info"] = Sample.SpecInfo.from_dict(values.get("spec_info") or {})
        values["prefix_cache_info"] = Sample.PrefixCacheInfo.from_dict(values.get("prefix_cache_info") or {})
        extra = {k: values.pop(k) for k in list(values) if k not in _INIT_NAMES}  # a plugin's own attributes
        sample = cls(**values)
        for name, value in extra.items():
            setattr(sample, name, value)
        return sample


_INIT_NAMES = frozenset(Sample.__dataclass_fields__)
SpecInfo = Sample.SpecInfo
PrefixCacheInfo = Sample.PrefixCacheInfo


def _finite_float(value: object, what: str) -> float:
    # bool is an int: a reward function returning True is almost always a bug, so refuse it
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SampleError(f"{what} must be a number, got {type(value).__name__}")
    result = float(value)
    if not math.isfinite(result):
        raise SampleError(f"{what} must be finite, got {result}")
    return result
