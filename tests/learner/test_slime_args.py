"""slime's ``args`` and its data source as plugins see them, and the slime modules tandem serves."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest

from learner.algorithms import PolicyLossConfig
from learner.plugins import PluginError, load_function
from learner.rollout import PromptSource, RolloutConfig, eval_rollout
from learner.sample import Sample
from learner.slime_args import SLIME_DEFAULTS, slime_args
from learner.trainers import TrainConfig


def test_settings_by_slimes_names() -> None:
    rollout = RolloutConfig(n_samples_per_prompt=3, max_new_tokens=64, temperature=0.7, top_k=5, seed=9)
    train = TrainConfig(loss=PolicyLossConfig(eps_clip=0.1, kl_loss_coef=0.01, reduction="token_mean"))
    args = slime_args(train.slime_args(), rollout.slime_args(), lr=1e-5)
    assert (args.n_samples_per_prompt, args.rollout_max_response_len, args.rollout_temperature) == (3, 64, 0.7)
    assert (args.rollout_top_k, args.rollout_top_p, args.rollout_seed) == (5, 1.0, 9)
    assert (args.eps_clip, args.eps_clip_high, args.use_kl_loss, args.kl_loss_type) == (0.1, 0.1, True, "k1")
    assert args.calculate_per_token_loss and args.loss_type == "policy_loss" and args.lr == 1e-5
    assert (args.partial_rollout, args.sglang_dp_size, args.sglang_speculative_algorithm) == (False, 1, None)
    assert args.advantage_estimator == "grpo" and not args.disable_grpo_std_normalization


def test_an_unknown_name_says_so_and_plugins_may_add_their_own() -> None:
    args = slime_args()
    with pytest.raises(AttributeError, match=r"args.sglang_model_routers: tandem has no setting of that name"):
        _ = args.sglang_model_routers
    assert getattr(args, "use_opd", False) is False  # slime's getattr-with-default reads keep working
    args.num_parallel = 4  # slime's multi-agent example sets its own
    twin = copy.deepcopy(args)
    assert twin.num_parallel == 4 and twin is not args and vars(twin).keys() >= SLIME_DEFAULTS.keys()


def test_the_data_source_hands_out_groups_like_slimes() -> None:
    args = slime_args(RolloutConfig(n_samples_per_prompt=2).slime_args(), hf_checkpoint=None)
    prompts = [Sample(prompt_token_ids=[1, 2], group_index=5, prompt="a"), Sample(prompt_token_ids=[3], prompt="b")]
    source = PromptSource(prompts, args, temperature=0.5)
    assert list(source) == prompts  # tandem's contract: the prompt samples
    [first] = source.get_samples(1)
    assert [s.tokens for s in first] == [[1, 2], [1, 2]] and [s.index for s in first] == [10, 11]
    assert all(s.group_index == 5 and s.rollout_temperature == 0.5 and s.response_length == 0 for s in first)
    source.add_samples([first])  # slime gives back aborted groups: they are handed out first
    again, second = source.get_samples(5)
    assert again is first and [s.group_index for s in second] == [1, 1]
    assert source.get_samples(1) == []


def eval_output(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
    assert evaluation and args.sglang_router_port is not None
    return {"math": {"rewards": [{"score": 1.0}, {"score": 0.0}], "truncated": [True, False]}}


def eval_not_numbers(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
    return {"math": {"rewards": ["yes"]}}


def test_eval_rollout_metrics_are_slimes() -> None:
    config = RolloutConfig()
    args = slime_args(config.slime_args(), reward_key="score")
    path = f"{__name__}:eval_output"
    metrics = eval_rollout("http://127.0.0.1:9", "k", [], config, path, rollout_id=2, args=args)
    assert metrics == {"eval/math": 0.5, "eval/math-truncated_ratio": 0.5}
    with pytest.raises(PluginError, match="rewards must be a non-empty list of numbers"):
        eval_rollout("http://127.0.0.1:9", "k", [], config, f"{__name__}:eval_not_numbers", rollout_id=2)


def test_slimes_modules_refuse_what_tandem_does_not_have() -> None:
    async_rm = load_function("slime.rollout.rm_hub.async_rm")
    with pytest.raises(ValueError, match="rm_type 'deepscaler': slime's built-in reward models are not part of tandem"):
        asyncio.run(async_rm(slime_args(rm_type="deepscaler"), Sample()))
    generate_state = load_function("slime.rollout.sglang_rollout.GenerateState")
    with pytest.raises(ValueError, match=r"needs args\.hf_checkpoint"):
        generate_state(slime_args())
    assert load_function("slime.utils.types.Sample") is Sample
