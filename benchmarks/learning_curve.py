"""Does tandem learn from its users, and which reward learns best? Simulated users, real server, real rounds.

For each reward source and seed: start `tandem serve` (SQLite, local engine, its learner worker off:
this script runs the rounds itself with the same pipeline), then repeat: measure the mean hidden
score of fresh answers to held-out questions, let the simulated users chat and rate through the
public API, run one round. The baseline is the same run's score before any round; results are the
rise over it. Writes a JSON of every curve and a plot (PNG) next to it, and prints one table row per
reward source plus the stage split of the rounds (collect, reward, rollout, train, export, swap).

    python -m benchmarks.learning_curve --model tiny --preference letters \\
        --reward feedback --reward reward_model --reward judge --reward custom --seeds 0 1
    python -m benchmarks.learning_curve --model smollm2-135m-instruct --preference brevity \\
        --reward feedback --rounds 4 --ratings 32 --max-tokens 48 --lr 2e-5
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from openai import OpenAI

from benchmarks.common import console, round_chart, serve
from benchmarks.simulated_users import BrevityPreference, LetterPreference, Population, Preference, evaluate, questions
from learner.judge import JudgeConfig
from learner.rollout import RolloutConfig
from learner.round import STAGES, run_round
from learner.round_settings import train_config
from tandem.settings import Settings

ADMIN_KEY = "learning-curve-admin"
PREFERENCES: dict[str, tuple[Preference, str]] = {
    # name: (preference, the custom reward plugin that knows it)
    "letters": (LetterPreference(), "benchmarks.simulated_users:letter_reward"),
    "brevity": (BrevityPreference(), "benchmarks.simulated_users:brevity_reward"),
}


def one_run(args: argparse.Namespace, reward: str, seed: int, workdir: Path) -> dict[str, Any]:
    preference, plugin = PREFERENCES[args.preference]
    server = serve(args.model, workdir, ADMIN_KEY, args.threads)
    try:
        client = OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, timeout=600)
        model = client.models.list().data[0].id
        population = Population.make(preference, size=8, seed=seed)
        held_out = questions(args.eval_prompts, seed=seed + 1000)
        # Every rating trains and every round rolls out (round_config), as the curves in BENCHMARKS.md
        # were measured.
        config = server.round_config(
            args.lr,
            reward=reward,
            reward_path=plugin if reward == "custom" else None,
            rollout=RolloutConfig(n_samples_per_prompt=args.samples_per_prompt, max_new_tokens=args.max_tokens),
            judge=JudgeConfig(max_tokens=args.judge_max_tokens),
            train_config=train_config(Settings(learn_kl_coef=args.kl)),
        )

        def fresh() -> float:
            return evaluate(client, model, preference, held_out, samples_per_prompt=4, max_tokens=args.max_tokens)

        curve, rounds, first = [fresh()], [], answers(client, model)
        for index in range(args.rounds):
            population.chat_and_rate(client, model, args.ratings, seed=seed * 100 + index, max_tokens=args.max_tokens)
            started = time.perf_counter()
            result = run_round(config)
            wall = time.perf_counter() - started
            if result.status not in ("succeeded", "nothing_to_learn"):
                raise RuntimeError(f"round {index} of {reward}/{seed}: {result.status} {result.error}")
            rounds.append(
                {"seconds": result.seconds, "wall": wall, "samples": result.samples, **_notes(result.metrics)}
            )
            curve.append(fresh())
            console.print(f"{reward} seed {seed} round {index + 1}: fresh {curve[-1]:+.3f} ({wall:.1f} s)")
        return {
            "reward": reward,
            "seed": seed,
            "curve": curve,
            "rounds": rounds,
            "answers": {"before": first, "after": answers(client, model)},
        }
    finally:
        server.stop()


def answers(client: OpenAI, model: str, count: int = 3) -> list[dict[str, str]]:
    """A few greedy answers of the final version, to read: learning must not cost coherence."""
    out = []
    for question in questions(count, seed=7):
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": question}], max_tokens=64, temperature=0
        )
        out.append({"question": question, "answer": reply.choices[0].message.content or ""})
    return out


def _notes(metrics: dict[str, Any]) -> dict[str, Any]:
    keys = ("reward_model", "reward_model/cv_spearman", "groups_kept", "removed_samples", "rollout_samples")
    return {k: metrics[k] for k in keys if k in metrics}


def plot(runs: list[dict[str, Any]], path: Path, title: str) -> None:
    with round_chart(path, title=title, xlabel="round", ylabel="mean hidden score of fresh answers") as axes:
        for index, reward in enumerate(dict.fromkeys(r["reward"] for r in runs)):
            colour = f"C{index}"
            curves = [r["curve"] for r in runs if r["reward"] == reward]
            mean = [statistics.fmean(values) for values in zip(*curves, strict=True)]
            for curve in curves:
                axes.plot(range(len(curve)), curve, color=colour, alpha=0.25, linewidth=1)
            axes.plot(range(len(mean)), mean, color=colour, linewidth=2.5, label=f"{reward} (mean of {len(curves)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="'tiny', a builtin name, or an HF folder")
    parser.add_argument("--preference", choices=sorted(PREFERENCES), default="letters")
    parser.add_argument("--reward", action="append", choices=["feedback", "reward_model", "judge", "custom"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--ratings", type=int, default=64, help="ratings per round")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--samples-per-prompt", type=int, default=4, help="rollouts per prompt (not feedback)")
    parser.add_argument("--judge-max-tokens", type=int, default=64, help="the judge's verdict length")
    parser.add_argument("--eval-prompts", type=int, default=12)
    parser.add_argument("--lr", type=float, default=5e-2)
    parser.add_argument("--kl", type=float, default=0.0, help="KL loss coefficient (low_var_kl to the first model)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    rewards = args.reward or ["feedback"]

    runs = []
    for reward in rewards:
        for seed in args.seeds:
            with tempfile.TemporaryDirectory(prefix="tandem-curve-") as workdir:
                runs.append(one_run(args, reward, seed, Path(workdir)))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"learning_curve_{Path(args.model).name}_{args.preference}" + (f"_kl{args.kl:g}" if args.kl else "")
    (args.out / f"{stem}.json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "runs": runs}))
    plot(runs, args.out / f"{stem}.png", f"{Path(args.model).name}, {args.preference} preference")

    print("| reward | before | after | rise (mean, min over seeds) | round wall s (median) |")
    print("|---|---|---|---|---|")
    for reward in rewards:
        mine = [r for r in runs if r["reward"] == reward]
        rises = [r["curve"][-1] - r["curve"][0] for r in mine]
        walls = [x["wall"] for r in mine for x in r["rounds"]]
        before = statistics.fmean(r["curve"][0] for r in mine)
        after = statistics.fmean(r["curve"][-1] for r in mine)
        print(
            f"| {reward} | {before:+.3f} | {after:+.3f} | {statistics.fmean(rises):+.3f}, {min(rises):+.3f} "
            f"| {statistics.median(walls):.1f} |"
        )
    stages = [s for s in STAGES if any(s in x["seconds"] for r in runs for x in r["rounds"])]
    print("\n| reward | " + " | ".join(stages) + " |")
    print("|---|" + "---|" * len(stages))
    for reward in rewards:
        seconds = [x["seconds"] for r in runs if r["reward"] == reward for x in r["rounds"]]
        cells = [f"{statistics.median(s.get(stage, 0.0) for s in seconds):.2f}" for stage in stages]
        print(f"| {reward} | " + " | ".join(cells) + " |")
    console.print(f"[green]wrote[/green] {args.out / stem}.json and .png")


if __name__ == "__main__":
    main()
