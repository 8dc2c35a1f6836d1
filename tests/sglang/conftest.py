"""One real SGLang 0.5.23 server on the CPU for this package, and a tandem gateway in front of it.

The server costs a core and a few GB while it runs, so it lives for this package only (it is gone
before the next package starts). SGLang lives in its own venv, installed by scripts/setup_sglang.sh
(``make test`` runs it first; here it is a no-op once installed). When SGLang cannot be installed
or started, these tests fail under ``CI=true`` and are skipped elsewhere.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import pytest
import torch

from server.engines.sglang_cpu.environment import CPU_SERVER_ARGS, cpu_environment
from tests.conftest import _in_ci
from tests.fixtures.tiny_model import perturb_weights, tiny_model_path
from tests.server.conftest import Gateway, gateway_settings, run_gateway
from tests.support.uvicorn_thread import free_port

ROOT = Path(__file__).resolve().parents[2]
SETUP_SCRIPT = ROOT / "scripts" / "setup_sglang.sh"
SGLANG_VENV = Path(os.environ.get("TANDEM_SGLANG_VENV") or Path.home() / ".cache" / "tandem" / "sglang-0.5.23")
INSTALL_TIMEOUT_S = 1800
START_TIMEOUT_S = 240
# float32, like the local engine and the transformers reference: the tiny random model's logits are
# nearly uniform (top-2 gaps of ~1e-3), and in bf16 some of them tie, so greedy picks differ.
TEST_SERVER_ARGS = ("--dtype", "float32", "--random-seed", "0")


def _unavailable(message: str) -> NoReturn:
    if _in_ci():
        pytest.fail(f"{message.rstrip()}\n(CI must run the SGLang tests)", pytrace=False)
    pytest.skip(message)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give the first test here time to install SGLang (~10 min) when the venv is not ready yet."""
    ours = [item for item in items if Path(str(item.path)).is_relative_to(Path(__file__).parent)]
    if not ours or not SETUP_SCRIPT.exists():
        return
    if subprocess.run(["bash", str(SETUP_SCRIPT), "--check"], check=False).returncode != 0:
        ours[0].add_marker(pytest.mark.timeout(INSTALL_TIMEOUT_S + START_TIMEOUT_S + 300))


@dataclass
class SGLangServer:
    url: str
    log: Path
    popen: subprocess.Popen[bytes]

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """SIGTERM to the whole process group (SGLang spawns a scheduler and a detokenizer), then SIGKILL."""
        for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.popen.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                continue
            if sig == signal.SIGTERM:  # the launcher is gone; make sure no child outlived it
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
            return


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health_generate", timeout=30) as response:
            return response.status == 200
    except (OSError, urllib.error.URLError):
        return False


def start_sglang(venv: Path, model: Path, log: Path) -> SGLangServer:
    port = free_port()
    argv = [str(venv / "bin" / "python"), "-m", "sglang.launch_server", "--model-path", str(model)]
    argv += ["--host", "127.0.0.1", "--port", str(port), *CPU_SERVER_ARGS, *TEST_SERVER_ARGS]
    with log.open("wb") as out:
        popen = subprocess.Popen(
            argv, env=cpu_environment(os.environ), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    server = SGLangServer(f"http://127.0.0.1:{port}", log, popen)
    started = time.monotonic()
    while time.monotonic() - started < START_TIMEOUT_S:
        if popen.poll() is not None:
            server.stop()
            raise RuntimeError(f"SGLang exited with {popen.returncode} while starting:\n{server.log_tail()}")
        if _healthy(server.url):
            print(f"SGLang healthy after {time.monotonic() - started:.1f} s at {server.url}")
            return server
        time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"SGLang did not pass /health_generate within {START_TIMEOUT_S} s:\n{server.log_tail()}")


@pytest.fixture(scope="package")
def sglang_venv() -> Path:
    """The SGLang venv, installed if missing."""
    if not SETUP_SCRIPT.exists():
        _unavailable(f"{SETUP_SCRIPT} is missing")
    try:
        done = subprocess.run(
            ["bash", str(SETUP_SCRIPT)],
            env={**os.environ, "TANDEM_SGLANG_VENV": str(SGLANG_VENV)},
            capture_output=True,
            text=True,
            timeout=INSTALL_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        _unavailable(f"installing SGLang took over {INSTALL_TIMEOUT_S} s")
    if done.returncode != 0:
        _unavailable(
            f"SGLang could not be installed (setup_sglang.sh exited {done.returncode}):\n{done.stderr[-3000:]}"
        )
    return SGLANG_VENV


@pytest.fixture(scope="package")
def tiny_model() -> Path:
    torch.set_num_threads(1)
    return tiny_model_path()


@pytest.fixture(scope="package")
def perturbed_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return perturb_weights(tiny_model, tmp_path_factory.mktemp("perturbed") / "model")


@pytest.fixture(scope="package")
def sglang_server(
    sglang_venv: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SGLangServer]:
    log = tmp_path_factory.mktemp("sglang") / "server.log"
    try:
        server = start_sglang(sglang_venv, tiny_model, log)
    except RuntimeError as exc:
        _unavailable(str(exc))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="package")
def sglang_url(sglang_server: SGLangServer) -> str:
    return sglang_server.url


@pytest.fixture(scope="package")
def sglang_gateway(sglang_url: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """A gateway whose engine is the SGLang server. Health probes are spaced out of these tests' way:
    the pause test holds the server's /health_generate, and a replica readmitted after a failed probe
    would get the gateway's weights pushed back over the ones a test loaded."""
    settings = gateway_settings(
        tmp_path_factory.mktemp("sglang-gateway"),
        tiny_model,
        engine="sglang",
        engine_urls=[sglang_url],
        health_interval_s=3600,
    )
    with run_gateway(settings) as gateway:
        yield gateway
