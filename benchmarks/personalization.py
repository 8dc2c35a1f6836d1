"""Do personal adapters give each group what it prefers? Groups of simulated users with opposite
tastes on one real server, personal rounds between their ratings.

Tastes (``--taste``): ``brevity`` (brief vs detailed answers: natural for a chat model such as
SmolLM2) and ``letters`` (answers rich in k and v vs poor in them, plus a group rating at random: what
the tiny random test model can learn). Each group's answers are judged by its own taste; the random
raters' answers, and those of a user in no group (the base), by the first group's taste, where
neither should move.

Starts `tandem serve` (SQLite, local engine, learner worker off), makes each group a cohort (or, with
``--scope user``, gives every user an adapter of their own), then repeats: score the answers served
to each group under its own taste, let every group chat and rate through the public API, run one
personal round. Writes per-group curves (JSON and a PNG plot), greedy answers before and after for
each group, and the time each scope's training took.

    python -m benchmarks.personalization --model smollm2-135m-instruct --rounds 4 --ratings 32
    python -m benchmarks.personalization --model smollm2-135m-instruct --scope user --users 4 --rounds 1
    python -m benchmarks.personalization --model tiny --taste letters --rounds 8 --ratings 48 --lr 5e-2
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from openai import OpenAI

from benchmarks.common import console, round_chart, serve
from benchmarks.simulated_users import (
    BrevityPreference,
    ContrastPreference,
    OppositePreference,
    Population,
    Preference,
    RandomPreference,
    evaluate,
    questions,
)
from learner.personal_round import PersonalRoundConfig, run_personal_round
from learner.training_request import AdapterSpec

ADMIN_KEY = "personalization-admin"
BASE = "base"  # the curve of a user in no group


@dataclass(frozen=True)
class Group:
    rates_by: Preference  # the hidden taste behind its ratings
    judged_by: Preference  # what its served answers are scored by


def tastes(name: str) -> dict[str, Group]:
    if name == "brevity":
        brief = BrevityPreference()
        return {"brief": Group(brief, brief), "detailed": Group(OppositePreference(brief), OppositePreference(brief))}
    kv = ContrastPreference()
    return {
        "likes-kv": Group(kv, kv),
        "likes-cp": Group(OppositePreference(kv), OppositePreference(kv)),
        "random": Group(RandomPreference(seed=3), kv),
    }


def tenant_of(url: str) -> str:
    """The simulated users' tenant (benchmarks.common makes it)."""
    tenants = httpx.get(f"{url}/admin/tenants", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()["data"]
    return next(t["id"] for t in tenants if t["name"] == "simulated-users")


def greedy_answers(client: OpenAI, model: str, user: str, count: int = 3) -> list[dict[str, str]]:
    out = []
    for question in questions(count, seed=7):
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": question}], max_tokens=64, temperature=0, user=user
        )
        out.append({"question": question, "answer": reply.choices[0].message.content or ""})
    return out


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    server = serve(args.model, workdir, ADMIN_KEY, args.threads)
    try:
        client = OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, timeout=600)
        model = client.models.list().data[0].id
        tenant = tenant_of(server.url)
        judges = tastes(args.taste)
        groups = {
            name: Population.make(group.rates_by, size=args.users, seed=index + 10 * (args.seed or 0), prefix=name)
            for index, (name, group) in enumerate(judges.items())
        }
        if args.scope == "cohort":
            for name, population in groups.items():
                response = httpx.put(
                    f"{server.url}/admin/tenants/{tenant}/cohorts/{name}",
                    json={"users": [u.name for u in population.users]},
                    headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                )
                response.raise_for_status()
        config = PersonalRoundConfig(
            base=server.round_config(args.lr),
            adapter=AdapterSpec(rank=args.rank, alpha=2 * args.rank, target_modules=tuple(args.target_modules)),
            learning_rate=args.lr,
            num_steps=args.steps,
            min_ratings=4,
            scope_kinds=(args.scope,),
        )
        held_out = questions(args.eval_prompts, seed=1000)

        askers = {name: p.users[0].name for name, p in groups.items()} | {BASE: "in-no-group"}
        reference = next(iter(judges.values())).judged_by

        def scores() -> dict[str, float]:
            return {
                name: evaluate(
                    client, model, judges[name].judged_by if name in judges else reference, held_out,
                    samples_per_prompt=args.samples, max_tokens=args.max_tokens, user=user,
                )
                for name, user in askers.items()
            }  # fmt: skip

        before_answers = {name: greedy_answers(client, model, p.users[0].name) for name, p in groups.items()}
        curves: dict[str, list[float]] = {name: [] for name in askers}
        scope_seconds: list[float] = []
        for index in range(args.rounds + 1):
            for name, value in scores().items():
                curves[name].append(value)
            console.print(f"round {index}: " + ", ".join(f"{n} {v[-1]:+.3f}" for n, v in curves.items()))
            if index == args.rounds:
                break
            for name, population in groups.items():
                population.chat_and_rate(
                    client,
                    model,
                    args.ratings,
                    seed=100 * index + len(name) + 10_000 * (args.seed or 0),
                    max_tokens=args.max_tokens,
                )
            started = time.perf_counter()
            result = run_personal_round(config)
            failed = [s.error for s in result.scopes if s.status == "failed"]
            if failed:
                raise RuntimeError(f"personal round {index}: {failed}")
            scope_seconds += [s.seconds for s in result.trained]
            console.print(f"  {len(result.trained)} adapters in {time.perf_counter() - started:.1f} s")
        after_answers = {name: greedy_answers(client, model, p.users[0].name) for name, p in groups.items()}
        return {
            "curves": curves,
            "scope_seconds": scope_seconds,
            "answers": {"before": before_answers, "after": after_answers},
        }
    finally:
        server.stop()


