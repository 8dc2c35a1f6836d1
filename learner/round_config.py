"""What a learning round is told (``RoundConfig``) and what it reports (``RoundResult``)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, get_args

from learner.algorithms import PolicyLossConfig
from learner.baselines import BaselineKind
from learner.evaluation import EvalConfig
from learner.judge import JudgeConfig
from learner.plugins import HookKind, load_plugins
from learner.reward_model import RewardModelConfig
from learner.rewards import FeedbackRewardMapping
from learner.rollout import RolloutConfig
from learner.round_metrics import RoundMetricsConfig
from learner.trainers import TrainConfig
from learner.trainers.drift import DriftConfig
from learner.user_weights import UserWeighting

__all__ = ["STAGES", "RewardSource", "RoundConfig", "RoundError", "RoundMode", "RoundResult", "default_train_config"]

# In the order a round runs them; ``rollout`` only when the reward can score new text, ``evaluate``
# only with the evaluation gate on, ``swap`` only for a candidate that passed it, ``eval_rollout``
# only with an eval rollout plugin, after a swap.
STAGES = ("collect", "reward", "rollout", "train", "export", "evaluate", "quantize", "swap", "eval_rollout")

RewardSource = Literal["feedback", "reward_model", "judge", "custom"]
RoundMode = Literal["train", "rollout_only", "sft"]


class RoundError(RuntimeError):
    """The round could not start (server unreachable, admin key refused, another round running)."""


class StageFailed(RuntimeError):
    """A stage failed for a reason its message says whole (no exception type prefixed in the round's error)."""


class Drifted(StageFailed):
    """The policy drifted past the drift guard's bounds (or diverged): the round stops before export and
    the schedule that fired it pauses."""


def default_train_config() -> TrainConfig:
    # Logged answers may come from older versions than the one trained: TIS corrects for that.
    return TrainConfig(loss=PolicyLossConfig(use_tis=True))


@dataclass(frozen=True, slots=True)
class RoundConfig:
    """Where the round runs, what it learns from and how it trains.

    ``model_dir`` is the base checkpoint when the serving version has no recorded checkpoint (the
    model the server started with); None: the folder the server reports, which must be readable here.

    Data: ``tenant_id``, ``end_user`` and ``max_age_s`` restrict which feedback trains; the rest is
    passed over for good (the watermark covers it).

    Reward: ``feedback`` trains directly on the rated logged answers, advantage = reward minus a
    ``baseline`` (per user or global running mean; a real group where one prompt has several rated
    answers), importance-corrected against the logged behaviour log-probs. The other sources can
    score new text, so the round also samples ``rollout.n_samples_per_prompt`` fresh answers per rated
    prompt and trains on real groups (``learner.groups``): ``reward_model`` fits a head over the
    policy's hidden states to all feedback so far (falling back to ``feedback`` while it is not
    trusted), ``judge`` asks the serving model with a rubric, ``custom`` calls the reward plugin at
    ``reward_path`` (slime's ``async (args, sample) -> float``, or batched ``(args, samples) -> list``
    with ``reward_batched``). Plugins by dotted path: ``dynamic_filter_path``,
    ``reward_post_process_path``, ``buffer_filter_path`` (slime's hooks, checked at config time), and
    ``eval_rollout_path`` (slime's eval function: run against the new version once it serves, its
    metrics recorded on the round as ``eval/<dataset>``).

    Evaluation (``evaluation``, ``docs/evaluation.md``): between export and swap, the candidate and
    the serving version are scored on an eval set; the candidate is rolled out only when it is not
    worse than serving by more than the margin, else it stays ``candidate`` (result ``held_back``).

    ``mode="rollout_only"`` collects, scores and (with ``save_batch_dir``) saves the batch, then stops:
    no training, no new version, the watermark stays. ``tandem replay`` trains a saved batch later,
    with no engine running.
    """

    server_url: str
    admin_key: str
    database_url: str
    checkpoint_dir: Path
    model_dir: Path | None = None
    # data
    tenant_id: str | None = None
    end_user: str | None = None
    max_age_s: float | None = None
    # reward
    reward: RewardSource = "feedback"
    reward_path: str | None = None
    reward_batched: bool = False
    reward_mapping: FeedbackRewardMapping = field(default_factory=FeedbackRewardMapping)
    baseline: BaselineKind = "user"
    baseline_prior_strength: float = 4.0
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    # rollout (reward sources other than feedback)
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(max_new_tokens=128))
    refill_attempts: int = 1
    dynamic_filter_path: str | None = None
    reward_post_process_path: str | None = None
    buffer_filter_path: str | None = None
    eval_rollout_path: str | None = None  # slime's --eval-function-path: run on the new serving version
    # training
    train_config: TrainConfig = field(default_factory=default_train_config)
    learning_rate: float = 1e-6
    num_steps: int = 1
    num_threads: int | None = None
    train_timeout_s: float = 3600.0
    evaluation: EvalConfig = field(default_factory=EvalConfig)
    canary_share: float = 0.0  # > 0: a passing version serves this share first (a base canary)
    rollout_weights: Literal["same", "fp8", "int4"] = "same"  # the engines get a quantized copy
    drift: DriftConfig = field(default_factory=DriftConfig)  # learner.trainers.drift (torch backend)
    user_weighting: UserWeighting = field(default_factory=UserWeighting)  # learner.user_weights
    # metrics, debugging and plumbing
    metrics: RoundMetricsConfig | None = None  # TensorBoard / W&B; None: only the round's row
    mode: RoundMode = "train"
    sft_data: Path | None = None  # mode "sft": an OpenAI-format JSONL of conversations; None: liked answers
    save_batch_dir: Path | None = None  # each round's training batch goes to <this>/<round id>/
    http_timeout_s: float = 600.0
    heartbeat_s: float = 30.0
    worker_id: str = field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}")
    trigger: str = "manual"  # what started the round ("manual", "schedule", ...), stored on its row
    schedule_id: str | None = None  # the training schedule that fired it, stored on its row

    def __post_init__(self) -> None:
        errors = []
        if not self.server_url.startswith(("http://", "https://")):
            errors.append(f"server_url must be an http(s) URL, got {self.server_url!r}")
        if not self.admin_key:
            errors.append("admin_key is empty (set TANDEM_ADMIN_KEY)")
        if self.heartbeat_s <= 0 or self.http_timeout_s <= 0:
            errors.append("heartbeat_s and http_timeout_s must be > 0")
        if self.max_age_s is not None and self.max_age_s <= 0:
            errors.append(f"max_age_s must be > 0, got {self.max_age_s}")
        if self.reward not in get_args(RewardSource):
            errors.append(f"reward must be one of {get_args(RewardSource)}, got {self.reward!r}")
        if (self.reward == "custom") != (self.reward_path is not None):
            errors.append("reward='custom' and reward_path go together")
        if self.baseline not in get_args(BaselineKind) or self.baseline_prior_strength < 0:
            errors.append(f"baseline must be one of {get_args(BaselineKind)} with a prior strength >= 0")
        if self.mode not in get_args(RoundMode):
            errors.append(f"mode must be one of {get_args(RoundMode)}, got {self.mode!r}")
        if self.refill_attempts < 0:
            errors.append(f"refill_attempts must be >= 0, got {self.refill_attempts}")
        if self.sft_data is not None and (self.mode != "sft" or not self.sft_data.is_file()):
            errors.append(f"sft_data goes with mode 'sft' and must be a file, got {self.sft_data}")
        if errors:
            raise ValueError("invalid round config: " + "; ".join(errors))
        self.plugins()  # a wrong path or signature fails here, not halfway through a round

    def plugins(self) -> dict[HookKind, Any]:
        """The configured hooks, loaded and checked (``learner.plugins.load_plugins``)."""
        reward_kind = HookKind.BATCHED_REWARD if self.reward_batched else HookKind.REWARD
        return load_plugins(
            {
                reward_kind: self.reward_path,
                HookKind.DYNAMIC_FILTER: self.dynamic_filter_path,
                HookKind.REWARD_POST_PROCESS: self.reward_post_process_path,
                HookKind.BUFFER_FILTER: self.buffer_filter_path,
                HookKind.EVAL_ROLLOUT: self.eval_rollout_path,
            }
        )

    @property
    def max_age(self) -> timedelta | None:
        return None if self.max_age_s is None else timedelta(seconds=self.max_age_s)

    def summary(self) -> dict[str, Any]:
        """The settings stored on the round's row (no secrets)."""
        return {
            "reward": self.reward,
            "reward_path": self.reward_path,
            "n_samples_per_prompt": self.rollout.n_samples_per_prompt if self.reward != "feedback" else 0,
            "baseline": self.baseline,
            "learning_rate": self.learning_rate,
            "num_steps": self.num_steps,
            "advantage_estimator": self.train_config.advantage_estimator,
            "use_tis": self.train_config.loss.use_tis,
            "kl_loss_coef": self.train_config.loss.kl_loss_coef,
            "filters": {"tenant_id": self.tenant_id, "end_user": self.end_user, "max_age_s": self.max_age_s},
            "mode": self.mode,
            "evaluation": self.evaluation.summary(),
            "drift_guard": self.drift.guard,
            "max_user_share": self.user_weighting.max_user_share,
        }


@dataclass(frozen=True, slots=True)
class RoundResult:
    """How a round ended; ``seconds`` has one entry per stage that ran (see ``STAGES``).

    ``train`` is the whole training child (load, steps, and the checkpoint write with its sha256);
    ``export`` is re-hashing the written checkpoint and recording its version row; ``evaluate`` is
    scoring candidate and serving; ``swap`` is the server's rolling update as the learner waits for it.

    ``held_back``: the round trained and recorded ``version_id``, but the evaluation gate kept it a
    candidate (its row's ``status_reason`` says why); serving is unchanged. ``canary``: it passed and
    serves a share of sessions from part of the engine pool until live ratings decide it.
    """

    status: Literal["succeeded", "canary", "held_back", "nothing_to_learn", "rollout_only", "failed"]
    round_id: str
    model: str
    samples: int = 0
    reward_mean: float | None = None
    version_id: str | None = None
    parent_version_id: str | None = None
    checkpoint_path: str | None = None
    watermark_from: int = 0
    watermark_to: int | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    reason: str | None = None  # why a round had nothing to learn
