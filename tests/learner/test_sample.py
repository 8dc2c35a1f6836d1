"""The learner's Sample: slime-compatible views, validation, reward access, plain-data round trip."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import pytest

from learner.sample import Sample, SampleError, SampleStatus


def make(**overrides: object) -> Sample:
    values: dict[str, object] = {"prompt_token_ids": [10, 11, 12], "response_token_ids": [20, 21], "index": 4}
    values.update(overrides)
    return Sample(**values)  # type: ignore[arg-type]


def test_slime_views_of_the_split_tokens() -> None:
    sample = make()
    assert sample.tokens == [10, 11, 12, 20, 21]
    assert sample.response_length == 2
    assert sample.prompt_length == 3
    assert sample.total_length == 5


def test_tokens_is_a_copy() -> None:
    sample = make()
    sample.tokens.append(99)
    assert sample.total_length == 5


def test_effective_response_length_follows_the_loss_mask() -> None:
    assert make().effective_response_length == 2  # no mask: every response token
    assert make(loss_mask=[0, 1]).effective_response_length == 1


def test_resolved_loss_mask_defaults_to_ones_and_is_a_copy() -> None:
    sample = make()
    assert sample.resolved_loss_mask() == [1, 1]
    masked = make(loss_mask=[1, 0])
    masked.resolved_loss_mask()[0] = 0
    assert masked.loss_mask == [1, 0]


def test_status_enum_is_slimes() -> None:
    assert Sample.Status is SampleStatus
    assert [s.value for s in SampleStatus] == ["pending", "completed", "truncated", "aborted", "failed"]
    assert make().status is Sample.Status.PENDING


def test_remove_sample_is_an_alias_of_remove() -> None:
    sample = make()
    sample.remove_sample = True
    assert sample.remove is True
    sample.remove = False
    assert sample.remove_sample is False


def test_slots_refuse_unknown_attributes() -> None:
    sample = make()
    with pytest.raises(AttributeError):
        sample.rewrad = 1.0  # type: ignore[attr-defined]


def test_samples_compare_by_identity() -> None:
    assert make() != make()
    one = make()
    assert one == one and one in [make(), one]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"loss_mask": [1]}, "loss_mask has 1 entries, response 2"),
        ({"loss_mask": [1, 2]}, "values must be 0 or 1"),
        ({"rollout_log_probs": [-0.1, -0.2, -0.3]}, "rollout_log_probs has 3 entries, response 2"),
        ({"status": "completed"}, "status must be a Sample.Status"),
    ],
)
def test_inconsistent_samples_are_refused(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(SampleError, match=message):
        make(**overrides)


def test_validate_catches_changes_after_construction() -> None:
    sample = make(loss_mask=[1, 1])
    sample.response_token_ids.append(22)
    with pytest.raises(SampleError, match="loss_mask has 2 entries, response 3"):
        sample.validate()


def test_reward_value_of_a_float_and_a_dict() -> None:
    assert make(reward=1).reward_value() == 1.0
    assert make(reward={"score": 0.5, "length": 3}).reward_value("score") == 0.5


@pytest.mark.parametrize(
    ("reward", "key", "message"),
    [
        (None, None, "has no reward yet"),
        ({"score": 0.5}, None, "dict reward \\['score'\\]; set a reward key"),
        ({"score": 0.5}, "length", "reward key 'length' not in \\['score'\\]"),
        (0.5, "score", "reward key 'score' given but the reward is not a dict"),
        (True, None, "must be a number, got bool"),
        ("1.0", None, "must be a number, got str"),
        (math.nan, None, "must be finite"),
        ({"score": math.inf}, "score", "must be finite"),
    ],
)
def test_unusable_rewards_are_refused(reward: object, key: str | None, message: str) -> None:
    with pytest.raises(SampleError, match=message):
        make(reward=reward).reward_value(key)


def test_get_reward_value_reads_the_key_from_args_like_slime() -> None:
    @dataclass
    class Args:
        reward_key: str | None

    sample = make(reward={"score": 0.25})
    assert sample.get_reward_value(Args("score")) == 0.25
    assert make(reward=0.75).get_reward_value(object()) == 0.75  # args without reward_key


def test_plain_data_round_trip_through_json() -> None:
    sample = make(
        group_index=2,
        rollout_id=7,
        prompt=[{"role": "user", "content": "hi"}],
        response="hello",
        reward={"score": 1.0},
        loss_mask=[1, 0],
        rollout_log_probs=[-0.5, -1.5],
        weight_versions=["v3"],
        status=SampleStatus.TRUNCATED,
        remove=True,
        user_id="u1",
        session_id="s1",
        completion_id="chatcmpl-1",
        metadata={"source": "logged"},
    )
    data = json.loads(json.dumps(sample.to_dict()))
    assert data["status"] == "truncated"
    back = Sample.from_dict(data)
    assert back.to_dict() == sample.to_dict()
    assert back.status is SampleStatus.TRUNCATED


def test_to_dict_is_a_deep_copy() -> None:
    sample = make(metadata={"tags": ["a"]})
    data = sample.to_dict()
    data["metadata"]["tags"].append("b")
    data["prompt_token_ids"].append(0)
    assert sample.metadata == {"tags": ["a"]} and sample.prompt_length == 3


def test_from_dict_refuses_unknown_fields_and_statuses() -> None:
    with pytest.raises(SampleError, match="unknown sample fields \\['tokens'\\]"):
        Sample.from_dict({"tokens": [1, 2]})
    with pytest.raises(SampleError, match="unknown sample status 'done'"):
        Sample.from_dict({"status": "done"})
