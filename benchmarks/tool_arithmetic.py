"""Arithmetic with and without the `python` tool on SmolLM2-135M-Instruct, then RL rounds on tool
rollouts: does the tool help, and does training on its own tool-using answers change the success rate?

Each problem multiplies two 3-digit numbers, far beyond what a 135M model computes in its head.
Measured on held-out problems, greedy: the plain chat answer (no tool), and the tool rollout (two
worked examples before the problem, the first turn a constrained `python` call, then the model
answers with the output in view) before training and after each of ``--rounds`` rounds.

A round is the platform's own loop: ``--problems`` fresh problems are asked through the chat API
(plain) and rated by a simulated user who checks the answer; the round samples ``--samples`` tool
rollouts of each rated prompt (``generate``, a slime generate function), scores them with a verifier
that reads the product from the prompt (``reward``), trains (GRPO, the rated answer in its group)
and hot-swaps. Its time is split by stage; the rollouts' own success rate (at temperature 1) is
recorded. Writes benchmarks/results/tool_arithmetic.json.

    .venv/bin/python -m benchmarks.tool_arithmetic --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import random
import re
import statistics
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
from learner.verifiers import exact_math_answer, final_number
from tandem.sandbox import Sandbox
from tandem.tool_registry import ToolRegistry, python_tool

ADMIN_KEY = "tool-arithmetic-admin"
RESULTS = Path(__file__).parent / "results" / "tool_arithmetic.json"
ROLLOUT = ToolRollout(ToolRegistry([python_tool(Sandbox())]), max_turns=2, first_turn="required")
TRAIN_SEED = 1
_FACTORS = re.compile(r"(\d+) \* (\d+)")
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


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """slime's generate contract: the rated problem, the worked examples before it, as a tool rollout."""
    asked = sample.metadata.get("messages") or sample.prompt
    sample.metadata = {**sample.metadata, "messages": [*EXAMPLES, *asked]}
    return await ROLLOUT.generate(args, sample, sampling_params)


SCORED: list[float] = []  # every rollout's reward, in order: the benchmark reads each round's share


async def reward(args: Any, sample: Sample, **kwargs: Any) -> float:
    """``exact_math_answer`` against the product of the problem the prompt asks."""
    asked = [m for m in sample.metadata.get("messages", []) if m.get("role") == "user"][-1]["content"]
    a, b = _FACTORS.findall(str(asked))[-1]
    sample.label = str(int(a) * int(b))
    score = await exact_math_answer(args, sample)
    SCORED.append(score)
    return score


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


def ask_and_rate(client: OpenAI, model: str, asked: list[tuple[str, int]]) -> None:
    """The simulated users: each asks a problem through the chat API and rates the answer by its
    correctness."""
    for question, answer in asked:
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": question}], temperature=0, max_tokens=32
        )
        right = final_number(reply.choices[0].message.content or "") == answer
        client.post("/feedback", body={"completion_id": reply.id, "rating": "up" if right else "down"}, cast_to=object)


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
                reward_path="benchmarks.tool_arithmetic:reward",
                rollout=RolloutConfig(
                    n_samples_per_prompt=args.samples,
                    max_new_tokens=MAX_TOKENS,
                    custom_generate_path="benchmarks.tool_arithmetic:generate",
                ),
            )
            scored = importlib.import_module("benchmarks.tool_arithmetic").SCORED  # what the round loads
            rounds = []
            for index in range(args.rounds):
                ask_and_rate(client, model, problems(args.problems, seed=TRAIN_SEED * 1000 + index))
                before = len(scored)
                started = time.perf_counter()
                result = run_round(config)
                wall = time.perf_counter() - started
                rounds.append(
                    {
                        "status": result.status,
                        "sampled_success": statistics.fmean(scored[before:]) if scored[before:] else None,
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
