"""Arithmetic with and without the `python` tool on SmolLM2-135M-Instruct, then RL rounds on tool
rollouts: does the tool help, and does training on its own tool-using answers change the success rate?

Each problem multiplies two 3-digit numbers, far beyond what a 135M model computes in its head. Three
measures on held-out problems, greedy: the plain chat answer (no tool), the tool rollout before
training (first turn a constrained `python` call, then the model answers with the result in view),
and the tool rollout after each of ``--rounds`` RL rounds; two worked examples (call, output, answer)
precede every problem in the tool conditions. A round samples ``--samples`` tool rollouts of each of
``--problems`` training problems (``arithmetic_rollout``, a slime rollout function), rewards each by
``exact_math_answer``, trains (GRPO) and hot-swaps; its time is split by stage. Writes benchmarks/results/tool_arithmetic.json.

    .venv/bin/python -m benchmarks.tool_arithmetic --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from openai import OpenAI

from benchmarks.common import console, model_arg, model_path, serve
from learner.rollout import RolloutConfig
from learner.round import run_round
from learner.sample import Sample
from learner.sglang_router import sglang_router
from learner.slime_args import slime_args
from learner.tool_rollout import ToolRollout
from learner.verifiers import exact_math_answer
from tandem.sandbox import Sandbox
from tandem.tool_registry import ToolRegistry, python_tool

ADMIN_KEY = "tool-arithmetic-admin"
RESULTS = Path(__file__).parent / "results" / "tool_arithmetic.json"
ROLLOUT = ToolRollout(ToolRegistry([python_tool(Sandbox())]), max_turns=2, first_turn="required")
TRAIN_SEED = 1
MAX_TOKENS = 160


def problems(count: int, seed: int) -> list[tuple[str, int]]:
    draw = random.Random(seed)
    out = []
    for _ in range(count):
        a, b = draw.randint(100, 999), draw.randint(100, 999)
        out.append((f"What is {a} * {b}? Answer with the number.", a * b))
    return out


def _worked(a: int, b: int, index: int) -> list[dict[str, Any]]:
    """One solved problem, as a conversation: the call, its output, the answer."""
    call = {"name": "python", "arguments": json.dumps({"code": f"print({a} * {b})"})}
    return [
        {"role": "user", "content": f"What is {a} * {b}? Answer with the number."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": f"call_{index}", "type": "function", "function": call}],
        },
        {"role": "tool", "tool_call_id": f"call_{index}", "content": str(a * b)},
        {"role": "assistant", "content": str(a * b)},
    ]


# Two worked examples before every problem: a 135M model does not find the call's form on its own.
EXAMPLES = [*_worked(12, 34, 1), *_worked(215, 47, 2)]


def prompt_sample(question: str, answer: int, index: int, group: int) -> Sample:
    messages = [*EXAMPLES, {"role": "user", "content": question}]
    return Sample(
        prompt_token_ids=[0],  # the tool rollout renders the messages itself
        prompt=messages,
        label=str(answer),
        index=index,
        group_index=group,
        metadata={"messages": messages},
    )


async def _generate(args: Any, samples: list[Sample], temperature: float) -> list[Sample]:
    params = {"temperature": temperature, "top_p": 1.0, "max_new_tokens": MAX_TOKENS}
    return list(await asyncio.gather(*(ROLLOUT.generate(args, sample, dict(params)) for sample in samples)))


def arithmetic_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> list[list[Sample]]:
    """A slime rollout function: each rated prompt of the round is replaced by a fresh training problem,
    sampled ``args.n_samples_per_prompt`` times as a tool rollout at the rollout temperature."""
    rated = data_source.get_samples(args.rollout_batch_size)
    drawn = problems(len(rated), seed=TRAIN_SEED * 1000 + rollout_id)
    size = args.n_samples_per_prompt
    samples = [
        prompt_sample(question, answer, index=g * size + i, group=g)
        for g, (question, answer) in enumerate(drawn)
        for i in range(size)
    ]
    done = asyncio.run(_generate(args, samples, args.rollout_temperature))
    return [done[g * size : (g + 1) * size] for g in range(len(drawn))]


def tool_success(server_url: str, checkpoint: Path, held_out: list[tuple[str, int]]) -> dict[str, float]:
    """Greedy tool rollouts of the held-out problems: the share answered exactly, and the share whose
    tool call printed the right number (the tool helped as far as it can)."""
    with sglang_router(server_url, ADMIN_KEY, timeout=600) as (ip, port):
        args = slime_args(hf_checkpoint=str(checkpoint), sglang_router_ip=ip, sglang_router_port=port)
        samples = [prompt_sample(q, a, index=i, group=i) for i, (q, a) in enumerate(held_out)]
        done = asyncio.run(_generate(args, samples, 0.0))
        rewards = [asyncio.run(exact_math_answer(args, s)) for s in done]
    printed = [str(answer) in _tool_results(s) for s, (_, answer) in zip(done, held_out, strict=True)]
    return {"success": sum(rewards) / len(rewards), "tool_printed_answer": sum(printed) / len(printed)}


def _tool_results(sample: Sample) -> str:
    return "\n".join(str(m.get("content")) for m in sample.metadata.get("messages", []) if m.get("role") == "tool")


def _sampled_success(metrics: dict[str, Any]) -> float | None:
    """The share of the round's tool rollouts (at the rollout temperature) answered exactly: the kept
    groups' mean reward, with the groups dropped for equal rewards (all right or all wrong) added back."""
    if "groups" not in metrics:
        return None
    equal = {
        float(key.rsplit("_", 1)[1]): count
        for key, count in metrics.items()
        if key.startswith("rollout/zero_std/count_")
    }
    right = metrics["rollout/raw_reward_mean"] * metrics["groups_kept"] + sum(r * c for r, c in equal.items())
    return float(right / metrics["groups"])


