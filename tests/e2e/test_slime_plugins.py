"""slime's plugins, unchanged, through real rounds: the contract suite.

The plugins in ``tests/slime_plugins`` are written as slime users write theirs: slime's imports
(``slime.utils.types``, ``slime.utils.http_utils.post``, ``slime.rollout.sglang_rollout``, ...),
slime's dotted paths, SGLang's ``/generate`` at ``args.sglang_router_ip``:``args.sglang_router_port``,
``Sample.append_response_tokens``, dict rewards picked by ``reward_key``, a group reward model, a
``pop_first`` buffer filter, a custom loss over slime's batch, a whole rollout function that is also
the eval function. Each round runs on a real gateway (local engine, tiny model, SQLite), trains in a
child process and swaps the new version in; the saved batch shows what the plugins made.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from learner.plugins import load_function
from learner.rollout import RolloutConfig
from learner.round import RoundConfig, RoundResult, run_round
from learner.round_config import default_train_config
from learner.trainers.critic import VALUE_HEAD_FILE
from tests.e2e.test_learning_round import DRIFT_OFF, EVAL_OFF, LEARNING_RATE, chat_and_rate, serving
from tests.fixtures.tiny_model import tiny_model_path
from tests.server.conftest import ADMIN_KEY, Gateway, gateway_settings, run_gateway

PLUGINS = "tests.slime_plugins"
# The plugins import slime's modules, which the learner serves: load them the way it does.
SEEN = load_function(f"{PLUGINS}.filters_and_loss.SEEN")
CALLS = load_function(f"{PLUGINS}.rollout_fn.CALLS")
TOOL_RESULT = load_function(f"{PLUGINS}.tool_generate.TOOL_RESULT")


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    torch.set_num_threads(1)
    settings = gateway_settings(tmp_path_factory.mktemp("slime"), tiny_model_path(), admin_key=ADMIN_KEY)
    with run_gateway(settings, tenants=("e2e",)) as gw:
        yield gw


def run(gateway: Gateway, tmp_path: Path, **overrides: Any) -> tuple[RoundResult, list[dict[str, Any]]]:
    """Rate three answers, run a round with ``overrides``, and give its result and saved samples."""
    chat_and_rate(gateway, [("Name a river.", "up"), ("Name a tree.", "down"), ("Name a bird.", "up")])
    config = RoundConfig(
        server_url=gateway.url,
        admin_key=ADMIN_KEY,
        database_url=gateway.settings.resolved_database_url,
        checkpoint_dir=tmp_path / "checkpoints",
        learning_rate=LEARNING_RATE,
        num_threads=1,
        evaluation=EVAL_OFF,
        drift=DRIFT_OFF,
        reward="custom",
        save_batch_dir=tmp_path / "batches",
        **overrides,
    )
    result = run_round(config)
    assert result.status == "succeeded", result.error
    assert serving(gateway)["weight_version"] == result.version_id
    [saved] = (tmp_path / "batches").iterdir()
    return result, json.loads((saved / "request.json").read_text())["samples"]


def rollouts(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [s for s in samples if s["metadata"].get("source") == "rollout"]


def test_a_multi_turn_tool_generate_with_a_dict_reward_filters_and_a_custom_loss(
    gateway: Gateway, tmp_path: Path
) -> None:
    SEEN.update(buffer=[], filter=0)
    result, samples = run(
        gateway,
        tmp_path,
        reward_path=f"{PLUGINS}.tool_generate.reward_func",
        rollout=RolloutConfig(
            n_samples_per_prompt=3, max_new_tokens=8, seed=5, custom_generate_path=f"{PLUGINS}.tool_generate.generate"
        ),
        train_config=dataclasses.replace(
            default_train_config(), reward_key="score", custom_loss_path=f"{PLUGINS}.filters_and_loss.reinforce_loss"
        ),
        dynamic_filter_path=f"{PLUGINS}.filters_and_loss.keep_varied",
        buffer_filter_path=f"{PLUGINS}.filters_and_loss.pop_first",
    )
    generated = rollouts(samples)
    assert generated, "every group was dropped"
    for sample in generated:
        # two model turns around the tool's answer, which is context (mask 0, log-prob 0), not policy
        assert TOOL_RESULT in sample["response"] and sample["tool_call_count"] == 1
        mask, log_probs = sample["loss_mask"], sample["rollout_log_probs"]
        assert len(mask) == len(log_probs) == sample["response_length"]
        tool = [i for i, m in enumerate(mask) if m == 0]
        assert tool and tool == list(range(tool[0], tool[-1] + 1)) and tool[0] > 0 and tool[-1] < len(mask) - 1
        assert all(log_probs[i] == 0.0 for i in tool) and all(log_probs[i] < 0 for i in range(len(mask)) if mask[i])
        assert set(sample["reward"]) == {"score", "pred"} and len(sample["weight_versions"]) == 2
    assert SEEN["filter"] >= 3  # one call per group
    [(rollout_id, buffered, wanted)] = SEEN["buffer"]
    assert buffered == wanted == result.metrics["groups_kept"] and rollout_id >= 0
    assert {"reinforce_loss", "reinforce_entropy"} <= set(result.metrics)  # the custom loss's, last step


def test_a_multi_agent_generate_shares_its_rollout_and_a_group_reward_model_scores_each_group(
    gateway: Gateway, tmp_path: Path
) -> None:
    _, samples = run(
        gateway,
        tmp_path,
        reward_path=f"{PLUGINS}.multi_agent.group_rm",
        reward_batched=True,
        rollout=RolloutConfig(
            n_samples_per_prompt=2,
            max_new_tokens=8,
            seed=6,
            custom_generate_path=f"{PLUGINS}.multi_agent.generate_with_multi_agents",
        ),
    )
    generated = rollouts(samples)
    by_rollout: dict[int, list[dict[str, Any]]] = {}
    for sample in generated:
        by_rollout.setdefault(sample["rollout_id"], []).append(sample)
    assert by_rollout and all(len(pair) == 2 for pair in by_rollout.values())
    for solver, critic in by_rollout.values():
        assert (solver["metadata"]["role"], critic["metadata"]["role"]) == ("solver", "critic")
        assert critic["tokens"][: len(solver["tokens"])] == solver["tokens"]  # the critic read the solver
    for group in {s["group_index"] for s in generated}:
        rewards = sorted(s["reward"] for s in generated if s["group_index"] == group)
        assert rewards[0] == 0.0 and rewards[-1] == 1.0  # ranked within its group, not across groups


def test_a_whole_rollout_function_and_an_eval_function(gateway: Gateway, tmp_path: Path) -> None:
    CALLS.clear()
    result, samples = run(
        gateway,
        tmp_path,
        reward_path=f"{PLUGINS}.rollout_fn.reward_func",
        rollout=RolloutConfig(
            n_samples_per_prompt=2, max_new_tokens=6, rollout_path=f"{PLUGINS}.rollout_fn.generate_rollout"
        ),
        eval_rollout_path=f"{PLUGINS}.rollout_fn.generate_rollout",
    )
    assert [(CALLS[0][0], False), (CALLS[0][0], True)] == CALLS  # one rollout id: train, then eval
    assert list(result.seconds)[-2:] == ["swap", "eval_rollout"]
    assert result.metrics["eval/probe"] > 0 and 0 <= result.metrics["eval/probe-truncated_ratio"] <= 1
    generated = rollouts(samples)
    assert generated and all(s["status"] in ("completed", "truncated") for s in generated)
    assert all(len(s["rollout_log_probs"]) == s["response_length"] > 0 for s in generated)


def test_reinforce_plus_plus_with_kl_in_the_reward_and_distillation_from_a_teacher(
    gateway: Gateway, tmp_path: Path
) -> None:
    train = dataclasses.replace(
        default_train_config(), advantage_estimator="reinforce_plus_plus", kl_coef=0.01, use_opd=True, opd_kl_coef=0.5
    )
    result, samples = run(
        gateway,
        tmp_path,
        reward_path=f"{PLUGINS}.distill.reward_with_teacher",
        rollout=RolloutConfig(n_samples_per_prompt=3, max_new_tokens=6, seed=8),
        train_config=train,
    )
    taught = [s for s in rollouts(samples) if s["teacher_log_probs"] is not None]
    assert taught and all(len(s["teacher_log_probs"]) == s["response_length"] for s in taught)
    assert result.metrics["opd_samples"] == len(taught)  # the rated answers have no teacher scores
    # The teacher is the serving checkpoint, the policy before its step: the reverse KL is float noise
    # around 0 (a full run saw exactly 0.0), so only that it was computed is checked.
    assert math.isfinite(result.metrics["opd_reverse_kl"]) and "kl_in_reward" in result.metrics


def test_ppo_keeps_its_critic_from_round_to_round(gateway: Gateway, tmp_path: Path) -> None:
    train = dataclasses.replace(default_train_config(), advantage_estimator="ppo", gamma=0.95, lambd=0.9)
    settings: dict[str, Any] = {
        "reward_path": f"{PLUGINS}.rollout_fn.reward_func",
        "rollout": RolloutConfig(n_samples_per_prompt=2, max_new_tokens=6, seed=9),
        "train_config": train,
    }
    first, _ = run(gateway, tmp_path / "first", **settings)
    assert first.checkpoint_path is not None
    assert (Path(first.checkpoint_path) / VALUE_HEAD_FILE).is_file()  # beside the weights
    assert first.metrics["values_mean"] == 0.0 and first.metrics["value_loss"] > 0  # a fresh critic
    second, _ = run(gateway, tmp_path / "second", **settings)
    assert second.metrics["values_mean"] != 0.0  # the parent's critic, trained in the first round
