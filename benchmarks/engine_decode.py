"""Local engine decode throughput vs plain transformers ``generate`` on the same model, same run.

    .venv/bin/python -m benchmarks.engine_decode [--model smollm2-135m-instruct] [--tokens 64] [--rounds 3]

Greedy, fixed new-token count (EOS ignored), batch 1 and batch 8; rounds alternate between the
two so machine noise hits both alike. Prints tokens/s of each and the ratio engine/transformers.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch
from transformers import AutoModelForCausalLM

from benchmarks.common import console, load_model_and_tokenizer, median, model_arg, progress
from server.engines.base import SamplingParams
from server.engines.local.engine import LocalEngine

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Why is the sky blue?",
    "Give me a synonym for happy.",
    "How many legs does a spider have?",
    "What is 12 times 12?",
    "Who wrote Hamlet?",
    "What is the boiling point of water?",
]


async def engine_tokens_per_s(engine: LocalEngine, prompts: list[list[int]], tokens: int) -> float:
    sampling = SamplingParams(max_new_tokens=tokens, temperature=0, ignore_eos=True)

    async def one(prompt: list[int]) -> int:
        return sum([len(c.token_ids) async for c in engine.generate(prompt, sampling)])

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts))
    return sum(counts) / (time.perf_counter() - start)


@torch.inference_mode()
def transformers_tokens_per_s(model, tokenizer, prompts: list[list[int]], tokens: int) -> float:  # type: ignore[no-untyped-def]
    batch = tokenizer.pad({"input_ids": prompts}, padding_side="left", return_tensors="pt")
    start = time.perf_counter()
    out = model.generate(
        **batch, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
    )
    elapsed = time.perf_counter() - start
    return (out.shape[1] - batch["input_ids"].shape[1]) * len(prompts) / elapsed


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arg(parser)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    path, tokenizer = load_model_and_tokenizer(args)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False)
        for q in QUESTIONS
    ]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = await LocalEngine.open(path, torch_threads=args.threads, max_batch_size=8)
    await engine_tokens_per_s(engine, prompts[:1], 4)  # warm-up: first forward pays one-off costs
    transformers_tokens_per_s(model, tokenizer, prompts[:1], 4)

    rows = []
    with progress() as bar:
        task = bar.add_task("decode", total=2 * args.rounds)
        for batch in (1, 8):
            ours, theirs = [], []
            for _ in range(args.rounds):
                ours.append(await engine_tokens_per_s(engine, prompts[:batch], args.tokens))
                theirs.append(transformers_tokens_per_s(model, tokenizer, prompts[:batch], args.tokens))
                bar.advance(task)
            rows.append((batch, median(ours), median(theirs)))
    await engine.close()
    console.print(f"model {path.name}, {args.tokens} new tokens, {args.threads} threads, median of {args.rounds}")
    for batch, ours, theirs in rows:
        print(
            f"batch {batch}: engine {ours:.1f} tok/s, transformers generate {theirs:.1f} tok/s, ratio {ours / theirs:.2f}"
        )


if __name__ == "__main__":
    asyncio.run(main())
