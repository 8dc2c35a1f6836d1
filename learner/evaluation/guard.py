"""The capability guard: a candidate must keep what the model could do, not only win on ratings.

Every candidate (a base version or an adapter) is measured, next to the version it would replace, on
the capability set (prompts with reference answers, ``capability_set.jsonl`` unless the operator
gives one) and on fresh sampled answers to held-out user prompts (``learner.evaluation.capability``).
``run_checks`` turns those measurements into checks, each with its value, bound and verdict; one
failed check holds the candidate back, and its reason names the check.

The bounds are relative to the replaced version (a model that always echoed is not made worse by a
candidate that echoes as often), except the KL to the lineage's first model, which bounds how far a
chain of versions may drift however small each step was. Defaults come from measurements
(BENCHMARKS.md, "The capability guard on SmolLM2").
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

__all__ = ["CAPABILITY_SET", "Check", "GuardConfig", "failed_checks", "run_checks"]

CAPABILITY_SET = Path(__file__).with_name("capability_set.jsonl")
GuardSwitch = Literal["on", "off"]


@dataclass(frozen=True, slots=True)
class GuardConfig:
    """What the guard measures and the bounds it holds candidates to (``TANDEM_EVAL_GUARD_*``)."""

    guard: GuardSwitch = "on"
    set_path: Path | None = None  # None: the set shipped with tandem
    user_prompts: int = 8  # held-out user prompts answered too (degeneration checks)
    max_tokens: int = 48
    seed: int = 0
    max_loglik_drop: float = 0.3  # nats per reference-answer token
    max_kl: float = 0.2  # nats per sampled token, candidate || lineage root (BENCHMARKS.md: SmolLM2 brevity)
    min_length_ratio: float = 0.5
    max_length_ratio: float = 2.5
    max_distinct_2_drop: float = 0.15
    max_loop_rise: float = 0.15
    max_echo_rise: float = 0.1
    max_empty_rise: float = 0.05

    def __post_init__(self) -> None:
        errors = []
        if self.guard not in get_args(GuardSwitch):
            errors.append(f"guard must be one of {get_args(GuardSwitch)}, got {self.guard!r}")
        if self.user_prompts < 0 or self.max_tokens < 1:
            errors.append("user_prompts must be >= 0 and max_tokens >= 1")
        bounds = {name: getattr(self, name) for name in self.__dataclass_fields__ if name.startswith(("max_", "min_"))}
        if any(not math.isfinite(v) or v < 0 for v in bounds.values()):
            errors.append(f"bounds must be finite and >= 0: {bounds}")
        if self.min_length_ratio > self.max_length_ratio:
            errors.append("min_length_ratio must not exceed max_length_ratio")
        if errors:
            raise ValueError("invalid capability guard: " + "; ".join(errors))

    @property
    def on(self) -> bool:
        return self.guard == "on"

    @property
    def capability_set(self) -> Path:
        return self.set_path or CAPABILITY_SET


@dataclass(frozen=True, slots=True)
class Check:
    """One guard check: ``value`` (the candidate's) against ``bound``; ``serving`` is the replaced version's."""

    name: str
    value: float
    bound: float
    passed: bool
    serving: float | None = None
    rule: str = ""

    def words(self) -> str:
        serving = "" if self.serving is None else f", serving {self.serving:.3f}"
        return f"{self.name} {self.value:.3f} ({self.rule} {self.bound:.3f}{serving})"


def _at_least(name: str, value: float, bound: float, serving: float | None = None) -> Check:
    return Check(name, value, bound, value >= bound, serving, "must be >=")


def _at_most(name: str, value: float, bound: float, serving: float | None = None) -> Check:
    return Check(name, value, bound, value <= bound, serving, "must be <=")


def run_checks(candidate: Mapping[str, float], serving: Mapping[str, float], config: GuardConfig) -> list[Check]:
    """The candidate's checks from both versions' measurements (``capability.measure``'s keys)."""
    ratio = candidate["length_mean"] / serving["length_mean"] if serving["length_mean"] else 1.0
    return [
        _at_least(
            "reference_loglik",
            candidate["reference_loglik"],
            serving["reference_loglik"] - config.max_loglik_drop,
            serving["reference_loglik"],
        ),
        _at_most("kl_to_root", candidate["kl_to_root"], config.max_kl),
        _at_least("length_ratio", ratio, config.min_length_ratio),
        _at_most("length_ratio_max", ratio, config.max_length_ratio),
        _at_least(
            "distinct_2",
            candidate["distinct_2"],
            serving["distinct_2"] - config.max_distinct_2_drop,
            serving["distinct_2"],
        ),
        _at_most(
            "loop_rate", candidate["loop_rate"], serving["loop_rate"] + config.max_loop_rise, serving["loop_rate"]
        ),
        _at_most(
            "echo_rate", candidate["echo_rate"], serving["echo_rate"] + config.max_echo_rise, serving["echo_rate"]
        ),
        _at_most(
            "empty_rate", candidate["empty_rate"], serving["empty_rate"] + config.max_empty_rise, serving["empty_rate"]
        ),
    ]


def failed_checks(checks: list[Check]) -> str | None:
    """The reason a candidate is held back by the guard, naming every failed check; None when all passed."""
    failed = [check.words() for check in checks if not check.passed]
    return "held back by the capability guard: " + "; ".join(failed) if failed else None
