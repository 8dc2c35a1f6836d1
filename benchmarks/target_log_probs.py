"""Target log-probs from ``[T, V]`` logits, forward and backward: the chunked function against the plain form.

The plain form is ``log_softmax(logits.float()).gather(...)`` (what both trainers ran before
``learner.algorithms.chunked_log_probs``). Each variant runs in a fresh process, so its peak resident
memory is its own; the report gives median seconds per forward + backward and the peak memory, and
chunked over plain for both.

    python -m benchmarks.target_log_probs --tokens 2048 --vocab 151936 --dtype bf16 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import statistics
import time

import torch

from learner.algorithms import target_log_probs

DTYPES = {"bf16": torch.bfloat16, "float32": torch.float32}


def _plain(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[:, None])[:, 0]


def _chunked(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return target_log_probs(logits, targets)[0]


VARIANTS = {"plain": _plain, "chunked": _chunked}


def _run(variant: str, args: argparse.Namespace, results: multiprocessing.Queue) -> None:
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(args.tokens, args.vocab, generator=generator).to(DTYPES[args.dtype])
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=generator)
    upstream = torch.randn(args.tokens, generator=generator)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(args.repeats):
        logits = base.clone().requires_grad_()
        started = time.perf_counter()
        (VARIANTS[variant](logits, targets) * upstream).sum().backward()
        times.append(time.perf_counter() - started)
    peak_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024  # ru_maxrss is in KiB
    results.put({"s": statistics.median(times), "peak_mb_over_inputs": peak_mb})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    context = multiprocessing.get_context("spawn")
    report: dict[str, object] = {k: getattr(args, k) for k in ("tokens", "vocab", "dtype", "repeats")}
    for variant in VARIANTS:
        results = context.Queue()
        process = context.Process(target=_run, args=(variant, args, results))
        process.start()
        report[variant] = result = results.get()
        process.join()
        print(f"{variant:>8}: {result['s']:.3f} s per forward + backward, peak {result['peak_mb_over_inputs']:,.0f} MB")
    plain, chunked = report["plain"], report["chunked"]
    assert isinstance(plain, dict) and isinstance(chunked, dict)
    report["time_chunked_over_plain"] = chunked["s"] / plain["s"]
    report["memory_chunked_over_plain"] = chunked["peak_mb_over_inputs"] / plain["peak_mb_over_inputs"]
    print(
        f"chunked / plain: time {report['time_chunked_over_plain']:.2f}x, memory {report['memory_chunked_over_plain']:.2f}x"
    )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
