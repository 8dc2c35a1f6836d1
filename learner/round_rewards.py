"""A round's reward stage: advantages from the ratings, and the scorer that rewards fresh rollouts.

Feedback rewards come from the rating mapping with a per-user (or group) baseline; fresh rollouts
are scored by a trusted reward model fitted to every rating so far, an LLM judge, or a reward plugin,
then grouped with the rated answers (``learner.groups``).
"""

from __future__ import annotations

import asyncio
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from learner.baselines import RewardHistory, assign_feedback_rewards, feedback_baseline_advantages
from learner.collect import feedback_samples
from learner.evaluation.stage import trainable
from learner.groups import GroupedBatch, GroupSettings, Scorer, build_groups
from learner.judge import judge
from learner.plugins import HookKind
from learner.reward_model import RewardModelError, fit_reward_model
from learner.rewards import feedback_reward, score_samples
from learner.rollout import eval_rollout
from learner.round_config import RoundConfig
from learner.sample import Sample
from learner.slime_args import SlimeArgs, slime_args
from storage import collect_feedback, rating_history


@dataclass(frozen=True, slots=True)
class RoundRewards:
    """Rewards for one round of ``model``; what they measure is added to ``metrics`` (the round's)."""

    config: RoundConfig
    sessions: sessionmaker[Session]
    model: str
    round_id: str
    watermark: int | None
    base_dir: Path  # the serving checkpoint, which the reward model reads
    metrics: dict[str, Any]
    # One namespace for all of the round's plugins: what a generate function sets, its reward sees.
    args: SlimeArgs = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "args", self._slime_args())

    def feedback_advantages(self, samples: list[Sample]) -> list[float]:
        """Rewards from the ratings; advantage = reward minus the group mean or the user's baseline."""
        config = self.config
        rewards = assign_feedback_rewards(samples, config.reward_mapping)
        with self.sessions() as session:
            ratings = rating_history(session, model=self.model)
        history = RewardHistory.of((r.user_id, feedback_reward(r, config.reward_mapping)) for r in ratings)
        baselines = [history.baseline(s.user_id, config.baseline, config.baseline_prior_strength) for s in samples]
        advantages = feedback_baseline_advantages(samples, baselines)
        self.metrics.update(
            samples=len(samples),
            reward_mean=statistics.fmean(rewards),
            reward_std=statistics.pstdev(rewards),
            baseline_mean=statistics.fmean(baselines),
            advantage_abs_mean=statistics.fmean(abs(a) for a in advantages),
            response_length_mean=statistics.fmean(s.response_length for s in samples),
        )
        return advantages

    def fresh_scorer(self) -> Scorer | None:
        """How fresh rollouts get rewards; None: train on the rated answers alone."""
        config = self.config
        if config.reward == "feedback":
            return None
        if config.reward == "reward_model":
            return self._reward_model_scorer()

        def score(fresh: list[Sample]) -> None:
            if config.reward == "judge":
                judge(config.server_url, config.admin_key, fresh, config.judge)  # sets reward or remove
                return
            kinds = (HookKind.REWARD, HookKind.BATCHED_REWARD)
            plugin = next(p for kind, p in config.plugins().items() if kind in kinds)
            asyncio.run(score_samples(plugin, self.args, fresh))

        return score

    def grouped(self, samples: list[Sample], score: Scorer, *, rollout_id: int) -> GroupedBatch:
        """Rated answers plus scored rollouts as real groups (``learner.groups``), with their advantages;
        ``rollout_id`` goes to a ROLLOUT plugin (slime's, the model's round count)."""
        config = self.config
        plugins = config.plugins()
        settings = GroupSettings(
            rollout=config.rollout,
            advantage_estimator=config.train_config.advantage_estimator,
            std_normalization=config.train_config.grpo_std_normalization,
            normalize_advantages=config.train_config.normalize_advantages,
            token_level=config.train_config.token_level,
            refill_attempts=config.refill_attempts,
            dynamic_filter=plugins.get(HookKind.DYNAMIC_FILTER),
            reward_post_process=plugins.get(HookKind.REWARD_POST_PROCESS),
            buffer_filter=plugins.get(HookKind.BUFFER_FILTER),
        )
        batch = build_groups(
            samples,
            settings,
            server_url=config.server_url,
            admin_key=config.admin_key,
            score=score,
            args=self.args,
            rollout_id=rollout_id,
        )
        self.metrics.update(batch.metrics)
        return batch

    def eval_rollout(self, samples: list[Sample], rollout_id: int) -> dict[str, float]:
        """The eval rollout plugin's metrics against what now serves (``learner.rollout.eval_rollout``);
        its ``data_source`` is the round's prompts, one per group of ``samples``."""
        config = self.config
        prompts = list({s.group_index: s for s in samples if not s.supervised}.values())
        path = config.eval_rollout_path or ""
        return eval_rollout(
            config.server_url, config.admin_key, prompts, config.rollout, path, rollout_id=rollout_id, args=self.args
        )

    def _slime_args(self) -> SlimeArgs:
        """slime's ``args`` for plugins (``learner.slime_args``): the round's settings by slime's names,
        tandem's under their own (``model``, ``round_id``, ``server_url``, ``admin_key``)."""
        config = self.config
        train = config.train_config
        return slime_args(
            config.summary(),
            train.slime_args(),
            config.rollout.slime_args(),
            model=self.model,
            round_id=self.round_id,
            server_url=config.server_url,
            admin_key=config.admin_key,
            client=None,
            hf_checkpoint=str(self.base_dir),
            lr=config.learning_rate,
            num_steps_per_rollout=config.num_steps,
            reward_key=train.reward_key,
            eval_reward_key=train.reward_key,
            group_rm=config.reward_batched,
            custom_rm_path=config.reward_path,
            dynamic_sampling_filter_path=config.dynamic_filter_path,
            custom_reward_post_process_path=config.reward_post_process_path,
            buffer_filter_path=config.buffer_filter_path,
        )

    def _reward_model_scorer(self) -> Scorer | None:
        """A reward model fitted to every rating so far, if it predicts held-out ratings well enough."""
        config = self.config
        with self.sessions.begin() as session:
            history = collect_feedback(session, model=self.model, since=0, until=self.watermark)
        rated = trainable([s for s in feedback_samples(history.items) if s.response_length > 0], config.evaluation)
        rewards = assign_feedback_rewards(rated, config.reward_mapping)
        try:
            model = fit_reward_model(
                self.base_dir, rated, rewards, config=config.reward_model, num_threads=config.num_threads
            )
        except RewardModelError as exc:
            self.metrics["reward_model"] = f"not used: {exc}"
            return None
        self.metrics.update({f"reward_model/{name}": value for name, value in model.metrics.items()})
        saved = config.checkpoint_dir / "reward_models" / self.round_id  # inspectable, reloadable
        model.save(saved)
        self.metrics["reward_model_path"] = str(saved)
        if not model.trusted:
            self.metrics["reward_model"] = (
                f"not used: held-out quality {model.quality:.3f} < {config.reward_model.min_quality}"
            )
            return None
        self.metrics["reward_model"] = "used"

        def score(fresh: list[Sample]) -> None:
            for sample, reward in zip(fresh, model.score(fresh, num_threads=config.num_threads), strict=True):
                sample.reward = reward

        return score
