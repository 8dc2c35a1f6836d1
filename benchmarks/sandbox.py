"""Sandbox cost: start-to-result latency of a trivial snippet, and executions per second on this machine.

    .venv/bin/python -m benchmarks.sandbox [--runs 200] [--slots 2]

Latency: ``print(1)`` run one at a time through ``Sandbox.run_python`` (a fresh bubblewrap tree and
interpreter each time), median and p95 in ms; as a baseline in the same run, the same interpreter
started without the sandbox (``python3 -I -c 'print(1)'`` as a plain subprocess), so the ratio is
what the isolation adds. Throughput: the same snippet with ``--slots`` executions at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from benchmarks.common import console, progress
from tandem.sandbox import Sandbox, sandbox_python

SNIPPET = "print(1)"


async def timed(run: object) -> float:
    start = time.perf_counter()
    await run  # type: ignore[misc]
    return (time.perf_counter() - start) * 1000


async def bare(python: str) -> None:
    process = await asyncio.create_subprocess_exec(
        python, "-I", "-c", SNIPPET, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    await process.communicate()


async def main(args: argparse.Namespace) -> None:
    sandbox = Sandbox(slots=args.slots)
    python = sandbox_python()
    sandboxed: list[float] = []
    plain: list[float] = []
    with progress() as bar:
        task = bar.add_task("one at a time", total=args.runs)
        for _ in range(args.runs):
            sandboxed.append(await timed(sandbox.run_python(SNIPPET)))
            plain.append(await timed(bare(python)))
            bar.advance(task)
    start = time.perf_counter()
    results = await asyncio.gather(*(sandbox.run_python(SNIPPET) for _ in range(args.runs)))
    per_s = len(results) / (time.perf_counter() - start)
    assert all(r.stdout == "1\n" for r in results)
    p95 = statistics.quantiles(sandboxed, n=20)[-1]
    median, base = statistics.median(sandboxed), statistics.median(plain)
    console.print(
        f"sandboxed: median {median:.1f} ms, p95 {p95:.1f} ms; plain interpreter {base:.1f} ms "
        f"(x{median / base:.2f}); {per_s:.1f} executions/s with {args.slots} at a time"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--slots", type=int, default=2)
    asyncio.run(main(parser.parse_args()))
