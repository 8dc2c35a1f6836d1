"""What the training child is asked to do: ``TrainingRequest``, shared by the torch and megatron
paths of ``learner.training.child`` (kept apart so neither backend imports the other's entry point)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from learner.algorithms import PolicyLossConfig
from learner.sample import Sample
from learner.trainers.drift import DriftConfig
from learner.trainers.torch_backend import TrainConfig
from learner.trainers.train_config import AdapterSpec

if TYPE_CHECKING:
    # Imported where used: learner.evaluation's package pulls in the database layer, which the
    # trainer (and the GPU benchmarks importing it) must not need.
    from learner.evaluation.config import EvalMethod

__all__ = ["AdapterSpec", "TrainingRequest"]


@dataclass(frozen=True, slots=True)
class TrainingRequest:
    """One training run: base checkpoint in, new checkpoint folder out."""

    base_model_dir: Path
    out_dir: Path  # the checkpoint folder to create; must not exist
    samples: tuple[Sample, ...]
    config: TrainConfig = field(default_factory=TrainConfig)
    num_steps: int = 1  # optimizer steps over the same samples (slime's --num-steps-per-rollout)
    learning_rate: float = 1e-6
    weight_decay: float = 0.0
    seed: int = 0
    device: str = "cpu"
    num_threads: int | None = None  # torch CPU threads in the child; None: torch's default
    timeout_s: float = 3600.0
    # One per sample, computed by the caller (e.g. reward minus a feedback baseline); None: from the rewards.
    advantages: tuple[float, ...] | None = None
    # The KL loss's reference policy (slime: the initial model); None: the base checkpoint itself.
    reference_model_dir: Path | None = None
    # Periodic evaluation of the in-training weights (0: none).
    eval_every: int = 0
    eval_set: tuple[Sample, ...] = ()
    eval_method: EvalMethod = field(default_factory=lambda: _eval_method({}))
    # A LoRA adapter over the base (the torch backend): out_dir becomes a PEFT adapter folder.
    adapter: AdapterSpec | None = None
    # Bounds on how far the steps may move the policy (torch backend); None: unwatched.
    drift: DriftConfig | None = None

    def __post_init__(self) -> None:
        errors = []
        if not self.samples:
            errors.append("no samples to train on")
        if self.advantages is not None and len(self.advantages) != len(self.samples):
            errors.append(f"{len(self.advantages)} advantages for {len(self.samples)} samples")
        if self.num_steps < 1:
            errors.append(f"num_steps must be >= 1, got {self.num_steps}")
        if not self.learning_rate > 0 or self.weight_decay < 0:
            errors.append("learning_rate must be > 0 and weight_decay >= 0")
        if self.num_threads is not None and self.num_threads < 1:
            errors.append(f"num_threads must be >= 1, got {self.num_threads}")
        if not self.timeout_s > 0:
            errors.append(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.eval_every < 0 or (self.eval_every > 0 and not self.eval_set):
            errors.append("eval_every must be >= 0, and > 0 only with an eval_set")
        if self.adapter is not None and self.config.backend != "torch":
            errors.append("adapters train on the torch backend only (the megatron backend trains the whole base)")
        if self.drift is not None and self.drift.on and self.config.backend != "torch":
            errors.append("the drift guard watches the torch backend only")
        if self.adapter is not None and self.config.advantage_estimator == "ppo":
            errors.append("ppo's critic is saved with whole checkpoints: personal adapters train other estimators")
        if errors:
            raise ValueError("invalid training request: " + "; ".join(errors))

    def to_json(self) -> str:
        data: dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data.update(
            base_model_dir=str(self.base_model_dir),
            out_dir=str(self.out_dir),
            reference_model_dir=None if self.reference_model_dir is None else str(self.reference_model_dir),
            samples=[s.to_dict() for s in self.samples],
            config=dataclasses.asdict(self.config),
            eval_set=[s.to_dict() for s in self.eval_set],
            eval_method=dataclasses.asdict(self.eval_method),
            adapter=None if self.adapter is None else self.adapter.to_dict(),
            drift=None if self.drift is None else dataclasses.asdict(self.drift),
        )
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str) -> TrainingRequest:
        data = json.loads(text)
        config = dict(data["config"])
        config["loss"] = PolicyLossConfig(**config["loss"])
        data.update(
            base_model_dir=Path(data["base_model_dir"]),
            out_dir=Path(data["out_dir"]),
            reference_model_dir=None if data.get("reference_model_dir") is None else Path(data["reference_model_dir"]),
            samples=tuple(Sample.from_dict(s) for s in data["samples"]),
            config=TrainConfig(**config),
            advantages=None if data.get("advantages") is None else tuple(data["advantages"]),
            eval_set=tuple(Sample.from_dict(s) for s in data.get("eval_set", ())),
            eval_method=_eval_method(data.get("eval_method", {})),
            adapter=None if data.get("adapter") is None else AdapterSpec.from_dict(data["adapter"]),
            drift=None if data.get("drift") is None else DriftConfig(**data["drift"]),
        )
        return cls(**data)


def _eval_method(fields: dict[str, Any]) -> EvalMethod:
    from learner.evaluation.config import EvalMethod

    return EvalMethod(**fields)
