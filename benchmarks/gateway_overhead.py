"""Gateway overhead: the gateway (conversation logging on) in front of a `tandem engine` process or a
real SGLang server, against calling that engine directly, in the same run.

    .venv/bin/python -m benchmarks.gateway_overhead [--engine tandem|sglang] [--model tiny] [--requests 300]
        [--concurrency 1 8 32]

Both paths send the same prompt tokens and get the same short greedy reply (--max-tokens); the
direct path posts SGLang's /generate, the gateway path posts /v1/chat/completions. For every
concurrency, streaming and not, the two paths alternate in rounds. Reports p50/p99 latency, req/s,
the gateway's added p50/p99, and the gateway process's CPU time per request (from /proc).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson
from transformers import AutoTokenizer

from benchmarks.common import console, model_arg, model_path, percentile, progress, start
from server.engines.launch_plan import load_launch_config, serving_urls
from tests.support.uvicorn_thread import free_port

MESSAGES = [{"role": "user", "content": "Say hello."}]
JSON = {"Content-Type": "application/json"}  # SGLang parses /generate bodies by content type
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def start_engine(
    kind: str, model: Path, env: dict[str, str], data_dir: Path
) -> tuple[list[str], str, subprocess.Popen[bytes] | None]:
    """The gateway's engine flags, the engine URL to call directly, and the engine process if we own it.

    An SGLang server is launched by the gateway itself, as a managed CPU group (--engine-config).
    """
    port = free_port()
    if kind == "tandem":
        url = f"http://127.0.0.1:{port}"
        engine = start(["engine", "--model", str(model), "--port", str(port)], env, url + "/model_info")
        return ["--engine-url", url], url, engine
    config = data_dir / "engines.toml"
    config.write_text(
        f'[[groups]]\nname = "sglang-cpu"\ndevice = "cpu"\nmodel_path = "{model}"\nbase_port = {port}\n'
        'extra_args = ["--dtype", "float32"]\n'
    )
    (url,) = serving_urls(load_launch_config(config))
    return ["--engine-config", str(config)], url, None


@dataclass
class Run:
    latencies: list[float]
    seconds: float
    cpu: float


async def load(send: Callable[[], Awaitable[None]], requests: int, concurrency: int, pid: int) -> Run:
    latencies: list[float] = []
    remaining = requests

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            begin = time.perf_counter()
            await send()
            latencies.append(time.perf_counter() - begin)

    cpu_before, began = cpu_seconds(pid), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return Run(latencies, time.perf_counter() - began, cpu_seconds(pid) - cpu_before)


async def read_all(response: aiohttp.ClientResponse) -> None:
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {(await response.read())[:300]!r}")
    async for _ in response.content.iter_any():
        pass


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arg(parser)
    parser.set_defaults(model="tiny")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument(
        "--engine",
        choices=["tandem", "sglang"],
        default="tandem",
        help="a `tandem engine` process, or a real SGLang server on the CPU (scripts/setup_sglang.sh installs it)",
    )
    args = parser.parse_args()
    path = model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False)

    data_dir = Path(tempfile.mkdtemp(prefix="tandem-bench-"))
    env = {**os.environ, "TANDEM_DATA_DIR": str(data_dir), "TANDEM_TORCH_THREADS": "1", "TANDEM_LOG_LEVEL": "WARNING"}
    gateway_port = free_port()
    gateway_url = f"http://127.0.0.1:{gateway_port}"
    engine_flags, engine_url, engine = start_engine(args.engine, path, env, data_dir)
    gateway = start(
        ["serve", *engine_flags, "--model", str(path), "--port", str(gateway_port)], env, gateway_url + "/v1/models"
    )
    model = path.name
    results: dict[tuple[int, bool, str], list[Run]] = {}
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            model = (await (await http.get(gateway_url + "/v1/models")).json())["data"][0]["id"]

            def direct(stream: bool) -> Callable[[], Awaitable[None]]:
                body = orjson.dumps(
                    {
                        "input_ids": prompt,
                        "sampling_params": {"max_new_tokens": args.max_tokens, "temperature": 0},
                        "return_logprob": True,
                        "stream": stream,
                    }
                )

                async def send() -> None:
                    async with http.post(engine_url + "/generate", data=body, headers=JSON) as response:
                        await read_all(response)

                return send

            def gateway_send(stream: bool) -> Callable[[], Awaitable[None]]:
                body = orjson.dumps(
                    {
                        "model": model,
                        "messages": MESSAGES,
                        "max_tokens": args.max_tokens,
                        "temperature": 0,
                        "stream": stream,
                    }
                )

                async def send() -> None:
                    async with http.post(gateway_url + "/v1/chat/completions", data=body, headers=JSON) as r:
                        await read_all(r)

                return send

            for warm in (direct(False), gateway_send(False)):
                await load(warm, 20, 4, gateway.pid)
            plan = [(c, s) for c in args.concurrency for s in (False, True)]
            with progress() as bar:
                task = bar.add_task("load", total=len(plan) * args.rounds * 2)
                for concurrency, stream in plan:
                    for _ in range(args.rounds):
                        for name, send in (("direct", direct(stream)), ("gateway", gateway_send(stream))):
                            run = await load(send, args.requests, concurrency, gateway.pid)
                            results.setdefault((concurrency, stream, name), []).append(run)
                            bar.advance(task)
    finally:
        for process in (gateway, engine):  # the gateway stops the SGLang server it launched
            if process is not None:
                process.terminate()
                process.wait(timeout=60)

    console.print(
        f"{args.engine} engine, model {model}, {args.max_tokens} new tokens, {args.requests} requests x {args.rounds} rounds"
    )
    print(
        "| clients | stream | direct p50 / p99 ms | gateway p50 / p99 ms | added p50 / p99 ms | direct req/s | gateway req/s | gateway CPU ms/req |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for concurrency, stream in plan:
        d = [x for run in results[(concurrency, stream, "direct")] for x in run.latencies]
        g = [x for run in results[(concurrency, stream, "gateway")] for x in run.latencies]
        g_runs = results[(concurrency, stream, "gateway")]
        d_runs = results[(concurrency, stream, "direct")]
        rate = lambda runs: sum(len(r.latencies) for r in runs) / sum(r.seconds for r in runs)  # noqa: E731
        cpu = sum(r.cpu for r in g_runs) / sum(len(r.latencies) for r in g_runs) * 1000
        dp50, dp99, gp50, gp99 = (percentile(x, q) * 1000 for x, q in ((d, 50), (d, 99), (g, 50), (g, 99)))
        print(
            f"| {concurrency} | {'yes' if stream else 'no'} | {dp50:.2f} / {dp99:.2f} | {gp50:.2f} / {gp99:.2f} | "
            f"{gp50 - dp50:+.2f} / {gp99 - dp99:+.2f} | {rate(d_runs):.0f} | {rate(g_runs):.0f} | {cpu:.2f} |"
        )


if __name__ == "__main__":
    asyncio.run(main())
