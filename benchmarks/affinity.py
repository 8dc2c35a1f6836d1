"""Session affinity over three `tandem engine` replicas: prefix-cache hits and TTFT of later turns.

    .venv/bin/python -m benchmarks.affinity [--model tiny] [--sessions 64] [--turns 6] [--concurrency 8] [--rounds 2]

Starts three engine processes and three gateways: one routing by session (TANDEM_ROUTING=affinity)
and one round-robin, both over the three engines, and one over the first engine alone, which gives
the hit ratio a session gets when it never moves. Each configuration plays the same multi-turn chats
through the `openai` client (streamed, greedy, EOS ignored; every turn resends the whole history with
the replies as returned; X-Session-Id per session; up to --concurrency sessions at a time), after
the engines' caches are flushed; configurations alternate within rounds. Reports the hit ratio
(cached / prompt tokens), TTFT of turns >= 2, how often a session changed replica, and the hit
ratio of each configuration against the single replica (goal: affinity keeps at least 0.9 of it).
The environment reaches the gateways, so e.g. TANDEM_ROUTING_LOAD_FACTOR=1.0 tries another load bound.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionMessageParam

from benchmarks.common import console, model_arg, model_path, percentile, progress, start
from tests.support.uvicorn_thread import free_port

REPLICAS = 3
GOAL = 0.9  # affinity keeps at least this share of the single-replica hit ratio (the target)
WORDS = ("rivers", "volcanoes", "bread", "chess", "bees", "comets", "tides", "owls", "maps", "kites", "ferns")


@dataclass(frozen=True, slots=True)
class Target:
    """One configuration: a gateway and the engines it routes over (flushed before its runs)."""

    name: str
    gateway: str
    engines: tuple[str, ...]


@dataclass(slots=True)
class TurnResult:
    session: str
    turn: int  # 0-based: turn 0 has nothing to reuse
    prompt_tokens: int
    cached_tokens: int
    ttft: float
    completion_id: str
    replica: str = ""


def user_message(session: str, turn: int) -> str:
    # Seeded by session and turn, so every configuration plays exactly the same conversation.
    rng = random.Random(f"{session}/{turn}")
    first, second = rng.sample(WORDS, 2)
    return f"Tell me about {first} and {second}."


async def chat_turn(
    client: AsyncOpenAI, model: str, session: str, turn: int, history: list[ChatCompletionMessageParam], tokens: int
) -> TurnResult:
    """Send the whole history, append the reply as returned; time to the first content chunk."""
    began = time.perf_counter()
    first: float | None = None
    parts: list[str] = []
    prompt = cached = 0
    completion_id = ""
    stream = await client.chat.completions.create(
        model=model,
        messages=history,
        max_tokens=tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
        extra_headers={"X-Session-Id": session},
    )
    async for chunk in stream:
        completion_id = chunk.id
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - began
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            prompt = chunk.usage.prompt_tokens
            details = chunk.usage.prompt_tokens_details
            cached = (details.cached_tokens or 0) if details is not None else 0
    history.append({"role": "assistant", "content": "".join(parts)})
    if first is None:
        raise RuntimeError(f"session {session} turn {turn}: no content in the reply")
    return TurnResult(session, turn, prompt, cached, first, completion_id)


async def flush(http: httpx.AsyncClient, engines: tuple[str, ...]) -> None:
    """Empty every engine's prefix cache so no run starts with another run's sessions."""
    for url in engines:
        response = await http.post(url + "/flush_cache")
        if response.status_code != 200:
            raise RuntimeError(f"{url}/flush_cache: HTTP {response.status_code} {response.text[:200]}")


async def replicas_of(client: AsyncOpenAI, results: list[TurnResult]) -> None:
    """Which replica served each turn, from the gateway's conversation log (not part of the timing)."""
    limit = asyncio.Semaphore(8)

    async def one(result: TurnResult) -> None:
        async with limit:
            view: Any = await client.get(f"/completions/{result.completion_id}", cast_to=object)
            result.replica = str(view["engine_replica"])

    await asyncio.gather(*(one(r) for r in results))


async def play(
    client: AsyncOpenAI,
    model: str,
    sessions: list[str],
    turns: int,
    concurrency: int,
    tokens: int,
    advance: Callable[[], object] = lambda: None,
) -> list[TurnResult]:
    """Every session's turns in order, at most ``concurrency`` sessions at a time."""
    limit = asyncio.Semaphore(concurrency)
    results: list[TurnResult] = []

    async def session_turns(session: str) -> None:
        async with limit:
            history: list[ChatCompletionMessageParam] = []
            for turn in range(turns):
                history.append({"role": "user", "content": user_message(session, turn)})
                results.append(await chat_turn(client, model, session, turn, history, tokens))
                advance()

    await asyncio.gather(*(session_turns(s) for s in sessions))
    return results


def hit_ratio(results: list[TurnResult]) -> float:
    prompt = sum(r.prompt_tokens for r in results)
    return sum(r.cached_tokens for r in results) / prompt if prompt else 0.0


def moved_share(results: list[TurnResult]) -> float:
    """Share of turns >= 2 served by another replica than the session's previous turn."""
    by_turn = {(r.session, r.turn): r.replica for r in results}
    later = [r for r in results if r.turn > 0]
    return sum(by_turn[(r.session, r.turn - 1)] != r.replica for r in later) / len(later) if later else 0.0


