"""The one place that turns Settings into a RoundConfig, so workers and commands train alike."""

from __future__ import annotations

import dataclasses
from typing import Literal

from learner.evaluation import EvalConfig, EvalMethod
from learner.evaluation.guard import GuardConfig
from learner.megatron_config import MegatronConfig
from learner.personal_round import PersonalRoundConfig
from learner.rollout import RolloutConfig
from learner.round import RoundConfig
from learner.round_config import default_train_config
from learner.round_metrics import RoundMetricsConfig
from learner.trainers import TrainConfig
from learner.trainers.drift import DriftConfig
from learner.training_request import AdapterSpec
from learner.user_weights import UserWeighting
from tandem.settings import Settings

__all__ = ["check_learner_settings", "eval_config", "round_config", "train_config"]


def check_learner_settings(settings: Settings) -> None:
    """Raise ValueError naming what in the learner settings cannot train (for commands at start-up)."""
    train_config(settings)


def megatron_config(settings: Settings) -> MegatronConfig:
    """The megatron layout; ValueError names an invalid size or combination, or a custom loss it cannot run."""
    config = MegatronConfig.from_dict(settings.learner.megatron)
    refusal = config.custom_loss_refusal()
    if settings.learner.backend == "megatron" and settings.learner.custom_loss_path and refusal:
        raise ValueError(refusal)
    return config


def train_config(settings: Settings) -> TrainConfig:
    """The default training knobs with the learner settings' KL loss, custom loss, micro-batch cap and
    backend, and slime's algorithm settings."""
    learner = settings.learner
    defaults = default_train_config()
    loss = dataclasses.replace(defaults.loss, kl_loss_coef=learner.kl_coef, kl_loss_type=learner.kl_type)
    return dataclasses.replace(
        defaults,
        loss=loss,
        custom_loss_path=learner.custom_loss_path,
        max_tokens_per_micro_batch=learner.max_tokens_per_device,
        backend=learner.backend,
        qat=learner.qat,
        optimizer_offload=learner.optimizer_offload,
        qat_group_size=learner.qat_group_size,
        megatron=megatron_config(settings),
        advantage_estimator=learner.advantage_estimator,
        normalize_advantages=learner.normalize_advantages,
        reward_key=learner.reward_key,
        kl_coef=learner.reward_kl_coef,
        gamma=learner.gamma,
        lambd=learner.lambd,
        value_clip=learner.value_clip,
        critic_lr=learner.critic_lr,
        use_opd=learner.use_opd,
        opd_kl_coef=learner.opd_kl_coef,
        custom_advantage_path=learner.custom_advantage_path,
        custom_pg_reducer_path=learner.custom_pg_reducer_path,
    )


def eval_config(settings: Settings) -> EvalConfig:
    """The evaluation gate from the ``eval_*`` settings."""
    method = EvalMethod(
        fn_path=settings.evaluation.fn_path,
        temperature=settings.evaluation.temperature,
        top_p=settings.evaluation.top_p,
        max_tokens=settings.evaluation.max_tokens,
        samples_per_prompt=settings.evaluation.samples_per_prompt,
        seed=settings.evaluation.seed,
    )
    return EvalConfig(
        gate=settings.evaluation.gate,
        margin=settings.evaluation.margin,
        method=method,
        prompts_path=settings.evaluation.prompts,
        holdout_fraction=settings.evaluation.holdout_fraction,
        max_samples=settings.evaluation.max_samples,
        every_steps=settings.evaluation.every_steps,
        timeout_s=settings.evaluation.timeout_s,
        guard=guard_config(settings),
    )


def guard_config(settings: Settings) -> GuardConfig:
    """The capability guard from the ``eval_guard_*`` settings."""
    evaluation = settings.evaluation
    return GuardConfig(
        guard=evaluation.guard,
        set_path=evaluation.guard_set,
        user_prompts=evaluation.guard_user_prompts,
        max_tokens=evaluation.guard_max_tokens,
        seed=evaluation.seed,
        max_loglik_drop=evaluation.guard_max_loglik_drop,
        max_kl=evaluation.guard_max_kl,
        min_length_ratio=evaluation.guard_min_length_ratio,
        max_length_ratio=evaluation.guard_max_length_ratio,
        max_distinct_2_drop=evaluation.guard_max_distinct_2_drop,
        max_loop_rise=evaluation.guard_max_loop_rise,
        max_echo_rise=evaluation.guard_max_echo_rise,
        max_empty_rise=evaluation.guard_max_empty_rise,
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
        checkpoint_dir=settings.storage.resolved_checkpoint_dir,
        learning_rate=settings.learner.learning_rate,
        num_steps=settings.learner.steps,
        num_threads=settings.learner.threads or None,
        train_timeout_s=settings.learner.train_timeout_s,
        heartbeat_s=settings.learner.round_heartbeat_s,
        trigger=trigger,
        reward=settings.learner.reward,
        reward_path=settings.learner.reward_path,
        reward_batched=settings.learner.reward_batched,
        baseline=settings.learner.baseline,
        rollout=RolloutConfig(
            n_samples_per_prompt=settings.learner.samples_per_prompt,
            max_new_tokens=settings.learner.rollout_max_tokens,
            custom_generate_path=settings.learner.custom_generate_path,
            rollout_path=settings.learner.rollout_path,
            routing_replay=settings.learner.routing_replay,
        ),
        dynamic_filter_path=settings.learner.dynamic_filter_path,
        buffer_filter_path=settings.learner.buffer_filter_path,
        reward_post_process_path=settings.learner.reward_post_process_path,
        eval_rollout_path=settings.learner.eval_rollout_path,
        metrics=RoundMetricsConfig.from_settings(settings),
        save_batch_dir=settings.learner.save_batch_dir,
        train_config=train_config(settings),
        evaluation=eval_config(settings),
        canary_share=settings.learner.canary_share,
        rollout_weights=settings.learner.rollout_weights,
        drift=DriftConfig(
            guard=settings.learner.drift_guard,
            max_kl=settings.learner.drift_max_kl,
            min_entropy_ratio=settings.learner.drift_min_entropy_ratio,
            grad_spike=settings.learner.drift_grad_spike,
            max_length_change=settings.learner.drift_max_length_change,
        ),
        user_weighting=UserWeighting(
            max_user_share=settings.learner.max_user_share,
            min_agreement=settings.learner.min_agreement,
            min_shared_prompts=settings.learner.min_shared_prompts,
            disagreeing_weight=settings.learner.disagreeing_weight,
        ),
    )


def personal_round_config(settings: Settings, base: RoundConfig) -> PersonalRoundConfig:
    """A personal round's config: ``base`` (server, data, rewards, losses) plus the adapter settings."""
    adapters = settings.adapters
    spec = AdapterSpec(
        rank=adapters.rank,
        alpha=adapters.alpha,
        dropout=adapters.dropout,
        target_modules=tuple(adapters.target_modules),
    )
    return PersonalRoundConfig(
        base=base,
        adapter=spec,
        learning_rate=adapters.learning_rate,
        num_steps=adapters.steps,
        min_ratings=adapters.min_ratings,
        scopes_per_pass=adapters.scopes_per_pass,
        canary_share=adapters.canary_share,
    )
