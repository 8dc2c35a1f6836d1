"""Shared bits of the benchmark scripts: model selection, percentiles, progress and result lines."""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from rich.console import Console
from rich.progress import Progress

from migrations.migrate import upgrade
from storage import create_api_key, make_engine, make_session_factory
from tandem.models import resolve_model
from tandem.settings import Settings

if TYPE_CHECKING:
    from learner.round import RoundConfig

console = Console(stderr=True)


def model_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m-instruct", help="builtin name, HF folder, or 'tiny'")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")


def load_model_and_tokenizer(args: argparse.Namespace) -> tuple[Path, Any]:
    """Apply --threads, resolve --model, and load its tokenizer."""
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    path = model_path(args.model)
    return path, AutoTokenizer.from_pretrained(path)


def model_path(spec: str) -> Path:
    if spec == "tiny":
        from tests.fixtures.tiny_model import tiny_model_path

        return tiny_model_path()
    return resolve_model(spec, Settings().storage.model_cache_dir)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tenant_key(database_url: str, tenant: str = "simulated-users") -> str:
    """An API key of ``tenant`` for simulated users (their traffic, like anyone's, needs one)."""
    upgrade(database_url)
    engine = make_engine(database_url)
    try:
        with make_session_factory(engine).begin() as session:
            plaintext, _ = create_api_key(session, tenant_name=tenant, name="benchmark")
    finally:
        engine.dispose()
    return plaintext


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def median(values: list[float]) -> float:
    return statistics.median(values)


def progress() -> Progress:
    return Progress(console=console, transient=True)


def start(args: list[str], env: dict[str, str], url: str, cwd: Path | None = None) -> subprocess.Popen[bytes]:
    """Start `tandem <args>` (from the source tree ``cwd``, default this one) and wait until ``url``
    answers; its output goes to a log in its data dir."""
    env = {"TANDEM_LEARNER": "off", **env}  # benchmarks measure serving: no learner child on the cores
    log_dir = Path(env.get("TANDEM_DATA_DIR") or ".")
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{args[0]}-{os.getpid()}-{time.monotonic_ns()}.log"
    with log.open("wb") as out:  # a file, not a pipe nobody drains: a chatty process would block on it
        process = subprocess.Popen(
            [sys.executable, "-m", "tandem.cli", *args], env=env, stdout=out, stderr=out, cwd=cwd
        )
    # A gateway that launches SGLang waits for it.
    return wait_until_answering(process, url, log, what=f"tandem {args[0]}", timeout_s=300)


def wait_until_answering(
    process: subprocess.Popen[bytes], url: str | urllib.request.Request, log: Path, *, what: str, timeout_s: float
) -> subprocess.Popen[bytes]:
    """``process`` once ``url`` answers (a Request: with its headers, a key say); killed, and its log's
    tail raised, if it exits or takes too long."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited:\n{log.read_text(errors='replace')[-2000:]}")
        try:
            urllib.request.urlopen(url, timeout=1)
            return process
        except OSError:
            time.sleep(0.3)
    process.kill()
    shown = url.full_url if isinstance(url, urllib.request.Request) else url
    raise RuntimeError(f"{what} did not answer {shown} within {timeout_s:.0f} s; log: {log}")


def start_engine(
    model: Path, data_dir: Path, device: str, dtype: torch.dtype, threads: int
) -> tuple[subprocess.Popen[bytes], str]:
    """Start `tandem engine` serving ``model`` on ``device`` in ``dtype``; the process and its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "TANDEM_DATA_DIR": str(data_dir),
        "TANDEM_DEVICE": device,
        "TANDEM_DTYPE": str(dtype).removeprefix("torch."),
        "TANDEM_TORCH_THREADS": str(threads),
        "TANDEM_LOG_LEVEL": "WARNING",
    }
    return start(["engine", "--model", str(model), "--port", str(port)], env, f"{url}/model_info"), url


@dataclass(frozen=True)
class Served:
    """A `tandem serve` started by ``serve``: SQLite in ``workdir``, its learner worker off."""

    process: subprocess.Popen[bytes]
    url: str
    admin_key: str
    database_url: str
    api_key: str  # a tenant's, for the simulated users
    workdir: Path
    threads: int

    def round_config(self, learning_rate: float, **settings: Any) -> RoundConfig:
        """A round the benchmark runs itself against this server, checkpoints in its data dir; every
        rating trains and every round rolls out (the evaluation gate off, unless ``settings`` says). ``settings``: the rest."""
        from learner.evaluation import EvalConfig
        from learner.round import RoundConfig

        return RoundConfig(
            server_url=self.url,
            admin_key=self.admin_key,
            database_url=self.database_url,
            checkpoint_dir=self.workdir / "checkpoints",
            learning_rate=learning_rate,
            num_threads=self.threads,
            **{"evaluation": EvalConfig(gate="off"), **settings},
        )

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)


def serve(model: str, workdir: Path, admin_key: str, threads: int) -> Served:
    """Start `tandem serve` of ``model`` (``model_path``) on SQLite in ``workdir``, its learner worker
    off: the benchmark runs the rounds itself."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "TANDEM_DATA_DIR": str(workdir),
        "TANDEM_MODEL": str(model_path(model)),
        "TANDEM_PORT": str(port),
        "TANDEM_ADMIN_KEY": admin_key,
        "TANDEM_LEARNER": "off",
        "TANDEM_TORCH_THREADS": str(threads),
        "TANDEM_LOG_LEVEL": "WARNING",
    }
    database_url = f"sqlite:///{workdir / 'tandem.db'}"
    api_key = tenant_key(database_url)
    process = start(["serve"], env, f"{url}/health")
    return Served(process, url, admin_key, database_url, api_key, workdir, threads)


@contextmanager
def round_chart(path: Path, *, title: str, xlabel: str, ylabel: str) -> Iterator[Any]:
    """The axes of a curves-per-round chart (matplotlib, no display), saved as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.2))
    yield axes
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