def stop(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def launch(path: Path, threads: int, processes: list[subprocess.Popen[bytes]]) -> list[Target]:
    """Start the engines and the three gateways; ``processes`` collects them as they come up."""
    data_dir = Path(tempfile.mkdtemp(prefix="tandem-bench-affinity-"))
    env = {
        **os.environ,
        "TANDEM_DATA_DIR": str(data_dir),
        "TANDEM_TORCH_THREADS": str(threads),
        "TANDEM_LOG_LEVEL": "WARNING",
    }
    engines: list[str] = []
    for _ in range(REPLICAS):
        port = str(free_port())
        engines.append(f"http://127.0.0.1:{port}")
        processes.append(start(["engine", "--model", str(path), "--port", port], env, engines[-1] + "/model_info"))
    targets: list[Target] = []
    # The single-replica baseline shares the first engine: every run starts from flushed caches anyway.
    for name, routing, over in (
        ("affinity", "affinity", engines),
        ("round-robin", "round_robin", engines),
        ("single", "affinity", engines[:1]),
    ):
        port = str(free_port())
        # Own data dir per gateway: each has its own SQLite file and journal.
        gateway_env = {**env, "TANDEM_DATA_DIR": str(data_dir / name), "TANDEM_ROUTING": routing}
        urls = [flag for url in over for flag in ("--engine-url", url)]
        targets.append(Target(name, f"http://127.0.0.1:{port}", tuple(over)))
        command = ["serve", *urls, "--model", str(path), "--port", port]
        processes.append(start(command, gateway_env, targets[-1].gateway + "/v1/models"))
    return targets


async def measure(targets: list[Target], args: argparse.Namespace) -> tuple[str, dict[str, list[list[TurnResult]]]]:
    """Every round plays the sessions through each configuration in turn; per configuration, its runs."""
    clients = {
        t.name: AsyncOpenAI(base_url=t.gateway + "/v1", api_key="unused", timeout=600, max_retries=0) for t in targets
    }
    results: dict[str, list[list[TurnResult]]] = {t.name: [] for t in targets}
    try:
        model = (await clients["single"].models.list()).data[0].id
        async with httpx.AsyncClient(timeout=60) as http:
            # Warm-up: the first requests of a process pay one-off costs no configuration should carry.
            for target in targets:
                await play(clients[target.name], model, ["warm-0", "warm-1"], 2, 2, args.max_tokens)
            with progress() as bar:
                task = bar.add_task("requests", total=args.rounds * len(targets) * args.sessions * args.turns)
                for round_index in range(args.rounds):
                    # New session ids per round (another spread over the ring); the same in every configuration.
                    sessions = [f"r{round_index}-s{i}" for i in range(args.sessions)]
                    # Rotate the order each round so no configuration always runs first or last.
                    shift = round_index % len(targets)
                    for target in targets[shift:] + targets[:shift]:
                        bar.update(task, description=f"round {round_index + 1} {target.name}")
                        await flush(http, target.engines)
                        client = clients[target.name]
                        run = await play(
                            client,
                            model,
                            sessions,
                            args.turns,
                            args.concurrency,
                            args.max_tokens,
                            lambda: bar.advance(task),
                        )
                        await replicas_of(client, run)
                        results[target.name].append(run)
    finally:
        for client in clients.values():
            await client.close()
    return model, results


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arg(parser)
    # One torch thread per engine: three engines share this machine's two cores.
    parser.set_defaults(model="tiny", threads=1)
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=8, help="sessions in flight at a time")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=24, help="new tokens per turn")
    args = parser.parse_args()
    path = model_path(args.model)

    processes: list[subprocess.Popen[bytes]] = []
    try:
        model, results = await measure(launch(path, args.threads, processes), args)
    finally:
        stop(processes[::-1])  # gateways before the engines they route to
    report(results, args, model)


def report(results: dict[str, list[list[TurnResult]]], args: argparse.Namespace, model: str) -> None:
    console.print(
        f"model {model}, {REPLICAS} replicas, {args.sessions} sessions x {args.turns} turns, "
        f"{args.concurrency} sessions in flight, {args.max_tokens} new tokens, {args.rounds} rounds"
    )
    pooled = {name: [r for run in runs for r in run] for name, runs in results.items()}
    base = hit_ratio([r for r in pooled["single"] if r.turn > 0])
    for name, runs in results.items():
        per_round = ", ".join(f"{hit_ratio([r for r in run if r.turn > 0]):.3f}" for run in runs)
        console.print(f"{name}: turns >= 2 hit ratio per round {per_round}")
    print(
        "| config | requests | hit ratio turns >= 2 | hit ratio overall | TTFT p50 / p90 ms turns >= 2 | moved | vs single |"
    )
    print("|---|---|---|---|---|---|---|")
    ratios: dict[str, float] = {}
    p50s: dict[str, float] = {}
    for name, turns in pooled.items():
        later = [r for r in turns if r.turn > 0]
        ttfts = [r.ttft for r in later]
        ratios[name] = hit_ratio(later) / base if base else 0.0
        p50s[name] = percentile(ttfts, 50) * 1000
        print(
            f"| {name} | {len(turns)} | {hit_ratio(later):.3f} | {hit_ratio(turns):.3f} | "
            f"{p50s[name]:.1f} / {percentile(ttfts, 90) * 1000:.1f} | {moved_share(turns):.1%} | {ratios[name]:.2f} |"
        )
    met = "met" if ratios["affinity"] >= GOAL else "NOT met"
    print(
        f"affinity keeps {ratios['affinity']:.2f} of the single-replica hit ratio (goal >= {GOAL}: {met}), "
        f"round-robin {ratios['round-robin']:.2f}; turn >= 2 TTFT p50 affinity {p50s['affinity']:.1f} ms, "
        f"round-robin {p50s['round-robin']:.1f} ms, single {p50s['single']:.1f} ms"
    )


if __name__ == "__main__":
    asyncio.run(main())
