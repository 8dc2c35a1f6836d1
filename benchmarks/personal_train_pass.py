"""A personal round's training for many scopes: one child per scope, back to back (each loads the base
and trains its adapter), against one child training every scope's adapter in one pass (rows carry
their adapter: ``learner.training.adapter_batch``), same run.

    .venv/bin/python -m benchmarks.personal_train_pass [--model smollm2-135m-instruct] [--scopes 1 4 8]

Each scope has ``--samples`` rated answers (a chat prompt from the decode benchmark's questions and a
``--response-tokens`` answer), the default adapter settings (rank 16 over every projection) and the
personal round's default steps and learning rate. Timed from the parent: process start, model
load, training and export, as a personal round pays them. The two ways alternate for ``--rounds``
rounds; medians are reported. Results go to benchmarks/results/personal_train_pass_<model>.json.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from benchmarks.common import console, load_model_and_tokenizer, median, model_arg, progress
from benchmarks.engine_decode import QUESTIONS
from learner.personal_round import PersonalRoundConfig
from learner.round_config import RoundConfig
from learner.sample import Sample
from learner.training import TrainingOutcome, TrainingRequest, run_training_child
from learner.training.adapter_batch import run_adapter_batch


def scope_samples(tokenizer: object, count: int, response_tokens: int, seed: int) -> tuple[Sample, ...]:
    rng = random.Random(seed)
    vocab = len(tokenizer)  # type: ignore[arg-type]
    samples = []
    for index in range(count):
        question = rng.choice(QUESTIONS)
        prompt = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            [{"role": "user", "content": question}], add_generation_prompt=True, return_dict=False
        )
        response = [rng.randrange(3, vocab) for _ in range(response_tokens)]
        samples.append(Sample(prompt_token_ids=prompt, response_token_ids=response, index=index, reward=rng.random()))
    return tuple(samples)


def requests_for(base: Path, out: Path, scopes: list[tuple[Sample, ...]], threads: int) -> list[TrainingRequest]:
    unused = RoundConfig(server_url="http://unused", admin_key="unused", database_url="sqlite://", checkpoint_dir=out)
    defaults = PersonalRoundConfig(unused)  # the personal round's own defaults
    return [
        TrainingRequest(
            base_model_dir=base,
            out_dir=out / f"scope-{i}",
            samples=samples,
            num_steps=defaults.num_steps,
            learning_rate=defaults.learning_rate,
            num_threads=threads,
            advantages=tuple(s.reward - 0.5 for s in samples),  # type: ignore[operator]
            adapter=defaults.adapter,
        )
        for i, samples in enumerate(scopes)
    ]


def timed(run: object, requests: list[TrainingRequest]) -> float:
    start = time.perf_counter()
    outcomes: list[TrainingOutcome] = run(requests)  # type: ignore[operator]
    seconds = time.perf_counter() - start
    failed = [o.error for o in outcomes if o.status != "succeeded"]
    if failed:
        raise SystemExit(f"training failed: {failed[0]}")
    return seconds


def back_to_back(requests: list[TrainingRequest]) -> list[TrainingOutcome]:
    return [run_training_child(r) for r in requests]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arg(parser)
    parser.add_argument("--scopes", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--samples", type=int, default=24, help="rated answers per scope")
    parser.add_argument("--response-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    path, tokenizer = load_model_and_tokenizer(args)
    largest = max(args.scopes)
    all_scopes = [scope_samples(tokenizer, args.samples, args.response_tokens, seed) for seed in range(largest)]
    ways = {"back_to_back": back_to_back, "one_pass": run_adapter_batch}
    seconds: dict[str, dict[int, list[float]]] = {way: {n: [] for n in args.scopes} for way in ways}
    with tempfile.TemporaryDirectory() as tmp, progress() as bar:
        task = bar.add_task("personal training", total=args.rounds * len(args.scopes) * len(ways))
        for round_index in range(args.rounds):
            for n in args.scopes:
                for way, run in ways.items():
                    out = Path(tmp) / f"{way}-{n}-{round_index}"
                    seconds[way][n].append(timed(run, requests_for(path, out, all_scopes[:n], args.threads)))
                    bar.advance(task)
    rows = {
        str(n): {
            "back_to_back_s": median(seconds["back_to_back"][n]),
            "one_pass_s": median(seconds["one_pass"][n]),
            "back_to_back_s_per_scope": median(seconds["back_to_back"][n]) / n,
            "one_pass_s_per_scope": median(seconds["one_pass"][n]) / n,
            "speedup": median(seconds["back_to_back"][n]) / median(seconds["one_pass"][n]),
        }
        for n in args.scopes
    }
    results = {
        "model": path.name,
        "samples_per_scope": args.samples,
        "response_tokens": args.response_tokens,
        "threads": args.threads,
        "rounds": args.rounds,
        "raw_seconds": {way: {str(n): v for n, v in by_n.items()} for way, by_n in seconds.items()},
        "scopes": rows,
    }
    out = Path(__file__).parent / "results" / f"personal_train_pass_{path.name}.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    console.print(
        f"model {path.name}, {args.samples} samples x {args.response_tokens} tokens per scope, median of {args.rounds}"
    )
    for n, row in rows.items():
        print(
            f"{n:>3} scopes: back to back {row['back_to_back_s']:.1f} s ({row['back_to_back_s_per_scope']:.1f} s/scope), "
            f"one pass {row['one_pass_s']:.1f} s ({row['one_pass_s_per_scope']:.1f} s/scope): {row['speedup']:.2f}x"
        )
    print(f"results in {out}")


if __name__ == "__main__":
    main()
