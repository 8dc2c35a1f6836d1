"""learner.rollout against a live gateway on the tiny model: groups, plugins, errors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from learner.plugins import PluginError
from learner.rollout import RolloutConfig, RolloutError, rollout_groups
from learner.sample import Sample, SampleStatus
from learner.trainers import response_log_probs
from tests.server.conftest import ADMIN_KEY, Gateway, gateway_settings, run_gateway, tiny_model
from tests.support.uvicorn_thread import free_port

__all__ = ["tiny_model"]  # the shared fixture, visible here

PLUGINS = "tests.learner.rollout_plugins"


@pytest.fixture(scope="module")
def gateway(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    settings = gateway_settings(tmp_path_factory.mktemp("rollout-gateway"), tiny_model, admin_key=ADMIN_KEY)
    with run_gateway(settings, tenants=("acme",)) as gw:
        yield gw


def prompts() -> list[Sample]:
    return [
        Sample(prompt_token_ids=[1, 2, 3], session_id="s-1", completion_id="c-1", metadata={"tenant_id": "t"}),
        Sample(prompt_token_ids=[4, 5, 6, 7], user_id="u"),
        Sample(prompt_token_ids=[8, 9]),
    ]


def test_groups_have_n_fresh_samples_per_prompt(gateway: Gateway) -> None:
    progress: list[tuple[int, int]] = []
    config = RolloutConfig(n_samples_per_prompt=3, max_new_tokens=6, concurrency=2, seed=0)
    groups = rollout_groups(gateway.url, ADMIN_KEY, prompts(), config, on_progress=lambda d, t: progress.append((d, t)))
    assert [len(g) for g in groups] == [3, 3, 3]
    assert sorted(progress) == [(1, 3), (2, 3), (3, 3)]
    for index, (prompt, group) in enumerate(zip(prompts(), groups, strict=True)):
        assert len({tuple(s.response_token_ids) for s in group}) > 1  # sampled, not one answer repeated
        for choice, sample in enumerate(group):
            assert sample.prompt_token_ids == prompt.prompt_token_ids and sample.group_index == index
            assert 1 <= sample.response_length <= 6
            assert sample.rollout_log_probs is not None and len(sample.rollout_log_probs) == sample.response_length
            assert all(lp <= 0 for lp in sample.rollout_log_probs)
            assert sample.status is (SampleStatus.TRUNCATED if sample.response_length == 6 else SampleStatus.COMPLETED)
            assert sample.weight_versions == ["default"] and sample.reward is None
            assert sample.session_id == prompt.session_id and sample.user_id == prompt.user_id
            assert sample.completion_id is None  # a rollout is no logged completion
            assert sample.metadata["source"] == "rollout" and sample.metadata["choice_index"] == choice
            assert sample.metadata["prompt_completion_id"] == prompt.completion_id
    again = rollout_groups(gateway.url, ADMIN_KEY, prompts(), config)
    assert [[s.response_token_ids for s in g] for g in again] == [[s.response_token_ids for s in g] for g in groups]


def test_the_trainer_scores_a_rollout_at_its_temperature(gateway: Gateway, tiny_model: Path) -> None:
    """The PPO ratio / TIS weight of a fresh rollout is 1 before any step: the trainer's log-probs of the
    sampled tokens, under the same weights, are the engine's (both of logits / 0.7)."""
    config = RolloutConfig(n_samples_per_prompt=2, max_new_tokens=8, temperature=0.7, seed=0)
    samples = [s for group in rollout_groups(gateway.url, ADMIN_KEY, prompts(), config) for s in group]
    assert {s.rollout_temperature for s in samples} == {0.7}
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    trained = response_log_probs(model, samples, max_tokens_per_micro_batch=4096)
    for sample, log_probs in zip(samples, trained, strict=True):
        assert sample.rollout_log_probs is not None
        ratio = torch.exp(log_probs - torch.tensor(sample.rollout_log_probs))
        torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=2e-3, rtol=0)
    greedy = rollout_groups(gateway.url, ADMIN_KEY, prompts()[:1], RolloutConfig(max_new_tokens=2, temperature=0))
    assert greedy[0][0].rollout_temperature == 1.0  # greedy answers are logged at temperature 1


