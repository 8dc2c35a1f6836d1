"""One optimizer step: micro-batching changes nothing, KL/TIS/entropy wiring, divergence refused."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from learner.algorithms import PolicyLossConfig
from learner.plugins import PluginError
from learner.trainers import TrainConfig, TrainingDiverged, compute_advantages, train_step
from learner.trainers.step_loss import all_finite
from tests.learner.trainers.conftest import load_tiny, random_samples


def sgd(model: PreTrainedModel) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


def weights(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("estimator", ["grpo", "gspo", "cispo"])
@pytest.mark.parametrize("reduction", ["sample_mean", "token_mean"])
def test_micro_batches_give_the_one_big_batch_step(base_dir: Path, reduction: str, estimator: str) -> None:
    samples = random_samples(8, seed=3)
    loss = PolicyLossConfig(reduction=reduction, entropy_coef=0.01)
    results = []
    for cap in (4096, 16):  # one micro-batch, then one or two samples each
        config = TrainConfig(
            loss=loss,
            advantage_estimator=estimator,  # type: ignore[arg-type]
            clip_grad=None,
            max_tokens_per_micro_batch=cap,
        )
        model = load_tiny(base_dir)
        metrics = train_step(model, sgd(model), samples, config)
        results.append((metrics, weights(model)))
    (big, big_weights), (small, small_weights) = results
    for name in ("loss", "pg_loss", "entropy_loss", "grad_norm"):
        assert small[name] == pytest.approx(big[name], rel=1e-4, abs=1e-6), name
    for name, tensor in big_weights.items():
        torch.testing.assert_close(small_weights[name], tensor, atol=1e-6, rtol=1e-4)


def test_metrics_carry_slimes_names_and_the_step_moves_weights(model: PreTrainedModel) -> None:
    samples = random_samples(6, with_log_probs=True)
    before = weights(model)
    config = TrainConfig(loss=PolicyLossConfig(use_tis=True, entropy_coef=0.01), max_tokens_per_micro_batch=24)
    metrics = train_step(model, sgd(model), samples, config)
    expected = {"loss", "pg_loss", "pg_clipfrac", "ppo_kl", "entropy_loss", "tis", "tis_clipfrac", "tis_abs", "ois"}
    assert expected | {"train_rollout_logprob_abs_diff", "grad_norm", "perf/tokens_per_sec"} <= set(metrics)
    assert (
        metrics["pg_clipfrac"] == 0 and metrics["ppo_kl"] == 0 and metrics["ois"] == pytest.approx(1)
    )  # on-policy: ratio 1
    assert metrics["tis"] > 2 and metrics["tis_clipfrac"] > 0.5  # ratio about exp(1.4), clipped at 2
    assert all(math.isfinite(v) for v in metrics.values())
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())


def test_clip_grad_bounds_the_update_and_reports_the_norm_before_clipping(base_dir: Path) -> None:
    samples = random_samples(4)
    model = load_tiny(base_dir)
    metrics = train_step(model, sgd(model), samples, TrainConfig(clip_grad=1e-3))
    assert metrics["grad_norm"] > 1e-3
    base = load_tiny(base_dir)
    with torch.no_grad():
        update = torch.cat([(p - base.get_parameter(n)).flatten() for n, p in model.named_parameters()])
    assert float(update.norm()) == pytest.approx(0.1 * 1e-3, rel=1e-3)  # lr x clipped norm


def test_kl_loss_against_the_frozen_reference(base_dir: Path) -> None:
    samples = random_samples(4)
    config = TrainConfig(loss=PolicyLossConfig(kl_loss_coef=0.1, kl_loss_type="low_var_kl"))
    model, reference = load_tiny(base_dir), load_tiny(base_dir).requires_grad_(False)
    with pytest.raises(ValueError, match="ref_model"):
        train_step(model, sgd(model), samples, config)
    optimizer = sgd(model)
    assert train_step(model, optimizer, samples, config, ref_model=reference)["kl_loss"] == pytest.approx(0, abs=1e-6)
    assert train_step(model, optimizer, samples, config, ref_model=reference)["kl_loss"] > 0  # moved away


def test_old_log_probs_make_the_ratio_off_policy(model: PreTrainedModel) -> None:
    samples = random_samples(4, with_log_probs=True)
    metrics = train_step(model, sgd(model), samples, TrainConfig(use_rollout_logprobs=True))
    assert metrics["ppo_kl"] != 0 and metrics["pg_clipfrac"] > 0  # behaviour -9 vs the model's own


def test_a_nan_loss_raises_before_any_weight_changes(model: PreTrainedModel) -> None:
    samples = random_samples(4)
    before = weights(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    advantages = compute_advantages(samples, TrainConfig())
    advantages[1] = math.nan
    with pytest.raises(TrainingDiverged, match="loss is nan"):
        train_step(model, optimizer, samples, TrainConfig(max_tokens_per_micro_batch=16), advantages=advantages)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert all(p.grad is None for p in model.parameters())


def test_an_overflowing_update_is_reported(model: PreTrainedModel) -> None:
    samples = random_samples(4)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e38)
    with pytest.raises(TrainingDiverged):
        for _ in range(3):
            train_step(model, optimizer, samples, TrainConfig(clip_grad=None))


def test_config_is_validated_at_once() -> None:
    with pytest.raises(ValueError, match=r"max_tokens_per_micro_batch.*clip_grad"):
        TrainConfig(max_tokens_per_micro_batch=0, clip_grad=0)
    with pytest.raises(ValueError, match="exclude each other"):
        TrainConfig(use_rollout_logprobs=True, loss=PolicyLossConfig(use_tis=True))


@pytest.mark.parametrize("cap", [4096, 16])
def test_a_custom_loss_by_dotted_path_replaces_the_built_in(base_dir: Path, cap: int) -> None:
    samples = random_samples(6, seed=5)
    stepped = []
    for path in (None, "tests.learner.plugins_examples:loss_vanilla_policy_gradient"):
        model = load_tiny(base_dir)
        config = TrainConfig(clip_grad=None, max_tokens_per_micro_batch=cap, custom_loss_path=path)
        metrics = train_step(model, sgd(model), samples, config)
        stepped.append((metrics, weights(model)))
    (built_in, built_in_weights), (custom, custom_weights) = stepped
    assert "custom_loss" in custom and "pg_clipfrac" not in custom
    assert custom["grad_norm"] == pytest.approx(built_in["grad_norm"], rel=1e-4)
    for name, tensor in built_in_weights.items():  # the same gradient, so the same step
        torch.testing.assert_close(custom_weights[name], tensor, atol=1e-6, rtol=1e-4)


def test_a_custom_loss_is_checked(base_dir: Path) -> None:
    with pytest.raises(PluginError, match="cannot import"):
        TrainConfig(custom_loss_path="nowhere.at_all:loss")
    model = load_tiny(base_dir)
    config = TrainConfig(custom_loss_path="tests.learner.plugins_examples:loss_not_a_tuple")
    with pytest.raises(PluginError, match="not \\(loss, metrics\\)"):
        train_step(model, sgd(model), random_samples(2), config)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_all_finite_finds_one_bad_element_among_many_tensors(bad: float) -> None:
    tensors = [torch.ones(3, 4, dtype=torch.bfloat16), torch.full((5,), 3e38), torch.zeros(0)]
    assert all_finite(tensors) and all_finite([])
    tensors[1][2] = bad
    assert not all_finite(tensors)


def test_a_custom_tis_function_with_slimes_contract_replaces_the_built_in(base_dir: Path) -> None:
    """slime's vanilla TIS written as a plugin steps exactly as the built-in; its metrics are reported."""
    samples = random_samples(6, seed=6, with_log_probs=True)
    stepped = []
    for path in (None, "tests.learner.plugins_examples:tis_vanilla"):
        model = load_tiny(base_dir)
        loss = PolicyLossConfig(use_tis=True, tis_clip=1.5)
        config = TrainConfig(loss=loss, clip_grad=None, max_tokens_per_micro_batch=16, custom_tis_path=path)
        stepped.append((train_step(model, sgd(model), samples, config), weights(model)))
    (built_in, built_in_weights), (custom, custom_weights) = stepped
    assert custom["custom_tis"] == pytest.approx(built_in["tis"], rel=1e-5)
    assert custom["custom_tis_clipfrac"] == pytest.approx(built_in["tis_clipfrac"], abs=1e-6)
    assert custom["pg_loss"] == pytest.approx(built_in["pg_loss"], rel=1e-5) and "tis" not in custom
    for name, tensor in built_in_weights.items():
        torch.testing.assert_close(custom_weights[name], tensor, atol=1e-6, rtol=1e-4)


def test_a_custom_tis_function_may_drop_tokens_and_is_checked(base_dir: Path) -> None:
    samples = random_samples(4, seed=7, with_log_probs=True)
    loss = PolicyLossConfig(use_tis=True)
    plain = train_step(load_tiny(base_dir), sgd(load_tiny(base_dir)), samples, TrainConfig(loss=loss))
    model = load_tiny(base_dir)
    dropped = TrainConfig(loss=loss, custom_tis_path="tests.learner.plugins_examples:tis_drop_first_tokens")
    assert train_step(model, sgd(model), samples, dropped)["pg_loss"] != pytest.approx(plain["pg_loss"])
    with pytest.raises(ValueError, match=r"custom_tis_path needs loss\.use_tis"):
        TrainConfig(custom_tis_path="tests.learner.plugins_examples:tis_vanilla")
    wrong = TrainConfig(loss=loss, custom_tis_path="tests.learner.plugins_examples:tis_wrong_shape")
    with pytest.raises(PluginError, match="other shapes"):
        train_step(model, sgd(model), samples, wrong)
