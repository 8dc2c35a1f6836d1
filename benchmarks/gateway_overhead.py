"""Gateway overhead: the gateway (conversation logging on) in front of a `tandem engine` process or a
real SGLang server, against calling that engine directly and, with SGLang, against LiteLLM's proxy in
front of the same server, in the same run.

    .venv/bin/python -m benchmarks.gateway_overhead [--engine tandem|sglang] [--model tiny] [--requests 300]
        [--concurrency 1 8 32] [--litellm]

Every path asks for the same short greedy reply (--max-tokens) to the same prompt: "direct" posts
the engine's /generate with the prompt's token ids, "direct chat" SGLang's own
/v1/chat/completions, "litellm" the same through LiteLLM (its proxy, one worker, no database,
installed by this script into ~/.cache/tandem/litellm-venv; LITELLM_LOCAL_MODEL_COST_MAP keeps it
offline), "tandem" the gateway's /v1/chat/completions. For every concurrency, streaming and not, the
paths alternate in rounds. Reports p50/p99 latency, req/s, each proxy's added p50 over the direct
chat endpoint (over /generate for the tandem engine) and its CPU time per request (from /proc).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson
from transformers import AutoTokenizer

from benchmarks.common import console, model_arg, model_path, percentile, progress, start, wait_until_answering
from server.engines.launch_plan import load_launch_config, serving_urls
from tests.support.uvicorn_thread import free_port

MESSAGES = [{"role": "user", "content": "Say hello."}]
JSON = {"Content-Type": "application/json"}  # SGLang parses /generate bodies by content type
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int | None) -> float:
    """CPU time of ``pid`` and its threads (0 for None); not its children (the SGLang it launched)."""
    if pid is None:
        return 0.0
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


async def load(send: Callable[[], Awaitable[None]], requests: int, concurrency: int, pid: int | None) -> Run:
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


LITELLM_VENV = Path.home() / ".cache" / "tandem" / "litellm-venv"
LITELLM_KEY = "sk-tandem-benchmark"


def litellm_command() -> Path:
    """LiteLLM's proxy, in a venv of its own: its pins would fight the project's."""
    command = LITELLM_VENV / "bin" / "litellm"
    if not command.exists():
        console.print(f"installing litellm[proxy] into {LITELLM_VENV} (a minute or two, once)")
        subprocess.run([sys.executable, "-m", "venv", str(LITELLM_VENV)], check=True)
        subprocess.run([LITELLM_VENV / "bin" / "pip", "install", "-q", "litellm[proxy]"], check=True)
    return command


def start_litellm(engine_url: str, engine_model: str, data_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    config = data_dir / "litellm.yaml"  # JSON is YAML
    model = {"model": f"openai/{engine_model}", "api_base": f"{engine_url}/v1", "api_key": "none"}
    config.write_bytes(orjson.dumps({"model_list": [{"model_name": "bench", "litellm_params": model}]}))
    env = {
        **os.environ,
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_LOG": "ERROR",
        "LITELLM_MASTER_KEY": LITELLM_KEY,  # it refuses to start without one; checked without a database
    }
    log = data_dir / "litellm.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [litellm_command(), "--config", config, "--port", str(port), "--num_workers", "1"],
            env=env,
            stdout=out,
            stderr=out,
        )
    url = f"http://127.0.0.1:{port}"
    return wait_until_answering(process, url + "/health/liveliness", log, what="litellm", timeout_s=180), url


def served_model(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as response:
        return str(orjson.loads(response.read())["data"][0]["id"])


@dataclass(frozen=True)
class Target:
    name: str
    send: Callable[[bool], Callable[[], Awaitable[None]]]  # stream -> one request
    pid: int | None  # the proxy process whose CPU time is counted


def chat_sender(
    http: aiohttp.ClientSession, url: str, model: str, max_tokens: int, key: str | None = None
) -> Callable[[bool], Callable[[], Awaitable[None]]]:
    headers = {**JSON, "Authorization": f"Bearer {key}"} if key else JSON

    def make(stream: bool) -> Callable[[], Awaitable[None]]:
        body = orjson.dumps(
            {"model": model, "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
        )

        async def send() -> None:
            async with http.post(url + "/v1/chat/completions", data=body, headers=headers) as response:
                await read_all(response)

        return send

    return make


def generate_sender(
    http: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int
) -> Callable[[bool], Callable[[], Awaitable[None]]]:
    def make(stream: bool) -> Callable[[], Awaitable[None]]:
        sampling = {"max_new_tokens": max_tokens, "temperature": 0}
        body = orjson.dumps(
            {"input_ids": prompt, "sampling_params": sampling, "return_logprob": True, "stream": stream}
        )

        async def send() -> None:
            async with http.post(url + "/generate", data=body, headers=JSON) as response:
                await read_all(response)

        return send

    return make


def rate(runs: list[Run]) -> float:
    return sum(len(r.latencies) for r in runs) / sum(r.seconds for r in runs)


def report(results: dict[tuple[int, bool, str], list[Run]], names: list[str], baseline: str) -> None:
    """One row per concurrency and mode; each proxy's added p50 is over ``baseline``."""
    proxies = [n for n in names if not n.startswith("direct")]
    plans = sorted({(c, s) for c, s, _ in results})
    p50 = lambda c, s, n: percentile([x for r in results[(c, s, n)] for x in r.latencies], 50) * 1000  # noqa: E731
    p99 = lambda c, s, n: percentile([x for r in results[(c, s, n)] for x in r.latencies], 99) * 1000  # noqa: E731
    columns = [f"{n} p50 / p99 ms" for n in names] + [f"{n} added p50 ms" for n in proxies]
    columns += [f"{n} req/s" for n in names] + [f"{n} / {baseline} req/s" for n in proxies]
    columns += [f"{n} CPU ms/req" for n in proxies]
    print("| clients | stream | " + " | ".join(columns) + " |")
    print("|" + "---|" * (len(columns) + 2))
    for c, s in plans:
        cells = [f"{p50(c, s, n):.1f} / {p99(c, s, n):.1f}" for n in names]
        cells += [f"{p50(c, s, n) - p50(c, s, baseline):+.1f}" for n in proxies]
        cells += [f"{rate(results[(c, s, n)]):.1f}" for n in names]
        cells += [f"{rate(results[(c, s, n)]) / rate(results[(c, s, baseline)]):.2f}" for n in proxies]
        for n in proxies:
            runs = results[(c, s, n)]
            cells.append(f"{sum(r.cpu for r in runs) / sum(len(r.latencies) for r in runs) * 1000:.2f}")
        print(f"| {c} | {'yes' if s else 'no'} | " + " | ".join(cells) + " |")


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
    parser.add_argument(
        "--litellm", action="store_true", help="add LiteLLM's proxy in front of SGLang (--engine sglang)"
    )
    args = parser.parse_args()
    if args.litellm and args.engine != "sglang":
        parser.error("--litellm fronts SGLang's OpenAI endpoint: use it with --engine sglang")
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
    processes: list[subprocess.Popen[bytes] | None] = [gateway, engine]
    results: dict[tuple[int, bool, str], list[Run]] = {}
    try:
        model = served_model(gateway_url)
        litellm_url = ""
        if args.litellm:  # before the client session: its idle connections would go stale meanwhile
            litellm, litellm_url = start_litellm(engine_url, served_model(engine_url), data_dir)
            processes.append(litellm)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            targets = [Target("direct", generate_sender(http, engine_url, prompt, args.max_tokens), None)]
            if args.engine == "sglang":
                direct_chat = chat_sender(http, engine_url, served_model(engine_url), args.max_tokens)
                targets.append(Target("direct chat", direct_chat, None))
            if args.litellm:
                litellm_chat = chat_sender(http, litellm_url, "bench", args.max_tokens, LITELLM_KEY)
                targets.append(Target("litellm", litellm_chat, litellm.pid))
            targets.append(Target("tandem", chat_sender(http, gateway_url, model, args.max_tokens), gateway.pid))
            for target in targets:
                await load(target.send(False), 20, 4, target.pid)  # warm up
            plan = [(c, s) for c in args.concurrency for s in (False, True)]
            with progress() as bar:
                task = bar.add_task("load", total=len(plan) * args.rounds * len(targets))
                for concurrency, stream in plan:
                    for _ in range(args.rounds):
                        for target in targets:
                            run = await load(target.send(stream), args.requests, concurrency, target.pid)
                            results.setdefault((concurrency, stream, target.name), []).append(run)
                            bar.advance(task)
    finally:
        for process in processes:  # the gateway stops the SGLang server it launched
            if process is not None:
                process.terminate()
                process.wait(timeout=60)

    console.print(
        f"{args.engine} engine, model {model}, {args.max_tokens} new tokens, {args.requests} requests x {args.rounds} rounds"
    )
    names = [t.name for t in targets]
    report(results, names, baseline="direct chat" if "direct chat" in names else "direct")


if __name__ == "__main__":
    asyncio.run(main())
