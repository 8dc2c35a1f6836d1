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


def test_slime_form_and_split_form_are_one_sample() -> None:
    sample = make()
    assert sample.tokens == [10, 11, 12, 20, 21]
    assert sample.response_length == 2
    assert sample.prompt_length == 3
    assert sample.total_length == 5
    slime_form = Sample(tokens=[10, 11, 12, 20, 21], response_length=2)
    assert slime_form.prompt_token_ids == [10, 11, 12] and slime_form.response_token_ids == [20, 21]


def test_a_slime_generate_function_writes_tokens_and_response_length() -> None:
    # what slime's multi-turn examples do: tokens assigned, then extended in place, length kept by hand
    sample = Sample(tokens=[10, 11, 12])
    sample.tokens = sample.tokens + [20, 21]  # noqa: RUF005 (as slime plugins write it)
    sample.response_length += 2
    sample.tokens += [30]
    sample.response_length += 1
    assert sample.prompt_token_ids == [10, 11, 12] and sample.response_token_ids == [20, 21, 30]
    sample.validate()


def test_append_response_tokens_keeps_mask_and_log_probs_in_step() -> None:
    sample = Sample(tokens=[10, 11])
    meta = {"finish_reason": {"type": "stop"}, "weight_version": "v1", "cached_tokens": 0, "prompt_tokens": 2}
    sample.append_response_tokens(None, tokens=[20, 21], log_probs=[-0.5, -0.25], text="ab", meta_info=meta)
    sample.append_response_tokens(tokens=[30], trainable=False, text="<tool>")
    assert sample.tokens == [10, 11, 20, 21, 30] and sample.response == "ab<tool>"
    assert sample.loss_mask == [1, 1, 0] and sample.rollout_log_probs == [-0.5, -0.25, 0.0]
    assert sample.status is Sample.Status.COMPLETED and sample.weight_versions == ["v1"]
    with pytest.raises(SampleError, match="need their rollout log-probs"):
        sample.append_response_tokens(tokens=[40])
    with pytest.raises(SampleError, match="take no log-probs"):
        sample.append_response_tokens(tokens=[40], log_probs=[-1.0], trainable=False)
    with pytest.raises(SampleError, match="1 log_probs for 2 tokens"):
        sample.append_response_tokens(tokens=[40, 41], log_probs=[-1.0])


def test_split_views_are_copies_and_assignable() -> None:
    sample = make()
    sample.response_token_ids.append(99)
    assert sample.tokens == [10, 11, 12, 20, 21]
    sample.response_token_ids = [7, 8, 9]
    assert sample.tokens == [10, 11, 12, 7, 8, 9] and sample.response_length == 3
    sample.prompt_token_ids = [1]
    assert sample.tokens == [1, 7, 8, 9] and sample.response_length == 3


def test_every_slime_field_is_here_with_its_default() -> None:
    slime_fields = {
        "group_index": None, "index": None, "rollout_id": None, "prompt": "", "tokens": [],
        "multimodal_inputs": None, "multimodal_train_inputs": None, "multimodal_train_input_id": None,
        "apply_chat_template_kwargs": {}, "response": "", "response_length": 0, "label": None, "reward": None,
        "loss_mask": None, "weight_versions": [], "rollout_log_probs": None, "rollout_top_p_token_ids": None,
        "rollout_top_p_token_offsets": None, "rollout_routed_experts": None, "remove_sample": False,
        "teacher_log_probs": None, "status": Sample.Status.PENDING, "metadata": {}, "generate_function_path": None,
        "custom_rm_path": None, "train_metadata": None, "session_id": None, "non_generation_time": 0.0,
    }  # fmt: skip
    sample = Sample()
    assert {name: getattr(sample, name) for name in slime_fields} == slime_fields
    assert list(Sample.__dataclass_fields__)[: len(slime_fields) + 2] == [
        *slime_fields,
        "spec_info",
        "prefix_cache_info",
    ]  # slime's order, so positional construction means the same
    assert sample.spec_info == Sample.SpecInfo() and sample.prefix_cache_info == Sample.PrefixCacheInfo()


def test_update_from_meta_info_like_slime() -> None:
    @dataclass
    class Args:
        sglang_speculative_algorithm: str | None

    sample = make()
    meta = {"finish_reason": {"type": "length"}, "weight_version": "v2", "cached_tokens": 3, "prompt_tokens": 4}
    sample.update_from_meta_info(Args(None), meta)
    sample.update_from_meta_info(
        Args("EAGLE"), {**meta, "finish_reason": {"type": "stop"}, "spec_verify_ct": 2, "completion_tokens": 6}
    )
    assert sample.status is Sample.Status.COMPLETED and sample.weight_versions == ["v2", "v2"]
    assert sample.prefix_cache_info.prefix_cache_hit_rate == 6 / 8
    assert sample.spec_info.spec_accept_length == 3.0  # counted only with speculation on


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


def test_plugins_may_set_attributes_of_their_own() -> None:
    sample = make()
    sample.turns = 3  # type: ignore[attr-defined]  # slime's Sample is a plain dataclass
    assert Sample.from_dict(sample.to_dict()).turns == 3  # type: ignore[attr-defined]


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
        ({"teacher_log_probs": [-0.1]}, "teacher_log_probs has 1 entries, response 2"),
        ({"status": "completed"}, "status must be a Sample.Status"),
    ],
)
def test_inconsistent_samples_are_refused(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(SampleError, match=message):
        make(**overrides)


def test_validate_catches_changes_after_construction() -> None:
    sample = make(loss_mask=[1, 1])
    sample.tokens.append(22)
    sample.response_length += 1
    with pytest.raises(SampleError, match="loss_mask has 2 entries, response 3"):
        sample.validate()


def test_reward_value_of_a_float_and_a_dict() -> None:
    assert make(reward=1).reward_value() == 1.0
    assert make(reward={"score": 0.5, "length": 3}).reward_value("score") == 0.5
    assert make(reward=0.5).reward_value("score") == 0.5  # a rated answer beside dict-scored rollouts


@pytest.mark.parametrize(
    ("reward", "key", "message"),
    [
        (None, None, "has no reward yet"),
        ({"score": 0.5}, None, "dict reward \\['score'\\]; set a reward key"),
        ({"score": 0.5}, "length", "reward key 'length' not in \\['score'\\]"),
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
        remove_sample=True,
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
    data["tokens"].append(0)
    assert sample.metadata == {"tags": ["a"]} and sample.prompt_length == 3


def test_from_dict_reads_older_saved_batches_and_refuses_unknown_statuses() -> None:
    older = Sample.from_dict({"prompt_token_ids": [1, 2], "response_token_ids": [3], "status": "completed"})
    assert older.tokens == [1, 2, 3] and older.response_length == 1
    with pytest.raises(SampleError, match="unknown sample status 'done'"):
        Sample.from_dict({"status": "done"})
