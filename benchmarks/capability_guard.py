"""Does the capability guard hold back a collapsing model and let a useful one through? SmolLM2, brevity.

Two runs of the same simulated users (8, sharing ``BrevityPreference``: short sentences), rating
through the public API of a real `tandem serve` (SQLite, local engine), one round after each batch:

1. **unguarded**: the gate and the drift guard off, every round rolls out (the BENCHMARKS.md curve
   that ends in "People."). Afterwards every round's checkpoint is judged by the capability guard
   with its defaults against the version it replaced (the round before), so each version's checks
   and verdict can be read next to its greedy answers.
2. **guarded**: the defaults (evaluation gate with the capability guard, drift guard on): the curve
   of what the users are served, and each round's outcome.

    python -m benchmarks.capability_guard --model smollm2-135m-instruct --rounds 5 --ratings 32 \\
        --max-tokens 48 --lr 3e-5

Writes benchmarks/results/capability_guard_<model>.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from openai import OpenAI

from benchmarks.common import console, model_path, round_chart, serve
from benchmarks.learning_curve import answers
from benchmarks.simulated_users import BrevityPreference, Population, evaluate, questions
from learner.evaluation import EvalConfig
from learner.evaluation.stage import evaluate_candidate
from learner.round import run_round
from learner.sample import Sample
from learner.trainers.drift import DriftConfig

ADMIN_KEY = "capability-guard-admin"


def one_run(args: argparse.Namespace, workdir: Path, *, guarded: bool) -> dict[str, Any]:
    preference = BrevityPreference()
    workdir.mkdir(parents=True)
    server = serve(args.model, workdir, ADMIN_KEY, args.threads)
    try:
        client = OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, timeout=600)
        model = client.models.list().data[0].id
        population = Population.make(preference, size=8, seed=args.seed)
        held_out = questions(args.eval_prompts, seed=args.seed + 1000)
        # guarded: the defaults (the gate with its capability guard, the drift guard); else neither
        if guarded:
            config = server.round_config(args.lr, evaluation=EvalConfig(), drift=DriftConfig())
        else:
            config = server.round_config(args.lr, drift=DriftConfig(guard="off"))

        def fresh() -> float:
            return evaluate(client, model, preference, held_out, samples_per_prompt=4, max_tokens=args.max_tokens)

        curve, rounds = [fresh()], []
        greedy = [answers(client, model)]
        for index in range(args.rounds):
            population.chat_and_rate(
                client, model, args.ratings, seed=args.seed * 100 + index, max_tokens=args.max_tokens
            )
            started = time.perf_counter()
            result = run_round(config)
            metrics = result.metrics
            rounds.append(
                {
                    "status": result.status,
                    "error": result.error,
                    "version": result.version_id,
                    "checkpoint": str(result.checkpoint_path) if result.checkpoint_path else None,
                    "wall": time.perf_counter() - started,
                    "reason": metrics.get("eval/reason"),
                    "guard": {k: v for k, v in metrics.items() if k.startswith(("guard/", "drift/"))},
                }
            )
            curve.append(fresh())
            greedy.append(answers(client, model))
            console.print(
                f"{'guarded' if guarded else 'unguarded'} round {index + 1}: {result.status}, served score "
                f"{curve[-1]:+.3f} ({rounds[-1]['wall']:.1f} s) {metrics.get('eval/reason') or result.error or ''}",
                soft_wrap=True,
            )
        return {"guarded": guarded, "curve": curve, "rounds": rounds, "greedy": greedy, "held_out": held_out}
    finally:
        server.stop()


def judge_each_version(run: dict[str, Any], base: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The capability guard's defaults on every round's checkpoint of the unguarded run, vs the one before."""
    prompts = [Sample(prompt=[{"role": "user", "content": q}]) for q in run["held_out"]]
    verdicts, serving = [], base
    for index, one in enumerate(run["rounds"], start=1):
        candidate = Path(one["checkpoint"])
        started = time.perf_counter()
        evaluation = evaluate_candidate(
            EvalConfig(holdout_fraction=0.0),
            prompts,
            candidate=candidate,
            serving=serving,
            serving_version=None,
            root=base,
            num_threads=args.threads,
        )
        checks = {c["name"]: c for c in evaluation.record["checks"]}
        verdicts.append(
            {
                "round": index,
                "passed": evaluation.passed,
                "reason": evaluation.reason,
                "checks": checks,
                "examples": evaluation.record["capability"]["candidate"]["examples"],
                "seconds": time.perf_counter() - started,
            }
        )
        console.print(
            f"round {index}: {'passes' if evaluation.passed else 'HELD BACK'}: {evaluation.reason}", soft_wrap=True
        )
        serving = candidate
    return verdicts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ratings", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--eval-prompts", type=int, default=12)
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tandem-guard-") as workdir:
        unguarded = one_run(args, Path(workdir) / "unguarded", guarded=False)
        unguarded["verdicts"] = judge_each_version(unguarded, model_path(args.model), args)
        guarded = one_run(args, Path(workdir) / "guarded", guarded=True)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"capability_guard_{Path(args.model).name}"
    result = {"args": {**vars(args), "out": str(args.out)}, "unguarded": unguarded, "guarded": guarded}
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    with round_chart(
        stem.with_suffix(".png"),
        title=f"brevity on {Path(args.model).name}",
        xlabel="round",
        ylabel="mean brevity score of served answers",
    ) as axes:
        for run, colour in ((unguarded, "C3"), (guarded, "C0")):
            label = "guards on (defaults)" if run["guarded"] else "no guards"
            axes.plot(range(len(run["curve"])), run["curve"], color=colour, linewidth=2.5, marker="o", label=label)
    console.print(
        "unguarded "
        + " ".join(f"{v:+.3f}" for v in unguarded["curve"])
        + " | guarded "
        + " ".join(f"{v:+.3f}" for v in guarded["curve"])
        + f" | results in {stem}.json"
    )


if __name__ == "__main__":
    main()
