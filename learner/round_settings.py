"""The one place that turns Settings into a RoundConfig, so workers and commands train alike."""

from __future__ import annotations

import dataclasses
from typing import Literal

from learner.evaluation import EvalConfig, EvalMethod
from learner.megatron_config import MegatronConfig
from learner.rollout import RolloutConfig
from learner.round import RoundConfig
from learner.round_config import default_train_config
from learner.round_metrics import RoundMetricsConfig
from learner.trainers import TrainConfig
from tandem.settings import Settings

__all__ = ["check_learner_settings", "eval_config", "round_config", "train_config"]


def check_learner_settings(settings: Settings) -> None:
    """Raise ValueError naming what in the learner settings cannot train (for commands at start-up)."""
    train_config(settings)


def megatron_config(settings: Settings) -> MegatronConfig:
    """The megatron layout; ValueError names an invalid size or combination, or a custom loss it cannot run."""
    config = MegatronConfig.from_dict(settings.learn_megatron)
    refusal = config.custom_loss_refusal()
    if settings.learn_backend == "megatron" and settings.learn_custom_loss_path and refusal:
        raise ValueError(refusal)
    return config


def train_config(settings: Settings) -> TrainConfig:
    """The default training knobs with the learner settings' KL loss, custom loss, micro-batch cap and backend."""
    defaults = default_train_config()
    loss = dataclasses.replace(defaults.loss, kl_loss_coef=settings.learn_kl_coef, kl_loss_type=settings.learn_kl_type)
    return dataclasses.replace(
        defaults,
        loss=loss,
        custom_loss_path=settings.learn_custom_loss_path,
        max_tokens_per_micro_batch=settings.learn_max_tokens_per_device,
        backend=settings.learn_backend,
        megatron=megatron_config(settings),
    )


def eval_config(settings: Settings) -> EvalConfig:
    """The evaluation gate from the ``eval_*`` settings."""
    method = EvalMethod(
        fn_path=settings.eval_fn_path,
        temperature=settings.eval_temperature,
        top_p=settings.eval_top_p,
        max_tokens=settings.eval_max_tokens,
        samples_per_prompt=settings.eval_samples_per_prompt,
        seed=settings.eval_seed,
    )
    return EvalConfig(
        gate=settings.eval_gate,
        margin=settings.eval_margin,
        method=method,
        prompts_path=settings.eval_prompts,
        holdout_fraction=settings.eval_holdout_fraction,
        max_samples=settings.eval_max_samples,
        every_steps=settings.eval_every_steps,
        timeout_s=settings.eval_timeout_s,
    )


def round_config(
    settings: Settings, *, server_url: str, admin_key: str, trigger: Literal["manual", "schedule"]
) -> RoundConfig:
    """A round against ``server_url`` with the learning settings (``learn_*``, ``eval_*``, ``round_*``,
    ``checkpoint_dir``)."""
    return RoundConfig(
        server_url=server_url,
        admin_key=admin_key,
        database_url=settings.resolved_database_url,
        checkpoint_dir=settings.resolved_checkpoint_dir,
        learning_rate=settings.learn_learning_rate,
        num_steps=settings.learn_steps,
        num_threads=settings.learn_threads or None,
        train_timeout_s=settings.learn_train_timeout_s,
        heartbeat_s=settings.round_heartbeat_s,
        trigger=trigger,
        reward=settings.learn_reward,
        reward_path=settings.learn_reward_path,
        baseline=settings.learn_baseline,
        rollout=RolloutConfig(
            n_samples_per_prompt=settings.learn_samples_per_prompt, max_new_tokens=settings.learn_rollout_max_tokens
        ),
        metrics=RoundMetricsConfig.from_settings(settings),
        save_batch_dir=settings.learn_save_batch_dir,
        train_config=train_config(settings),
        evaluation=eval_config(settings),
    )
