"""Every shell and Python example of README.md and docs/, run as written against a live gateway.

The gateway serves the tiny model under the quick start's name from two engine servers, with an
admin key and no tenant key (keyless loopback, as the quick start). What the examples name exists
before they run: the round they cancel, the versions they promote and roll back to, the checkpoint
and delta they roll out, the adapter folder they register; the docs' paths and addresses are
replaced by those (``DocServer.prepare``). Blocks run in document order (README first): later ones
see what earlier ones made, as a reader following the docs would. A curl that gets an HTTP error
fails its block (``--fail-with-body``).
"""

from __future__ import annotations

import ast
import importlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from learner.plugins import use_slime_compat
from migrations.migrate import upgrade
from server.engines.local.engine import LocalEngine
from server.engines.sglang_server import create_engine_app
from server.weight_delta import read_checkpoint, write_delta
from storage import queue_round, record_model_version, set_version_status
from storage.db import make_engine, make_session_factory
from tandem.cli import app
from tests.docs.doc_blocks import DocBlock, all_doc_blocks
from tests.fixtures.tiny_model import perturb_weights, tiny_model_path
from tests.server.conftest import ADMIN_KEY, gateway_settings, run_gateway
from tests.server.engines.test_local_lora import make_adapter
from tests.support.uvicorn_thread import serve_in_thread

MODEL = "smollm2-135m-instruct"  # the quick start's served name, which the examples use
ROUND = "round-3f2a9c1e0b7d4e5f8a6b2c3d4e5f6a7b"
VERSION_TO_PROMOTE, VERSION_TO_ROLL_BACK_TO = "v42-1a2b3c4d", "v41-9f8e7d6c"
BLOCKS = all_doc_blocks()
RUN = [b for b in BLOCKS if b.mode == "run"]
CURL_FAILS_ON_HTTP_ERRORS = 'curl() { command curl --fail-with-body --show-error --max-time 300 "$@"; }\n'
BLOCK_TIMEOUT_S = 600


@dataclass(frozen=True)
class DocServer:
    url: str
    database_url: str
    workdir: Path
    replacements: dict[str, str]

    def prepare(self, code: str) -> str:
        for documented, here in self.replacements.items():
            code = code.replace(documented, here)
        return code

    def env(self) -> dict[str, str]:
        bin_dir = str(Path(sys.executable).parent)  # the venv's `tandem`
        return {
            **os.environ,
            "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}",
            "TANDEM": self.url,
            "TANDEM_ADMIN_KEY": ADMIN_KEY,
            "TANDEM_DATABASE_URL": self.database_url,  # for the commands that read the log (tandem export)
            "AUTH": f"Authorization: Bearer {ADMIN_KEY}",
        }


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DocServer]:
    root = tmp_path_factory.mktemp("docs")
    tiny_model = tiny_model_path()
    perturbed_model = perturb_weights(tiny_model, root / "perturbed")
    checkpoint = shutil.copytree(tiny_model, root / "v12-ab12cd34")
    delta = root / "v12.delta"
    write_delta(
        read_checkpoint(checkpoint),
        read_checkpoint(perturbed_model),
        delta,
        base_version="v12-ab12cd34",  # what the weights example serves first
        target_version="v13-5e6f7a8b",
        files_from=perturbed_model,
    )
    adapter = make_adapter(tiny_model, root / "alice-1", seed=1, targets=["q_proj", "v_proj"])
    with ExitStack() as stack:
        engines = [
            stack.enter_context(
                serve_in_thread(
                    create_engine_app(
                        lambda: LocalEngine.open(tiny_model, torch_threads=1, max_batch_size=4, served_model_name=MODEL)
                    )
                )
            )
            for _ in range(2)
        ]
        (root / "data").mkdir()
        settings = gateway_settings(
            root / "data",
            tiny_model,
            admin_key=ADMIN_KEY,
            engine="sglang",
            engine_urls=engines,
            health_interval_s=3600,
        )
        _seed(settings.resolved_database_url, tiny_model, perturbed_model)
        gateway = stack.enter_context(run_gateway(settings))
        workdir = root / "work"
        workdir.mkdir()
        yield DocServer(
            gateway.url,
            settings.resolved_database_url,
            workdir,
            {
                "http://127.0.0.1:8000": gateway.url,
                "localhost:8000": gateway.url,
                "http://10.0.0.7:30000": engines[0],
                "/ckpt/v12-ab12cd34": str(checkpoint),
                "/ckpt/v12.delta": str(delta),
                "/adapters/alice-1": str(adapter),
            },
        )


def _seed(database_url: str, serving: Path, candidate: Path) -> None:
    """A serving version, a candidate to promote over it, and a queued round to cancel."""
    upgrade(database_url)
    db = make_engine(database_url)
    try:
        with make_session_factory(db).begin() as session:
            record_model_version(session, version_id=VERSION_TO_ROLL_BACK_TO, model=MODEL, checkpoint_path=str(serving))
            set_version_status(session, version_id=VERSION_TO_ROLL_BACK_TO, status="serving")
            record_model_version(session, version_id=VERSION_TO_PROMOTE, model=MODEL, checkpoint_path=str(candidate))
            queue_round(session, model=MODEL, trigger="manual", round_id=ROUND)
    finally:
        db.dispose()


@pytest.mark.parametrize("block", RUN, ids=[b.name for b in RUN])
def test_the_example_runs_as_written(block: DocBlock, server: DocServer) -> None:
    code = server.prepare(block.code)
    if block.language == "bash":
        command = ["bash", "-c", "set -euo pipefail\n" + CURL_FAILS_ON_HTTP_ERRORS + code]
    else:
        command = [sys.executable, "-c", code]
    done = subprocess.run(
        command, cwd=server.workdir, env=server.env(), capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S
    )
    assert done.returncode == 0, (
        f"{block.name} failed:\n{code}\n--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}"
    )


@pytest.mark.parametrize("block", BLOCKS, ids=[b.name for b in BLOCKS])
def test_every_example_is_well_formed(block: DocBlock) -> None:
    """Also for the blocks that do not run here: syntax, imports and the `tandem` commands they use."""
    if block.mode == "not run":
        assert block.why, f"{block.name}: say why it is not run"
    if block.language == "python":
        use_slime_compat()  # plugin examples import slime's modules, which the learner serves
        tree = ast.parse(block.code, block.name)
        compile(block.code, block.name, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name), f"{block.name}: {node.module} has no {alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    importlib.import_module(alias.name)
        return
    syntax = subprocess.run(["bash", "-n", "-c", block.code], capture_output=True, text=True)
    assert syntax.returncode == 0, f"{block.name}: {syntax.stderr}"
    for command in block.tandem_commands():
        helped = CliRunner().invoke(app, [command, "--help"])
        assert helped.exit_code == 0, f"{block.name}: `tandem {command}` does not exist: {helped.output}"
