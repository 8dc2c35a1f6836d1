"""Multi-adapter decode in the local engine: one batch of 16 requests with 0, 1, 4 or 16 distinct
LoRA adapters, against the base alone at the same batch size, same run; plus adapter load time and
memory per resident adapter.

    .venv/bin/python -m benchmarks.adapter_decode [--model smollm2-135m-instruct] [--rank 16] [--rounds 3]
        [--device cuda --dtype bfloat16] [--batch 16]

Greedy, fixed new-token count (EOS ignored). Adapters are random rank-``--rank`` LoRAs over every
linear layer of the attention and MLP blocks (made with peft, saved in its format). Rounds cycle
through the configurations so machine noise hits all alike; the median of each is reported as
tokens/s and as a ratio to the base. Results go to benchmarks/results/adapter_decode_<model>.json
(``_<device>_b<batch>`` added off the CPU default).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from benchmarks.common import console, load_model_and_tokenizer, median, model_arg, progress
from benchmarks.engine_decode import QUESTIONS
from server.engines.base import AdapterRef, SamplingParams
from server.engines.local.engine import DTYPES, LocalEngine
from server.engines.local.lora import read_adapter

DISTINCT = (0, 1, 4, 16)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(base: Path, root: Path, count: int, rank: int) -> list[AdapterRef]:
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(
        model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
    )
    refs = []
    for index in range(count):
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                torch.nn.init.normal_(param, std=0.01)
        folder = root / f"adapter-{index}"
        peft_model.save_pretrained(folder)
        refs.append(AdapterRef(key=folder.name, path=str(folder)))
    return refs


async def tokens_per_s(
    engine: LocalEngine, prompts: list[list[int]], adapters: list[AdapterRef | None], tokens: int
) -> float:
    sampling = SamplingParams(max_new_tokens=tokens, temperature=0, ignore_eos=True)

    async def one(prompt: list[int], adapter: AdapterRef | None) -> int:
        return sum([len(c.token_ids) async for c in engine.generate(prompt, sampling, adapter=adapter)])

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(p, a) for p, a in zip(prompts, adapters, strict=True)))
    return sum(counts) / (time.perf_counter() - start)


def load_times_ms(base: Path, refs: list[AdapterRef], device: str, dtype: str) -> list[float]:
    """Cold reads of each adapter folder into the serving model's dtype and device (what a cache miss costs)."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=DTYPES[dtype]).to(device)
    times = []
    for ref in refs:
        start = time.perf_counter()
        read_adapter(ref.key, Path(ref.path), model)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1000)
    return times


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arg(parser)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16, help="rows decoding together")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    args = parser.parse_args()
    batch = args.batch
    path, tokenizer = load_model_and_tokenizer(args)
    questions = (QUESTIONS * (batch // len(QUESTIONS) + 1))[:batch]
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False)
        for q in questions
    ]
    with tempfile.TemporaryDirectory() as tmp:
        refs = make_adapters(path, Path(tmp), max(DISTINCT), args.rank)
        loads = load_times_ms(path, refs, args.device, args.dtype)
        engine = await LocalEngine.open(
            path, device=args.device, dtype=args.dtype, torch_threads=args.threads, max_batch_size=batch
        )
        plans = {n: [refs[i % n] if n else None for i in range(batch)] for n in DISTINCT}
        for plan in plans.values():  # warm-up: loads every adapter once, pays first-forward costs
            await tokens_per_s(engine, prompts, plan, 2)
        measured: dict[int, list[float]] = {n: [] for n in DISTINCT}
        with progress() as bar:
            task = bar.add_task("decode", total=len(DISTINCT) * args.rounds)
            for _ in range(args.rounds):
                for n, plan in plans.items():
                    measured[n].append(await tokens_per_s(engine, prompts, plan, args.tokens))
                    bar.advance(task)
        per_adapter = engine.adapters.nbytes / len(engine.adapters.resident)
        await engine.close()
    base = median(measured[0])
    results = {
        "model": path.name,
        "rank": args.rank,
        "batch": batch,
        "device": args.device,
        "dtype": args.dtype,
        "tokens": args.tokens,
        "threads": args.threads,
        "rounds": args.rounds,
        "tokens_per_s": {str(n): median(v) for n, v in measured.items()},
        "ratio_to_base": {str(n): median(v) / base for n, v in measured.items()},
        "load_ms_median": median(loads),
        "load_ms_max": max(loads),
        "bytes_per_resident_adapter": per_adapter,
    }
    where = "" if (args.device, batch) == ("cpu", 16) else f"_{args.device}_b{batch}"
    out = Path(__file__).parent / "results" / f"adapter_decode_{path.name}{where}.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    console.print(
        f"model {path.name} on {args.device} ({args.dtype}), batch {batch}, rank {args.rank}, {args.tokens} new tokens, median of {args.rounds}"
    )
    for n in DISTINCT:
        label = "base alone" if n == 0 else f"{n} distinct adapter{'s' if n > 1 else ''}"
        print(f"{label:>20}: {results['tokens_per_s'][str(n)]:.1f} tok/s, ratio {results['ratio_to_base'][str(n)]:.2f}")
    print(
        f"adapter load: median {results['load_ms_median']:.1f} ms, max {results['load_ms_max']:.1f} ms; "
        f"{per_adapter / 2**20:.2f} MiB per resident adapter; results in {out}"
    )


if __name__ == "__main__":
    asyncio.run(main())