def plot(curves: dict[str, list[float]], path: Path, title: str, judged: dict[str, str]) -> None:
    ylabel = "mean taste score of served answers"
    with round_chart(path, title=title, xlabel="personal round", ylabel=ylabel) as axes:
        for name, curve in curves.items():
            axes.plot(range(len(curve)), curve, linewidth=2.5, marker="o", label=f"{name} users, {judged[name]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="'tiny', a builtin name, or an HF folder")
    parser.add_argument("--taste", choices=["brevity", "letters"], default="brevity")
    parser.add_argument("--scope", choices=["cohort", "user"], default="cohort")
    parser.add_argument("--users", type=int, default=4, help="users per group")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--ratings", type=int, default=32, help="ratings per group per round")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--eval-prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=2, help="answers scored per eval prompt")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--target-modules", nargs="+", default=list(AdapterSpec().target_modules))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--seed", type=int, default=None, help="other users and other chats (the held-out questions stay)"
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tandem-personal-") as workdir:
        result = run(args, Path(workdir))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"personalization_{Path(args.model).name}_{args.taste}_{args.scope}"
    stem += "" if args.seed is None else f"_seed{args.seed}"
    (args.out / f"{stem}.json").write_text(json.dumps({"args": {**vars(args), "out": str(args.out)}, **result}))
    judges = tastes(args.taste)
    first = next(iter(judges))
    judged = {name: "under their own taste" if name in judges and judges[name].judged_by is judges[name].rates_by
              else f"under the {first} taste" for name in result["curves"]}  # fmt: skip
    plot(
        result["curves"],
        args.out / f"{stem}.png",
        f"{Path(args.model).name}: {args.taste}, {args.scope} adapters",
        judged,
    )
    print("| group | before | after | rise |")
    print("|---|---|---|---|")
    for name, curve in result["curves"].items():
        print(f"| {name} | {curve[0]:+.3f} | {curve[-1]:+.3f} | {curve[-1] - curve[0]:+.3f} |")
    seconds = result["scope_seconds"]
    if seconds:
        print(f"training per scope: median {statistics.median(seconds):.1f} s over {len(seconds)} scopes")
    console.print(f"[green]wrote[/green] {args.out / stem}.json and .png")


if __name__ == "__main__":
    main()
