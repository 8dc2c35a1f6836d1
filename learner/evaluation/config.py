"""What the evaluation gate is told: the eval set, the eval method and its sampling, the margin."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from learner.evaluation.eval_set import read_eval_prompts
from learner.evaluation.guard import GuardConfig
from learner.plugins import HookKind, load_plugin

__all__ = ["LOGLIK_MARGIN", "EvalConfig", "EvalGate", "EvalMethod"]

EvalGate = Literal["on", "off"]
LOGLIK_MARGIN = "loglik_margin"  # the built-in method's name, in records and metrics


@dataclass(frozen=True, slots=True)
class EvalMethod:
    """How one model is scored on the eval set (the same for the candidate and the serving version).

    ``fn_path`` None: the built-in ``loglik_margin``, teacher-forced on rated answers (no generation):
    the mean per-token log-likelihood of liked answers minus that of disliked ones. Otherwise an
    eval function with the reward function's signature, ``async (args, sample) -> float`` (slime's
    ``--custom-rm-path``), scoring answers the model generates to each eval prompt with these
    sampling parameters: ``samples_per_prompt`` answers per prompt, prompt ``i`` seeded with
    ``seed + i`` for every model compared. ``temperature`` 0 is greedy.
    """

    fn_path: str | None = None
    temperature: float = 0.7
    top_p: float = 1.0
    max_tokens: int = 128
    samples_per_prompt: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        errors = []
        if self.temperature < 0:
            errors.append(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            errors.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1 or self.samples_per_prompt < 1:
            errors.append("max_tokens and samples_per_prompt must be >= 1")
        if errors:
            raise ValueError("invalid eval method: " + "; ".join(errors))
        if self.fn_path is not None:
            load_plugin(self.fn_path, HookKind.EVAL)  # a wrong path or signature fails now, not in a round

    @property
    def name(self) -> str:
        return self.fn_path or LOGLIK_MARGIN

    @property
    def generates(self) -> bool:
        return self.fn_path is not None


@dataclass(frozen=True, slots=True)
class EvalConfig:
    """The gate between a round's export and its swap (``docs/evaluation.md``).

    ``gate="off"``: no evaluation and no holdout, every rated answer trains and every candidate is
    rolled out (benchmarks). ``"on"``: a candidate is rolled out only when its score is at least the
    serving version's minus ``margin`` and it passes the capability ``guard`` (``learner.evaluation.guard``,
    unless that is off); otherwise it stays ``candidate`` with the scores and failed checks as its reason.

    The eval set is ``prompts_path`` (JSONL, ``learner.evaluation.eval_set.read_eval_prompts``), read
    at every round; when None, the rated answers to a stable ``holdout_fraction`` of prompts, which
    no round ever trains on (the latest ``max_samples`` of them up to the round's watermark).
    ``every_steps`` > 0 also scores the in-training weights every that many optimizer steps.
    """

    gate: EvalGate = "on"
    margin: float = 0.05
    method: EvalMethod = field(default_factory=EvalMethod)
    prompts_path: Path | None = None
    holdout_fraction: float = 0.1
    max_samples: int = 64
    every_steps: int = 0
    timeout_s: float = 1800.0
    guard: GuardConfig = field(default_factory=GuardConfig)

    def __post_init__(self) -> None:
        errors = []
        if self.gate not in get_args(EvalGate):
            errors.append(f"gate must be one of {get_args(EvalGate)}, got {self.gate!r}")
        if self.margin < 0:
            errors.append(f"margin must be >= 0, got {self.margin}")
        if not 0 <= self.holdout_fraction < 1:
            errors.append(f"holdout_fraction must be in [0, 1), got {self.holdout_fraction}")
        if self.max_samples < 1 or self.every_steps < 0 or not self.timeout_s > 0:
            errors.append("max_samples must be >= 1, every_steps >= 0 and timeout_s > 0")
        if errors:
            raise ValueError("invalid eval config: " + "; ".join(errors))
        if self.on and self.guard.on:
            read_eval_prompts(self.guard.capability_set, needs_answers=True)  # a bad capability set fails now
        if self.prompts_path is not None:
            # checked now (a bad line fails at start-up), read again at every round
            read_eval_prompts(self.prompts_path, needs_answers=not self.method.generates)

    @property
    def on(self) -> bool:
        return self.gate == "on"

    @property
    def holds_out(self) -> bool:
        """Whether rated traffic is split: a held-out share never trains."""
        return self.on and self.prompts_path is None and self.holdout_fraction > 0

    def summary(self) -> dict[str, object]:
        """What the round's row records about its evaluation settings."""
        method = self.method
        return {
            "gate": self.gate,
            "margin": self.margin,
            "fn": method.name,
            "prompts_path": None if self.prompts_path is None else str(self.prompts_path),
            "holdout_fraction": self.holdout_fraction if self.holds_out else 0.0,
            "every_steps": self.every_steps,
            "guard": self.guard.guard,
            **(
                {
                    "temperature": method.temperature,
                    "top_p": method.top_p,
                    "max_tokens": method.max_tokens,
                    "samples_per_prompt": method.samples_per_prompt,
                    "seed": method.seed,
                }
                if method.generates
                else {}
            ),
        }
