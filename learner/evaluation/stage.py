"""The round's ``evaluate`` stage: build the eval set, score candidate and serving, decide.

Both versions are scored from their checkpoints in one child process (``learner.evaluation.child``)
on the same eval set with the same method, sampling parameters and seeds; the serving engines keep
serving and never load the candidate. With nothing to score (no held-out rated answers yet, or none
with a non-zero reward) the gate cannot judge: the candidate is rolled out and its evaluation says
it was skipped and why, so a fresh deployment still learns from its first ratings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from learner.baselines import assign_feedback_rewards
from learner.collect import feedback_samples
from learner.evaluation.child import run_eval_child
from learner.evaluation.config import EvalConfig
from learner.evaluation.eval_set import read_eval_prompts, split_held_out
from learner.evaluation.gate import decide
from learner.evaluation.guard import failed_checks, run_checks
from learner.evaluation.scoring import unscorable
from learner.rewards import FeedbackRewardMapping
from learner.sample import Sample
from storage.feedback_collect import FeedbackItem

__all__ = ["Evaluation", "evaluate_candidate", "held_out_answers", "load_eval_set", "trainable"]


@dataclass(frozen=True, slots=True)
class Evaluation:
    """The gate's verdict: ``record`` goes to the version's ``evaluation``, ``metrics`` to the round's."""

    passed: bool
    reason: str
    record: dict[str, Any]
    metrics: dict[str, float]


def trainable(rated: Sequence[Sample], config: EvalConfig) -> list[Sample]:
    """``rated`` less the answers to held-out prompts, which only ever evaluate."""
    return split_held_out(rated, config.holdout_fraction)[0] if config.holds_out else list(rated)


def held_out_answers(items: Sequence[FeedbackItem], config: EvalConfig, mapping: FeedbackRewardMapping) -> list[Sample]:
    """The latest ``config.max_samples`` rated answers to held-out prompts, rewarded by ``mapping``."""
    if not config.holds_out:
        return []
    rated = [s for s in feedback_samples(items) if s.response_length > 0]
    held = split_held_out(rated, config.holdout_fraction)[1][-config.max_samples :]
    assign_feedback_rewards(held, mapping)
    return held


def load_eval_set(config: EvalConfig, held_out: Sequence[Sample]) -> list[Sample]:
    """The prompts file when configured (read now: it may have changed since start-up), else ``held_out``."""
    if config.prompts_path is not None:
        return read_eval_prompts(config.prompts_path, needs_answers=not config.method.generates)
    return list(held_out)


def evaluate_candidate(
    config: EvalConfig,
    eval_set: Sequence[Sample],
    *,
    candidate: Path,
    serving: Path,
    serving_version: str | None,
    root: Path,
    num_threads: int | None,
) -> Evaluation:
    """Score ``candidate`` and ``serving`` (checkpoint folders), apply the margin and the capability guard.

    ``root`` is the lineage's first model, the reference of the guard's KL bound. The guard runs also
    when the preference cannot be scored yet (no held-out ratings): a first round is guarded too.

    Raises:
        EvalFailed: the evaluation child failed (the eval function raised, a crash, the timeout).
    """
    method = config.method
    guard = config.guard if config.guard.on else None
    record: dict[str, Any] = {
        "fn": method.name,
        "margin": config.margin,
        "eval_set": str(config.prompts_path) if config.prompts_path else "held_out",
        "serving_version": serving_version,
        "sampling": {k: v for k, v in asdict(method).items() if k != "fn_path"} if method.generates else None,
    }
    why = unscorable(eval_set, method)
    if why is not None and guard is None:
        record |= {"passed": None, "skipped": why, "n": 0}
        return Evaluation(True, f"promoted without evaluation: {why}", record, {"eval/n": 0.0})
    scores = run_eval_child(
        {"candidate": candidate, "serving": serving},
        eval_set,
        method,
        num_threads=num_threads,
        timeout_s=config.timeout_s,
        guard=guard,
        root=root,
    )
    ours, theirs = scores["candidate"], scores["serving"]
    passed, reasons, metrics = True, [], {}
    if why is None:
        preference = _preference(ours, theirs, config, record)
        passed, metrics = preference.passed, preference.metrics
        reasons.append(preference.reason)
    else:
        record |= {"skipped": why, "n": 0}
        reasons.append(f"preference not evaluated: {why}")
        metrics["eval/n"] = 0.0
    if guard is not None:
        checks = run_checks(ours["capability"], theirs["capability"], guard)
        held = failed_checks(checks)
        record |= {
            "checks": [asdict(check) for check in checks],
            "capability": {"candidate": ours.pop("capability"), "serving": theirs.pop("capability")},
        }
        metrics |= {f"guard/{check.name}": check.value for check in checks} | {"guard/passed": float(held is None)}
        if held is not None:
            passed = False
            reasons.insert(0, held)
        else:
            reasons.append(f"capability guard passed ({len(checks)} checks)")
    record |= {"passed": passed, "candidate": ours, "serving": theirs}
    return Evaluation(passed, "; ".join(reasons), record, metrics)


def _preference(ours: dict[str, Any], theirs: dict[str, Any], config: EvalConfig, record: dict[str, Any]) -> Evaluation:
    """The margin between the two versions' preference scores (``record`` gets the scores)."""
    n = int(ours["n"])
    decision = decide(ours["score"], theirs["score"], config.margin, method=config.method.name, n=n)
    record |= {"score": ours["score"], "serving_score": theirs["score"], "n": n}
    metrics = {
        "eval/score": ours["score"],
        "eval/serving_score": theirs["score"],
        "eval/delta": ours["score"] - theirs["score"],
        "eval/margin": config.margin,
        "eval/n": float(n),
        "eval/passed": float(decision.passed),
    }
    return Evaluation(decision.passed, decision.reason, {}, metrics)
