"""How often does the canary judge decide right, and after how many ratings? A simulation of the rule.

Ratings arrive one at a time, each on the canary's side with probability ``--share`` (the sticky split),
each a thumbs up with the side's true rate; the judge (``server.canary.decision.judge``, the code the
gateway runs) looks every ``--check-every`` ratings, as the gateway's periodic check does, until it
decides or ``--max-ratings`` is reached (the deadline: rolled back). Scenarios set the candidate's true
rate against the control's.

The baseline, measured in the same run on the same rating streams: a naive rule that waits for the
same minimum sample and then compares the raw rates once (promote when the canary's is not below the
control's minus the margin, else roll back). The ratio reported is the rule's wrong decisions over
the naive rule's.

    python -m benchmarks.canary_decision --runs 400

Writes benchmarks/results/canary_decision.json.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import console, progress
from server.canary.decision import CanaryRules, judge
from storage.canaries import Thumbs

# (name, control rate, canary rate, the right decision)
SCENARIOS = [
    ("equal (0.60 vs 0.60)", 0.60, 0.60, "promoted"),
    ("better by 0.10", 0.60, 0.70, "promoted"),
    ("worse by 0.03 (inside the margin)", 0.60, 0.57, "promoted"),
    ("worse by 0.15", 0.60, 0.45, "rolled_back"),
    ("worse by 0.30", 0.60, 0.30, "rolled_back"),
]


@dataclass
class Outcome:
    decision: str
    ratings: int  # ratings seen (both sides) when decided


def stream(rng: np.random.Generator, control: float, canary: float, share: float, n: int) -> np.ndarray:
    """``n`` ratings as rows of booleans (on the canary's side, thumbs up)."""
    on_canary = rng.random(n) < share
    up = rng.random(n) < np.where(on_canary, canary, control)
    return np.stack([on_canary, up], axis=1)


def counts(ratings: np.ndarray) -> np.ndarray:
    """Running tallies: row i holds (canary up, canary down, control up, control down) after i ratings."""
    on_canary, up = ratings[:, 0], ratings[:, 1]
    columns = [on_canary & up, on_canary & ~up, ~on_canary & up, ~on_canary & ~up]
    running = np.cumsum(np.stack(columns, axis=1), axis=0)
    return np.vstack([np.zeros((1, 4), dtype=running.dtype), running])


def sides(tally: np.ndarray, upto: int) -> tuple[Thumbs, Thumbs]:
    canary_up, canary_down, control_up, control_down = (int(x) for x in tally[upto])
    return Thumbs(canary_up, canary_down), Thumbs(control_up, control_down)


def sequential(tally: np.ndarray, rules: CanaryRules, check_every: int) -> Outcome:
    last = len(tally) - 1
    for upto in range(check_every, last + 1, check_every):
        verdict = judge(*sides(tally, upto), rules, elapsed_s=0.0)
        if verdict.decision is not None:
            return Outcome(verdict.decision, upto)
    return Outcome("timed_out", last)  # the deadline: rolled back, the safe side


def naive(tally: np.ndarray, rules: CanaryRules) -> Outcome:
    """One look, as soon as both sides have the minimum sample: raw rates compared with the margin."""
    rated = np.minimum(tally[:, 0] + tally[:, 1], tally[:, 2] + tally[:, 3])
    enough = np.flatnonzero(rated >= rules.min_ratings)
    if not len(enough):
        return Outcome("timed_out", len(tally) - 1)
    canary, control = sides(tally, int(enough[0]))
    better = canary.up / canary.rated >= control.up / control.rated - rules.margin
    return Outcome("promoted" if better else "rolled_back", int(enough[0]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=400, help="simulated canaries per scenario")
    parser.add_argument("--share", type=float, default=0.2, help="the canary's share of the ratings")
    parser.add_argument("--check-every", type=int, default=10, help="ratings between two looks of the judge")
    parser.add_argument("--max-ratings", type=int, default=3000, help="ratings before the deadline")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    rules = CanaryRules()
    rng = np.random.default_rng(args.seed)
    results: list[dict[str, Any]] = []
    with progress() as bar:
        task = bar.add_task("simulated canaries", total=args.runs * len(SCENARIOS))
        for name, control, canary, right in SCENARIOS:
            ours, theirs = [], []
            for _ in range(args.runs):
                tally = counts(stream(rng, control, canary, args.share, args.max_ratings))
                ours.append(sequential(tally, rules, args.check_every))
                theirs.append(naive(tally, rules))
                bar.advance(task)
            results.append(summary(name, control, canary, right, ours, theirs))
    report(results, args, rules)


def summary(
    name: str, control: float, canary: float, right: str, ours: list[Outcome], theirs: list[Outcome]
) -> dict[str, Any]:
    def wrong(outcomes: list[Outcome]) -> float:
        # A timeout rolls back: wrong exactly when a promotion was right.
        return sum(o.decision.replace("timed_out", "rolled_back") != right for o in outcomes) / len(outcomes)

    return {
        "scenario": name,
        "control_rate": control,
        "canary_rate": canary,
        "right_decision": right,
        "judge_wrong": wrong(ours),
        "judge_timed_out": sum(o.decision == "timed_out" for o in ours) / len(ours),
        "judge_ratings_median": float(np.median([o.ratings for o in ours])),
        "judge_ratings_p90": float(np.percentile([o.ratings for o in ours], 90)),
        "naive_wrong": wrong(theirs),
        "naive_ratings_median": float(np.median([o.ratings for o in theirs])),
    }


def report(results: list[dict[str, Any]], args: argparse.Namespace, rules: CanaryRules) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "canary_decision.json"
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    path.write_text(json.dumps({"args": config, "rules": rules.record(), "results": results}, indent=2))
    for r in results:
        ratio = r["judge_wrong"] / r["naive_wrong"] if r["naive_wrong"] else float("nan")
        console.print(
            f"{r['scenario']:<36} right: {r['right_decision']:<11} judge wrong {r['judge_wrong']:6.1%} "
            f"(median {r['judge_ratings_median']:.0f} ratings, p90 {r['judge_ratings_p90']:.0f}, "
            f"timed out {r['judge_timed_out']:.1%}) | naive wrong {r['naive_wrong']:6.1%} "
            f"(at {r['naive_ratings_median']:.0f}) | ratio {ratio:.2f}"
        )
    worst = max(results, key=lambda r: r["judge_wrong"])
    console.print(f"canary judge: worst wrong-decision rate {worst['judge_wrong']:.1%} ({worst['scenario']}); {path}")


if __name__ == "__main__":
    main()