def test_custom_generate_plugin_replaces_the_default(gateway: Gateway) -> None:
    config = RolloutConfig(
        n_samples_per_prompt=2, max_new_tokens=4, custom_generate_path=f"{PLUGINS}:greedy_through_the_gateway"
    )
    groups = rollout_groups(gateway.url, ADMIN_KEY, prompts()[:2], config)
    assert [len(g) for g in groups] == [2, 2]
    for index, group in enumerate(groups):
        assert all(s.metadata["generated_by"] == "plugin" and s.group_index == index for s in group)
        assert group[0].response_token_ids == group[1].response_token_ids  # the plugin samples greedily
    canned = RolloutConfig(n_samples_per_prompt=2, custom_generate_path=f"{PLUGINS}:two_canned")
    (group,) = rollout_groups(gateway.url, ADMIN_KEY, prompts()[:1], canned)
    assert [s.response_token_ids for s in group] == [[7], [8, 9], [7], [8, 9]]
    assert {s.group_index for s in group} == {0}


def test_rollout_plugin_replaces_the_whole_rollout() -> None:
    config = RolloutConfig(rollout_path=f"{PLUGINS}:echo_rollout")
    groups = rollout_groups("http://127.0.0.1:9", "unused", prompts(), config, rollout_id=5)
    assert [[s.response_token_ids for s in g] for g in groups] == [[[5]], [[5]], [[5]]]


def test_wrong_plugins_fail_clearly(gateway: Gateway) -> None:
    with pytest.raises(PluginError, match="custom_generate plugin"):
        RolloutConfig(custom_generate_path=f"{PLUGINS}:echo_rollout")  # wrong signature: refused at config time
    config = RolloutConfig(n_samples_per_prompt=1, custom_generate_path=f"{PLUGINS}:not_a_sample")
    with pytest.raises(PluginError, match="not a Sample"):
        rollout_groups(gateway.url, ADMIN_KEY, prompts()[:1], config)


def test_errors_are_rollout_errors(gateway: Gateway) -> None:
    config = RolloutConfig(n_samples_per_prompt=2, max_new_tokens=2)
    with pytest.raises(RolloutError, match="cannot reach the gateway") as down:
        rollout_groups(f"http://127.0.0.1:{free_port()}", ADMIN_KEY, prompts(), config)
    assert down.value.status is None
    with pytest.raises(RolloutError, match="answered 401") as wrong_key:
        rollout_groups(gateway.url, "not-the-key", prompts(), config)
    assert wrong_key.value.status == 401
    with pytest.raises(RolloutError, match="answered 403"):
        rollout_groups(gateway.url, gateway.keys["acme"], prompts(), config)
    with pytest.raises(RolloutError, match="answered 400: input_ids must be token ids"):
        rollout_groups(gateway.url, ADMIN_KEY, [Sample(prompt_token_ids=[10**9])], config)


def test_a_prompt_without_room_gets_an_empty_group(gateway: Gateway) -> None:
    config = RolloutConfig(n_samples_per_prompt=2, max_new_tokens=4)
    too_long = Sample(prompt_token_ids=[1] * 4000)
    groups = rollout_groups(gateway.url, ADMIN_KEY, [too_long, *prompts()[:1]], config)
    assert [len(g) for g in groups] == [0, 2]


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match="n_samples_per_prompt must be in"):
        RolloutConfig(n_samples_per_prompt=0)
    with pytest.raises(ValueError, match=r"top_k must be -1 .* concurrency must be at least 1"):
        RolloutConfig(top_k=0, concurrency=0)
