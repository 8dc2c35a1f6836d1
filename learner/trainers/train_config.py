"""What one training step is told, whichever backend runs it: ``TrainConfig`` and ``TrainingDiverged``;
and ``AdapterSpec``, the LoRA adapter the torch backend trains instead of the whole model."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from learner.algorithms import PolicyLossConfig, Surrogate
from learner.megatron_config import MegatronConfig
from learner.plugins import HookKind, load_plugin

__all__ = ["AdapterSpec", "AdvantageEstimator", "Backend", "TrainConfig", "TrainingDiverged"]

# slime's --advantage-estimator: gspo and cispo take GRPO's advantages and their own policy-gradient term;
# reinforce_plus_plus's and ppo's are per token (discounted returns; GAE over a critic's values).
AdvantageEstimator = Literal["grpo", "gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"]
WHITENED_ESTIMATORS = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")  # slime requires it for both
Backend = Literal["torch", "megatron"]


class TrainingDiverged(RuntimeError):
    """A non-finite loss, gradient or weight: the step is refused and the model must not be exported."""


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """One training step's knobs (slime's flag names where they exist).

    ``use_rollout_logprobs``: the PPO ratio's old log-probs are the behaviour log-probs logged at
    serving time instead of the trainer's own (slime's ``--use-rollout-logprobs``; not with TIS).
    ``backend``: ``torch`` (transformers model, one process) or ``megatron`` (megatron-core
    ``GPTModel`` laid out by ``megatron``; docs/megatron.md). Both compute the same losses.

    Per-token advantages (``token_level``; the torch backend): ``kl_coef`` puts ``-kl_coef * KL`` to
    the reference into the reward (slime's ``--kl-coef``; not with ``loss.kl_loss_coef``), ``gamma``
    discounts REINFORCE++'s returns, ``use_opd`` subtracts ``opd_kl_coef`` times the reverse KL to the
    teacher's log-probs (``Sample.teacher_log_probs``; slime's on-policy distillation), and
    ``custom_advantage_path`` replaces all of it (slime's ``--custom-advantage-function-path``:
    ``f(args, rollout_data)`` sets ``rollout_data["advantages"]`` and ``["returns"]``).
    ``ppo`` trains a critic beside the policy (``learner.trainers.critic``): GAE with ``gamma`` and
    ``lambd`` over its values, its clipped value loss (``value_clip``) at ``critic_lr``.
    """

    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    advantage_estimator: AdvantageEstimator = "grpo"
    grpo_std_normalization: bool = True
    # slime's --normalize-advantages: whiten the advantages over every trained token of the batch
    # (always on for reinforce_plus_plus_baseline, which slime requires it for).
    normalize_advantages: bool = False
    reward_key: str | None = None
    max_tokens_per_micro_batch: int = 4096
    clip_grad: float | None = 1.0  # slime's --clip-grad; None: no clipping (the norm is still reported)
    use_rollout_logprobs: bool = False
    custom_loss_path: str | None = None  # slime's --custom-loss-function-path (see ``custom_loss``)
    custom_tis_path: str | None = None  # slime's --custom-tis-function-path: replaces the built-in TIS
    kl_coef: float = 0.0
    gamma: float = 1.0
    use_opd: bool = False
    opd_kl_coef: float = 1.0
    custom_advantage_path: str | None = None
    custom_pg_reducer_path: str | None = None  # slime's --custom-pg-loss-reducer-function-path
    lambd: float = 1.0
    value_clip: float = 0.2
    critic_lr: float = 1e-3  # a linear head on frozen features: the policy's lr would barely move it
    backend: Backend = "torch"
    qat: Literal["off", "int4"] = "off"  # int4: fake-quantize linear weights in the forward (torch backend)
    qat_group_size: int = 128  # INT4 group size: 32, 64 or 128 (what compressed-tensors kernels take)
    optimizer_offload: bool = False  # AdamW's state on the host (learner.trainers.host_optimizer; torch backend)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)

    @property
    def token_level(self) -> bool:
        """Whether advantages differ from token to token (computed in the trainer, see the class doc)."""
        return (
            self.advantage_estimator in ("reinforce_plus_plus", "ppo")
            or self.kl_coef != 0
            or self.use_opd
            or self.custom_advantage_path is not None
        )

    @property
    def whitens(self) -> bool:
        """Whether advantages are whitened over the batch's trained tokens (slime's --normalize-advantages)."""
        return self.normalize_advantages or self.advantage_estimator in WHITENED_ESTIMATORS

    @property
    def surrogate(self) -> Surrogate:
        """The policy-gradient term the estimator trains with (``learner.algorithms.Surrogate``)."""
        estimator = self.advantage_estimator
        return "gspo" if estimator == "gspo" else "cispo" if estimator == "cispo" else "ppo"

    def slime_args(self) -> dict[str, Any]:
        """These settings by their own names and by slime's argument names (``learner.slime_args``)."""
        loss = self.loss
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("loss", "megatron")}
        return {
            **own,
            **dataclasses.asdict(loss),
            "eps_clip_high": loss.eps_clip if loss.eps_clip_high is None else loss.eps_clip_high,
            "use_kl_loss": loss.kl_loss_coef != 0,
            "calculate_per_token_loss": loss.reduction == "token_mean",
            "disable_grpo_std_normalization": not self.grpo_std_normalization,
            "loss_type": "policy_loss" if self.custom_loss_path is None else "custom_loss",
            "custom_loss_function_path": self.custom_loss_path,
            "custom_tis_function_path": self.custom_tis_path,
            "custom_advantage_function_path": self.custom_advantage_path,
            "custom_pg_loss_reducer_function_path": self.custom_pg_reducer_path,
            "max_tokens_per_gpu": self.max_tokens_per_micro_batch,
        }

    def __post_init__(self) -> None:
        if isinstance(self.megatron, Mapping):  # from JSON (``TrainingRequest.from_json``)
            object.__setattr__(self, "megatron", MegatronConfig.from_dict(self.megatron))
        errors = []
        if self.advantage_estimator not in get_args(AdvantageEstimator):
            errors.append(f"advantage_estimator must be one of {get_args(AdvantageEstimator)}")
        if self.max_tokens_per_micro_batch < 1:
            errors.append(f"max_tokens_per_micro_batch must be >= 1, got {self.max_tokens_per_micro_batch}")
        if self.clip_grad is not None and not self.clip_grad > 0:
            errors.append(f"clip_grad must be > 0 or None, got {self.clip_grad}")
        if self.use_rollout_logprobs and self.loss.use_tis:
            errors.append("use_rollout_logprobs and use_tis exclude each other (TIS corrects the trainer's log-probs)")
        if self.backend not in get_args(Backend):
            errors.append(f"backend must be one of {get_args(Backend)}, got {self.backend!r}")
        refusal = self.megatron.custom_loss_refusal()
        if self.backend == "megatron" and self.custom_loss_path is not None and refusal:
            errors.append(refusal)
        if self.custom_tis_path is not None and not self.loss.use_tis:
            errors.append("custom_tis_path needs loss.use_tis")
        if self.kl_coef != 0 and self.loss.kl_loss_coef != 0:
            errors.append("kl_coef (KL in the reward) and loss.kl_loss_coef (KL in the loss) exclude each other")
        if self.kl_coef < 0 or self.opd_kl_coef < 0 or not 0 <= self.gamma <= 1 or not 0 <= self.lambd <= 1:
            errors.append("kl_coef and opd_kl_coef must be >= 0, gamma and lambd in [0, 1]")
        if self.value_clip <= 0 or self.critic_lr <= 0:
            errors.append("value_clip and critic_lr must be > 0")
        if self.qat not in ("off", "int4"):
            errors.append(f"qat must be 'off' or 'int4', got {self.qat!r}")
        if self.qat_group_size not in (32, 64, 128):
            errors.append(f"qat_group_size must be 32, 64 or 128, got {self.qat_group_size}")
        if self.optimizer_offload and self.backend == "megatron":
            errors.append("optimizer_offload is a torch-backend option (megatron: its distributed optimizer)")
        if self.qat != "off" and self.backend == "megatron":
            errors.append("qat int4 is a torch-backend option (the megatron backend has no fake quantizer yet)")
        if self.token_level and self.backend == "megatron":
            errors.append(
                "per-token advantages (reinforce_plus_plus, ppo, kl_coef, use_opd, custom_advantage_path) run on "
                "the torch backend only"
            )
        if errors:
            raise ValueError("invalid train config: " + "; ".join(errors))
        if self.custom_loss_path is not None:
            load_plugin(self.custom_loss_path, HookKind.CUSTOM_LOSS)  # a wrong path fails now, not in the child
        if self.custom_advantage_path is not None:
            load_plugin(self.custom_advantage_path, HookKind.CUSTOM_ADVANTAGE)
        if self.custom_pg_reducer_path is not None:
            load_plugin(self.custom_pg_reducer_path, HookKind.CUSTOM_PG_REDUCER)
        if self.custom_tis_path is not None:
            load_plugin(self.custom_tis_path, HookKind.CUSTOM_TIS)


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """Train a LoRA adapter over the frozen base instead of the base itself (peft's ``LoraConfig``).

    ``init_dir``: continue from this adapter folder (the scope's serving adapter); None: a fresh one.
    """

    rank: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    init_dir: Path | None = None

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "init_dir": None if self.init_dir is None else str(self.init_dir)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AdapterSpec:
        init_dir = data.get("init_dir")
        return cls(
            **{
                **data,
                "target_modules": tuple(data["target_modules"]),
                "init_dir": Path(init_dir) if init_dir else None,
            }
        )
