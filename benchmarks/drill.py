"""The outside drill's availability scenarios, against this tree and a baseline tree in the same run.

1. Database stall: PostgreSQL behind a TCP proxy that stops answering, then one that refuses
   connections; a tenant key chats throughout (its key was verified before the fault).
2. Oversized prompts: four concurrent chats of 3.9 M characters (under the 4 MiB body limit) while
   /health and another tenant's 2-token chats are timed.
3. One tenant floods: 300 concurrent chats from tenant A while tenant B's 8-token chats are timed.

Each tree runs as `tandem serve` from its own source folder (PYTHONPATH), on a fresh PostgreSQL
database, with the default settings. Example (baseline: the commit before the fixes):

    git worktree add /tmp/before 3fbeadf
    .venv/bin/python -m benchmarks.drill --baseline-tree /tmp/before
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg
from psycopg import sql

from benchmarks.common import console, free_port, model_path, percentile, start
from tests.fixtures.tcp_proxy import TcpProxy

ROOT = Path(__file__).resolve().parents[1]
POSTGRES_ADMIN_DSN = "host=127.0.0.1 port=5432 user=postgres dbname=test connect_timeout=5"
ADMIN_KEY = "drill-admin-key"


@dataclass
class Gateway:
    url: str
    keys: dict[str, str]
    model: str = ""


@dataclass
class Timings:
    seconds: list[float] = field(default_factory=list)
    statuses: list[int] = field(default_factory=list)

    def summary(self) -> str:
        if not self.seconds:
            return "none"
        failed = sum(s != 200 for s in self.statuses)
        return (
            f"{len(self.seconds)} requests, {failed} not 200, p50 {percentile(self.seconds, 50):.3f} s, "
            f"max {max(self.seconds):.3f} s"
        )


@contextmanager
def postgres_database() -> Iterator[str]:
    name = f"tandem_drill_{secrets.token_hex(4)}"
    with psycopg.connect(POSTGRES_ADMIN_DSN, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        try:
            yield f"postgresql://postgres@127.0.0.1:5432/{name}"
        finally:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def create_keys(tree: Path, database_url: str, tenants: tuple[str, ...]) -> dict[str, str]:
    """Tenant keys, made by the tree's own code (it also migrates the database to its schema)."""
    script = (
        "import sys, json\n"
        "try:\n    from migrations.migrate import upgrade\n"
        "except ImportError:  # trees before the migration runner moved\n    from storage.migrate import upgrade\n"
        "from storage.api_keys import create_api_key\n"
        "from storage.db import make_engine, make_session_factory\n"
        "url = sys.argv[1]; upgrade(url)\n"
        "with make_session_factory(make_engine(url)).begin() as s:\n"
        "    print(json.dumps({t: create_api_key(s, tenant_name=t, name='drill')[0] for t in sys.argv[2:]}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, database_url, *tenants],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@contextmanager
def gateway(tree: Path, database_url: str, workdir: Path, model: Path) -> Iterator[Gateway]:
    keys = create_keys(tree, database_url, ("tenant-a", "tenant-b"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "PYTHONPATH": str(tree),
        "TANDEM_DATA_DIR": str(workdir),
        "TANDEM_DATABASE_URL": database_url,
        "TANDEM_MODEL": str(model),
        "TANDEM_PORT": str(port),
        "TANDEM_ADMIN_KEY": ADMIN_KEY,
        "TANDEM_LOG_LEVEL": "WARNING",
    }
    process = start(["serve"], env, f"{url}/health", cwd=tree)  # `python -m` puts the cwd first on sys.path
    try:
        served = Gateway(url, keys)
        served.model = httpx.get(f"{url}/v1/models", headers=auth(keys["tenant-a"])).json()["data"][0]["id"]
        yield served
    finally:
        process.terminate()
        process.wait(timeout=60)


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def timed_chat(
    http: httpx.AsyncClient, gw: Gateway, key: str, content: str, max_tokens: int
) -> tuple[float, int]:
    body = {"model": gw.model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
    started = time.perf_counter()
    try:
        response = await http.post(f"{gw.url}/v1/chat/completions", json=body, headers=auth(key))
        status = response.status_code
    except httpx.HTTPError:
        status = 0
    return time.perf_counter() - started, status


async def probe_while(
    done: asyncio.Event, call: Callable[[], Awaitable[tuple[float, int]]], timings: Timings, pause_s: float
) -> None:
    while not done.is_set():
        seconds, status = await call()
        timings.seconds.append(seconds)
        timings.statuses.append(status)
        await asyncio.sleep(pause_s)


async def database_fault(gw: Gateway, proxy: TcpProxy, fault: str, seconds: float) -> Timings:
    """A verified tenant key chats every 0.5 s while the database stalls (or refuses) for ``seconds``."""
    timings = Timings()
    async with httpx.AsyncClient(timeout=60) as http:
        await timed_chat(http, gw, gw.keys["tenant-a"], "hi", 2)
        done = asyncio.Event()
        if fault == "stall":
            proxy.fault = "stall"
        else:
            proxy.stop()
        prober = asyncio.create_task(
            probe_while(done, lambda: timed_chat(http, gw, gw.keys["tenant-a"], "hi", 2), timings, 0.5)
        )
        await asyncio.sleep(seconds)
        done.set()
        await prober
        proxy.fault = None
        if fault != "stall":
            proxy.start()
    return timings


async def oversized_prompts(gw: Gateway) -> tuple[Timings, Timings, Timings]:
    big, health, others = Timings(), Timings(), Timings()
    async with httpx.AsyncClient(timeout=120) as http:

        async def one_big() -> None:
            seconds, status = await timed_chat(http, gw, gw.keys["tenant-a"], "a" * 3_900_000, 2)
            big.seconds.append(seconds)
            big.statuses.append(status)

        async def health_check() -> tuple[float, int]:
            started = time.perf_counter()
            response = await http.get(f"{gw.url}/health")
            return time.perf_counter() - started, response.status_code

        done = asyncio.Event()
        probes = [
            asyncio.create_task(probe_while(done, health_check, health, 0.1)),
            asyncio.create_task(
                probe_while(done, lambda: timed_chat(http, gw, gw.keys["tenant-b"], "hi", 2), others, 0.1)
            ),
        ]
        await asyncio.gather(*(one_big() for _ in range(4)))
        done.set()
        await asyncio.gather(*probes)
    return big, health, others


async def tenant_flood(gw: Gateway, flood: int) -> tuple[Timings, Timings, Timings]:
    """Tenant B's 8-token chats alone, then while tenant A has ``flood`` chats in flight."""
    alone, during, flooder = Timings(), Timings(), Timings()
    limits = httpx.Limits(max_connections=flood + 16)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        for _ in range(5):
            seconds, status = await timed_chat(http, gw, gw.keys["tenant-b"], "hello", 8)
            alone.seconds.append(seconds)
            alone.statuses.append(status)

        async def flood_one() -> None:
            seconds, status = await timed_chat(http, gw, gw.keys["tenant-a"], "tell me a story", 64)
            flooder.seconds.append(seconds)
            flooder.statuses.append(status)

        flooding = [asyncio.create_task(flood_one()) for _ in range(flood)]
        await asyncio.sleep(1.0)  # the flood is queued
        for _ in range(5):
            seconds, status = await timed_chat(http, gw, gw.keys["tenant-b"], "hello", 8)
            during.seconds.append(seconds)
            during.statuses.append(status)
        await asyncio.gather(*flooding)
    return alone, during, flooder


def run_tree(name: str, tree: Path, model: Path, workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with postgres_database() as direct:
        proxy = TcpProxy("127.0.0.1", 5432)
        proxy.start()
        proxied = direct.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
        try:
            with gateway(tree, proxied, workdir / name, model) as gw:
                console.print(f"{name}: database stall for {args.fault_s:.0f} s")
                results["stall"] = asyncio.run(database_fault(gw, proxy, "stall", args.fault_s))
                console.print(f"{name}: database refusing connections for {args.fault_s:.0f} s")
                results["refused"] = asyncio.run(database_fault(gw, proxy, "refuse", args.fault_s))
                console.print(f"{name}: oversized prompts")
                results["oversized"] = asyncio.run(oversized_prompts(gw))
                console.print(f"{name}: tenant flood of {args.flood}")
                results["flood"] = asyncio.run(tenant_flood(gw, args.flood))
        finally:
            proxy.stop()
    return results


def report(name: str, results: dict[str, Any]) -> None:
    print(f"## {name}")
    print(f"- database stalled: tenant-key chats: {results['stall'].summary()}")
    print(f"- database refusing: tenant-key chats: {results['refused'].summary()}")
    big, health, others = results["oversized"]
    print(f"- 4 x 3.9 M-character prompts: {big.summary()} (statuses {sorted(set(big.statuses))})")
    print(f"  - meanwhile /health: {health.summary()}")
    print(f"  - meanwhile tenant B 2-token chats: {others.summary()}")
    alone, during, flooder = results["flood"]
    print(f"- tenant B 8-token chats alone: {alone.summary()}")
    print(f"  - while tenant A floods: {during.summary()}")
    refused = sum(s == 429 for s in flooder.statuses)
    print(f"  - tenant A's flood: {flooder.summary()} ({refused} answered 429)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline-tree", type=Path, required=True, help="source folder of the baseline commit")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="builtin name, HF folder, or 'tiny'")
    parser.add_argument("--fault-s", type=float, default=45.0, help="how long each database fault lasts")
    parser.add_argument("--flood", type=int, default=300, help="tenant A's concurrent chats")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/tandem-drill"))
    args = parser.parse_args()
    model = model_path(args.model)
    runs = {"baseline": args.baseline_tree.resolve(), "this tree": ROOT}
    results = {name: run_tree(name.replace(" ", "-"), tree, model, args.workdir, args) for name, tree in runs.items()}
    for name, result in results.items():
        report(name, result)


if __name__ == "__main__":
    main()
