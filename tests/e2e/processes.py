"""Real `tandem` processes for end-to-end tests: start, wait until they answer, stop or kill."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tests.support.uvicorn_thread import free_port


@dataclass
class Process:
    popen: subprocess.Popen[bytes]
    url: str
    log: Path

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            self.popen.wait(timeout=30)


def start_tandem(args: list[str], *, data_dir: Path, ready_path: str, env: dict[str, str] | None = None) -> Process:
    port = free_port()
    log = data_dir / f"{args[0]}-{port}.log"
    data_dir.mkdir(parents=True, exist_ok=True)
    # No embedded learner worker unless a test asks for one: it would compete for the two cores.
    environment = {
        **os.environ,
        "TANDEM_DATA_DIR": str(data_dir),
        "TANDEM_TORCH_THREADS": "1",
        "TANDEM_LEARNER": "off",
        **(env or {}),
    }
    with log.open("wb") as out:
        popen = subprocess.Popen(
            [sys.executable, "-m", "tandem.cli", *args, "--port", str(port)], env=environment, stdout=out, stderr=out
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            raise RuntimeError(f"tandem {args[0]} exited with {popen.returncode}:\n{log.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(url + ready_path, timeout=2)
            return Process(popen, url, log)
        except OSError:
            time.sleep(0.2)
    popen.kill()
    raise RuntimeError(f"tandem {args[0]} did not answer {ready_path} within 120 s:\n{log.read_text()[-3000:]}")
