"""The promotion rule: a candidate is rolled out only when it scores no worse than serving, within a margin."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GateDecision", "decide"]


@dataclass(frozen=True, slots=True)
class GateDecision:
    """Whether the candidate may serve, and the why in words (its version's ``status_reason``)."""

    passed: bool
    reason: str


def decide(candidate: float, serving: float, margin: float, *, method: str, n: int) -> GateDecision:
    """Pass when ``candidate >= serving - margin`` (both scored by ``method`` on the same ``n`` eval items)."""
    passed = candidate >= serving - margin
    comparison = f"candidate {candidate:.4f} {'>=' if passed else '<'} serving {serving:.4f} - margin {margin:g}"
    verdict = "passed evaluation" if passed else "held back by evaluation"
    return GateDecision(passed, f"{verdict}: {comparison} ({method} on {n} eval items)")
