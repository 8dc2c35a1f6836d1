"""``slime.rollout.base_types``: what a rollout function returns, with slime's fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from learner.sample import Sample

__all__ = ["RolloutFnEvalOutput", "RolloutFnTrainOutput"]


@dataclass
class RolloutFnTrainOutput:
    samples: list[list[Sample]]
    metrics: dict[str, Any] | None = None


@dataclass
class RolloutFnEvalOutput:
    data: dict[str, dict[str, Any]]  # dataset name -> {"rewards": [...], "truncated": [...], "samples": [...]}
    metrics: dict[str, Any] | None = None
