"""Rollout interference: user latency on a gateway while the learner's rollouts run on the same engine.

    .venv/bin/python -m benchmarks.rollout_interference [--model tiny] [--users 4] [--seconds 20]
        [--rollout-concurrency 1 2 4] [--rounds 2]

For each ``rollout_max_concurrency`` a `tandem serve` gateway (local engine) is started; a steady
user load (``--users`` clients in a closed loop of chat completions, ``--max-tokens`` each) runs for
``--seconds`` with no rollouts, then as long again while a rollout job loops
``learner.rollout.rollout_groups`` (``--prompts`` prompts x ``--samples`` samples, ``--rollout-tokens``
each). The two phases alternate for ``--rounds``. Reports user p50/p99 latency in both phases, the
p99 ratio (goal: at most 1.2) and the rollout samples generated per second.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.common import console, model_arg, model_path, percentile, start
from learner.rollout import RolloutConfig, rollout_groups
from learner.sample import Sample
from tests.support.uvicorn_thread import free_port

ADMIN_KEY = "bench-admin-key"
QUESTIONS = ["Say hello.", "What is the capital of France?", "Count to three.", "Name a colour."]


@dataclass
class Phase:
    latencies: list[float] = field(default_factory=list)
    rollout_samples: int = 0
    seconds: float = 0.0


async def user_load(url: str, model: str, users: int, seconds: float, max_tokens: int) -> list[float]:
    """Closed loop: each user sends the next chat completion when the last one is answered."""
    latencies: list[float] = []
    deadline = time.monotonic() + seconds
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}

    async def user(index: int, http: httpx.AsyncClient) -> None:
        turn = 0
        while time.monotonic() < deadline:
            body = {
                "model": model,
                "messages": [{"role": "user", "content": QUESTIONS[(index + turn) % len(QUESTIONS)]}],
                "max_tokens": max_tokens,
                "ignore_eos": True,  # same work every request: latency differences are interference only
            }
            started = time.perf_counter()
            response = await http.post(f"{url}/v1/chat/completions", json=body, headers=headers)
            response.raise_for_status()
            latencies.append(time.perf_counter() - started)
            turn += 1

    async with httpx.AsyncClient(timeout=120) as http:
        await asyncio.gather(*(user(i, http) for i in range(users)))
    return latencies


def rollout_job(url: str, prompts: list[Sample], config: RolloutConfig, stop: threading.Event, phase: Phase) -> None:
    while not stop.is_set():
        groups = rollout_groups(url, ADMIN_KEY, prompts, config)
        phase.rollout_samples += sum(len(g) for g in groups)


def run_phase(url: str, model: str, args: argparse.Namespace, prompts: list[Sample] | None) -> Phase:
    phase = Phase()
    stop = threading.Event()
    job = None
    if prompts is not None:
        config = RolloutConfig(
            n_samples_per_prompt=args.samples, max_new_tokens=args.rollout_tokens, concurrency=len(prompts)
        )
        job = threading.Thread(target=rollout_job, args=(url, prompts, config, stop, phase), daemon=True)
        job.start()
        time.sleep(1.0)  # the rollouts are under way before users are measured
    started = time.perf_counter()
    phase.latencies = asyncio.run(user_load(url, model, args.users, args.seconds, args.max_tokens))
    phase.seconds = time.perf_counter() - started
    stop.set()
    if job is not None:
        job.join()
    return phase


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arg(parser)
    parser.set_defaults(model="tiny")
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--rollout-tokens", type=int, default=32)
    parser.add_argument("--rollout-concurrency", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    path = model_path(args.model)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [
        Sample(
            prompt_token_ids=list(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": f"Question {i}: {QUESTIONS[i % len(QUESTIONS)]}"}],
                    add_generation_prompt=True,
                    return_dict=False,
                )
            )
        )
        for i in range(args.prompts)
    ]
    rows = []
    for limit in args.rollout_concurrency:
        data_dir = Path(tempfile.mkdtemp(prefix="tandem-bench-rollout-"))
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = {
            **os.environ,
            "TANDEM_DATA_DIR": str(data_dir),
            "TANDEM_TORCH_THREADS": str(args.threads),
            "TANDEM_LOG_LEVEL": "WARNING",
            "TANDEM_ADMIN_KEY": ADMIN_KEY,
            "TANDEM_ROLLOUT_MAX_CONCURRENCY": str(limit),
            "TANDEM_LEARNER": "off",
        }
        gateway = start(["serve", "--model", str(path), "--port", str(port)], env, url + "/health")
        try:
            model = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()["data"][0][
                "id"
            ]
            run_phase(url, model, argparse.Namespace(**{**vars(args), "seconds": 2.0}), None)  # warm-up
            alone, shared = Phase(), Phase()
            for round_ in range(args.rounds):
                console.log(f"rollout_max_concurrency={limit}: round {round_ + 1}/{args.rounds}")
                for target, rollouts in ((alone, None), (shared, prompts)):
                    phase = run_phase(url, model, args, rollouts)
                    target.latencies += phase.latencies
                    target.rollout_samples += phase.rollout_samples
                    target.seconds += phase.seconds
        finally:
            gateway.terminate()
            gateway.wait(30)
        rows.append((limit, alone, shared))

    print(
        f"users={args.users} user max_tokens={args.max_tokens} rollouts={args.prompts}x{args.samples} "
        f"x {args.rollout_tokens} tokens, {args.rounds} rounds of {args.seconds:.0f} s per phase"
    )
    print(
        "| rollout_max_concurrency | user p50 alone (ms) | user p99 alone (ms) | user p50 with rollouts (ms) "
        "| user p99 with rollouts (ms) | p99 ratio | user req/s alone / with | rollout samples/s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for limit, alone, shared in rows:
        p99a, p99s = percentile(alone.latencies, 99), percentile(shared.latencies, 99)
        print(
            f"| {limit} | {percentile(alone.latencies, 50) * 1000:.0f} | {p99a * 1000:.0f} "
            f"| {percentile(shared.latencies, 50) * 1000:.0f} | {p99s * 1000:.0f} | {p99s / p99a:.2f} "
            f"| {len(alone.latencies) / alone.seconds:.1f} / {len(shared.latencies) / shared.seconds:.1f} "
            f"| {shared.rollout_samples / shared.seconds:.1f} |"
        )


if __name__ == "__main__":
    main()
