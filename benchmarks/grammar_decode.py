"""What constrained decoding and tools cost the local engine: decode with a JSON-schema grammar vs
without, grammar compile time, and the first-token latency tools add to a prompt.

    .venv/bin/python -m benchmarks.grammar_decode [--model smollm2-135m-instruct] [--tokens 64] [--rounds 5]
        [--sglang-python ~/.cache/tandem/sglang-0.5.23/bin/python]

Decode: eight chat prompts, batch 1 and batch 8 (concurrent requests), exactly ``--tokens`` new
tokens each, greedy; the constrained requests follow a tool-call schema that cannot end sooner (a list
of at least 50 calls), the free ones ignore EOS. The two alternate round by round in one engine;
medians, and the ratio constrained/free. Compile: a fresh grammar for the two-tool ``required``
schema the gateway builds (the llguidance tokenizer built once beforehand). First token: the same
question rendered without and with two tools (the default rendering for SmolLM2's template),
prefill to first token, median. With ``--sglang-python`` (a venv with xgrammar and llguidance, as
SGLang's) it also runs benchmarks/grammar_libraries.py there: the measurement behind the choice of
llguidance.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks.common import console, load_model_and_tokenizer, model_arg, progress
from benchmarks.engine_decode import QUESTIONS, chat_prompts
from server.engines.base import SamplingParams
from server.engines.local.engine import LocalEngine
from server.engines.local.grammar import GrammarCache
from server.schemas import ChatCompletionRequest
from server.tools import forced_schema
from tandem.tool_calls import PARSERS, conversation_with_tools

CALL = {
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}, "days": {"type": "integer"}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
LONG_ANSWER = json.dumps({"type": "array", "items": CALL, "minItems": 50})  # never complete within --tokens
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather forecast for a city",
            "parameters": CALL["properties"]["arguments"],  # type: ignore[index]
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
        },
    },
]
BATCHES = (1, 8)


async def tokens_per_s(engine: LocalEngine, prompts: list[list[int]], sampling: SamplingParams) -> float:
    async def one(prompt: list[int]) -> int:
        return sum([len(c.token_ids) async for c in engine.generate(prompt, sampling)])

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts))
    assert all(n == sampling.max_new_tokens for n in counts), counts
    return sum(counts) / (time.perf_counter() - start)


async def first_token_ms(engine: LocalEngine, prompt: list[int]) -> float:
    start = time.perf_counter()
    async for _ in engine.generate(prompt, SamplingParams(max_new_tokens=1, temperature=0)):
        break
    return (time.perf_counter() - start) * 1000


def tool_prompt(tokenizer: Any, question: str) -> list[int]:
    conversation, _ = conversation_with_tools(
        [{"role": "user", "content": question}], TOOLS, template_renders=False, parser=PARSERS["hermes"]
    )
    return list(tokenizer.apply_chat_template(conversation, add_generation_prompt=True, return_dict=False))


def compile_ms(tokenizer: Any, vocab: int, repeats: int) -> float:
    request = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "tool_choice": "required"}
    )
    schema = forced_schema(request) or ""
    cache = GrammarCache(tokenizer, vocab, [])
    cache.matcher('{"type": "object"}')  # builds the llguidance tokenizer, once per model
    times = []
    for _ in range(repeats):
        cache._compiled.clear()
        start = time.perf_counter()
        cache.matcher(schema)
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    path, tokenizer = load_model_and_tokenizer(args)
    prompts = chat_prompts(tokenizer)
    engine = await LocalEngine.open(path, torch_threads=args.threads, max_batch_size=8)
    free = SamplingParams(max_new_tokens=args.tokens, temperature=0, ignore_eos=True)
    constrained = SamplingParams(max_new_tokens=args.tokens, temperature=0, json_schema=LONG_ANSWER)
    await tokens_per_s(engine, prompts[:1], SamplingParams(max_new_tokens=4, temperature=0, json_schema=LONG_ANSWER))
    rates: dict[str, dict[str, list[float]]] = {str(b): {"free": [], "grammar": []} for b in BATCHES}
    with_tools = [tool_prompt(tokenizer, q) for q in QUESTIONS]
    ttft: dict[str, list[float]] = {"plain": [], "tools": []}
    with progress() as bar:
        task = bar.add_task("rounds", total=args.rounds)
        for _ in range(args.rounds):
            for batch in BATCHES:
                rates[str(batch)]["free"].append(await tokens_per_s(engine, prompts[:batch], free))
                rates[str(batch)]["grammar"].append(await tokens_per_s(engine, prompts[:batch], constrained))
            for plain, tooled in zip(prompts, with_tools, strict=True):
                ttft["plain"].append(await first_token_ms(engine, plain))
                ttft["tools"].append(await first_token_ms(engine, tooled))
            bar.advance(task)
    await engine.close()
    return {
        "decode": {b: {k: statistics.median(v) for k, v in r.items()} for b, r in rates.items()},
        "first_token_ms": {k: statistics.median(v) for k, v in ttft.items()},
        "prompt_tokens": {"plain": statistics.mean(map(len, prompts)), "tools": statistics.mean(map(len, with_tools))},
        "compile_ms": compile_ms(tokenizer, _vocab(path), args.rounds * 4),
    }


def _vocab(path: Path) -> int:
    return int(json.loads((path / "config.json").read_text())["vocab_size"])


def libraries(python: str, model: Path) -> dict[str, Any]:
    script = str(Path(__file__).with_name("grammar_libraries.py"))
    done = subprocess.run([python, script, str(model)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"grammar_libraries.py failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arg(parser)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sglang-python", help="a venv with xgrammar and llguidance; unset: no library comparison")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    for batch, rate in result["decode"].items():
        console.print(
            f"batch {batch}: free {rate['free']:.1f} tok/s, grammar {rate['grammar']:.1f} tok/s "
            f"(x{rate['grammar'] / rate['free']:.2f})"
        )
    first, tokens = result["first_token_ms"], result["prompt_tokens"]
    console.print(
        f"first token: {first['plain']:.1f} ms ({tokens['plain']:.0f} prompt tokens) without tools, "
        f"{first['tools']:.1f} ms ({tokens['tools']:.0f}) with two tools (x{first['tools'] / first['plain']:.2f}); "
        f"grammar compile {result['compile_ms']:.2f} ms"
    )
    if args.sglang_python:
        path, _ = load_model_and_tokenizer(args)
        result["libraries"] = libraries(args.sglang_python, path)
        for name, costs in result["libraries"].items():
            if isinstance(costs, dict):
                console.print(f"{name}: " + ", ".join(f"{k} {v:.4f}" for k, v in costs.items()))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
