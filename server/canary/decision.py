"""When a canary's live ratings are enough to decide it: a Bayesian beta-binomial test on thumbs.

Each side's thumbs-up rate has a Beta(1 + up, 1 + down) posterior (a uniform prior). The canary is
promoted once P(rate_canary > rate_control - margin) reaches ``confidence`` (better, or not worse by
more than the margin), and rolled back once that probability falls to ``1 - confidence`` (worse by
more than the margin). Nothing is decided before both sides have ``min_ratings`` rated answers, and
a canary still undecided at its deadline is rolled back: the safe side keeps what served before.

Judging again as ratings arrive peeks at the data many times; the minimum sample and a high
confidence keep that honest (docs/adapters.md gives the error rates measured by simulation).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np

from storage.canaries import Thumbs

_GRID = np.linspace(0.0, 1.0, 2001)


@dataclass(frozen=True, slots=True)
class CanaryRules:
    min_ratings: int = 20
    margin: float = 0.05
    confidence: float = 0.95
    max_duration_s: float = 86400.0

    def record(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def of(cls, stored: dict[str, Any]) -> CanaryRules:
        return cls(**stored)


@dataclass(frozen=True, slots=True)
class Verdict:
    decision: Literal["promoted", "rolled_back"] | None  # None: keep the canary running
    reason: str
    numbers: dict[str, Any]


def p_not_worse(canary: Thumbs, control: Thumbs, margin: float) -> float:
    """P(rate_canary > rate_control - margin) under the two Beta posteriors (numerical integration)."""
    density = _posterior_density(canary)
    control_density = _posterior_density(control)
    # The midpoint rule: unbiased at each grid point.
    control_cdf = np.cumsum(control_density) - control_density / 2
    control_cdf /= control_cdf[-1] + control_density[-1] / 2
    # P = sum over x of p_canary(x) * P(rate_control < x + margin)
    below = np.interp(np.minimum(_GRID + margin, 1.0), _GRID, control_cdf)
    return float(np.clip(np.sum(density * below) / np.sum(density), 0.0, 1.0))


def _posterior_density(thumbs: Thumbs) -> np.ndarray:
    a, b = thumbs.up + 1, thumbs.down + 1
    with np.errstate(divide="ignore", invalid="ignore"):
        log = (a - 1) * np.log(_GRID) + (b - 1) * np.log1p(-_GRID)
    log = np.where(np.isnan(log), -np.inf, log)  # 0 * log(0) at an end of the grid
    density: np.ndarray = np.exp(log - np.max(log))
    return density


def tallies(canary: Thumbs, control: Thumbs, rules: CanaryRules) -> tuple[str, dict[str, Any]]:
    """Both sides' ratings and the probability the decision reads, in words and in numbers."""
    probability = p_not_worse(canary, control, rules.margin)
    numbers = {"canary": _side(canary), "control": _side(control), "p_not_worse": round(probability, 4)}
    words = f"canary {_rate(canary)} vs control {_rate(control)}, P(not worse by {rules.margin:g}) = {probability:.3f}"
    return words, numbers


def judge(canary: Thumbs, control: Thumbs, rules: CanaryRules, *, elapsed_s: float) -> Verdict:
    """The decision on a canary's tallies ``elapsed_s`` after it started."""
    words, numbers = tallies(canary, control, rules)
    probability = numbers["p_not_worse"]
    short = min(canary.rated, control.rated) < rules.min_ratings
    if short or (1 - rules.confidence) < probability < rules.confidence:
        if elapsed_s >= rules.max_duration_s:
            why = f"fewer than {rules.min_ratings} rated answers a side" if short else "undecided"
            return Verdict("rolled_back", f"timed out after {_duration(elapsed_s)}, {why}: {words}", numbers)
        return Verdict(None, f"running: {words}", numbers)
    if probability >= rules.confidence:
        return Verdict("promoted", f"not worse: {words}", numbers)
    return Verdict("rolled_back", f"worse: {words}", numbers)


def _side(thumbs: Thumbs) -> dict[str, Any]:
    return {"up": thumbs.up, "down": thumbs.down, "rate": round((thumbs.up + 1) / (thumbs.rated + 2), 4)}


def _rate(thumbs: Thumbs) -> str:
    return f"{thumbs.up}/{thumbs.rated} up"


def _duration(seconds: float) -> str:
    hours = seconds / 3600
    return f"{hours:.1f} h" if hours >= 1 else f"{math.ceil(seconds)} s"