def plain_success(client: OpenAI, model: str, held_out: list[tuple[str, int]]) -> float:
    hits = 0
    for question, answer in held_out:
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": question}], temperature=0, max_tokens=MAX_TOKENS
        )
        sample = Sample(prompt_token_ids=[0], response=reply.choices[0].message.content or "", label=str(answer))
        hits += int(asyncio.run(exact_math_answer(None, sample)))
    return hits / len(held_out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_arg(parser)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--problems", type=int, default=8, help="training problems per round")
    parser.add_argument("--samples", type=int, default=4, help="tool rollouts per training problem")
    parser.add_argument("--eval", type=int, default=32, help="held-out problems")
    parser.add_argument("--lr", type=float, default=1e-5)
    args = parser.parse_args()
    held_out = problems(args.eval, seed=99)
    checkpoint = model_path(args.model)
    report: dict[str, Any] = {"command": ".venv/bin/python -m benchmarks.tool_arithmetic " + " ".join(_given(args))}
    with tempfile.TemporaryDirectory(prefix="tool-arithmetic-") as workdir:
        server = serve(args.model, Path(workdir), ADMIN_KEY, args.threads)
        try:
            client = OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, timeout=600)
            model = client.models.list().data[0].id
            report["plain"] = plain_success(client, model, held_out)
            curve = [tool_success(server.url, checkpoint, held_out)]
            console.print(f"plain {report['plain']:.3f}; with the tool, before training {curve[0]}")
            config = server.round_config(
                args.lr,
                reward="custom",
                reward_path="learner.verifiers:exact_math_answer",
                rollout=RolloutConfig(
                    n_samples_per_prompt=args.samples,
                    max_new_tokens=MAX_TOKENS,
                    rollout_path="benchmarks.tool_arithmetic:arithmetic_rollout",
                ),
            )
            rounds = []
            for index in range(args.rounds):
                # A round starts from new feedback: one rated answer per training problem, each of whose
                # prompts the rollout function replaces by a problem.
                for _ in range(args.problems):
                    reply = client.chat.completions.create(
                        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
                    )
                    client.post("/feedback", body={"completion_id": reply.id, "rating": "up"}, cast_to=object)
                started = time.perf_counter()
                result = run_round(config)
                wall = time.perf_counter() - started
                rounds.append(
                    {
                        "status": result.status,
                        "sampled_success": _sampled_success(result.metrics),
                        "samples": result.samples,
                        "seconds": result.seconds,
                        "wall_s": wall,
                        "error": result.error or result.reason,
                        "metrics": {k: v for k, v in result.metrics.items() if k.startswith(("rollout", "groups"))},
                    }
                )
                curve.append(tool_success(server.url, checkpoint, held_out))
                console.print(f"round {index + 1}: {rounds[-1]['status']} in {wall:.1f} s; {curve[-1]}")
        finally:
            server.stop()
    report |= {"tool_curve": curve, "rounds": rounds}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2))
    console.print(
        f"plain {report['plain']:.2f}, tool before {curve[0]['success']:.2f}, after {len(rounds)} rounds "
        f"{curve[-1]['success']:.2f}; wrote {RESULTS}"
    )


def _given(args: argparse.Namespace) -> list[str]:
    return [f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("model", "threads")]


if __name__ == "__main__":
    main()
