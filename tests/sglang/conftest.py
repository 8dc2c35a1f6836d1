"""One real SGLang 0.5.23 server on the CPU for this package, and a tandem gateway in front of it.

The server costs a core and a few GB while it runs, so it lives for this package only (it is gone
before the next package starts). SGLang lives in its own venv, installed by scripts/setup_sglang.sh
(``make test`` runs it first; here it is a no-op once installed). When SGLang cannot be installed
or started, these tests fail under ``CI=true`` and are skipped elsewhere.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import pytest

from server.engines.launch_plan import load_launch_config, serving_urls
from tandem.settings import Settings
from tests.conftest import _in_ci
from tests.server.conftest import Gateway, gateway_settings, perturbed_model, run_gateway, tiny_model
from tests.support.uvicorn_thread import free_port

ROOT = Path(__file__).resolve().parents[2]
SETUP_SCRIPT = ROOT / "scripts" / "setup_sglang.sh"
SGLANG_VENV = Settings().engine.sglang_venv
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
def engine_config(sglang_venv: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One managed SGLang group on the CPU, serving LoRA adapters too: what `tandem serve --engine-config`
    launches."""
    path = tmp_path_factory.mktemp("sglang-config") / "engines.toml"
    extra = ", ".join(f'"{arg}"' for arg in TEST_SERVER_ARGS)
    path.write_text(
        f"""
[[groups]]
name = "sglang-cpu"
engine = "sglang"
device = "cpu"
model_path = "{tiny_model}"
python = "{sglang_venv / "bin" / "python"}"
base_port = {free_port()}
extra_args = [{extra}]

[groups.lora]
max_rank = 16
max_loras_per_batch = 4
"""
    )
    return path


@pytest.fixture(scope="package")
def sglang_url(engine_config: Path, sglang_gateway: Gateway) -> str:
    """The managed server's own URL (it runs while the gateway does)."""
    (url,) = serving_urls(load_launch_config(engine_config))
    return url


@pytest.fixture(scope="package")
def sglang_gateway(
    engine_config: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    """A gateway that launches and supervises the SGLang server (it stops with the gateway).

    Health probes are spaced out of these tests' way: the pause test holds the server's
    /health_generate, and a replica readmitted after a failed probe would get the gateway's
    weights pushed back over the ones a test loaded."""
    data_dir = tmp_path_factory.mktemp("sglang-gateway")
    settings = gateway_settings(
        data_dir,
        tiny_model,
        engine="sglang",
        engine_config=engine_config,
        health_interval_s=3600,
        engine_start_timeout_s=START_TIMEOUT_S,
    )
    started = time.monotonic()
    try:
        gateway = run_gateway(settings, startup_timeout_s=START_TIMEOUT_S + 60)
        entered = gateway.__enter__()
    except RuntimeError as exc:
        log = data_dir / "engines" / "sglang-cpu-0.log"
        tail = log.read_text(errors="replace")[-4000:] if log.exists() else "(no log)"
        _unavailable(f"the gateway's managed SGLang server did not start: {exc}\n{tail}")
    print(f"managed SGLang server healthy behind the gateway after {time.monotonic() - started:.1f} s")
    try:
        yield entered
    finally:
        gateway.__exit__(None, None, None)


__all__ = ["perturbed_model", "tiny_model"]  # the shared fixtures, visible to this package's tests
