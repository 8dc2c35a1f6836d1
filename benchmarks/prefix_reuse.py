"""Time to first token of turn 6 of a session: session prefix cache on vs off, same run.

    .venv/bin/python -m benchmarks.prefix_reuse [--model smollm2-135m-instruct] [--sessions 5]

Each session plays five turns (the engine's replies are appended to the history as a client would),
then turn 6 is timed to its first token, once on an engine with the prefix cache and once on an
engine without it, alternating sessions between the two. Prints median TTFT of each and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from benchmarks.common import console, load_model_and_tokenizer, median, model_arg, progress
from server.engines.base import SamplingParams
from server.engines.local.engine import LocalEngine

TOPICS = ["rivers", "volcanoes", "bread", "chess", "bees", "comets"]
REPLY = SamplingParams(max_new_tokens=48, temperature=0)


async def turn(engine: LocalEngine, tokenizer, history: list[dict[str, str]], session: str) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    """Send the history, append the reply; returns (seconds to first token, cached tokens)."""
    ids = tokenizer.apply_chat_template(history, add_generation_prompt=True, return_dict=False)
    start = time.perf_counter()
    first: float | None = None
    output: list[int] = []
    cached = 0
    async for chunk in engine.generate(ids, REPLY, session_key=session):
        first = first or time.perf_counter() - start
        output += chunk.token_ids
        cached = chunk.cached_tokens
    history.append({"role": "assistant", "content": tokenizer.decode(output, skip_special_tokens=True)})
    return first or 0.0, cached


async def sixth_turn(engine: LocalEngine, tokenizer, session: str) -> tuple[float, int, int]:  # type: ignore[no-untyped-def]
    history: list[dict[str, str]] = []
    for topic in TOPICS:
        history.append({"role": "user", "content": f"Tell me one interesting fact about {topic}."})
        ttft, cached = await turn(engine, tokenizer, history, session)
    prompt = len(tokenizer.apply_chat_template(history[:-1], add_generation_prompt=True, return_dict=False))
    return ttft, cached, prompt


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arg(parser)
    parser.add_argument("--sessions", type=int, default=5)
    args = parser.parse_args()
    path, tokenizer = load_model_and_tokenizer(args)
    cached_engine = await LocalEngine.open(path, torch_threads=args.threads)
    uncached_engine = await LocalEngine.open(path, torch_threads=args.threads, prefix_cache_bytes=0)
    with_cache, without_cache, cached_tokens, prompt_tokens = [], [], [], []
    with progress() as bar:
        task = bar.add_task("sessions", total=args.sessions)
        for i in range(args.sessions):
            ttft, cached, prompt = await sixth_turn(cached_engine, tokenizer, f"on-{i}")
            with_cache.append(ttft)
            cached_tokens.append(cached)
            prompt_tokens.append(prompt)
            without_cache.append((await sixth_turn(uncached_engine, tokenizer, f"off-{i}"))[0])
            bar.advance(task)
    await cached_engine.close()
    await uncached_engine.close()
    on, off = median(with_cache), median(without_cache)
    console.print(f"model {path.name}, {args.sessions} sessions, turn-6 prompt ~{median(prompt_tokens):.0f} tokens")
    print(
        f"turn-6 TTFT: cache on {on * 1000:.1f} ms ({median(cached_tokens):.0f} cached tokens), "
        f"cache off {off * 1000:.1f} ms, speed-up {off / on:.2f}x"
    )


if __name__ == "__main__":
    asyncio.run(main())
